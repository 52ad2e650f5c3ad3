"""Run metrics: a JSONL file, periodic progress lines with rate and ETA, and PNG plots."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Sequence

import jax


def say(*args: Any, **kwargs: Any) -> None:
  """Prints on process 0 only, so a multi-host run prints each line once."""
  if jax.process_index() == 0:
    print(*args, **kwargs, flush=True)


class MetricsLog:
  """Appends one JSON object per step to `path` and prints a progress line every `every` steps.

  Only process 0 writes or prints, so a multi-host run keeps one log. A resumed run passes
  append=True to continue the file.
  """

  def __init__(self, path: str, total_steps: int, every: int = 10, unit: str = "tokens",
               append: bool = False, shown: Sequence[str] = ()):
    self.path, self.total_steps, self.every, self.unit = path, total_steps, max(every, 1), unit
    self.shown = tuple(shown)  # the metrics in progress lines (all when empty)
    self.rows: list[dict[str, Any]] = []
    self._active = jax.process_index() == 0
    self._start = self._last = self._previous = time.perf_counter()
    self._first_step: int | None = None
    self._units_since = 0.0
    if self._active:
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      if not append:
        open(path, "w").close()

  def log(self, step: int, metrics: dict[str, Any], units: float = 0.0) -> None:
    """Records `metrics` of `step` (1-based); `units` (e.g. tokens) feed the rate."""
    now = time.perf_counter()
    self._units_since += units
    if self._first_step is None:
      self._first_step = step
    row = {"step": step, "time": round(now - self._start, 4),
           **{k: float(v) for k, v in metrics.items()}}
    if units:
      row[f"{self.unit}_per_s"] = round(float(units) / max(now - self._previous, 1e-9), 2)
    self._previous = now
    self.rows.append(row)
    if not self._active:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if step % self.every == 0 or step == self.total_steps:
      rate = self._units_since / max(now - self._last, 1e-9)
      done = step - self._first_step + 1
      eta = (now - self._start) / done * (self.total_steps - step)
      shown = "  ".join(f"{k}={float(v):.4g}" for k, v in metrics.items()
                        if not self.shown or k in self.shown)
      print(f"step {step}/{self.total_steps}  {shown}  {rate:,.0f} {self.unit}/s  "
            f"ETA {eta:.0f}s", flush=True)
      self._last, self._units_since = now, 0.0

  def plot(self, png_path: str, keys: Sequence[str] = ("loss",), title: str = "") -> str | None:
    """Writes a PNG of `keys` against step; returns its path, or None without matplotlib."""
    if not self._active:
      return None
    try:
      import matplotlib
      matplotlib.use("Agg")
      import matplotlib.pyplot as plt
    except ImportError:
      print("matplotlib is not installed (pip install 'coa-jax[plots]'): no plot written")
      return None
    with open(self.path) as f:  # the whole history, earlier runs of a resumed job included
      rows = [json.loads(line) for line in f if line.strip()]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
      ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows])
      ax.set_xlabel("step")
      ax.set_ylabel(key)
      ax.grid(alpha=0.3)
    if title:
      fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
