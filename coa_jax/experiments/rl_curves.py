"""The "rl" experiment kind: held-out learning curves of an RL stage from the main job's SFT
models.

A cell and seed takes the main job's SFT export and its held-out evaluation (`make pipeline`
first; the evaluation is the curve's point at update 0), selects the RL tasks when the cell
turns query selection on (`pipeline.rl_tasks`), then trains the cell's RL stage (options
"stage": the pipeline's "dapo" or "ppo" stage config) in segments of options "every" updates,
resuming from its checkpoint. Resuming is exact (the learning rate is constant), so a run of
96 updates passes through the run of 48 with the same settings: the run's folder is named after
its settings without the number of updates (`runner.shared_dir`), and a shorter or longer
experiment reuses every segment and evaluation on disk. After each segment the exported policy
is evaluated like the main job's models (every held-out task, config.eval.k samples).

Option "temperature" sets the RL stage's rollout temperature alone (its updates' log-probs
follow it: they are the tempered policy's), leaving the evaluations' sampling as it is. On a
world with near-miss figures each point also gives pass@1 by where the answer's page states
one (`evaluation.pass_at_1_by_page`), and the near-miss probe of its model: how likely it is
to write the entity's own figure where its teacher wrote the near-miss one
(`evaluation.near_miss_chance`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from coa_jax import evaluation, pipeline, rl
from coa_jax.data.world import WorldConfig
from coa_jax.evaluation.settings import EvaluationSettings
from coa_jax.experiments.runner import cell, mean_sd, new_figure, save_figure, shared_dir, without
from coa_jax.model import ConfigError, Transformer
from coa_jax.pipeline import Stages
from coa_jax.rl.settings import RLSettings
from coa_jax.rollout.settings import agent_tokenizer
from coa_jax.runtime.settings import to_section
from coa_jax.runtime import hf_checkpoint
from coa_jax.runtime.cache import exists, file_fingerprint
from coa_jax.runtime.distributed import say

STAGES = {"dapo": "DAPO", "ppo": "PPO (critic, GAE)"}
COLUMNS = ("pass@1", "tokens_per_task", "tool_calls_per_task", "format_error_rate")
TRAINING = ("reward", "accuracy", "explained_variance", "value_loss")
# pass@1 split by task family, and on a world with near-miss figures by where the answer's page
# states one ("before" or "after" the entity's own sentence, or "none"); the table's prefix.
GROUPS = {"pass@1_by_family": "", "pass@1_by_page": "near-miss "}
# The near-miss probe's parts (`evaluation.near_miss_chance`), by their rows' labels.
PROBE = {"own_log10": "own figure, log10 chance", "near_log10": "near-miss figure, log10 chance",
         "own_likelier": "own figure the likelier"}


def _read(path: str) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def _settings(train: RLSettings, evaluate: EvaluationSettings, every: int) -> dict[str, Any]:
  """Returns what decides a run's curve: the stage's settings without its length and paths,
  the SFT model's and the task file's contents, the evaluation and the segment length."""
  stage = without(to_section(train), "workdir", "export_dir", "checkpoint")
  stage["rl"] = without(stage["rl"], "steps")
  stage["model"]["checkpoint"] = file_fingerprint(train.model.checkpoint)
  stage["tasks"] = file_fingerprint(train.tasks)
  return {"stage": stage, "eval": without(to_section(evaluate), "output_dir", "model"),
          "every": every}


def _eval_dir(folder: str, steps: int) -> str:
  """Returns where the export after `steps` updates of a run in `folder` is evaluated."""
  return os.path.join(folder, f"eval-{steps}")


def _point(train: RLSettings, evaluate: EvaluationSettings, steps: int, every: int,
           folder: str) -> dict[str, Any]:
  """Returns the held-out metrics after `steps` updates, training the segment that ends there
  and evaluating its export unless they are on disk."""
  done = os.path.join(_eval_dir(folder, steps), "metrics.json")
  if exists(done):
    return _read(done)
  export = os.path.join(folder, f"export-{steps}")
  if not exists(hf_checkpoint.written_last(export)):  # an export cut short is run again
    say(f"== updates {steps - every + 1}-{steps} in {folder}")
    rl.run(dataclasses.replace(
        train, rl=dataclasses.replace(train.rl, steps=steps), workdir=folder, export_dir=export,
        checkpoint=dataclasses.replace(train.checkpoint, every=every, max_to_keep=1,
                                       directory=os.path.join(folder, "checkpoints"))))
  evaluation.run(dataclasses.replace(evaluate, model=evaluate.model.replace(checkpoint=export),
                                     output_dir=os.path.dirname(done), copy_probe=""))
  return _read(done)


def _training_rows(folder: str, steps: int) -> list[dict[str, float]]:
  """Returns each step's training metrics up to `steps` (the last row of a step run twice)."""
  rows: dict[int, dict[str, float]] = {}
  path = os.path.join(folder, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          if int(row["step"]) <= steps:
            rows[int(row["step"])] = {k: row[k] for k in ("step", *TRAINING) if k in row}
  return [rows[s] for s in sorted(rows)]


def _near_miss_probe(world: WorldConfig, evaluate: EvaluationSettings):
  """Returns checkpoint folder -> the near-miss probe of its model (`evaluation.near_miss_chance`)
  on the held-out tasks and the teacher's held-out trajectories of `evaluate`."""
  tokenizer = agent_tokenizer(evaluate)

  def probe(checkpoint: str) -> dict[str, float]:
    model_config, params = hf_checkpoint.load_checkpoint(checkpoint,
                                                         vocab_size=tokenizer.vocab_size)
    return evaluation.near_miss_chance(world, evaluate.tasks, evaluate.copy_probe, tokenizer,
                                       Transformer(model_config), params)

  return probe


def run_cell(stages: Stages, seed: int, options: Mapping[str, Any]) -> dict[str, Any]:
  """Returns one seed's curve: the held-out metrics (and pass@1 by task family) after every
  options["every"] updates of the options["stage"] stage, the training metrics per update and
  the query-selection report."""
  every, stage = int(options.get("every", 4)), options.get("stage", "dapo")
  if stage not in STAGES:
    raise ConfigError(f"rl experiment: stage {stage!r} is not one of {sorted(STAGES)}")
  seed_stages = stages.of(seed)
  train, evaluate = seed_stages[stage], seed_stages["eval_sft"]
  sft_metrics = os.path.join(evaluate.output_dir, "metrics.json")
  if not exists(sft_metrics):
    raise ConfigError(f"{sft_metrics} is missing: run the main job first (make pipeline "
                      f"ARGS=\"--seeds 3\")")
  if "temperature" in options:  # the rollouts' alone; the held-out evaluations keep theirs
    if not float(options["temperature"]) > 0:
      raise ConfigError(f"rl experiment: temperature={options['temperature']!r}: expected > 0")
    train = dataclasses.replace(train, sampling=dataclasses.replace(
        train.sampling, temperature=float(options["temperature"])))
  total = train.rl.steps
  if total % every:
    raise ConfigError(f"{stage} runs {total} updates: not a multiple of every={every}")
  tasks, selection = pipeline.rl_tasks(stages.settings.selection, seed_stages, stage)
  train = dataclasses.replace(train, tasks=tasks)
  folder = os.path.join(shared_dir(stages, stage, _settings(train, evaluate, every)),
                        f"seed-{seed}")
  points = {0: _read(sft_metrics)}
  evaluated = {0: os.path.dirname(sft_metrics)}
  for steps in range(every, total + 1, every):
    points[steps] = _point(train, evaluate, steps, every, folder)
    evaluated[steps] = _eval_dir(folder, steps)
    say(f"seed {seed} {stage} after {steps} updates: pass@1 {points[steps]['pass@1']:.3f}")
  world = stages.settings.world
  if world.distractors:  # where the answer's page has a near miss
    probe = _near_miss_probe(world, evaluate)
    for steps, where in evaluated.items():
      points[steps]["pass@1_by_page"] = evaluation.pass_at_1_by_page(world, evaluate.tasks,
                                                                     where)
      points[steps]["near_miss_chance"] = probe(
          os.path.join(folder, f"export-{steps}") if steps else train.model.checkpoint)
  keep = (*COLUMNS, *GROUPS, "near_miss_chance")
  return {"points": {k: {c: p[c] for c in keep if c in p} for k, p in points.items()},
          "training": _training_rows(folder, total), "selection": selection, "run": folder}


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Returns, per cell and number of updates, the mean +- sd over seeds of each column and of
  each task family's pass@1 (and, on a world with near-miss figures, of each page kind's)."""
  summary = {}
  for name, by_seed in results.items():
    runs = list(by_seed.values())
    updates = sorted({int(k) for r in runs for k in r["points"]})
    summary[name] = {}
    for k in updates:
      points = [r["points"][str(k)] for r in runs]
      row = {c: mean_sd([p[c] for p in points]) for c in COLUMNS}
      for group in (*GROUPS, "near_miss_chance"):  # the parts every seed has (a result of
        parts = [p.get(group, {}) for p in points]    # older code lacks pages and the probe)
        common = [part for part in parts[0] if all(part in other for other in parts)]
        if common:
          row[group.replace("pass@1_", "")] = {
              part: mean_sd([other[part] for other in parts]) for part in common}
      summary[name][k] = row
  return summary


def table(summary: Mapping[str, Any]) -> str:
  """Returns the markdown tables: held-out pass@1 (mean +- sd over seeds) after each number of
  updates, then the last point's tokens, tool calls and format errors per task; below it, each
  task family's (then each near-miss page kind's) pass@1 after each number of updates, and the
  near-miss probe where the points have it."""
  updates = sorted({int(k) for rows in summary.values() for k in rows})
  head = ["cell"] + [f"pass@1 after {k}" for k in updates] + [
      c.replace("_", " ") for c in COLUMNS[1:]]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  families = ["", "| cell: task family | " + " | ".join(head[1:len(updates) + 1]) + " |",
              "|" + "---|" * (len(updates) + 1)]
  probes = ["", "| cell: near-miss probe (median over tasks) | " + " | ".join(
      f"after {k}" for k in updates) + " |", "|" + "---|" * (len(updates) + 1)]
  for name, rows in summary.items():
    rows = {int(k): v for k, v in rows.items()}
    last = rows[max(rows)]
    lines.append("| " + " | ".join(
        [name] + [cell(rows[k]["pass@1"]) if k in rows else "-" for k in updates] +
        [cell(last[c], 1 if c == "tokens_per_task" else 3) for c in COLUMNS[1:]]) + " |")
    for group, prefix in GROUPS.items():
      key = group.replace("pass@1_", "")
      for part in last.get(key, {}):
        families.append("| " + " | ".join(
            [f"{name}: {prefix}{part}"] + [cell(rows[k][key][part]) if key in rows[k] else "-"
                                           for k in updates]) + " |")
    for part, label in PROBE.items():
      if part in last.get("near_miss_chance", {}):
        probes.append("| " + " | ".join([f"{name}: {label}"] + [
            cell(rows[k]["near_miss_chance"][part], 2) if "near_miss_chance" in rows[k] else "-"
            for k in updates]) + " |")
  return "\n".join(lines + families + (probes if len(probes) > 3 else []))


def plot(report: Mapping[str, Any], path: str) -> str | None:
  """Writes the curves (held-out pass@1 per cell; each task family's pass@1, or on a world
  with near-miss figures each page kind's, one line style per part; training reward), mean +-
  sd over seeds against updates; returns the path, or None without matplotlib."""
  figure = new_figure(3, (16, 4))
  if figure is None:
    return None
  plt, fig, axes = figure
  styles = ["-", "--", ":", "-."]
  split = ("by_page" if any("by_page" in row for rows in report["summary"].values()
                            for row in rows.values()) else "by_family")
  for name, rows in report["summary"].items():
    rows = {int(k): v for k, v in rows.items()}
    updates = np.array(sorted(rows))
    mean = np.array([rows[k]["pass@1"]["mean"] for k in updates])
    sd = np.array([rows[k]["pass@1"]["sd"] for k in updates])
    line, = axes[0].plot(updates, mean, marker="o", label=name)
    axes[0].fill_between(updates, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
    for style, part in zip(styles, rows[int(updates[0])].get(split, {})):
      axes[1].plot(updates, [rows[k][split][part]["mean"] for k in updates],
                   linestyle=style, color=line.get_color(), label=f"{name}: {part}")
    runs = [[r.get("reward", np.nan) for r in result["training"]]
            for result in report["results"][name].values()]
    if runs and all(len(r) == len(runs[0]) for r in runs) and runs[0]:
      steps = np.arange(1, len(runs[0]) + 1)
      axes[2].plot(steps, np.nanmean(runs, axis=0), color=line.get_color(), label=name)
      axes[2].fill_between(steps, np.nanmean(runs, axis=0) - np.nanstd(runs, axis=0),
                           np.nanmean(runs, axis=0) + np.nanstd(runs, axis=0),
                           color=line.get_color(), alpha=0.2)
  labels = ("held-out pass@1", "held-out pass@1 by task family" if split == "by_family" else
            "held-out pass@1 by near-miss page", "training reward")
  for ax, label in zip(axes, labels):
    ax.set(xlabel="updates", ylabel=label)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run without training metrics draws no reward
      ax.legend(fontsize=7)
  return save_figure(plt, fig, report, path)
