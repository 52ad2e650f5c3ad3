"""The `qa` scorer: SQuAD-normalized exact match and token F1 against the gold answers;
`|`-separated gold parts must all be given."""

from __future__ import annotations

import collections
import re
import string
from typing import Any

from coa_jax.data.rewards.answers import error_text, gold_answers

QA_METRICS = ("em", "f1")

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_text(text: str) -> str:
  """Returns the SQuAD normalization: lowercase, no punctuation, no a/an/the, single spaces."""
  text = text.lower().translate(_PUNCTUATION)
  return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _tokens(text: str) -> list[str]:
  return normalize_text(text.replace("|", " ")).split()


def token_f1(prediction: str, gold: str) -> float:
  """Returns the F1 of the normalized tokens of `prediction` against `gold` (`|` separates
  tokens too)."""
  predicted, expected = _tokens(prediction), _tokens(gold)
  if not predicted or not expected:
    return float(predicted == expected)
  common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(predicted), common / len(expected)
  return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> bool:
  """Returns whether the normalized strings are equal; for a gold with `|`-separated parts,
  whether the prediction's `|`-separated parts are the same set."""
  if "|" not in gold:
    return normalize_text(prediction) == normalize_text(gold)
  return _answer_parts(prediction) == _answer_parts(gold)


def _answer_parts(text: str) -> set[str]:
  return {normalize_text(part) for part in text.split("|")} - {""}


def qa_reward(answer: str, ground_truth: Any, metric: str = "em") -> tuple[float, dict[str, Any]]:
  """Returns (exact match 1.0/0.0, or token F1 with metric="f1", best over the gold answers;
  details with both)."""
  try:
    if metric not in QA_METRICS:
      return 0.0, {"error": f"unknown QA metric {metric!r}; expected one of {QA_METRICS}"}
    golds = gold_answers(ground_truth)
    if not golds:
      return 0.0, {"error": "no ground truth"}
    em = max(float(exact_match(answer, gold)) for gold in golds)
    f1 = max(token_f1(answer, gold) for gold in golds)
    return (em if metric == "em" else f1), {"em": em, "f1": f1, "golds": golds}
  except Exception as e:  # noqa: BLE001 - a reward never raises
    return 0.0, {"error": error_text(e)}

