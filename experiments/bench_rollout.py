"""Decode throughput vs HF transformers `generate`, and how much tool latency rollouts hide.

  python experiments/bench_rollout.py [--batches=1,8,64 --prompt_len=64 --new_tokens=128]

1. Greedy decoding of random 64-token prompts for 128 new tokens, prefill included, for the
   tiny and a ~100M Qwen2-shaped model: coa-jax's Sampler (one prefill + one on-device chunk
   of 128 steps) against HF transformers `generate` (PyTorch, KV cache on) with the same
   weights (exported by coa-jax, loaded by transformers), in the same run. Each is also given
   as a fraction of the matmul-bound ceiling: this CPU's measured matmul FLOP/s over
   2 x parameters FLOPs per generated token.
2. Rollouts of the SFT demo's model (trained here first if `make demo` has not been run) on
   the shipped tasks, greedy, with the embedded tools answering at once and then after a
   200 ms delay: the extra wall time against the tool latency the samples incurred shows how
   much of it decoding hides.
"""

import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging

from coa_jax.data.tasks import load_tasks
from coa_jax.model import Transformer, build_config
from coa_jax.perf import bench
from coa_jax.rollout import job as rollout_job
from coa_jax.rollout.sampler import Sampler, SamplingConfig, bucket
from coa_jax.runtime import hf_checkpoint, sharding
from coa_jax.runtime.sharding import init_params
from coa_jax.sft import job as sft
from configs import bench_model, rollout_tiny_cpu, sft_tiny_cpu
from tools_env import Tool, ToolRegistry

_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64"], "decode batch sizes")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "prompt tokens")
_NEW = flags.DEFINE_integer("new_tokens", 128, "generated tokens per row")
_TOOL_DELAY = flags.DEFINE_float("tool_delay_s", 0.2, "latency added to every tool call")
_TASKS = flags.DEFINE_integer("tasks", 32, "rollout tasks for the tool-latency run")
_OUTPUT = flags.DEFINE_string("output", "runs/bench/bench_rollout.json", "figures (JSON)")


def ours_seconds(model_config, params, mesh, prompts):
  """Returns median seconds of prefill + greedy decoding of new_tokens for `prompts`."""
  batch, length = prompts.shape
  sampler = Sampler(model_config, mesh, batch_size=batch,
                    cache_size=bucket(length) + _NEW.value + 1, chunk=_NEW.value, stop_ids=(),
                    sampling=SamplingConfig(temperature=0.0))
  groups = [([row], list(prompt)) for row, prompt in enumerate(prompts)]
  budgets = [length + _NEW.value] * batch

  def run():
    state = sampler.prefill_groups(params, sampler.init_state(), groups, budgets)
    _, chunk = sampler.decode_chunk(params, state, jax.random.key(0))
    counts = np.asarray(chunk.counts_B)
    assert (counts == _NEW.value).all(), counts

  return bench.time_calls(run, 1, 3)


def hf_seconds(folder, prompts):
  """Returns median seconds of HF `generate` (greedy, KV cache) for the same work."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  model.eval()
  inputs = torch.as_tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(inputs)

  def run():
    with torch.no_grad():
      out = model.generate(inputs, attention_mask=mask, max_new_tokens=_NEW.value,
                           min_new_tokens=_NEW.value, do_sample=False, use_cache=True,
                           pad_token_id=0)
    assert out.shape[1] == prompts.shape[1] + _NEW.value

  return bench.time_calls(run, 1, 3)


def bench_decode(peak):
  models = bench_model.get_config().models
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  rows = []
  for name, spec in models.items():
    model_config = build_config(dict(spec, attention_impl="xla"))
    params = init_params(Transformer(model_config), mesh, jax.random.key(0))
    ceiling = peak / (2 * model_config.num_params())  # tokens/s if matmul-bound
    with tempfile.TemporaryDirectory() as folder:
      hf_checkpoint.save_checkpoint(folder, model_config, params, dtype="float32")
      for batch in map(int, _BATCHES.value):
        prompts = np.random.default_rng(batch).integers(
            0, model_config.vocab_size, (batch, _PROMPT.value)).astype(np.int32)
        tokens = batch * _NEW.value
        ours = tokens / ours_seconds(model_config, params, mesh, prompts)
        theirs = tokens / hf_seconds(folder, prompts)
        row = dict(model=name, params=model_config.num_params(), batch=batch,
                   ours_tokens_per_s=ours, hf_tokens_per_s=theirs, ratio=ours / theirs,
                   ours_of_ceiling=ours / ceiling, hf_of_ceiling=theirs / ceiling)
        rows.append(row)
        print(f"{name:>11} batch {batch:3d}: coa-jax {ours:8,.0f} tok/s ({ours / ceiling:6.1%} "
              f"of ceiling)  HF generate {theirs:8,.0f} tok/s ({theirs / ceiling:6.1%})  "
              f"ratio {ours / theirs:.2f}x", flush=True)
  return rows


class Delayed(Tool):
  """Another tool's answer, given after a fixed delay."""

  def __init__(self, tool, delay_s):
    super().__init__(tool.max_output_chars)
    self.tool, self.delay_s, self.name = tool, delay_s, tool.name

  def _run(self, body, goal):
    time.sleep(self.delay_s)
    result = self.tool(body, goal)
    return result.observation, result.metadata


