"""The "sft" experiment kind: the trajectory-quality ablation. A cell trains the main job's SFT
stage (same model, steps and schedule) on the output of one progressive filter stage
(options "data": "all" for every teacher trace including the wrong ones, or a stage of
`coa_jax.distill.job.STAGES`: each keeps what passed it and every stage before), then evaluates
it like the main job.

The stage's data are rebuilt from distillation's traces.jsonl (no teacher is re-run). Data with
the same bytes train the same model: a stage that drops nothing shares the run of the stage
before it (runs are named after their settings and their data's digest), and the data the main
job trained on reuse the main job's SFT model and evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from coa_jax import evaluation, sft
from coa_jax.distill import job as distill
from coa_jax.distill.teacher import Trace, to_trajectory
from coa_jax.experiments.runner import cell, mean_sd, new_figure, save_figure, shared_dir, without
from coa_jax.model import ConfigError
from coa_jax.pipeline import Stages
from coa_jax.runtime import hf_checkpoint
from coa_jax.runtime.cache import exists, file_fingerprint, write_jsonl
from coa_jax.runtime.distributed import say
from coa_jax.runtime.settings import to_section

DATA = ("all",) + distill.STAGES
COLUMNS = ("trajectories", "pass@1", "format_error_rate", "tokens_per_task")


def stage_data(stages: Stages, traces: str, stage: str) -> str:
  """Returns the path of the trajectories that pass the filter stages up to `stage` ("all":
  every trace), written once from `traces` (a distillation's traces.jsonl) with the main job's
  filters and system prompt."""
  if stage not in DATA:
    raise ConfigError(f"sft experiment: data {stage!r} is not one of {DATA}")
  settings = stages.of()["distill"]
  key = {"traces": file_fingerprint(traces), "filters": settings.filters,
         "system_prompt": settings.system_prompt, "stage": stage}
  path = os.path.join(shared_dir(stages, "data", key), "trajectories.jsonl")
  if os.path.exists(path):
    return path
  with open(traces) as f:
    trajectories = [to_trajectory(Trace.from_json(json.loads(line)), settings.system_prompt)
                    for line in f if line.strip()]
  kept = trajectories
  if stage != "all":
    filters = distill.Distiller(settings.filters)
    kept = next(survivors for name, survivors, _ in filters.progressive(trajectories)
                if name == stage)
  write_jsonl(path, (t.to_json() for t in kept))
  say(f"filter stage {stage}: {len(kept)} of {len(trajectories)} trajectories -> {path}")
  return path


def run_cell(stages: Stages, seed: int, options: Mapping[str, Any]) -> dict[str, Any]:
  """Returns one seed's held-out metrics after SFT on options["data"]'s trajectories."""
  seed_stages = stages.of(seed)
  train, evaluate = seed_stages["sft"], seed_stages["eval_sft"]
  main_data = train.data.path
  data = stage_data(stages, os.path.join(os.path.dirname(main_data), "traces.jsonl"),
                    options["data"])
  with open(data) as f:
    count = sum(1 for line in f if line.strip())
  reused = file_fingerprint(data) == file_fingerprint(main_data)
  if not reused:  # a run of its own, named after its settings
    run = without(to_section(train), "workdir", "export_dir", "checkpoint")
    run["data"] = {**run["data"], "path": file_fingerprint(data)}
    run["eval"] = without(to_section(evaluate), "output_dir", "model")
    folder = shared_dir(stages, "sft", run)
    # saved every 250 steps: a run cut short resumes
    train = dataclasses.replace(
        train, data=dataclasses.replace(train.data, path=data), workdir=folder,
        export_dir=os.path.join(folder, "hf_export"),
        checkpoint=dataclasses.replace(train.checkpoint, every=250,
                                       directory=os.path.join(folder, "checkpoints")))
    if not exists(hf_checkpoint.written_last(train.export_dir)):  # cut short: run again
      say(f"== SFT on {options['data']} ({count} trajectories) in {folder}")
      sft.run(train)
    evaluate = dataclasses.replace(evaluate, model=evaluate.model.replace(
        checkpoint=train.export_dir), output_dir=os.path.join(folder, "eval"))
  metrics_path = os.path.join(evaluate.output_dir, "metrics.json")
  if not exists(metrics_path):
    if reused and not os.path.isdir(evaluate.model.checkpoint):
      raise ConfigError(f"{evaluate.model.checkpoint} is missing: run the main job first (make "
                        f"pipeline ARGS=\"--seeds 3\")")
    evaluation.run(evaluate)
  with open(metrics_path) as f:
    metrics = json.load(f)
  return {"trajectories": count, "main_job": reused,
          **{c: metrics[c] for c in COLUMNS[1:]},
          "pass@1_by_family": metrics.get("pass@1_by_family", {})}


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Returns, per cell, the mean +- sd over seeds of each column."""
  return {name: {c: mean_sd([r[c] for r in by_seed.values()]) for c in COLUMNS}
          for name, by_seed in results.items()}


def table(summary: Mapping[str, Any]) -> str:
  """Returns the markdown table: per filter stage, its trajectories and the held-out pass@1,
  format-error rate and tokens per task of the SFT model (mean +- sd over seeds)."""
  lines = ["| data | trajectories | pass@1 | format errors | tokens per task |",
           "|---|---|---|---|---|"]
  for name, row in summary.items():
    lines.append(f"| {name} | {row['trajectories']['mean']:.0f} | {cell(row['pass@1'])} | "
                 f"{cell(row['format_error_rate'])} | {cell(row['tokens_per_task'], 1)} |")
  return "\n".join(lines)


def plot(report: Mapping[str, Any], path: str) -> str | None:
  """Writes held-out pass@1 and the format-error rate against each stage's trajectory count
  (mean +- sd over seeds); returns the path, or None without matplotlib."""
  figure = new_figure(2, (11, 4))
  if figure is None:
    return None
  plt, fig, axes = figure
  for ax, metric, label in ((axes[0], "pass@1", "held-out pass@1"),
                            (axes[1], "format_error_rate", "held-out format-error rate")):
    # Stages that kept the same data (the same point) share one marker and one label.
    points: dict[tuple[float, float, float], list[str]] = {}
    for name, row in report["summary"].items():
      point = (row["trajectories"]["mean"], row[metric]["mean"], row[metric]["sd"])
      points.setdefault(point, []).append(name)
    for (x, mean, sd), names in points.items():
      ax.errorbar([x], [mean], yerr=[sd], marker="o", capsize=3, label=" = ".join(names))
      ax.annotate(" = ".join(names), (x, mean), fontsize=7, xytext=(4, 4),
                  textcoords="offset points")
    ax.set(xlabel="SFT trajectories (filter stage's output)", ylabel=label)
    ax.margins(x=0.2)  # room for the labels
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  return save_figure(plt, fig, report, path)

