"""The DAPO job end to end on a fresh tiny model over 8 devices: metrics, plot, checkpoints,
exact resume, the dynamic-sampling cap."""

import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.rl import dapo
from coa_jax.rl import job as rl_job
from configs import common, dapo_tiny_cpu
from tools_env.sandbox import CodeSandbox


def _config(tmp_path, name, **rl):
  config = dapo_tiny_cpu.get_config()
  config.model.checkpoint = ""  # a fresh model: no SFT export needed
  config.max_tasks, config.eval_max_tasks = 16, 2
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)  # the 8 fake devices
  config.batch_size, config.chunk = 4, 16
  config.rollout.update(group_size=2, max_prompt_tokens=192, max_response_tokens=48,
                        max_observation_tokens=32, max_turns=2)
  config.rl = common.rl(**{**dict(steps=2, batch_groups=2, prompts_per_round=2, max_rounds=2,
                                  mini_batch_groups=2, overlong_cache=16, eval_every=2,
                                  dynamic_sampling=False), **rl})
  config.optimizer = common.optimizer(learning_rate=1e-3, schedule="constant", weight_decay=0.0)
  config.rewards.domains["code"] = {"kind": "code"}  # a code reward (no task of it here)
  config.checkpoint = common.checkpoint(str(tmp_path / name / "ckpt"), every=1, max_to_keep=3,
                                        async_save=False)
  config.workdir = str(tmp_path / name)
  config.export_dir = ""
  return config


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("dapo")
  return tmp, rl_job.run(_config(tmp, "whole"))


def test_job_writes_metrics_plot_and_checkpoints(uninterrupted):
  tmp, summary = uninterrupted
  rows = [json.loads(line) for line in open(tmp / "whole" / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
  # What the code tool and the code reward ran programs in.
  assert summary["sandbox_isolation"] == summary["reward_sandbox_isolation"] == \
      CodeSandbox().isolation
  for key in ("reward", "accuracy", "response_len", "entropy", "clip_high", "clip_low",
              "dual_clip", "approx_kl", "pg_loss", "grad_norm", "logp_diff_mean",
              "logp_diff_max", "kept", "rounds"):
    assert key in rows[0], key
  assert "eval_accuracy" in rows[1] and "eval_accuracy" not in rows[0]
  assert rows[0]["kept"] == 2 and rows[0]["rounds"] == 1
  assert rows[0]["logp_diff_max"] < 1e-3  # the sampler's log-probs equal teacher forcing
  assert (tmp / "whole" / "dapo.png").stat().st_size > 0
  prompts = json.load(open(summary["prompts"]))
  assert len(prompts["never_solved"]) == 4  # 2 steps x 2 groups of a fresh model, all wrong
  assert sorted(p.name for p in (tmp / "whole" / "ckpt").iterdir() if p.name.isdigit()) == [
      "1", "2"]


def test_resumed_run_equals_the_uninterrupted_one(uninterrupted, tmp_path):
  _, whole = uninterrupted
  config = _config(tmp_path, "split")
  config.rl.stop_after = 1
  first = rl_job.run(config)
  assert first["steps"] == 1
  second = rl_job.run(config)  # resumes from step 1's checkpoint, runs step 2
  assert second["resumed_from"] == 1 and second["steps"] == 2
  rows = [json.loads(line) for line in open(tmp_path / "split" / "metrics.jsonl")]
  whole_rows = [json.loads(line) for line in open(whole["metrics"])]
  assert [a["step"] for a in rows] == [b["step"] for b in whole_rows] == [1, 2]
  for a, b in zip(rows, whole_rows):
    assert a["reward"] == b["reward"] and a["response_len"] == b["response_len"]
    np.testing.assert_allclose(a["pg_loss"], b["pg_loss"], rtol=1e-6)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(second["state"].params),
                         jax.device_get(whole["state"].params))


def test_dynamic_sampling_cap_stops_the_run_clearly(tmp_path):
  config = _config(tmp_path, "cap", dynamic_sampling=True)
  config.rewards.format_penalty = 0.0  # a fresh model is never right: every group is uniform
  with pytest.raises(dapo.DynamicSamplingError, match="after 2 generation rounds"):
    rl_job.run(config)


def test_lora_dapo_trains_adapters_decodes_them_and_resumes_exactly(tmp_path):
  """DAPO with LoRA (dropout set, which RL updates do not apply) and a KL term: the state and
  optimizer hold the adapters alone, the frozen base is untouched, the sampler's log-probs on
  the LoRA model (base and adapters) equal its teacher-forced ones after the adapters moved, the
  reference (the base, adapters off) moves away from the policy, and a resumed run equals the
  uninterrupted one; the export writes PEFT's adapters beside the merged model, each with the
  tokenizer's files."""
  from coa_jax.rl.settings import rl_settings
  from coa_jax.rollout.settings import agent_tokenizer
  from coa_jax.model import lora

  def lora_config(name):
    config = _config(tmp_path, name, kl_coef=0.1)
    config.model.update(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1)
    config.optimizer.learning_rate = 1e-2
    return config

  whole_config = lora_config("whole")
  whole_config.export_dir = str(tmp_path / "export")
  whole = rl_job.run(whole_config)
  rows = [json.loads(line) for line in open(whole["metrics"])]
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["ref_kl"] == 0.0 < rows[1]["ref_kl"]  # B starts at 0: the policy is the base
  assert rows[1]["logp_diff_max"] < 1e-3  # the sampler runs the adapted model
  state = whole["state"]
  leaves = lambda tree: {path[-1] for path in flax.traverse_util.flatten_dict(tree)}
  assert leaves(state.params) == set(lora.ADAPTERS) and "kernel" in leaves(state.frozen)
  assert leaves(state.opt_state[1][0].mu) == set(lora.ADAPTERS)
  assert float(jnp.abs(state.params["layers"]["attn"]["q_proj"]["lora_b"]).max()) > 0
  assert (tmp_path / "export" / "adapter" / "adapter_config.json").exists()
  # Both exports carry the tokenizer's tag mapping, the merged one the sampling defaults.
  tokenizer = agent_tokenizer(rl_settings(whole_config))
  for folder in ("export", "export/adapter"):
    assert json.loads((tmp_path / folder / "coa_tags.json").read_text()) == tokenizer.tag_map()
  generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
  assert (generation["eos_token_id"], generation["temperature"]) == (tokenizer.end_id, 1.0)

  split_config = lora_config("split")
  split_config.rl.stop_after = 1
  assert rl_job.run(split_config)["steps"] == 1
  second = rl_job.run(split_config)
  assert second["resumed_from"] == 1
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(second["state"].params),
                         jax.device_get(state.params))
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(second["state"].frozen),
                         jax.device_get(state.frozen))
