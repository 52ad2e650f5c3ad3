"""Decode throughput vs HF transformers `generate` with tool-style extends, and how much tool
latency rollouts hide.

  python experiments/bench_rollout.py [--config=configs/bench_model.py] [--skip_tools]
  python experiments/bench_rollout.py --config=configs/bench_model_gpu.py --skip_tools  # GPU
  python experiments/bench_rollout.py --host_overhead_only  # part 3 only (make bench-sampler)
  python experiments/bench_rollout.py --config=configs/bench_model_gpu.py --skip_tools \
      --skip_host_overhead --batches=16  # part 1 at one batch size (experiments/device_check.py)
  python experiments/bench_rollout.py --evaluation_only  # part 4 only, after `make pipeline`

1. Greedy decoding of the config's models (`config.decode`): random prompts, then rounds of
   new tokens with an observation appended between rounds, prefill and extends included.
   coa-jax's Sampler (prefill, one on-device chunk per round, an extend between rounds)
   against HF transformers `generate` (PyTorch, SDPA attention, its static KV cache kept
   across rounds) with the same weights (exported by coa-jax, loaded by transformers), on the
   same device kind, in the same run; also how many generated tokens agree. Each is given as
   a fraction of the roofline: a step must read every weight (compute dtype) and each row's
   filled KV slots (`bench.decode_step_bytes`) at the device's memory bandwidth (an
   accelerator's HBM figure, a CPU's measured rate), and run 2 x params FLOPs a row at its
   peak; the slower of the two bounds the step (on an accelerator the bytes, at these batch
   sizes; on a CPU the FLOPs from a few rows up). The measured time includes the prefill and
   the extends, which the roofline leaves out, so the fraction is a lower bound for the decode
   steps alone.
2. Rollouts of the SFT demo's model (trained here first if `make demo` has not been run) on
   the shipped tasks, greedy, with the embedded tools answering at once and then after a
   200 ms delay: the extra wall time against the tool latency the samples incurred shows how
   much of it decoding hides.
3. The sampler's host overhead on the tiny model (the rollout tests' preset), batch 16: the
   decode step alone in a tight loop against `Sampler.decode_chunk` driven as the rollout loop
   drives it, and the rollout loop itself (`coa_jax.perf.host_overhead`).
4. (`--evaluation_only`) The main job's held-out evaluation rollouts (seed 0's SFT model from
   `make pipeline`, 200 tasks x 3 samples in one batch of 600 rows, the world's tools): the
   rollout loop naming its active rows, which the sampler then decodes alone when they fill
   at most half the batch, against decoding the whole batch at every chunk; alternated
   rounds, compiled first, and whether the two give the same samples.
"""

import dataclasses
import os
import tempfile
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from coa_jax.data.tasks import load_tasks
from coa_jax.data.tasks import Task
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.model import Transformer, build_config
from coa_jax.perf import bench, host_overhead
from coa_jax.rollout import settings as agent
from coa_jax.runtime import cache, hf_checkpoint, sharding
from coa_jax.runtime.sharding import init_params
from coa_jax.sft import job as sft
from configs import bench_model, rollout_tiny_cpu, sft_tiny_cpu
from tools_env import Tool, ToolRegistry

_CONFIG = config_flags.DEFINE_config_file("config", bench_model.__file__)
_SKIP_TOOLS = flags.DEFINE_bool("skip_tools", False, "skip the tool-latency rollouts (part 2)")
_TOOL_DELAY = flags.DEFINE_float("tool_delay_s", 0.2, "latency added to every tool call")
_TASKS = flags.DEFINE_integer("tasks", 32, "rollout tasks for the tool-latency run")
_HOST_ONLY = flags.DEFINE_bool("host_overhead_only", False, "run part 3 (host overhead) only")
_SKIP_HOST = flags.DEFINE_bool("skip_host_overhead", False, "skip the host overhead (part 3)")
_MODELS = flags.DEFINE_list("models", [], "the config's models to decode (default: all)")
_BATCHES = flags.DEFINE_multi_integer("batches", [], "decode batch sizes (default: the "
                                      "config's); repeat the flag for several")
