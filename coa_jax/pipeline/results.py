"""The results of a pipeline run: every seed's held-out metrics, their mean and standard
deviation over seeds, the Markdown tables (results.md), the plots (results.png, and the
before/after spread of several runs), and several runs combined into one."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

SYSTEMS = {"teacher": "teacher system", "sft": "AFM after SFT", "dapo": "AFM after DAPO"}


def metric_names(k: int) -> tuple[str, ...]:
  """Returns the metrics the results table reports, in its column order."""
  return ("pass@1", f"avg@{k}", f"pass@{k}", f"maj@{k}", "tokens_per_task",
          "tool_calls_per_task", "format_error_rate", "copy_exact", "copy_sampled", "call_exact",
          "call_sampled", "question_exact", "question_sampled")


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]],
              k: int) -> dict[str, dict[str, dict[str, Any]]]:
  """Returns, per system and metric, the seeds' values, their mean and their sample standard
  deviation (0 for one seed)."""
  summary: dict[str, dict[str, dict[str, Any]]] = {}
  for system in SYSTEMS:
    summary[system] = {}
    for metric in metric_names(k):
      values = [rows[system][metric] for rows in per_seed.values()
                if metric in rows.get(system, {})]
      if values:
        summary[system][metric] = dict(
            values=values, mean=float(np.mean(values)),
            sd=float(np.std(values, ddof=1)) if len(values) > 1 else 0.0)
  return summary


def family_means(per_seed: dict[int, dict[str, dict[str, Any]]],
                 key: str = "pass@1_by_family") -> dict[str, dict[str, float]]:
  """Returns, per system, each task family's pass@1 (or each group's of `key`) averaged over
  seeds (where the score is won and lost)."""
  means: dict[str, dict[str, float]] = {}
  for system in SYSTEMS:
    rows = {seed: r[system][key] for seed, r in per_seed.items() if key in r.get(system, {})}
    if not rows:
      continue
    families = set().union(*rows.values())
    lacking = {seed: sorted(families - set(row)) for seed, row in rows.items()
               if set(row) != families}
    if lacking:  # runs of other task files: a mean over some seeds would read as all
      raise ValueError(f"{system} {key}: seeds lack groups the others have: {lacking}")
    means[system] = {family: float(np.mean([row[family] for row in rows.values()]))
                     for family in next(iter(rows.values()))}
  return means


def format_summary(summary: dict[str, dict[str, dict[str, Any]]], k: int) -> str:
  """Returns the results as a Markdown table of mean +- sd over seeds, with each system's
  worst seed's pass@1 beside its mean."""
  columns = [m for m in metric_names(k) if any(m in summary[s] for s in summary)]
  names = [c.replace("_", " ") for c in columns]
  lines = ["| system | " + " | ".join(names[:1] + ["worst seed"] + names[1:]) + " |",
           "|---" * (len(columns) + 2) + "|"]
  for system, metrics in summary.items():
    cells = []
    seeds = max((len(m["values"]) for m in metrics.values()), default=0)
    for column in columns:
      if column not in metrics or len(metrics[column]["values"]) < seeds:
        cells.append("-")  # not measured on every seed (an older run's results)
        continue
      mean, sd = metrics[column]["mean"], metrics[column]["sd"]
      digits = 0 if mean >= 10 else 3
      cells.append(f"{mean:.{digits}f} +- {sd:.{digits}f}")
    worst = min(metrics["pass@1"]["values"]) if "pass@1" in metrics else None
    cells.insert(1, "-" if worst is None else f"{worst:.3f}")
    lines.append(f"| {SYSTEMS[system]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def per_seed_table(per_seed: dict[int, dict[str, dict[str, Any]]]) -> str:
  """Returns a Markdown table of each seed's pass@1, overall and per task family, and its
  question-copy probe, after SFT and after DAPO; then the worst seed's and mean +- sd rows."""
  models = [m for m in ("sft", "dapo") if all(m in rows for rows in per_seed.values())]
  families = sorted({f for rows in per_seed.values() for m in models
                     for f in rows[m].get("pass@1_by_family", {})})
  columns = [(m, key, family) for m in models
             for key, family in [("pass@1", None)] + [("pass@1_by_family", f) for f in families]
             + [("question_exact", None)]]
  value = lambda rows, m, key, family: (rows[m][key][family] if family else rows[m].get(key))
  header = [f"{SYSTEMS[m].replace('AFM after ', '')} {family or key.replace('_', ' ')}"
            for m, key, family in columns]
  lines = ["| seed | " + " | ".join(header) + " |", "|---" * (len(columns) + 1) + "|"]
  cell = lambda v: "-" if v is None else f"{v:.3f}"
  for seed, rows in per_seed.items():
    lines.append(f"| {seed} | " + " | ".join(cell(value(rows, *c)) for c in columns) + " |")
  for name, reduce in (("worst", lambda v: f"{min(v):.3f}"),
                       ("mean +- sd", lambda v: f"{np.mean(v):.3f} +- "
                                                f"{np.std(v, ddof=1) if len(v) > 1 else 0:.3f}")):
    cells = []
    for c in columns:
      values = [value(rows, *c) for rows in per_seed.values()]
      cells.append("-" if None in values else reduce(values))
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def pyplot() -> Any:
  """Returns matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt


def plot(summary: dict[str, dict[str, dict[str, Any]]], k: int, seeds: int,
         path: str) -> str | None:
  """Writes bar charts (mean over seeds, sd as error bars, values on the bars) of pass@1 and
  pass@k, tokens and tool calls per task and format errors to `path`; returns it (None
  without matplotlib)."""
  plt = pyplot()
  if plt is None:
    return None
  names = list(summary)
  colors = {"teacher": "#888888", "sft": "#44aa77", "dapo": "#4477aa"}
  panels = [(f"pass@1 (dark), pass@{k} (light)", ("pass@1", f"pass@{k}")),
            ("tokens per task", ("tokens_per_task",)),
            ("tool calls per task", ("tool_calls_per_task",)),
            ("format-error rate", ("format_error_rate",))]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8),
                           gridspec_kw={"width_ratios": [1.6, 1, 1, 1]})
  for ax, (title, metrics) in zip(axes, panels):
    width = 0.8 / len(metrics)
    for j, metric in enumerate(metrics):
      x = np.arange(len(names)) + (j - (len(metrics) - 1) / 2) * width
      means = [summary[n][metric]["mean"] for n in names]
      sds = [summary[n][metric]["sd"] for n in names]
      bars = ax.bar(x, means, width, yerr=sds, capsize=3, color=[colors[n] for n in names],
                    alpha=1.0 if j == 0 else 0.55, label=metric)
      ax.bar_label(bars, [f"{m:.0f}" if m >= 10 else f"{m:.2f}" for m in means], fontsize=7,
                   padding=2)
    ax.set_xticks(np.arange(len(names)), [SYSTEMS[n].replace("AFM ", "") for n in names],
                  fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)
  fig.suptitle(f"held-out tasks, mean +- sd over {seeds} seed{'s' * (seeds > 1)}: "
               "teacher system vs AFM after SFT and after DAPO")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_spread(runs: dict[str, dict[str, Any]], path: str,
                floors: dict[str, float] | None = None) -> str | None:
  """Writes each seed's held-out pass@1, overall and per task family, after SFT (top) and
  after DAPO (bottom), one column of dots per run (`runs`: label -> results.json), the mean as
  a bar and each panel's worst seed named; `floors` draws a target line per panel ("pass@1",
  or a family). Returns `path` (None without matplotlib)."""
  plt = pyplot()
  if plt is None:
    return None
  families = sorted({f for results in runs.values() for rows in results["per_seed"].values()
                     for f in rows["sft"].get("pass@1_by_family", {})})
  panels = ["pass@1"] + families
  fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 6.4), sharey=True)
  for row, model in enumerate(("sft", "dapo")):
    for ax, panel in zip(axes[row], panels):
      for x, (label, results) in enumerate(runs.items()):
        seeds = list(results["per_seed"])
        values = [rows[model]["pass@1"] if panel == "pass@1" else
                  rows[model]["pass@1_by_family"][panel]
                  for rows in results["per_seed"].values()]
        jitter = np.linspace(-0.15, 0.15, len(values))
        ax.scatter(x + jitter, values, s=18, alpha=0.8)
        ax.hlines(np.mean(values), x - 0.25, x + 0.25, color="black")
        worst = int(np.argmin(values))
        ax.annotate(f"seed {seeds[worst]}", (x + jitter[worst], values[worst]), fontsize=7,
                    textcoords="offset points", xytext=(4, -8))
      if floors and panel in floors and model == "dapo":
        ax.axhline(floors[panel], color="#cc4444", linestyle="--", linewidth=1)
      ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
      ax.set_xlim(-0.6, len(runs) - 0.4)
      ax.set_title(f"{SYSTEMS[model].replace('AFM ', '')}: {panel}", fontsize=9)
  axes[0][0].set_ylabel("held-out pass@1 per seed")
  axes[1][0].set_ylabel("held-out pass@1 per seed")
  fig.suptitle("every seed, before and after (bar: mean; dashed: target after DAPO)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def results_of(per_seed: dict[int, dict[str, dict[str, Any]]], k: int) -> dict[str, Any]:
  """Returns the results of per-seed evaluation rows: the rows, their summary over seeds, the
  table, the per-seed table and pass@1 by task family averaged over seeds."""
  summary = aggregate(per_seed, k)
  return {"seeds": list(per_seed), "per_seed": per_seed, "summary": summary,
          "table": format_summary(summary, k), "per_seed_table": per_seed_table(per_seed),
          "pass@1_by_family": family_means(per_seed)}


def combine(runs: Sequence[dict[str, Any]], k: int) -> dict[str, Any]:
  """Returns the results of several pipeline runs' results.json over the same distillation as
  one (`results_of` every seed's rows); a seed in two runs is an error."""
  per_seed: dict[int, dict[str, dict[str, Any]]] = {}
  for results in runs:
    for seed, rows in results["per_seed"].items():
      if int(seed) in per_seed:
        raise ValueError(f"seed {seed} is in more than one of the runs combined")
      per_seed[int(seed)] = rows
  return results_of(dict(sorted(per_seed.items())), k)


def write_results_page(output_dir: str, table: str, seeds: int, by_seed: str = "") -> str:
  """Writes results.md beside results.json: the table, the plot, the per-seed table and a link
  to the page of every trajectory (trajectories.html); returns its path."""
  path = os.path.join(output_dir, "results.md")
  by_seed = f"Per seed and task family:\n\n{by_seed}\n\n" if by_seed else ""
  with open(path, "w") as f:
    f.write(f"# Held-out results, mean +- sd over {seeds} seed(s)\n\n{table}\n\n"
            f"![the table's metrics per system](results.png)\n\n{by_seed}"
            f"Every held-out trajectory, teacher, SFT and DAPO side by side, with filters: "
            f"[trajectories.html](trajectories.html) (`make view RUN={output_dir}`).\n")
  return path
