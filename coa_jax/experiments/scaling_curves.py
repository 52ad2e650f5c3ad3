"""The "scaling" experiment kind: test-time scaling. A cell evaluates one of the main job's
systems (options "system": "teacher", "sft" or "dapo") with options "k" samples of every
held-out task and reports pass@j and maj@j for j = 1..k (`coa_jax.evaluation.scaling`, exact
expectations over the j-subsets of the k samples) with the tokens a sample costs. On a world
with near-miss figures (`world.distractors`), also pass@1 by where the answer's page states one.

The evaluation's folder is named after its settings; the scripted teacher does not depend on
the seed, so its seeds share one evaluation (its sd is 0 by construction, not by luck).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from coa_jax import evaluation
from coa_jax.experiments.runner import cell, mean_sd, new_figure, save_figure, shared_dir, without
from coa_jax.model import ConfigError
from coa_jax.pipeline import Stages
from coa_jax.runtime.cache import exists, file_fingerprint
from coa_jax.runtime.settings import to_section

SYSTEMS = ("teacher", "sft", "dapo")
SHOWN = (1, 2, 4, 8, 16)  # the table's columns (those <= k)
PAGES = ("none", "after", "before")  # where a near-miss figure stands (world.distractors)


def run_cell(stages: Stages, seed: int, options: Mapping[str, Any]) -> dict[str, Any]:
  """Returns one seed's scaling curves of options["system"] with options["k"] samples."""
  system, k = options.get("system"), int(options.get("k", 16))
  if system not in SYSTEMS:
    raise ConfigError(f"scaling experiment: system {system!r} is not one of {SYSTEMS}")
  evaluate = stages.of(seed)[f"eval_{system}"]
  evaluate = dataclasses.replace(evaluate, k=k, copy_probe="",
                                 batch_size=max(evaluate.batch_size // k, 1) * k)
  key = without(to_section(evaluate), "output_dir", "model")
  if system == "teacher":
    key.pop("seed")  # the teacher's k samples are its seeds 0..k-1
  else:
    if not exists(evaluate.model.checkpoint):
      raise ConfigError(f"{evaluate.model.checkpoint} is missing: run the main job first (make "
                        f"pipeline ARGS=\"--seeds 3\")")
    key["model"] = file_fingerprint(evaluate.model.checkpoint)
  evaluate = dataclasses.replace(evaluate, output_dir=shared_dir(stages, "eval", key))
  path = os.path.join(evaluate.output_dir, "metrics.json")
  if not exists(path):
    evaluation.run(evaluate)
  with open(path) as f:
    metrics = json.load(f)
  result = {"curves": metrics["curves"], "tokens_per_task": metrics["tokens_per_task"],
            "tool_calls_per_task": metrics["tool_calls_per_task"]}
  world = stages.settings.world
  if world.distractors:
    result["pass@1_by_page"] = evaluation.pass_at_1_by_page(world, evaluate.tasks,
                                                            evaluate.output_dir)
  return result


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Returns, per cell, mean +- sd over seeds of pass@j and maj@j for each j, and of the
  tokens and tool calls a sample costs."""
  summary = {}
  for name, by_seed in results.items():
    runs = list(by_seed.values())
    ks = runs[0]["curves"]["k"]
    summary[name] = {
        "k": ks,
        **{curve: [mean_sd([r["curves"][curve][i] for r in runs]) for i in range(len(ks))]
           for curve in ("pass@k", "maj@k")},
        **{c: mean_sd([r[c] for r in runs]) for c in ("tokens_per_task", "tool_calls_per_task")}}
    if "pass@1_by_page" in runs[0]:
      summary[name]["by_page"] = {page: mean_sd([r["pass@1_by_page"][page] for r in runs])
                                  for page in runs[0]["pass@1_by_page"]}
  return summary


def table(summary: Mapping[str, Any]) -> str:
  """Returns the markdown table: pass@j and maj@j at j = 1, 2, 4, 8, 16 (those sampled) and the
  tokens per sample, mean +- sd over seeds."""
  shown = [j for j in SHOWN if all(j in row["k"] for row in summary.values())]
  head = ["system"] + [f"pass@{j}" for j in shown] + [f"maj@{j}" for j in shown[1:]] + [
      "tokens per sample", "tool calls per sample"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, row in summary.items():
    at = lambda curve, j: cell(row[curve][row["k"].index(j)])
    lines.append("| " + " | ".join(
        [name] + [at("pass@k", j) for j in shown] + [at("maj@k", j) for j in shown[1:]] +
        [cell(row["tokens_per_task"], 1), cell(row["tool_calls_per_task"], 2)]) + " |")
  pages = [p for p in PAGES if all(p in row.get("by_page", {}) for row in summary.values())]
  if pages:
    lines += ["", "pass@1 by where the answer's page states a near-miss figure:", "",
              "| system | " + " | ".join(f"near-miss {p}" for p in pages) + " |",
              "|" + "---|" * (len(pages) + 1)]
    lines += ["| " + " | ".join([name] + [cell(row["by_page"][p]) for p in pages]) + " |"
              for name, row in summary.items()]
  return "\n".join(lines)


def plot(report: Mapping[str, Any], path: str) -> str | None:
  """Writes pass@j (solid) and maj@j (dashed) against j and against the tokens j samples cost
  (mean +- sd over seeds); returns the path, or None without matplotlib."""
  figure = new_figure(2, (12, 4.2))
  if figure is None:
    return None
  plt, fig, axes = figure
  import matplotlib.ticker  # installed with pyplot

  for name, row in report["summary"].items():
    ks = np.array(row["k"])
    for ax, x in ((axes[0], ks), (axes[1], ks * row["tokens_per_task"]["mean"])):
      color = None
      for curve, style in (("pass@k", "-"), ("maj@k", "--")):
        mean = np.array([p["mean"] for p in row[curve]])
        sd = np.array([p["sd"] for p in row[curve]])
        line, = ax.plot(x, mean, linestyle=style, marker=".", color=color,
                        label=f"{name} {curve.replace('k', 'j')}")
        color = line.get_color()
        ax.fill_between(x, mean - sd, mean + sd, color=color, alpha=0.15)
  axes[0].set(xlabel="samples per task j", ylabel="held-out score")
  axes[1].set(xlabel="tokens per task for j samples", ylabel="held-out score")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return save_figure(plt, fig, report, path)
