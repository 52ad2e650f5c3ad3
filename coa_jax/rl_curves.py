"""RL stages side by side: held-out learning curves of DAPO and PPO from the main job's SFT models.

`run(config, stage_configs, seeds, every, output_dir)` is `experiments/rl_curves.py`. For each
seed it takes the main job's SFT export and its held-out evaluation (`make pipeline` first; the
evaluation is the curve's point at update 0), then trains each algorithm's stage (the
pipeline's "dapo" and "ppo" stage configs: the same sampled responses and updates per step) in
segments of `every` steps, resuming from its checkpoint, which is exact: the runs equal
uninterrupted ones, whose learning rate is constant. After each segment the exported policy is
evaluated like the main job's models (every held-out task, `config.eval.k` samples each).
Segments and evaluations whose outputs exist are reused. results.json holds every point, the
mean and sd over seeds per algorithm and step, and each run's training metrics per step;
results.md the table and results.png the curves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import ml_collections
import numpy as np

from coa_jax import evaluation, rl
from coa_jax.runtime.distributed import say

ALGORITHMS = ("dapo", "ppo")
NAMES = {"dapo": "DAPO", "ppo": "PPO (critic, GAE)"}
COLUMNS = ("pass@1", "tokens_per_task", "tool_calls_per_task", "format_error_rate")
TRAINING = ("reward", "accuracy", "explained_variance", "value_loss")
StageConfigs = Callable[[Any, int], dict[str, ml_collections.ConfigDict]]


def _read(path: str) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def _point(stages: dict[str, Any], algorithm: str, steps: int, every: int,
           folder: str) -> dict[str, Any]:
  """Returns the held-out metrics of `algorithm` after `steps` updates, training the segment
  that ends there and evaluating its export unless they are on disk."""
  done = os.path.join(folder, f"eval-{steps}", "metrics.json")
  if os.path.exists(done):
    return _read(done)
  export = os.path.join(folder, f"export-{steps}")
  if not os.path.isdir(export):
    train = ml_collections.ConfigDict(stages[algorithm].to_dict())
    train.rl.steps = steps
    train.workdir, train.export_dir = folder, export
    train.checkpoint.update(directory=os.path.join(folder, "checkpoints"), every=every,
                            max_to_keep=1)
    say(f"== {algorithm}: updates {steps - every + 1}-{steps} in {folder}")
    rl.run(train)
  evaluate = ml_collections.ConfigDict(stages["eval_sft"].to_dict())
  evaluate.model.checkpoint, evaluate.output_dir = export, os.path.dirname(done)
  evaluation.run(evaluate)
  return _read(done)


def _training_rows(folder: str) -> list[dict[str, float]]:
  """Returns each step's training metrics of a run (the last row of a step run twice)."""
  rows: dict[int, dict[str, float]] = {}
  path = os.path.join(folder, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          rows[int(row["step"])] = {k: row[k] for k in ("step", *TRAINING) if k in row}
  return [rows[s] for s in sorted(rows)]


def _mean_sd(values: list[float]) -> dict[str, Any]:
  sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  return dict(values=values, mean=float(np.mean(values)), sd=sd)


def run(config: Any, stage_configs: StageConfigs, seeds: int = 3, every: int = 4,
        output_dir: str = "", algorithms: tuple[str, ...] = ALGORITHMS) -> dict[str, Any]:
  """Runs the side-by-side (see the module docstring); returns what results.json holds."""
  output_dir = output_dir or os.path.join(config.output_dir, "rl_curves")
  seed_list = list(range(config.seed, config.seed + seeds))
  points: dict[str, dict[int, dict[int, dict[str, Any]]]] = {a: {} for a in algorithms}
  training: dict[str, dict[int, list]] = {a: {} for a in algorithms}
  steps = None
  for seed in seed_list:
    stages = stage_configs(config, seed)
    sft_metrics = os.path.join(stages["eval_sft"].output_dir, "metrics.json")
    if not os.path.exists(sft_metrics):
      raise SystemExit(f"{sft_metrics} is missing: run the main job first (make pipeline "
                       f"ARGS=\"--seeds {seeds}\")")
    for algorithm in algorithms:
      total = stages[algorithm].rl.steps
      if steps not in (None, total) or total % every:
        raise SystemExit(f"{algorithm} runs {total} steps: every algorithm must run the same "
                         f"number, a multiple of --every={every}")
      steps = total
      folder = os.path.join(output_dir, f"seed-{seed}", algorithm)
      curve = {0: _read(sft_metrics)}
      for k in range(every, total + 1, every):
        curve[k] = _point(stages, algorithm, k, every, folder)
        say(f"seed {seed} {algorithm} after {k} updates: pass@1 {curve[k]['pass@1']:.3f}")
      points[algorithm][seed] = curve
      training[algorithm][seed] = _training_rows(folder)
  updates = list(range(0, steps + 1, every))
  summary = {a: {k: {c: _mean_sd([points[a][s][k][c] for s in seed_list]) for c in COLUMNS}
                 for k in updates} for a in algorithms}
  results = dict(seeds=seed_list, every=every, updates=updates, summary=summary,
                 points={a: {s: {k: {c: points[a][s][k][c] for c in COLUMNS} for k in updates}
                             for s in seed_list} for a in algorithms},
                 training=training)
  os.makedirs(output_dir, exist_ok=True)
  with open(os.path.join(output_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  table = format_table(results)
  with open(os.path.join(output_dir, "results.md"), "w") as f:
    f.write(table + "\n")
  say(table)
  plot(results, os.path.join(output_dir, "results.png"))
  return results


def format_table(results: dict[str, Any]) -> str:
  """Returns the markdown table: held-out pass@1 (mean +- sd over seeds) after each number of
  updates, then the final model's tokens, tool calls and format errors per task."""
  updates = results["updates"]
  head = ["algorithm"] + [f"pass@1 after {k}" for k in updates] + list(COLUMNS[1:])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for algorithm, by_step in results["summary"].items():
    cell = lambda m, digits=3: f"{m['mean']:.{digits}f} +- {m['sd']:.{digits}f}"
    final = by_step[updates[-1]]
    lines.append("| " + " | ".join(
        [NAMES.get(algorithm, algorithm)] + [cell(by_step[k]["pass@1"]) for k in updates] +
        [cell(final[c], 1 if c == "tokens_per_task" else 3) for c in COLUMNS[1:]]) + " |")
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> str | None:
  """Writes the curves (held-out pass@1, training reward, the critic's explained variance
  clipped to [-1, 1], each mean +- sd over seeds against updates) as a PNG; returns its path,
  or None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(16, 4))
  updates = np.asarray(results["updates"])
  for algorithm, by_step in results["summary"].items():
    mean = np.array([by_step[k]["pass@1"]["mean"] for k in results["updates"]])
    sd = np.array([by_step[k]["pass@1"]["sd"] for k in results["updates"]])
    line, = axes[0].plot(updates, mean, marker="o", label=NAMES.get(algorithm, algorithm))
    axes[0].fill_between(updates, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
    for ax, key in ((axes[1], "reward"), (axes[2], "explained_variance")):
      runs = [[r.get(key, np.nan) for r in rows] for rows in
              results["training"][algorithm].values()]
      if runs and all(len(r) == len(runs[0]) for r in runs) and not np.isnan(runs).all():
        steps = np.arange(1, len(runs[0]) + 1)
        if key == "explained_variance":  # below -1 says only "worse than the mean"
          runs = np.clip(runs, -1.0, 1.0)
        mean, sd = np.nanmean(runs, axis=0), np.nanstd(runs, axis=0)
        ax.plot(steps, mean, color=line.get_color(), label=NAMES.get(algorithm, algorithm))
        ax.fill_between(steps, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
  labels = ("held-out pass@1", "training reward", "critic explained variance")
  for ax, label in zip(axes, labels):
    ax.set(xlabel="updates (steps)", ylabel=label)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f"RL from the main job's SFT models, mean +- sd over seeds {results['seeds']}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
