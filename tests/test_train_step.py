"""The training step, its loss, optimizer pieces, the job loop (its checkpoints keep the tag
mapping) and the demo job."""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coa_jax.data.tokenizer import TagMapError, default_tokenizer
from coa_jax.losses import token_cross_entropy
from coa_jax.model import ConfigError, Transformer, get_preset
from coa_jax.runtime import sharding
from coa_jax.runtime.checkpointing import Checkpointer
from coa_jax.train import LoopConfig, run_loop
from coa_jax.train import lm_demo as demo
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from configs import common, demo_tiny
from state_job import StateJob


def test_cross_entropy_counts_only_masked_tokens():
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
  sums = token_cross_entropy(logits, jnp.array([[0, 1, 2]]), jnp.array([[1, 1, 0]]))
  np.testing.assert_allclose(sums.total, -np.log(0.5) - np.log(0.8), rtol=1e-6)
  assert sums.count == 2
  np.testing.assert_allclose(sums.mean(), (-np.log(0.5) - np.log(0.8)) / 2, rtol=1e-6)


def test_next_token_batch_shifts_targets():
  batch = step_lib.next_token_batch(np.array([[5, 6, 7, 8]]))
  np.testing.assert_array_equal(batch.input_ids, [[5, 6, 7]])
  np.testing.assert_array_equal(batch.targets, [[6, 7, 8]])
  np.testing.assert_array_equal(batch.positions, [[0, 1, 2]])


def test_weight_decay_skips_norms_and_biases():
  params = sharding.abstract_params(Transformer(get_preset("tiny")))
  mask = {"/".join(k.key for k in path): v for path, v in
          jax.tree_util.tree_leaves_with_path(optimizer.weight_decay_mask(nn.unbox(params)))}
  assert mask["embedding"] and mask["layers/mlp/up_proj/kernel"]
  assert not mask["layers/input_norm/scale"] and not mask["layers/attn/q_proj/bias"]


def test_warmup_then_cosine_schedule():
  schedule = optimizer.learning_rate_schedule(common.optimizer(
      learning_rate=1.0, warmup_steps=10, total_steps=110, final_lr_fraction=0.0))
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10), schedule(60),
                              schedule(110)], [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)


def test_warmup_stable_decay_schedule():
  schedule = optimizer.learning_rate_schedule(common.optimizer(
      schedule="wsd", learning_rate=1.0, warmup_steps=10, total_steps=110, decay_steps=40,
      final_lr_fraction=0.0))
  np.testing.assert_allclose([schedule(s) for s in (0, 5, 10, 40, 70, 90, 110)],
                             [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0], atol=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (dict(schedule="linear"), "schedule='linear'"),
    (dict(learning_rate=0.0), "learning_rate must be > 0"),
    (dict(total_steps=5, warmup_steps=10), "must exceed warmup_steps"),
    (dict(schedule="wsd", total_steps=100, warmup_steps=10, decay_steps=95), "decay_steps=95"),
])
def test_bad_optimizer_values_are_named(overrides, message):
  with pytest.raises(ConfigError, match=message):
    optimizer.make_optimizer(common.optimizer(**overrides))


@pytest.fixture(scope="module")
def tiny_state(single_device_mesh):
  """(model, tx, a fresh state, a batch of 2 rows)."""
  model = Transformer(get_preset("tiny"))
  tx = optimizer.make_optimizer(common.optimizer())
  state = state_lib.init_state(model, tx, single_device_mesh, jax.random.key(0))
  batch = sharding.shard_batch(step_lib.next_token_batch(np.ones((2, 9), np.int32)),
                               single_device_mesh)
  return model, tx, state, batch


def _poisoned(state):
  params = jax.tree_util.tree_map(jnp.copy, state.params)
  params["final_norm"]["scale"] = params["final_norm"]["scale"].at[0].set(jnp.nan)
  return state.replace(params=params)


def test_non_finite_loss_is_flagged(single_device_mesh, tiny_state):
  model, tx, state, batch = tiny_state
  _, metrics = step_lib.jit_train_step(model, tx, single_device_mesh, donate=False)(
      _poisoned(state), batch)
  assert not metrics["is_finite"] and not metrics["applied"]


