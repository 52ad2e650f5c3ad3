"""Asynchronous DAPO against the synchronous job on the main job's DAPO stage, with slow tools;
and the synchronous job through the trainer's own endpoint (`--agent`).

  python experiments/bench_async.py [--seeds=3] [--staleness=0,1,2] [--latency=0.5,2.0]
                                    [--output=runs/bench_async] [--config=<a pipeline config>]
  # agent RL through the endpoint against the built-in loop, tools at their own speed:
  python experiments/bench_async.py --agent --staleness= --latency=0,0 --steps=6 \
      --output=runs/bench_agent_rl

Needs the pipeline's SFT exports (`make pipeline`; --config and its --config.* overrides name
the pipeline, as for experiments/pipeline.py). For each seed, and for the synchronous job and
each staleness bound, it runs the pipeline's DAPO stage (same updates, same seed) from that
seed's SFT model with every tool behind a modelled service latency (uniform in --latency
seconds, fixed per call; tool_workers=32, so calls run at once as on a tool service), on 2
fake CPU devices: the synchronous job uses both, an asynchronous one decodes on one and trains
on the other. `--agent` adds the synchronous job rolling out the built-in loop as an agent
program through the trainer's endpoint (`coa_jax.serving.agent:coa_loop`). Each result is then
evaluated on the held-out tasks (tools at their own speed). Writes results.json, results.md and
results.png to --output; a re-run skips the runs done.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax.evaluation import job as evaluation  # noqa: E402
from coa_jax.perf import async_bench  # noqa: E402
from coa_jax.rl import job as rl_job  # noqa: E402
from configs import pipeline_tiny_cpu  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", pipeline_tiny_cpu.__file__,
                                          "the pipeline whose SFT models the runs start from")

_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0 .. n-1 of the main job")
_STALENESS = flags.DEFINE_list("staleness", ["0", "1", "2"], "staleness bounds to run")
_LATENCY = flags.DEFINE_list("latency", ["0.5", "2.0"], "tool latency range, seconds")
_STEPS = flags.DEFINE_integer("steps", 0, "updates per run (0: the main job's)")
_EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 0, "held-out tasks (0: the main job's)")
_SEED_LIST = flags.DEFINE_list("seed_list", [], "these seeds in place of 0 .. --seeds - 1")
_AGENT = flags.DEFINE_bool("agent", False, "also the synchronous job through the endpoint")
_OUTPUT = flags.DEFINE_string("output", "runs/bench_async", "where to write")
AGENT = "agent"  # the variant through the endpoint


def _configs(seed: int, staleness: int | str | None, folder: str):
  pipeline = _CONFIG.value
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
  if staleness == AGENT:
    config.rl.agent = "coa_jax.serving.agent:coa_loop"
  elif staleness is not None:
    config.rl["async"].update({"enabled": True, "staleness": staleness})
  config.workdir, config.export_dir = folder, os.path.join(folder, "hf_export")
  config.checkpoint.directory = os.path.join(folder, "checkpoints")
  config.checkpoint.every = config.rl.steps
  evaluate.model.checkpoint, evaluate.output_dir = config.export_dir, os.path.join(folder, "eval")
  if _EVAL_TASKS.value:
    evaluate.max_tasks = _EVAL_TASKS.value
  return config, evaluate


def _run(seed: int, staleness: int | str | None, folder: str) -> dict[str, float]:
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
  seeds = len(next(iter(table.values()))["pass@1"]["values"])
  fig.suptitle(f"DAPO, tools {_LATENCY.value[0]}-{_LATENCY.value[1]} s per call, {seeds} seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  out = _OUTPUT.value
  os.makedirs(out, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.path.join(out, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  variants = [None] + [int(k) for k in _STALENESS.value] + [AGENT] * _AGENT.value
  seeds = [int(s) for s in _SEED_LIST.value] or list(range(_SEEDS.value))
  plan = [(seed, k) for seed in seeds for k in variants]
  runs: dict[str, dict[int, dict[str, float]]] = {}
  start = time.perf_counter()
  for i, (seed, k) in enumerate(plan):
    name = AGENT if k == AGENT else async_bench.variant_name(k)
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
