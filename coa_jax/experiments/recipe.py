"""The "recipe" experiment kind: the main job's whole recipe (distil, SFT, DAPO, evaluate) run
on a cell's config, for comparisons that change what every stage trains, such as the model's
size. A cell and seed runs `pipeline.run` for that seed in a folder named after the cell's
config (`runner.shared_dir`; the seeds of a cell share its distillation), or, with options
"main_job", reads the main job's results (`make pipeline` first). A run cut short reuses, at the
next launch, every stage that finished (`pipeline.run`); a stage cut short runs again (the
pipeline's SFT keeps a checkpoint only at its end).

A result holds the model's parameter count, its SFT steps and, after SFT and after DAPO, the
held-out pass@1 (all, and per task family), pass@3, the copy probe's three exact rates (answers,
tool calls, question items), the share of samples writing a number from nowhere and the tokens
per task, with the teacher system's pass@1 and tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from coa_jax import pipeline
from coa_jax.experiments.runner import cell, mean_sd, new_figure, save_figure, shared_dir, without
from coa_jax.model import ConfigError
from coa_jax.pipeline import Stages
from coa_jax.runtime.cache import exists

SYSTEMS = ("sft", "dapo")
METRICS = ("pass@1", "pass@1_by_family", "pass@3", "copy_exact", "call_exact", "question_exact",
           "invented_numbers", "tokens_per_task")


def run_cell(stages: Stages, seed: int, options: Mapping[str, Any]) -> dict[str, Any]:
  """Returns one seed's held-out metrics of the recipe of `stages` (a cell's pipeline)."""
  if options.get("main_job"):
    rows = _main_job_rows(stages, seed)
  else:
    recipe = without(stages.section(), "output_dir", "seed")
    run = stages.moved(shared_dir(stages, "recipe", recipe), seed)
    rows = pipeline.run_stages(run, seeds=1)["per_seed"][seed]
  sft = stages.of(seed)["sft"]
  return {"params": sft.model.fresh_config().num_params(), "sft_steps": sft.train.steps,
          "teacher": {m: rows["teacher"][m] for m in ("pass@1", "tokens_per_task")},
          **{system: {m: rows[system][m] for m in METRICS} for system in SYSTEMS}}


def _main_job_rows(stages: Stages, seed: int) -> dict[str, Any]:
  """Returns the main job's metrics of `seed` from its results.json, once its models are
  known to have trained with the settings of `stages` (a main job trained otherwise, e.g. with
  other SFT steps, would stand in a row that says these)."""
  output_dir = stages.settings.output_dir
  times = pipeline.StageTimes(os.path.join(output_dir, "stage_seconds.json"))
  for name, settings in pipeline.trained(stages, seed).items():
    times.check(name, settings, "run the main job again with these settings")
  path = os.path.join(output_dir, "results.json")
  per_seed = {}
  if exists(path):
    with open(path) as f:
      per_seed = json.load(f)["per_seed"]
  if str(seed) not in per_seed:
    raise ConfigError(f"{path} has no seed {seed}: run the main job first (make pipeline "
                      f"ARGS=\"--seeds 3\")")
  return per_seed[str(seed)]


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Returns, per cell, its parameter count, SFT steps and the mean +- sd over seeds of every
  metric (of a per-family metric, of each family's)."""
  summary = {}
  for name, by_seed in results.items():
    runs = list(by_seed.values())
    if any("sft_steps" not in r or set(METRICS) - set(r["sft"]) for r in runs):
      raise ConfigError(f"recipe cell {name}: a result cached by older code (without sft_steps or "
                        f"a metric of {METRICS}); delete its seed-*.json under "
                        f"<output_dir>/experiments/<experiment>/cells/{name}/ to recompute it "
                        f"(its runs on disk are reused)")
    summary[name] = {"params": runs[0]["params"], "sft_steps": runs[0]["sft_steps"]}
    for system in ("teacher",) + SYSTEMS:
      summary[name][system] = _mean_sd_of([r[system] for r in runs])
  return summary


def _mean_sd_of(values: list[Any]) -> Any:
  """mean_sd of numbers; of mappings (a metric per task family), the mean_sd of each key."""
  if isinstance(values[0], Mapping):
    return {key: _mean_sd_of([value[key] for value in values]) for key in values[0]}
  return mean_sd(values)


def table(summary: Mapping[str, Any]) -> str:
  """Returns the markdown table: per cell, parameters and SFT steps, then pass@1, copy probe and
  tokens per task after SFT and after DAPO (mean +- sd over seeds), and the teacher's pass@1."""
  lines = ["| model | params | SFT steps | SFT pass@1 | DAPO pass@1 | SFT copy probe | "
           "DAPO copy probe | tokens per task (DAPO) | teacher pass@1 |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, row in summary.items():
    sft, dapo = row["sft"], row["dapo"]
    lines.append(f"| {name} | {row['params'] / 1e6:.2f}M | {row['sft_steps']:,} | "
                 f"{cell(sft['pass@1'])} | "
                 f"{cell(dapo['pass@1'])} | {cell(sft['copy_exact'])} | "
                 f"{cell(dapo['copy_exact'])} | {cell(dapo['tokens_per_task'], 0)} | "
                 f"{cell(row['teacher']['pass@1'])} |")
  return "\n".join(lines)


def plot(report: Mapping[str, Any], path: str) -> str | None:
  """Writes held-out pass@1 after SFT and after DAPO against parameters (mean +- sd over
  seeds), a pair of lines per number of SFT steps, with the teacher's line; returns the path,
  or None without matplotlib."""
  figure = new_figure(1, (7, 4.5))
  if figure is None:
    return None
  plt, fig, ax = figure
  rows = sorted(report["summary"].items(), key=lambda item: item[1]["params"])
  for steps in sorted({row["sft_steps"] for _, row in rows}):
    arm = [row for _, row in rows if row["sft_steps"] == steps]
    for system, label, style in (("sft", "AFM after SFT", "--"), ("dapo", "AFM after DAPO", "-")):
      ax.errorbar([row["params"] for row in arm], [row[system]["pass@1"]["mean"] for row in arm],
                  yerr=[row[system]["pass@1"]["sd"] for row in arm], marker="o", capsize=3,
                  linestyle=style, label=f"{label}, {steps:,} SFT steps")
  ax.axhline(rows[0][1]["teacher"]["pass@1"]["mean"], color="gray", linestyle="--",
             label="teacher system")
  for name, row in rows:
    ax.annotate(name, (row["params"], row["dapo"]["pass@1"]["mean"]), fontsize=7,
                xytext=(4, 4), textcoords="offset points")
  ax.set(xscale="log", xlabel="parameters", ylabel="held-out pass@1")
  ax.margins(x=0.12)  # room for the last size's label
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return save_figure(plt, fig, report, path)
