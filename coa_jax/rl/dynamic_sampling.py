"""Dynamic sampling: keep only prompt groups whose samples disagree, until the batch is full.

A group whose samples are all correct or all wrong has zero advantage everywhere and teaches
nothing, so DAPO drops it and generates more prompts instead. The filter looks at the
correctness metric, not at the shaped score (overlong shaping can make equal answers differ).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from coa_jax.rollout.tool_loop import RolloutRecord


class DynamicSamplingError(RuntimeError):
  """The generation-round cap was reached before the training batch was full."""


@dataclasses.dataclass
class ScoredGroup:
  """One prompt's samples with their shaped scores and correctness."""

  task_id: str
  records: list[RolloutRecord]
  scores: list[float]  # shaped rewards: what the advantages are computed from
  correct: list[bool]  # the correctness metric: what the filter looks at

  @property
  def uniform(self) -> bool:
    """Returns whether every sample is correct, or every sample is wrong."""
    return len(set(self.correct)) < 2


@dataclasses.dataclass
class SamplingStats:
  """What one batch's dynamic sampling did."""

  rounds: int = 0
  groups: int = 0  # generated
  kept: int = 0
  all_correct: int = 0  # dropped: every sample correct
  all_wrong: int = 0  # dropped: every sample wrong
  surplus: int = 0  # mixed groups beyond the batch (the last round's extra)
  solved: list[str] = dataclasses.field(default_factory=list)  # task ids, all correct
  unsolved: list[str] = dataclasses.field(default_factory=list)  # task ids, all wrong

  def to_json(self) -> dict[str, int]:
    return {k: v for k, v in dataclasses.asdict(self).items() if isinstance(v, int)}


def fill_batch(next_round: Callable[[], Iterable[ScoredGroup]], batch_groups: int,
               max_rounds: int, drop_uniform: bool = True) -> tuple[list[ScoredGroup],
                                                                    SamplingStats]:
  """Returns `batch_groups` groups gathered over generation rounds, and what was dropped.

  Each call of `next_round()` generates (and scores) the groups of one batch of prompts; the
  rounds go on until enough groups are kept. With `drop_uniform`, groups whose samples are all
  correct or all wrong are dropped. Raises DynamicSamplingError after `max_rounds` rounds.
  """
  if batch_groups < 1 or max_rounds < 1:
    raise ValueError(f"batch_groups={batch_groups} and max_rounds={max_rounds} must be >= 1")
  kept: list[ScoredGroup] = []
  stats = SamplingStats()
  while len(kept) < batch_groups:
    if stats.rounds == max_rounds:
      raise DynamicSamplingError(
          f"after {max_rounds} generation rounds ({stats.groups} groups) only {len(kept)} of "
          f"{batch_groups} groups had both correct and wrong samples ({stats.all_correct} all "
          f"correct, {stats.all_wrong} all wrong): raise rl.max_rounds, or use easier/harder "
          f"tasks")
    stats.rounds += 1
    for group in next_round():
      stats.groups += 1
      if group.uniform:
        solved = all(group.correct)
        stats.all_correct += solved
        stats.all_wrong += not solved
        (stats.solved if solved else stats.unsolved).append(group.task_id)
        if drop_uniform:
          continue
      if len(kept) < batch_groups:
        kept.append(group)
      else:
        stats.surplus += 1
  stats.kept = len(kept)
  return kept, stats