_REPEATS = flags.DEFINE_integer("repeats", 15, "timed runs of each loop in part 3")
_CHUNK = flags.DEFINE_integer("chunk", 32, "decode steps per device call in part 3")
_OUTPUT = flags.DEFINE_string("output", "", "figures (JSON); default: next to the config's")
_EVALUATION = flags.DEFINE_bool("evaluation_only", False, "run part 4 (the main job's "
                                "evaluation rollouts, active rows alone vs the whole batch) only")
_PIPELINE = flags.DEFINE_string("pipeline_dir", "runs/pipeline_tiny",
                                "the main job's output folder, for part 4")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "part 1 without HF generate (coa-jax alone)")
_CACHE = flags.DEFINE_integer("cache_size", 0, "KV cache slots of part 1's decodes, both sides "
                              "(default: the bucket that fits the work; a rollout's cache is "
                              "sized for its longest sample)")


def bench_decode(config, bandwidth, peak, models=(), batches=(), peer=True):
  """Returns a row of figures per (model, batch): `models` of the config (default all but the
  LoRA ones), at `batches` (default the config's); HF `generate` on the same work too, with
  `peer`."""
  settings = config.decode.to_dict()
  batches = list(batches or settings["batches"])
  del settings["batches"]
  work = bench.AgentDecode(**settings)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  rows = []
  progress = bench.progress()
  for name, spec in config.models.items():
    # rollouts decode LoRA's merged weights: the base model's cost
    if spec.get("lora_rank") or (models and name not in models):
      continue
    model_config = build_config(dict(spec, attention_impl="xla"))  # cached attention decodes
    params = jax.block_until_ready(init_params(Transformer(model_config), mesh,
                                               jax.random.key(0)))
    progress(f"{name}: weights initialized")
    with tempfile.TemporaryDirectory() as folder:
      if peer:
        hf_checkpoint.save_checkpoint(folder, model_config, params, dtype=model_config.dtype)
        progress(f"{name}: exported for HF transformers")
      for batch in batches:
        prompts, observations = work.inputs(batch, model_config.vocab_size, seed=batch)
        ours_s, ours_ids = bench.jax_agent_decode(model_config, params, mesh, work, prompts,
                                                  observations, cache_size=_CACHE.value)
        tokens = batch * work.generated
        ours = tokens / ours_s
        progress(f"{name} batch {batch}: coa-jax {ours:,.0f} tok/s (compiled and timed)"
                 + ("; HF generate next" if peer else ""))
        step_bytes = bench.decode_step_bytes(model_config, batch, work.mean_filled_slots)
        bounds = {"memory": step_bytes / bandwidth,
                  "compute": 2 * model_config.num_params() * batch / peak}
        bound = max(bounds, key=bounds.get)
        roofline = batch / bounds[bound]  # tokens/s at the binding limit
        row = dict(model=name, params=model_config.num_params(), batch=batch,
                   dtype=model_config.dtype, **dataclasses.asdict(work),
                   cache_size=_CACHE.value or None, ours_tokens_per_s=ours,
                   step_bytes=step_bytes, bound=bound, roofline_tokens_per_s=roofline,
                   ours_of_roofline=ours / roofline,
                   ours_of_bandwidth=ours * bounds["memory"] / batch)
        line = (f"{name:>12} batch {batch:3d}: coa-jax {ours:9,.0f} tok/s ({ours / roofline:6.1%} "
                f"of the roofline, {bound}-bound; {step_bytes / 1e9:.3g} GB a step, "
                f"{row['ours_of_bandwidth']:.1%} of the bandwidth)")
        if peer:
          hf_s, hf_ids = bench.hf_agent_decode(folder, model_config.dtype, work, prompts,
                                               observations, cache_size=_CACHE.value)
          theirs = tokens / hf_s
          row.update(hf_tokens_per_s=theirs, ratio=ours / theirs, hf_of_roofline=theirs / roofline,
                     same_tokens=float((ours_ids == hf_ids).mean()))
          line += (f"  HF generate {theirs:9,.0f} tok/s ({theirs / roofline:6.1%})  ratio "
                   f"{ours / theirs:.2f}x  same tokens {row['same_tokens']:.0%}")
        rows.append(row)
        print(line, flush=True)
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
  settings = agent.rollout_settings(config)
  tasks = load_tasks(settings.tasks, settings.max_tasks, require_answer=False)
  tokenizer = agent.agent_tokenizer(settings)
  runs = {}
  for delay in (0.0, _TOOL_DELAY.value):
    engine = agent.engine(settings, tokenizer)
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