def test_after_a_non_finite_update_the_returned_state_is_the_usable_one(single_device_mesh,
                                                                        tiny_state):
  model, tx, state, batch = tiny_state
  poisoned = jax.tree_util.tree_map(jnp.copy, _poisoned(state))
  new_state, metrics = step_lib.run_step(step_lib.jit_train_step(model, tx, single_device_mesh),
                                         poisoned, batch)
  assert metrics["nonfinite"] == 1.0 and int(new_state.step) == 0
  assert poisoned.params["embedding"].is_deleted()  # donated: only the returned lives
  for got, want in zip(jax.tree_util.tree_leaves(new_state.params),
                       jax.tree_util.tree_leaves(_poisoned(state).params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_all_masked_batch_moves_nothing(single_device_mesh, tiny_state):
  """AdamW would still apply momentum and weight decay to zero gradients."""
  model, tx, state, batch = tiny_state
  step = step_lib.jit_train_step(model, tx, single_device_mesh, donate=False)
  moved, metrics = step(state, batch)
  assert metrics["applied"] and int(moved.step) == 1
  masked, metrics = step(moved, batch.replace(loss_mask=jnp.zeros_like(batch.loss_mask)))
  assert metrics["is_finite"] and not metrics["applied"] and metrics["tokens"] == 0
  for got, want in zip(jax.tree_util.tree_leaves(masked), jax.tree_util.tree_leaves(moved)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- the shared loop (coa_jax.train.loop, as SFT and RL drive it) -----------------------------


class _PlannedJob(StateJob):
  """A job for `run_loop` whose step i runs the jitted step plan[i - 1][0] on batch
  plan[i - 1][1] through `run_step`, as the SFT and RL jobs do."""

  def __init__(self, state, plan):
    self.state, self.plan = state, plan

  def step(self, step):
    step_fn, batch = self.plan[step - 1]
    self.state, metrics = step_lib.run_step(step_fn, self.state, batch)
    return metrics


def _loop(tmp_path, steps):
  return LoopConfig(steps=steps, workdir=str(tmp_path), checkpoint=None, log_every=1,
                    nonfinite_skips=0)


def test_the_loop_goes_on_past_a_step_without_a_trainable_token(tmp_path, single_device_mesh,
                                                                tiny_state):
  model, tx, state, batch = tiny_state
  step = step_lib.jit_train_step(model, tx, single_device_mesh, donate=False)
  empty = batch.replace(loss_mask=jnp.zeros_like(batch.loss_mask))
  job = _PlannedJob(state, [(step, batch), (step, empty), (step, batch)])
  result = run_loop(job, _loop(tmp_path, 3), None, model.config)
  assert result.steps == 3
  assert [(r["nonfinite"], r["empty"], r["nonfinite_skipped"]) for r in result.rows] == [
      (0, 0, 0), (0, 1, 0), (0, 0, 0)]
  assert int(job.state.step) == 2  # the empty step's update was not applied


def test_steps_without_a_trainable_token_do_not_count_toward_nonfinite_skips(
    tmp_path, single_device_mesh, tiny_state):
  model, tx, state, batch = tiny_state
  step = step_lib.jit_train_step(model, tx, single_device_mesh, donate=False)
  nan_step = step_lib.jit_train_step(model, tx, single_device_mesh, donate=False,
                                     z_loss=float("nan"))
  empty = batch.replace(loss_mask=jnp.zeros_like(batch.loss_mask))
  job = _PlannedJob(state, [(step, empty), (step, empty), (nan_step, batch)])
  with pytest.raises(step_lib.NonFiniteLossError,
                     match="at step 3 .* 1 such steps exceed nonfinite_skips=0"):
    run_loop(job, _loop(tmp_path, 3), None, model.config)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [(r["step"], r["empty"], r["nonfinite_skipped"]) for r in rows] == [(1, 1, 0),
                                                                             (2, 1, 0)]


class _Counter(StateJob):
  """A job whose state counts its steps."""

  def __init__(self):
    self.state = {"w": jnp.zeros((4,), jnp.float32)}

  def step(self, step):
    self.state = {"w": self.state["w"] + 1.0}
    return {"loss": float(step)}


def _tagged(tmp_path, steps, tool_tags):
  """The loop settings of a run with checkpoints whose tokenizer declares `tool_tags`."""
  return LoopConfig(steps=steps, workdir=str(tmp_path / "work"), log_every=100,
                    checkpoint=common.checkpoint(str(tmp_path / "ckpt"), every=2,
                                                 async_save=False),
                    tokenizer=default_tokenizer("plain", tool_tags=tool_tags))


def _counter_abstract(mesh):
  return {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P()))}


def test_every_checkpoint_keeps_the_tokenizer_s_tag_mapping(tmp_path, single_device_mesh):
  config = _tagged(tmp_path, 2, ("sql", "kv"))
  run_loop(_Counter(), config, _counter_abstract(single_device_mesh), None)
  checkpointer = Checkpointer(str(tmp_path / "ckpt"))
  step, _, data = checkpointer.restore_latest(_counter_abstract(single_device_mesh))
  checkpointer.close()
  assert (step, data["loop"]["tags"]) == (2, config.tokenizer.tag_map())


def test_resuming_with_a_tokenizer_whose_tag_ids_moved_is_an_error_naming_them(
    tmp_path, single_device_mesh):
  run_loop(_Counter(), _tagged(tmp_path, 2, ("sql", "kv")), _counter_abstract(single_device_mesh),
           None)
  with pytest.raises(TagMapError) as raised:
    run_loop(_Counter(), _tagged(tmp_path, 4, ("kv", "sql")),
             _counter_abstract(single_device_mesh), None)
  assert str(raised.value).startswith(
      f"checkpoint step 2 in {tmp_path}/ckpt: the tokenizer's tags differ from those the model "
      f"was trained with: <sql> saved as id 1024, here 1026; </sql> saved as id 1025, here 1027; "
      f"<kv> saved as id 1026, here 1024; </kv> saved as id 1027, here 1025. ")


def test_demo_trains_exports_and_reloads_on_a_2x2x2_mesh(tmp_path):
  config = demo_tiny.get_config()
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)
  config.steps, config.log_every, config.batch_size, config.seq_len = 4, 2, 8, 16
  config.workdir = str(tmp_path)
  summary = demo.run(config)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(r["tokens"] == 8 * 16 for r in rows)
  assert summary["final_loss"] < summary["first_loss"]
  assert summary["reload_max_abs_logit_diff"] == 0.0
  assert (tmp_path / "hf_export" / "config.json").is_file()
  assert (tmp_path / "loss.png").stat().st_size > 1000


