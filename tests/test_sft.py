"""SFT: loss vs NumPy, token-exact accumulation, sharding, exact resume, bad inputs."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FAST_COMPILE

from coa_jax.data.importers import DataError
from coa_jax.losses import token_cross_entropy_and_z
from coa_jax.model import Transformer, get_preset
from coa_jax.runtime import sharding
from coa_jax.sft import job as sft
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from coa_jax.train.step import NonFiniteLossError
from configs import common, sft_tiny_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loss_and_z_loss_equal_a_numpy_reference():
  rng = np.random.RandomState(0)
  logits = rng.randn(2, 5, 7).astype(np.float32) * 3
  targets = rng.randint(0, 7, (2, 5))
  mask = np.array([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  nll = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  sums, z_total = token_cross_entropy_and_z(logits, targets, mask)
  np.testing.assert_allclose(sums.total, (nll * mask).sum(), rtol=1e-6)
  assert sums.count == 5
  np.testing.assert_allclose(z_total, (log_z ** 2 * mask).sum(), rtol=1e-6)


def _batch(rows=8, seq=16, seed=0):
  rng = np.random.RandomState(seed)
  batch = step_lib.next_token_batch(rng.randint(0, 512, (rows, seq + 1)))
  return batch.replace(loss_mask=(rng.rand(rows, seq) < np.linspace(0.1, 0.9, rows)[:, None])
                       .astype(np.int32))  # very different token counts per row


def _initial(mesh, **changes):
  model = Transformer(get_preset("tiny", num_heads=4, num_kv_heads=4, **changes))
  tx = optimizer.make_optimizer(common.optimizer(learning_rate=1e-2, eps=1e-3))
  return model, tx, state_lib.init_state(model, tx, mesh, jax.random.key(0))


def _step(mesh, micro_batches, z_loss=0.0, **changes):
  model, tx, state = _initial(mesh, **changes)
  step = step_lib.jit_train_step(model, tx, mesh, micro_batches=micro_batches, z_loss=z_loss)
  return step(state, sharding.shard_batch(_batch(), mesh))


@pytest.fixture(scope="module")
def one_device_step(single_device_mesh):
  """The reference: one applied step that moves every parameter."""
  state, metrics = jax.device_get(_step(single_device_mesh, 1))
  initial = jax.device_get(_initial(single_device_mesh)[2])
  assert metrics["applied"] and int(state.step) == 1
  for moved, before in zip(jax.tree_util.tree_leaves(state.params),
                           jax.tree_util.tree_leaves(initial.params)):
    assert np.abs(moved - before).max() > 1e-4
  return state, metrics


@pytest.mark.parametrize("micro_batches, unrolled", [(2, False), (4, False), (2, True)])
def test_gradient_accumulation_is_token_exact(micro_batches, unrolled, single_device_mesh,
                                              one_device_step):
  """Unrolled layers (scan_unroll = layers) unroll the micro-batch loop too."""
  changes = dict(scan_unroll=2) if unrolled else {}
  (state, metrics), (ref_state, ref_metrics) = _step(single_device_mesh, micro_batches,
                                                     **changes), one_device_step
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
  assert metrics["tokens"] == ref_metrics["tokens"]
  for got, want in zip(jax.tree_util.tree_leaves(state.params),
                       jax.tree_util.tree_leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_accumulated_step_sharded_on_8_devices_equals_one_device(one_device_step):
  state, metrics = _step(sharding.make_mesh((2, 2, 2)), 2)
  ref_state, ref_metrics = one_device_step
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
  for got, want in zip(jax.tree_util.tree_leaves(state.params),
                       jax.tree_util.tree_leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_non_finite_step_leaves_the_state_unchanged(single_device_mesh):
  state, metrics = _step(single_device_mesh, 1, z_loss=float("nan"))
  assert not metrics["is_finite"] and not metrics["applied"]
  for got, want in zip(jax.tree_util.tree_leaves(state),  # params, moments, count, step
                       jax.tree_util.tree_leaves(_initial(single_device_mesh)[2])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _config(tmp_path, steps, **changes):
  config = sft_tiny_cpu.get_config()
  config.model.update(hidden_size=32, head_dim=8, intermediate_size=64, num_layers=1)
  config.batch_size, config.seq_len = 4, 512
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)
  config.optimizer.total_steps = config.train.steps = steps
  config.optimizer.warmup_steps = 1
  config.train.log_every = 2
  config.checkpoint.update(directory=str(tmp_path / "ckpt"), every=2, async_save=False)
  config.workdir = str(tmp_path)
  config.export_dir = ""
  for key, value in changes.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def _losses(path):
  return [json.loads(line)["loss"] for line in open(path)]


def test_resume_is_exact_and_the_loss_falls(tmp_path, monkeypatch):
  built, build = [], step_lib.jit_train_step
  monkeypatch.setattr(step_lib, "jit_train_step", lambda *a, **k: built.append(a) or build(*a, **k))
  straight = sft.run(_config(tmp_path / "a", 6))
  sft.run(_config(tmp_path / "b", 6, **{"train.stop_after": 3}))  # interrupted at step 3
  resumed = sft.run(_config(tmp_path / "b", 6))
  assert resumed["resumed_from"] == 3 and resumed["steps"] == straight["steps"] == 6
  for got, want in zip(jax.tree_util.tree_leaves(resumed["state"]),
                       jax.tree_util.tree_leaves(straight["state"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(_losses(tmp_path / "b" / "metrics.jsonl"),  # same data order
                             _losses(tmp_path / "a" / "metrics.jsonl"), rtol=1e-6)
  assert straight["final_loss"] < straight["first_loss"]
  assert len(built) <= 1  # three runs alike, one jitted step (none: an earlier test built it)


def _params_at(tmp_path, step):
  path = tmp_path / "ckpt" / str(step) / "state"
  return ocp.StandardCheckpointer().restore(path)["params"]


def test_non_finite_loss_stops_with_the_last_good_state_saved(tmp_path):
  sft.run(_config(tmp_path, 4, **{"train.stop_after": 2}))
  with pytest.raises(NonFiniteLossError, match="step 3 .*saved the state it holds"):
    sft.run(_config(tmp_path, 4, **{"train.z_loss": float("nan")}))
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "3"]
  for got, want in zip(jax.tree_util.tree_leaves(_params_at(tmp_path, 3)),
                       jax.tree_util.tree_leaves(_params_at(tmp_path, 2))):
    np.testing.assert_array_equal(got, want)


def test_non_finite_steps_are_skipped_up_to_the_configured_count(tmp_path):
  sft.run(_config(tmp_path, 5, **{"train.stop_after": 2}))
  with pytest.raises(NonFiniteLossError, match="step 4 .*2 such steps exceed nonfinite_skips=1"):
    sft.run(_config(tmp_path, 5, **{"train.z_loss": float("nan"), "train.nonfinite_skips": 1}))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [(r["step"], r["nonfinite"], r["nonfinite_skipped"]) for r in rows] == [
      (1, 0, 0), (2, 0, 0), (3, 1, 1)]
  # The count is kept in the checkpoint saved at step 4: a resumed run goes on from it.
  sft.run(_config(tmp_path, 5, **{"train.z_loss": float("nan"), "train.nonfinite_skips": 5}))
  last = json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])
  assert (last["step"], last["nonfinite_skipped"]) == (5, 3)


@pytest.mark.parametrize("content,message", [(None, "does not exist"), ("", "is empty"),
                                             ("{bad\n{worse\n", "no usable examples")])
def test_bad_data_files_fail_clearly(tmp_path, content, message):
  path = tmp_path / "data.jsonl"
  if content is not None:
    path.write_text(content)
  with pytest.raises(DataError, match=message):
    sft.run(_config(tmp_path, 2, **{"data.path": str(path)}))


def test_unknown_config_field_is_rejected_by_the_entry_point():
  result = subprocess.run([sys.executable, "experiments/sft.py", "--config.train.bogus=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode != 0 and "bogus" in result.stderr


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
  import signal
  import time

  args = [sys.executable, "experiments/sft.py", "--config.train.steps=100000",
          "--config.optimizer.total_steps=100000", "--config.model.hidden_size=32",
          "--config.model.intermediate_size=64", "--config.model.num_layers=1",
          "--config.batch_size=2", "--config.seq_len=512", "--config.train.log_every=1",
          f"--config.checkpoint.directory={tmp_path / 'ckpt'}", "--config.checkpoint.every=1000",
          f"--config.workdir={tmp_path}", "--config.export_dir="]
  proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                          "XLA_FLAGS": FAST_COMPILE})  # one device
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and (not metrics.exists() or
                                    len(metrics.read_text().splitlines()) < 3):
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  output, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, output
  assert "saving a checkpoint, then stopping" in output
  saved = [int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit()]
  assert saved and max(saved) == len(metrics.read_text().splitlines())


def test_fine_tuning_an_hf_checkpoint_grows_its_vocabulary_for_the_tags(tmp_path):
  from hf_reference import make_hf_model

  make_hf_model("qwen2", vocab=96, heads=4, kv_heads=2, layers=1).save_pretrained(tmp_path / "hf")
  config = _config(tmp_path, 2, **{"model.checkpoint": str(tmp_path / "hf")})
  config.export_dir = str(tmp_path / "export")
  summary = sft.run(config)
  assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
  exported = json.loads((tmp_path / "export" / "config.json").read_text())
  assert exported["vocab_size"] == 1024 and exported["hidden_size"] == 32


def test_the_run_ends_when_the_data_are_exhausted(tmp_path):
  source = os.path.join(ROOT, "coa_jax", "assets", "coa_sample.jsonl")
  with open(source) as f, open(tmp_path / "few.jsonl", "w") as out:
    out.writelines(f.readlines()[:12])
  summary = sft.run(_config(tmp_path, 50, **{"data.path": str(tmp_path / "few.jsonl"),
                                             "data.num_epochs": 1}))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert 1 <= summary["steps"] == len(rows) < 50
  assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == str(summary["steps"])  # saved at the end


def test_lora_sft_trains_the_adapters_and_new_rows_alone_and_resumes_exactly(tmp_path):
  """LoRA SFT of an HF checkpoint on the 8 devices: the base weights stay the checkpoint's,
  the optimizer and the checkpoints hold the adapters only (and the embedding and LM-head rows
  of the tokens the checkpoint lacks: its vocabulary of 96 grows to the tokenizer's 1,024), a
  resumed run (dropout on) ends where the uninterrupted one does, and both exports give the
  LoRA model's logits: adapters merged, in transformers, and the adapters alone (PEFT's
  format), in peft onto the base, its vocabulary resized; both carry the run's tokenizer."""
  import peft
  import transformers
  from hf_reference import hf_logits, make_hf_model

  from coa_jax.data import load_tokenizer
  from coa_jax.runtime import hf_checkpoint
  from coa_jax.sft.settings import sft_settings

  make_hf_model("qwen2", vocab=96, heads=4, kv_heads=2, layers=1).save_pretrained(tmp_path / "hf")
  lora = {"model.checkpoint": str(tmp_path / "hf"), "model.lora_rank": 4,
          "model.lora_alpha": 8.0, "model.lora_dropout": 0.1}
  config = _config(tmp_path / "a", 6, **lora)
  config.export_dir = str(tmp_path / "a" / "export")
  straight = sft.run(config)
  sft.run(_config(tmp_path / "b", 6, **lora, **{"train.stop_after": 3}))
  resumed = sft.run(_config(tmp_path / "b", 6, **lora))
  assert resumed["resumed_from"] == 3
  for got, want in zip(jax.tree_util.tree_leaves(resumed["state"]),
                       jax.tree_util.tree_leaves(straight["state"])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)

  state = straight["state"]
  adapters = jax.tree_util.tree_leaves_with_path(state.params)
  trained = {"lora_a", "lora_b", "embedding_rows", "lm_head_rows"}
  assert {path[-1].key for path, _ in adapters} == trained
  assert state.params["embedding_rows"].shape == (1024 - 96, 32)  # ids 96..1023
  assert any(np.any(leaf) for path, leaf in adapters if path[-1].key == "lora_b")  # trained
  shapes = {leaf.shape for _, leaf in adapters}
  assert {m.shape for m in jax.tree_util.tree_leaves(state.opt_state) if m.ndim} <= shapes
  settings = sft_settings(config)
  tokenizer = load_tokenizer(settings.tokenizer, settings.model.checkpoint, settings.tools)
  model_config, base = hf_checkpoint.load_model(settings.model, tokenizer,
                                                sharding.make_mesh(settings.mesh))
  for got, want in zip(jax.tree_util.tree_leaves(state.frozen), jax.tree_util.tree_leaves(base)):
    np.testing.assert_array_equal(got, want)  # untouched by 6 updates
  saved = ocp.StandardCheckpointer().restore(tmp_path / "a" / "ckpt" / "6" / "state")
  assert saved.get("frozen") is None
  assert {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(saved["params"])} == trained

  ids = np.arange(2, 14, dtype=np.int32)[None] * 7 % 96
  ours = Transformer(model_config).apply({"params": state.model_params()}, ids)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "export").eval()
  np.testing.assert_allclose(hf_logits(exported, ids), np.asarray(ours), atol=1e-4)
  # The adapters and rows alone, onto the HF base, its vocabulary of 96 grown as the SFT's.
  base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  base_model.resize_token_embeddings(model_config.vocab_size)
  peft_model = peft.PeftModel.from_pretrained(base_model, tmp_path / "a" / "export" / "adapter")
  np.testing.assert_allclose(hf_logits(peft_model, ids), np.asarray(ours), atol=1e-4)
  # Both exports carry the run's tokenizer, tags included (the base model's has none).
  text = "<think>\nrun it\n</think>\n<code>\nprint(1)\n</code>"
  for folder in ("export", "export/adapter"):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "a" / folder)
    assert hf.encode(text, add_special_tokens=False)[-1] == tokenizer.tag_id("code", close=True)
