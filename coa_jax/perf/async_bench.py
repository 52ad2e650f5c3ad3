"""The asynchronous-RL benchmark's bookkeeping: per-run figures from a DAPO run's metrics and an
evaluation, and the table of every variant against the synchronous run (experiments/
bench_async.py runs them)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

SYNC = "sync"


def variant_name(staleness: int | None) -> str:
  """Returns "sync" (None) or "k=<staleness>"."""
  return SYNC if staleness is None else f"k={staleness}"


def run_figures(rows: Sequence[dict[str, float]], evaluation: dict[str, Any]) -> dict[str, float]:
  """Returns one run's figures: wall seconds per update (the mean interval between updates
  after the first, which holds the compilations), the busy fractions and token rates averaged
  over the same updates, and held-out pass@1."""
  if len(rows) < 2:
    raise ValueError(f"need at least 2 updates to time one, got {len(rows)}")
  later = rows[1:]
  mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in later)
  return {"updates": len(rows),
          "wall_per_update_s": (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1),
          "sampler_busy": mean("sampler_busy"), "trainer_busy": mean("trainer_busy"),
          "staleness_mean": mean("staleness_mean"), "stale_dropped": rows[-1].get(
              "stale_dropped", 0.0),
          "pass@1": evaluation["pass@1"]}


def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
  return {"values": list(values), "mean": statistics.fmean(values),
          "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def compare(runs: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, Any]]:
  """Returns, per variant, every figure over seeds (values, mean, sd) and the speed-up over
  the synchronous run (its wall per update over the variant's, per seed, then mean +- sd)."""
  out = {}
  for name, seeds in runs.items():
    figures = {key: _mean_sd([seeds[s][key] for s in sorted(seeds)])
               for key in next(iter(seeds.values()))}
    if SYNC in runs and all(s in runs[SYNC] for s in seeds):
      figures["speedup"] = _mean_sd([runs[SYNC][s]["wall_per_update_s"] /
                                     seeds[s]["wall_per_update_s"] for s in sorted(seeds)])
    out[name] = figures
  return out


COLUMNS = (("wall_per_update_s", "wall per update (s)", "{:.2f}"),
           ("speedup", "speed-up vs sync", "{:.2f}x"),
           ("pass@1", "held-out pass@1", "{:.3f}"),
           ("sampler_busy", "sampler busy", "{:.2f}"),
           ("trainer_busy", "trainer busy", "{:.2f}"),
           ("staleness_mean", "mean staleness", "{:.2f}"))


def markdown(table: dict[str, dict[str, Any]]) -> str:
  """Returns the comparison as a Markdown table (mean +- sd over seeds)."""
  lines = ["| run | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
           "|---" * (len(COLUMNS) + 1) + "|"]
  for name, figures in table.items():
    cells = []
    for key, _, fmt in COLUMNS:
      if key not in figures:
        cells.append("-")
        continue
      f = figures[key]
      cells.append(f"{fmt.format(f['mean'])} +- {fmt.format(f['sd']).rstrip('x')}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