def test_the_job_loop_writes_every_step_to_tensorboard_too(tmp_path):
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.util import tensor_util

  config = demo_tiny.get_config()
  config.steps, config.log_every, config.batch_size, config.seq_len = 3, 1, 8, 16
  config.workdir = str(tmp_path)
  demo.run(config)
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  losses = [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")]
  written = [(e.step, float(np.asarray(tensor_util.make_ndarray(e.tensor_proto))))
             for e in events.Tensors("loss")]
  assert written == [(step, pytest.approx(loss)) for step, loss in enumerate(losses, 1)]


def test_a_resumed_run_appends_its_metrics_and_other_processes_write_none(tmp_path):
  from tensorboard.backend.event_processing import event_accumulator

  from coa_jax.train.writers import MetricWriter

  for step, append in ((1, False), (2, True)):
    writer = MetricWriter(str(tmp_path), append=append)
    writer.write_scalars(step, {"loss": np.float32(step / 2)})
    writer.close()
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 1.0}]
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  assert [e.step for e in events.Tensors("loss")] == [1, 2]
  MetricWriter(str(tmp_path / "other"), append=False, active=False).write_scalars(1, {"a": 1})
  assert not (tmp_path / "other").exists()


def test_writing_metrics_does_not_import_tensorflow(tmp_path):
  """TensorFlow (installed with the tfds extra) took about 5 s of every job's start."""
  code = ("import sys; from coa_jax.train.writers import MetricWriter; "
          f"w = MetricWriter({str(tmp_path)!r}, append=False); w.write_scalars(1, {{'a': 1}}); "
          "w.close(); print('tensorflow' in sys.modules)")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert done.stdout.split() == ["False"]