def bench_host_overhead():
  """The sampler's loop against the decode step alone, and the rollout loop, per token."""
  tokenizer = default_tokenizer("plain")
  config = build_config({"preset": "tiny", "vocab_size": tokenizer.vocab_size,
                         "tie_embeddings": False})
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = init_params(Transformer(config), mesh, jax.random.key(0))
  work = host_overhead.DecodeWork(chunk=_CHUNK.value, repeats=_REPEATS.value)
  engine = host_overhead.rollout_engine(config, params, work, tokenizer)
  tasks = [Task(f"t{i}", f"What is {i} + {i}?") for i in range(3 * work.batch)]
  result = host_overhead.sampler_vs_step(config, params, work, rollout=(engine, tasks))
  rollout, floor = result["rollout"], result["floor"]
  result["rollout_overhead"] = rollout["device_step_s"] / floor["step_s"] - 1
  result["rollout_overhead_cpu"] = rollout["cpu_step_s"] / floor["cpu_step_s"] - 1
  _print_host_overhead(result)
  return result


def _print_host_overhead(result):
  for name in ("floor_on_device", "floor", "chunks", "sampler", "rollout"):
    r = result[name]
    print(f"{name:>16}: {r['step_s'] * 1e6:7.0f} us per step of {result['batch']} rows "
          f"({r['min_step_s'] * 1e6:.0f}-{r['max_step_s'] * 1e6:.0f}; CPU time "
          f"{r['cpu_step_s'] * 1e6:.0f} us), {r['tokens_per_s']:8,.0f} tok/s", flush=True)
  paired, cpu = result["host_overhead_paired"], result["host_overhead_cpu"]
  split = ", ".join(f"{part} {t * 1e6:.0f} us" for part, t in
                    result["host_split_per_chunk_s"].items())
  rollout = result["rollout"]
  print(f"host overhead (sampler / floor - 1): {result['host_overhead']:+.1%} (runs back to "
        f"back: median {paired['median']:+.1%}, {paired['min']:+.1%} to {paired['max']:+.1%}; "
        f"in CPU time {cpu['median']:+.1%}); against the on-device floor "
        f"{result['overhead_vs_on_device']:+.1%}; chunk bookkeeping "
        f"{result['chunk_bookkeeping']:+.1%}; fetch and checks {result['fetch_and_checks']:+.1%}; "
        f"a chunk's host time: {split}; rollout loop per decode step the device ran (prefills, "
        f"extends and the host's work included) {result['rollout_overhead']:+.1%}, in CPU time "
        f"{result['rollout_overhead_cpu']:+.1%}, runs back to back "
        f"{result['rollout_overhead_paired']['median']:+.1%} ({rollout['tool_calls_per_run']} "
        f"tool calls, {rollout['tasks']} tasks, rows busy {rollout['rows_busy']:.0%} of the "
        f"steps, decode chunks {rollout['decode_share']:.0%} of the wall time); "
        f"compilations after warm-up: "
        f"{result['compilations_after_warmup']} and {rollout['compilations_after_warmup']}",
        flush=True)


