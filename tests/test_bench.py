"""Benchmark helpers: the decode with tool-style extends does the same work on both sides."""

import jax
import numpy as np

from coa_jax.model import Transformer, get_preset
from coa_jax.perf import bench
from coa_jax.runtime import hf_checkpoint, sharding


def test_agent_decode_generates_the_same_greedy_tokens_as_hf_generate_across_extends(tmp_path):
  """Ours (prefill, a chunk per round, extends) and HF `generate` with its static cache kept
  across rounds, float32 on the CPU, same weights: the same tokens, so the same work."""
  config = get_preset("tiny", attention_impl="xla")
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = sharding.init_params(Transformer(config), mesh, jax.random.key(3))
  hf_checkpoint.save_checkpoint(str(tmp_path), config, params, dtype="float32")
  work = bench.AgentDecode(prompt_len=12, new_tokens=6, rounds=3, observation_len=5)
  assert work.generated == 18 and work.length == 12 + 18 + 2 * 5
  prompts, observations = work.inputs(3, config.vocab_size)
  _, ours = bench.jax_agent_decode(config, params, mesh, work, prompts, observations, 0, 1)
  _, theirs = bench.hf_agent_decode(str(tmp_path), "float32", work, prompts, observations, 0, 1)
  assert ours.shape == theirs.shape == (3, 18)
  np.testing.assert_array_equal(ours, theirs)
  assert len(np.unique(ours)) > 3  # the observations changed what the model generates


def test_a_lora_config_step_runs_with_only_its_adapters_trained_in_memory():
  """measure_config_step (experiments/device_fit.py) runs an SFT config's own step on this
  machine: the loss is finite and moves, and LoRA's step holds less than full fine-tuning's
  (float32 adapters and their AdamW moments beside a frozen base in the compute dtype)."""
  from coa_jax.sft.settings import sft_settings
  from configs import common, sft_tiny_cpu

  results = {}
  for rank in (0, 2):
    config = sft_tiny_cpu.get_config()
    config.model = common.model("tiny", dtype="bfloat16", lora_rank=rank, lora_alpha=4.0)
    config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)  # the 8 devices the tests run on
    config.batch_size, config.seq_len, config.train.micro_batches = 16, 64, 2
    config.optimizer.warmup_steps = 0
    results[rank] = bench.measure_config_step(sft_settings(config), steps=2)
  full, lora = results[0], results[2]
  assert lora["adapter_params"] > 0 and full["adapter_params"] == 0
  for r in (full, lora):
    assert len(r["losses"]) == 3 and np.all(np.isfinite(r["losses"]))
    assert r["losses"][-1] < r["losses"][0]
    assert r["step_seconds"] > 0 and r["compiler_peak_bytes"] >= r["compiler_argument_bytes"]
  # full: 4 + 4 + 4 bytes (f32 weights, two moments) a parameter; LoRA: 2 (the bf16 base), and
  # 12 for each of the adapters' 4% of parameters
  assert lora["compiler_argument_bytes"] < 0.5 * full["compiler_argument_bytes"]


def test_host_overhead_times_the_sampler_against_the_decode_step_without_recompiling():
  """The host-overhead benchmark (bench_rollout --host_overhead_only): every loop decodes the
  full budget (the stop ids are never sampled), nothing compiles after warm-up, and the
  figures are per-step times of real runs."""
  from coa_jax.perf import host_overhead

  config = get_preset("tiny")
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = sharding.init_params(Transformer(config), mesh, jax.random.key(0))
  work = host_overhead.DecodeWork(batch=4, prompt_len=8, tokens=8, chunk=4, repeats=2)
  result = host_overhead.sampler_vs_step(config, params, work)
  assert result["compilations_after_warmup"] == 0
  for name in ("floor", "floor_on_device", "chunks", "sampler"):
    r = result[name]
    assert r["runs"] == 2 and 0 < r["min_step_s"] <= r["step_s"] <= r["max_step_s"]
    assert np.isclose(r["tokens_per_s"], 4 / r["step_s"])
  assert np.isclose(result["host_overhead"],
                    result["sampler"]["step_s"] / result["floor"]["step_s"] - 1)
  assert set(result["host_split_per_chunk_s"]) == {"dispatch", "device_wait", "fetch", "checks"}


def test_a_decode_step_reads_every_weight_once_and_each_rows_filled_kv_slots():
  config = get_preset("tiny", dtype="bfloat16")  # 2 layers, 2 kv heads of 16, bf16 compute
  weights = config.num_params() * 2
  kv_per_slot = 2 * 2 * 2 * 16 * 2  # keys and values x layers x kv heads x head dim x bytes
  step_bytes = bench.decode_step_bytes(config, batch=4, filled_slots=10.0)
  assert step_bytes == weights + 4 * 10 * kv_per_slot
  # prompt 3, 2 rounds of 2 tokens, a 5-token observation between: slots 3, 4, then 10, 11
  work = bench.AgentDecode(prompt_len=3, new_tokens=2, rounds=2, observation_len=5)
  assert work.mean_filled_slots == (3 + 4 + 10 + 11) / 4
