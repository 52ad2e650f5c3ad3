"""Test-time scaling curves against brute force over every k-subset of the samples."""

import itertools
import random

import pytest

from coa_jax.evaluation import scaling
from coa_jax.evaluation.job import Sample


def _sample(answer, correct):
  return Sample(correct=correct, answer=answer, tokens=1, tool_calls={}, format_errors=0)


def _brute_maj(samples, k):
  """The mean over k-subsets of the majority's correctness, ties shared equally."""
  scores = []
  for subset in itertools.combinations(samples, k):
    votes = {}
    for s in subset:
      if s.answer is not None:
        votes.setdefault(s.answer.strip().lower(), []).append(s.correct)
    if not votes:
      scores.append(0.0)
      continue
    top = max(len(v) for v in votes.values())
    tied = [v[0] for v in votes.values() if len(v) == top]
    scores.append(sum(tied) / len(tied))
  return sum(scores) / len(scores)


def _brute_pass(samples, k):
  subsets = list(itertools.combinations(samples, k))
  return sum(any(s.correct for s in subset) for subset in subsets) / len(subsets)


def _random_task(rng, n):
  answers = ["42", "41", "7", None]
  samples = [rng.choice(answers) for _ in range(n)]
  return [_sample(a, a == "42") for a in samples]


@pytest.mark.parametrize("seed", range(6))
def test_maj_and_pass_at_k_equal_brute_force_over_subsets(seed):
  rng = random.Random(seed)
  task = _random_task(rng, rng.randint(1, 9))
  for k in range(1, len(task) + 1):
    assert scaling.maj_at_k(task, k) == pytest.approx(_brute_maj(task, k), abs=1e-12)
  curves = scaling.curves({"t": task}, range(1, len(task) + 1))
  assert curves["pass@k"] == pytest.approx([_brute_pass(task, k) for k in curves["k"]])


def test_maj_at_1_is_avg_at_1_when_the_normalization_merges_what_the_grader_does_not():
  samples = [_sample("1.5", False), _sample("15", True)]  # both "15" once normalized
  assert scaling.maj_at_k(samples, 1) == pytest.approx(0.5)


def test_maj_at_k_by_hand():
  # Answers 42 (correct) x2, 41 x2, none x1. k=2 of 5 (10 pairs): {42,42} 1 pair wins,
  # {42,41} 4 pairs tie (1/2 each), {42,none} 2 pairs win, the rest lose: (1 + 2 + 2) / 10.
  task = [_sample("42", True), _sample("42", True), _sample("41", False), _sample("41", False),
          _sample(None, False)]
  assert scaling.maj_at_k(task, 2) == pytest.approx(0.5)
  assert scaling.maj_at_k(task, 5) == pytest.approx(0.5)  # a tie of 2 and 2
  assert scaling.maj_at_k(task, 1) == pytest.approx(0.4)  # = avg@1


def test_curves_average_over_tasks_and_reject_bad_k():
  sure, never = [_sample("1", True)] * 3, [_sample("2", False)] * 3
  curves = scaling.curves({"a": sure, "b": never}, [1, 3])
  assert curves == {"k": [1, 3], "pass@k": [0.5, 0.5], "maj@k": [0.5, 0.5]}
  with pytest.raises(ValueError, match="1 <= k <= n"):
    scaling.maj_at_k(sure, 4)
