"""The `python` scorer: a user's function, by import path, that sees the whole trajectory (a
`Response`: answer, every tool call with its result, token counts, the task's data)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from coa_jax.data import coa_format


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One tool call of a response: its tag, its body and the observation that answered it (None
  when none came: the response ended first)."""

  tag: str
  body: str
  result: str | None


@dataclasses.dataclass(frozen=True)
class Response:
  """What a `python` reward function sees: one whole response to a task.

  `task` is the task's data (`question`, the ground truth under `answer` / `ground_truth`, any
  other field of its row); `answer` the final answer (None without a closed, non-empty
  `answer` step); token counts are None where the caller has none (a teacher's trace)."""

  text: str
  steps: tuple[coa_format.Step, ...]
  answer: str | None
  tool_calls: tuple[ToolCall, ...]
  task: Mapping[str, Any]
  response_tokens: int | None = None  # sampled and observation tokens after the prompt
  sampled_tokens: int | None = None  # the model's own


def tool_calls_of(steps: list[coa_format.Step]) -> tuple[ToolCall, ...]:
  """Returns the tool calls of parsed steps, each with the observation right after it."""
  calls = []
  for i, step in enumerate(steps):
    if step.is_tool:
      after = steps[i + 1] if i + 1 < len(steps) else None
      answered = after is not None and after.tag == coa_format.OBSERVATION
      calls.append(ToolCall(step.tag, step.content, after.content if answered else None))
  return tuple(calls)


class PythonScorer:
  """A `python` domain's scorer: the user's function on the whole Response; a result that is
  not a number in [0, 1] (or such a number and a dict) is an error."""

  def __init__(self, function: Callable[..., Any], options: Mapping[str, Any]):
    self.function, self.options = function, options

  def __call__(self, response: Response) -> tuple[float, dict[str, Any]]:
    result = self.function(response, **self.options)
    value, details = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1
        or not isinstance(details, dict)):
      raise ValueError(f"a python reward must return a score in [0, 1] or (score, dict), got "
                       f"{result!r:.200}")
    return float(value), details

