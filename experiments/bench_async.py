"""Asynchronous DAPO against the synchronous job on the main job's DAPO stage, with slow tools.

  python experiments/bench_async.py [--seeds=3] [--staleness=0,1,2] [--latency=0.5,2.0]
                                    [--output=runs/bench_async]

Needs the main job's SFT exports (`make pipeline`). For each seed, and for the synchronous job
and each staleness bound, it runs the main job's DAPO stage (same updates, same seed) from that
seed's SFT model with every tool behind a modelled service latency (uniform in --latency
seconds, fixed per call; tool_workers=32, so calls run at once as on a tool service), on 2
fake CPU devices: the synchronous job uses both, an asynchronous one decodes on one and trains
on the other. Each result is then evaluated on the held-out tasks (tools at their own speed).
Writes results.json, results.md and results.png to --output; a re-run skips the runs done.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from coa_jax.evaluation import job as evaluation  # noqa: E402
from coa_jax.perf import async_bench  # noqa: E402
from coa_jax.rl import job as rl_job  # noqa: E402
from configs import pipeline_tiny_cpu  # noqa: E402

_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0 .. n-1 of the main job")
_STALENESS = flags.DEFINE_list("staleness", ["0", "1", "2"], "staleness bounds to run")
_LATENCY = flags.DEFINE_list("latency", ["0.5", "2.0"], "tool latency range, seconds")
_STEPS = flags.DEFINE_integer("steps", 0, "updates per run (0: the main job's)")
_EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 0, "held-out tasks (0: the main job's)")
_OUTPUT = flags.DEFINE_string("output", "runs/bench_async", "where to write")


def _configs(seed: int, staleness: int | None, folder: str):
  pipeline = pipeline_tiny_cpu.get_config()
  stages = pipeline_tiny_cpu.stage_configs(pipeline, seed)
  config, evaluate = stages["dapo"], stages["eval_dapo"]
  if not os.path.isdir(config.model.checkpoint):
    raise SystemExit(f"{config.model.checkpoint} is missing: run the main job first "
                     f"(make pipeline)")
  low, high = map(float, _LATENCY.value)
  # Slow tools for training only (the evaluation shares the stage's tool spec object).
  config.tools = ml_collections.ConfigDict(
      {tag: {**spec, "latency_s": [low, high]} for tag, spec in config.tools.to_dict().items()})
  config.rollout.tool_workers = 32
  if _STEPS.value:
    config.rl.steps = _STEPS.value
  if staleness is not None:
    config.rl["async"].update({"enabled": True, "staleness": staleness})
  config.workdir, config.export_dir = folder, os.path.join(folder, "hf_export")
  config.checkpoint.directory = os.path.join(folder, "checkpoints")
  config.checkpoint.every = config.rl.steps
  evaluate.model.checkpoint, evaluate.output_dir = config.export_dir, os.path.join(folder, "eval")
  if _EVAL_TASKS.value:
    evaluate.max_tasks = _EVAL_TASKS.value
  return config, evaluate


def _run(seed: int, staleness: int | None, folder: str) -> dict[str, float]:
  """Returns one run's figures, running it unless its evaluation is on disk."""
  done = os.path.join(folder, "eval", "metrics.json")
  config, evaluate = _configs(seed, staleness, folder)
  if not os.path.exists(done):
    if os.path.exists(folder):  # an interrupted run starts over: its timing would be broken
      shutil.rmtree(folder)
    rl_job.run(config)
    evaluation.run(evaluate)
  rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
  with open(done) as f:
    return async_bench.run_figures(rows, json.load(f))


def _plot(table, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(table)
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  for ax, key, title in ((axes[0], "wall_per_update_s", "wall seconds per update"),
                         (axes[1], "pass@1", "held-out pass@1")):
    ax.bar(names, [table[n][key]["mean"] for n in names],
           yerr=[table[n][key]["sd"] for n in names], capsize=4,
           color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
    ax.set_title(title)
  fig.suptitle(f"DAPO with slow tools ({_LATENCY.value[0]}-{_LATENCY.value[1]} s per call), "
               f"{_SEEDS.value} seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  out = _OUTPUT.value
  os.makedirs(out, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  variants = [None] + [int(k) for k in _STALENESS.value]
  plan = [(seed, k) for seed in range(_SEEDS.value) for k in variants]
  runs: dict[str, dict[int, dict[str, float]]] = {}
  start = time.perf_counter()
  for i, (seed, k) in enumerate(plan):
    name = async_bench.variant_name(k)
    figures = _run(seed, k, os.path.join(out, f"seed-{seed}", name.replace("=", "")))
    runs.setdefault(name, {})[seed] = figures
    elapsed = time.perf_counter() - start
    print(f"[{i + 1}/{len(plan)}] seed {seed} {name}: {figures['wall_per_update_s']:.2f} s per "
          f"update, pass@1 {figures['pass@1']:.3f}, sampler busy {figures['sampler_busy']:.2f}, "
          f"trainer busy {figures['trainer_busy']:.2f}  ({elapsed:.0f} s, ETA "
          f"{elapsed / (i + 1) * (len(plan) - i - 1):.0f} s)", flush=True)
  table = async_bench.compare(runs)
  text = async_bench.markdown(table)
  print(text)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"latency_s": [float(x) for x in _LATENCY.value], "devices": jax.device_count(),
               "runs": runs, "table": table}, f, indent=1)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(text + "\n")
  _plot(table, os.path.join(out, "results.png"))


if __name__ == "__main__":
  app.run(main)
