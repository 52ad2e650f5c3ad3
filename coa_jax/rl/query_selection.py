"""RL query selection: the paper's filter before RL. The SFT model samples k solutions of each
training task; a task is kept when its pass rate p (correct samples / k) lies in [low, high].

Tasks the model always solves (p = 1) or never solves (p = 0) give groups whose samples all
score alike, which carry no gradient under group-normalized advantages; in-training dynamic
sampling (coa_jax.rl.dynamic_sampling) skips them too, but only after paying for their rollouts
at every step. Selecting once, before RL, pays for k samples of each task once.

`select_tasks` is the stage: it samples through a `sample(tasks, k)` callable (the pipeline
passes an evaluation of the SFT export; the tests a fake), caches the pass rates in a JSON file
keyed by what decides them (the model, the task file, k, the sampling), and returns the kept
tasks with a report. Every range over the same pass rates reuses one sampling.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Mapping, Sequence

from coa_jax.data.tasks import Task
from coa_jax.model import ConfigError
from coa_jax.runtime.cache import cached_json, write_jsonl

# (tasks, k) -> each task id's k outcomes (True: correct)
Sampler = Callable[[Sequence[Task], int], Mapping[str, Sequence[bool]]]


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
  """k samples of each of the first `max_tasks` training tasks (0: all); keep low <= p <= high.
  [0, 1] keeps every task and samples nothing."""

  k: int = 4
  low: float = 0.0
  high: float = 1.0
  max_tasks: int = 0

  def __post_init__(self):
    if self.k < 1 or self.max_tasks < 0 or not 0.0 <= self.low <= self.high <= 1.0:
      raise ConfigError(f"selection: need k >= 1, max_tasks >= 0 and 0 <= low <= high <= 1, "
                        f"got {self}")

  @property
  def enabled(self) -> bool:
    return self.low > 0.0 or self.high < 1.0


def pass_rates(outcomes: Mapping[str, Sequence[bool]]) -> dict[str, float]:
  """Returns each task's fraction of correct samples."""
  empty = [task_id for task_id, samples in outcomes.items() if not samples]
  if empty:
    raise ValueError(f"no samples for tasks {empty[:5]}")
  return {task_id: sum(map(bool, samples)) / len(samples)
          for task_id, samples in outcomes.items()}


def keep(tasks: Sequence[Task], rates: Mapping[str, float], low: float,
         high: float) -> list[Task]:
  """Returns the tasks (in order) whose pass rate lies in [low, high]; a task without a rate is
  dropped (it was not sampled)."""
  return [task for task in tasks if task.id in rates and low <= rates[task.id] <= high]


def histogram(rates: Mapping[str, float], k: int) -> dict[str, int]:
  """Returns how many tasks have each pass rate j/k, j = 0..k (keys "j/k")."""
  counts = collections.Counter(round(rate * k) for rate in rates.values())
  return {f"{j}/{k}": counts.get(j, 0) for j in range(k + 1)}


def select_tasks(selection: SelectionConfig, tasks: Sequence[Task], sample: Sampler,
                 cache_path: str, key: Mapping[str, Any]) -> tuple[list[Task], dict[str, Any]]:
  """Returns the tasks kept by `selection` and a report (sampled tasks, the pass-rate
  histogram, kept). The pass rates are read from `cache_path` when it was written under the
  same `key` (plus k and max_tasks), else sampled and written there. Raises ConfigError when
  no task is kept."""
  pool = list(tasks[:selection.max_tasks] if selection.max_tasks else tasks)
  if not selection.enabled:
    return pool, {"sampled": 0, "kept": len(pool), "low": 0.0, "high": 1.0}
  full_key = {**key, "k": selection.k, "tasks": [task.id for task in pool]}
  rates = cached_json(cache_path, full_key,
                      lambda: pass_rates(sample(pool, selection.k)))
  kept = keep(pool, rates, selection.low, selection.high)
  report = {"sampled": len(rates), "k": selection.k, "low": selection.low,
            "high": selection.high, "kept": len(kept),
            "mean_pass_rate": sum(rates.values()) / max(len(rates), 1),
            "pass_rates": histogram(rates, selection.k)}
  if not kept:
    raise ConfigError(f"query selection kept no task: no pass rate in [{selection.low}, "
                      f"{selection.high}] over {len(rates)} tasks (pass rates: "
                      f"{report['pass_rates']})")
  return kept, report


def write_tasks(tasks: Sequence[Task], path: str) -> str:
  """Writes tasks as a JSONL task file that `load_tasks` reads back to the same tasks (each
  row: the task's data with its id and question); returns the path."""
  write_jsonl(path, ({**task.data, "id": task.id, "question": task.question} for task in tasks))
  return path
