"""Test-time scaling: pass@k and maj@k for every k up to the samples drawn per task.

Each value is the exact expectation over the k-subsets of a task's n samples, so a curve from n
samples has no subset-sampling noise:

- pass@k: some sample of the k is correct (the unbiased estimator, `pass_at_k`);
- maj@k: the most frequent normalized answer among the k is correct. Ties are broken uniformly
  at random among the tied answers (the expectation of "the first seen" over the subsets'
  orders); samples without an answer cast no vote, and k of them score 0.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence

from coa_jax.data import rewards

# A sample is an `evaluation.job.Sample`: read here are `.correct` and `.answer` (None: none).
Sample = Any


def pass_at_k(n: int, c: int, k: int) -> float:
  """Returns the unbiased estimate of pass@k from n samples of which c are correct:
  1 - C(n - c, k) / C(n, k)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_groups(samples: Sequence[Sample]) -> list[list[Sample]]:
  """Returns the answered samples grouped by answer for a vote, in first-seen order: the same
  normalized text and the same grade (answers the normalization merges but the grader tells
  apart, `-1/2` and `1/2` under a math grader, are two answers)."""
  groups: dict[tuple[str, bool], list[Sample]] = {}
  for sample in samples:
    if sample.answer is not None:
      key = (rewards.normalize_text(sample.answer), bool(sample.correct))
      groups.setdefault(key, []).append(sample)
  return list(groups.values())


def maj_at_k(samples: Sequence[Sample], k: int) -> float:
  """Returns the expected majority-vote correctness of k of `samples` drawn without
  replacement, over their `answer_groups`."""
  n = len(samples)
  if not 1 <= k <= n:
    raise ValueError(f"maj@k needs 1 <= k <= n, got n={n}, k={k}")
  groups = answer_groups(samples)
  # Over the answers one at a time: (samples drawn, top count, answers at it, correct ones among
  # them) -> the number of ways to draw that far.
  ways: collections.Counter = collections.Counter({(0, 0, 0, 0): 1})
  for group in groups:
    size, correct = len(group), int(group[0].correct)
    nxt: collections.Counter = collections.Counter()
    for (drawn, top, at_top, right), count in ways.items():
      for x in range(min(size, k - drawn) + 1):
        if x > top:
          state = (drawn + x, x, 1, correct)
        elif x == top and x > 0:
          state = (drawn + x, top, at_top + 1, right + correct)
        else:
          state = (drawn + x, top, at_top, right)
        nxt[state] += count * math.comb(size, x)
    ways = nxt
  unanswered = n - sum(len(g) for g in groups)
  total = sum(count * math.comb(unanswered, k - drawn) * right / at_top
              for (drawn, top, at_top, right), count in ways.items() if top > 0)
  return total / math.comb(n, k)


def curves(outcomes: dict[str, Sequence[Sample]], ks: Sequence[int]) -> dict[str, list[float]]:
  """Returns {"k", "pass@k", "maj@k"}: each metric's mean over tasks at every k of `ks`."""
  if not outcomes:
    raise ValueError("no tasks to summarize")
  groups = list(outcomes.values())
  mean = lambda values: sum(values) / len(groups)
  return {"k": list(ks),
          "pass@k": [mean(pass_at_k(len(g), sum(s.correct for s in g), k) for g in groups)
                     for k in ks],
          "maj@k": [mean(maj_at_k(g, k) for g in groups) for k in ks]}
