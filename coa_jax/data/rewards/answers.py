"""What every scorer shares: a response's final answer, a task's gold answers and ground truth,
and a failure's error text (a reward never raises; its details say what went wrong)."""

from __future__ import annotations

import json
from typing import Any, Mapping

from coa_jax.data import coa_format


def error_text(exc: BaseException) -> str:
  return f"{type(exc).__name__}: {exc}"


def final_answer(response_text: str, tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS
                 ) -> str | None:
  """Returns the stripped content of the response's last `answer` step, or None if there is
  none, it is empty, or it is still open (cut off before `</answer>`)."""
  return answer_of(coa_format.parse(response_text, tool_tags)[0])


def answer_of(steps: list[coa_format.Step]) -> str | None:
  answers = [step for step in steps if step.tag == "answer"]
  if not answers or not answers[-1].closed:
    return None
  return answers[-1].content.strip() or None


def gold_answers(ground_truth: Any) -> list[str]:
  """Returns the gold answers of a ground truth: a string, a list of them, a {"target": ...}
  dict, or that dict as a JSON string (the reference release's `reward_model.ground_truth`)."""
  if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
    try:
      decoded = json.loads(ground_truth)
    except json.JSONDecodeError:
      decoded = None
    if isinstance(decoded, dict) and "target" in decoded:
      ground_truth = decoded
  if isinstance(ground_truth, Mapping):
    ground_truth = ground_truth.get("target")
  if ground_truth is None:
    return []
  if isinstance(ground_truth, (list, tuple)):
    return [str(gold) for gold in ground_truth if gold is not None]
  return [str(ground_truth)]


def ground_truth_of(task_data: Mapping[str, Any]) -> Any:
  """Returns the task's ground truth: `answer`, `ground_truth` or `reward_model.ground_truth`."""
  for key in ("answer", "ground_truth"):
    if task_data.get(key) is not None:
      return task_data[key]
  reward_model = task_data.get("reward_model")
  return reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