def bench_tool_latency():
  config = rollout_tiny_cpu.get_config()
  if not os.path.isdir(config.model.checkpoint):
    print(f"{config.model.checkpoint} is missing: training the SFT demo model first")
    sft.run(sft_tiny_cpu.get_config())
  config.max_tasks = _TASKS.value
  config.sampling.temperature = 0.0  # greedy: the same tokens whatever the tool timing
  config.rollout.group_size = 1
  tasks = load_tasks(config.tasks, config.max_tasks, require_answer=False)
  runs = {}
  for delay in (0.0, _TOOL_DELAY.value):
    engine, _ = rollout_job.build(config)
    engine.tools = ToolRegistry({tag: Delayed(tool, delay)
                                 for tag, tool in engine.tools.tools.items()})
    list(engine.run(tasks[:8]))  # compile every bucket first
    engine.decode_s = engine.tool_wait_s = 0.0
    start = time.perf_counter()
    records = [r for group in engine.run(tasks) for r in group]
    runs[delay] = dict(wall_s=time.perf_counter() - start, decode_s=engine.decode_s,
                       tool_wait_s=engine.tool_wait_s, turns=sum(r.turns for r in records),
                       max_turns=max(r.turns for r in records),
                       tokens=sum(r.response_len for r in records),
                       ids={(r.task_id, r.sample): r.ids for r in records})
  fast, slow = runs[0.0], runs[_TOOL_DELAY.value]
  fast_ids, slow_ids = fast.pop("ids"), slow.pop("ids")
  same = sum(fast_ids[k] == slow_ids[k] for k in fast_ids)
  print(f"{same}/{len(fast_ids)} samples are token-identical in the two runs (extends batched "
        f"differently may flip a near-tie argmax)")
  added = slow["wall_s"] - fast["wall_s"]
  serial = _TOOL_DELAY.value * slow["turns"]
  result = dict(tasks=len(tasks), identical_samples=same, tool_delay_s=_TOOL_DELAY.value,
                instant_tools=fast,
                delayed_tools=slow, added_wall_s=added, serial_tool_latency_s=serial,
                hidden_fraction=1 - added / serial if serial else None,
                wall_over_decode_plus_turn_latency=slow["wall_s"] / (
                    fast["wall_s"] + _TOOL_DELAY.value * slow["max_turns"]))
  print(f"rollout of {len(tasks)} tasks, {slow['turns']} tool calls (at most "
        f"{slow['max_turns']} per sample): instant tools {fast['wall_s']:.2f} s; with "
        f"{_TOOL_DELAY.value * 1000:.0f} ms tools {slow['wall_s']:.2f} s (+{added:.2f} s against "
        f"{serial:.1f} s of tool latency run one after another: "
        f"{result['hidden_fraction']:.0%} hidden); wall / (decode-only + one tool latency per "
        f"turn) = {result['wall_over_decode_plus_turn_latency']:.2f}", flush=True)
  return result


def bench_decode_gemms():
  """The ~100M model's decode matmuls at batch 64 in both frameworks: the floor under a step."""
  spec = bench_model.get_config().models["qwen2_100m"]
  d, f, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
  rows = []
  for m, k, n in [(64, d, d), (64, d, f), (64, f, d), (64, d, v)]:
    rates = bench.matmul_flops(m, k, n)
    rows.append(dict(shape=[m, k, n], **rates))
    print(f"GEMM {m}x{k}x{n}: JAX {rates['jax'] / 1e9:.0f} GFLOP/s, PyTorch "
          f"{rates['torch'] / 1e9:.0f} GFLOP/s ({rates['jax'] / rates['torch']:.2f}x)", flush=True)
  return rows


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  peaks = bench.matmul_peak_flops()
  peak = max(peaks.values())
  print(f"matmul peak (float32, 2048^3): JAX {peaks['jax'] / 1e9:.1f} GFLOP/s, "
        f"PyTorch {peaks['torch'] / 1e9:.1f} GFLOP/s; prompts {_PROMPT.value} tokens, "
        f"{_NEW.value} new tokens, greedy")
  figures = dict(peak_flops=peaks, decode_gemms=bench_decode_gemms(),
                 decode=bench_decode(peak), tools=bench_tool_latency())
  os.makedirs(os.path.dirname(_OUTPUT.value) or ".", exist_ok=True)
  with open(_OUTPUT.value, "w") as f:
    json.dump(figures, f, indent=2)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