def bench_evaluation(pipeline_dir: str, rounds: int = 2):
  """Part 4: the main job's evaluation rollouts, active rows decoded alone vs the whole batch."""
  from coa_jax.data import rewards
  from coa_jax.evaluation.job import evaluate_rollouts
  from coa_jax.evaluation.settings import evaluation_settings
  from configs import pipeline_tiny_cpu

  main_job = pipeline_tiny_cpu.get_config()
  main_job.output_dir = pipeline_dir
  config = pipeline_tiny_cpu.stage_configs(main_job, 0)["eval_sft"]
  if not os.path.exists(os.path.join(config.model.checkpoint, "config.json")):
    raise SystemExit(f"no SFT model in {config.model.checkpoint}: run `make pipeline` first "
                     f"(or pass --pipeline_dir)")
  settings = evaluation_settings(config)
  tasks = load_tasks(settings.tasks, settings.max_tasks)
  tokenizer = agent.agent_tokenizer(settings)
  rewarder = rewards.build_rewarder(settings.rewards, tokenizer.tool_tags)
  engine = agent.engine(settings, tokenizer, dataclasses.replace(settings.rollout,
                                                                 group_size=settings.k))
  seconds = {"active_rows": [], "whole_batch": []}
  samples = {}
  try:
    for i in range(rounds + 1):  # round 0 compiles both
      for mode in seconds:
        engine.decode_active_rows = mode == "active_rows"
        engine.key = jax.random.key(settings.seed)  # every run samples alike
        start = time.perf_counter()
        samples[mode] = evaluate_rollouts(engine, tokenizer, tasks, rewarder)
        if i:
          seconds[mode].append(round(time.perf_counter() - start, 2))
        print(f"round {i} {mode}: {time.perf_counter() - start:.1f} s", flush=True)
  finally:
    engine.tools.close()
  same = samples["active_rows"] == samples["whole_batch"]  # every sample's text and outcome
  best = {mode: min(times) for mode, times in seconds.items()}
  result = dict(tasks=len(tasks), rows=config.batch_size, seconds=seconds, best_s=best,
                speedup=round(best["whole_batch"] / best["active_rows"], 3),
                same_samples=same)
  print(f"evaluation rollouts ({len(tasks)} tasks x {config.k}, {config.batch_size} rows): "
        f"active rows alone {best['active_rows']:.1f} s, whole batch "
        f"{best['whole_batch']:.1f} s: {result['speedup']:.2f}x; same samples: {same}",
        flush=True)
  return result


def main(argv):
  del argv
  bench.share_gpu_with_torch()
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if _EVALUATION.value:
    return _write(dict(evaluation=bench_evaluation(_PIPELINE.value)),
                  _OUTPUT.value or config.output.replace(".json", "_evaluation.json"))
  if _HOST_ONLY.value:
    return _write(dict(host_overhead=bench_host_overhead()),
                  _OUTPUT.value or config.output.replace(".json", "_host_overhead.json"))
  bandwidth, source = bench.memory_bandwidth()
  peak, peak_source = bench.peak_flops()
  d = config.decode
  print(f"device {jax.devices()[0].device_kind} (PyTorch on {bench.torch_device()}); memory "
        f"bandwidth {bandwidth / 1e9:.3g} GB/s ({source}); peak {peak / 1e12:.3g} TFLOP/s "
        f"({peak_source}); prompts {d.prompt_len} tokens, {d.rounds} rounds of "
        f"{d.new_tokens} new tokens with {d.observation_len}-token observations between "
        f"them, greedy")
  figures = dict(device=jax.devices()[0].device_kind, bandwidth_bytes_per_s=bandwidth,
                 bandwidth_source=source, peak_flops=peak, peak_source=peak_source,
                 decode=bench_decode(config, bandwidth, peak, _MODELS.value, _BATCHES.value,
                                     peer=not _SKIP_HF.value))
  if not _SKIP_HOST.value:
    figures["host_overhead"] = bench_host_overhead()
  if jax.devices()[0].platform == "cpu":
    figures["decode_gemms"] = bench_decode_gemms()
  if not _SKIP_TOOLS.value:
    figures["tools"] = bench_tool_latency()
  _write(figures, _OUTPUT.value or config.output.replace(".json", "_rollout.json"))


def _write(figures, output):
  cache.write_json(output, figures)
  print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)
