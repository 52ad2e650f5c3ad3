"""The Chain-of-Agents trajectory format: types, renderer, a total parser and a validator.

A response is a sequence of steps `<tag>\\ncontent\\n</tag>` separated by newlines. Role agents
(`think`, `plan`, `reflection`, `suggested_answer`, `double_check`, `answer`) and tool agents
are written by the model; every tool step is followed by exactly one `observation` step written
by the environment. An observation is opaque: whatever it contains up to its closing tag is
text, never tags. The tool tags are the declared tools' (`tools_env.registry.declare`), by
default the four CoA tools `TOOL_TAGS`; `check_tool_tags` says which names can be tags.

`parse` accepts any string and never raises: it returns the steps it could read plus a list
of `FormatError`s. `validate` applies the transition rules to a list of steps.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable

ROLE_TAGS = ("think", "plan", "reflection", "suggested_answer", "double_check", "answer")
TOOL_TAGS = ("web_search", "crawl_page", "wiki_search", "code")
OBSERVATION = "observation"
ALL_TAGS = ROLE_TAGS + TOOL_TAGS + (OBSERVATION,)

# Error kinds, each a stable string that counters and tests can use.
UNCLOSED_TAG = "unclosed_tag"
NESTED_TAG = "nested_tag"
TAG_IN_FREE_TEXT = "tag_in_free_text"
STRAY_TEXT = "stray_text"
ILLEGAL_TRANSITION = "illegal_transition"
OBSERVATION_WITHOUT_TOOL = "observation_without_tool"
MISSING_OBSERVATION = "missing_observation"
MISSING_ANSWER = "missing_answer"
MALFORMED_TOOL_CALL = "malformed_tool_call"
EMPTY = "empty"

# A tool tag: a lower-case identifier, one token of its own in the tokenizer.
TOOL_TAG_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_CODE_BLOCK_RE = re.compile(r"```(?:python|py)[^\n]*\n(.*?)```", re.DOTALL)


def opening(tag: str) -> str:
  return f"<{tag}>"


def closing(tag: str) -> str:
  return f"</{tag}>"


class TagError(ValueError):
  """A tool tag that cannot be one: malformed, a role's or the observation's, or declared
  twice."""


def check_tool_tags(tool_tags: Iterable[str]) -> tuple[str, ...]:
  """Returns `tool_tags` as a tuple; raises TagError naming the first that is not a lower-case
  identifier of at most 32 characters, is a role tag or `observation`, or repeats."""
  tags = tuple(tool_tags)
  for i, tag in enumerate(tags):
    if not isinstance(tag, str) or not TOOL_TAG_RE.fullmatch(tag):
      raise TagError(f"tool tag {tag!r} is malformed: expected a lower-case identifier "
                     f"([a-z][a-z0-9_]*, at most 32 characters)")
    if tag in ROLE_TAGS or tag == OBSERVATION:
      raise TagError(f"tool tag {tag!r} collides with the role tag <{tag}>")
    if tag in tags[:i]:
      raise TagError(f"tool tag {tag!r} is declared twice")
  return tags


@functools.lru_cache(maxsize=None)
def _tag_re(tool_tags: tuple[str, ...]) -> re.Pattern:
  tags = ROLE_TAGS + check_tool_tags(tool_tags) + (OBSERVATION,)
  return re.compile(r"<(/?)(" + "|".join(tags) + r")>")


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of a response: its tag, its content, and whether its closing tag was seen."""

  tag: str
  content: str
  closed: bool = True

  @property
  def is_tool(self) -> bool:
    """Whether a tool agent wrote the step: any tag but a role's or the observation's."""
    return self.tag not in ROLE_TAGS and self.tag != OBSERVATION


@dataclasses.dataclass(frozen=True)
class FormatError:
  """A format problem: its kind (one of the module constants), where, and a message."""

  kind: str
  position: int
  message: str


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """A task prompt (system prompt + user question) and the response steps that solve it."""

  system: str
  question: str
  steps: tuple[Step, ...]
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

  def response_text(self) -> str:
    """Returns the response in the reference text format."""
    return render_steps(self.steps)

  def to_json(self) -> dict[str, Any]:
    """Returns the JSON-serializable record of this trajectory (our JSONL format)."""
    return dict(system=self.system, question=self.question,
                steps=[dict(tag=s.tag, content=s.content) for s in self.steps],
                metadata=self.metadata)


def render_step(step: Step) -> str:
  """Returns `<tag>\\ncontent\\n</tag>` (without the closing tag if the step is open)."""
  text = f"{opening(step.tag)}\n{step.content}"
  return text + f"\n{closing(step.tag)}" if step.closed else text


def render_steps(steps: Iterable[Step]) -> str:
  """Returns the reference text format of `steps`: rendered steps joined by newlines."""
  return "\n".join(render_step(s) for s in steps)


def _strip_one_newline(text: str) -> str:
  if text.startswith("\n"):
    text = text[1:]
  if text.endswith("\n"):
    text = text[:-1]
  return text


def parse(text: str, tool_tags: tuple[str, ...] = TOOL_TAGS
          ) -> tuple[list[Step], list[FormatError]]:
  """Returns the steps of a response and its syntax errors; never raises on any string. The
  tags are the roles', `tool_tags`' and the observation's: any other `<name>` is text.

  Recovery rules: text outside steps is reported (STRAY_TEXT, or TAG_IN_FREE_TEXT for a
  closing tag with no open step) and skipped; a tag opened inside an open step is reported
  (NESTED_TAG) and kept as text of that step; an observation runs to the first
  `</observation>`; a step still open at the end is kept with closed=False (UNCLOSED_TAG),
  which is how a rollout sees a tool call cut at its stop token.
  """
  if not isinstance(text, str):
    return [], [FormatError(EMPTY, 0, f"expected a string, got {type(text).__name__}")]
  tag_re = _tag_re(tuple(tool_tags))
  steps: list[Step] = []
  errors: list[FormatError] = []
  pos = 0
  while pos < len(text):
    match = tag_re.search(text, pos)
    gap_end = match.start() if match else len(text)
    if text[pos:gap_end].strip():
      errors.append(FormatError(STRAY_TEXT, pos,
                                f"text outside any step: {text[pos:gap_end].strip()[:60]!r}"))
    if match is None:
      break
    is_close, tag = bool(match.group(1)), match.group(2)
    if is_close:
      errors.append(FormatError(TAG_IN_FREE_TEXT, match.start(),
                                f"{closing(tag)} closes no open step"))
      pos = match.end()
      continue
    start = match.end()
    if tag == OBSERVATION:  # opaque up to its own closing tag
      end = text.find(closing(OBSERVATION), start)
      body_end = len(text) if end < 0 else end
      steps.append(Step(tag, _strip_one_newline(text[start:body_end]), closed=end >= 0))
      if end < 0:
        errors.append(FormatError(UNCLOSED_TAG, match.start(), "<observation> is never closed"))
        break
      pos = end + len(closing(OBSERVATION))
      continue
    pos, closed = start, False
    while True:
      inner = tag_re.search(text, pos)
      if inner is None:
        break
      if inner.group(1) and inner.group(2) == tag:
        closed = True
        break
      errors.append(FormatError(NESTED_TAG, inner.start(),
                                f"{inner.group(0)} inside the open {opening(tag)} step"))
      pos = inner.end()
    body_end = inner.start() if closed else len(text)
    steps.append(Step(tag, _strip_one_newline(text[start:body_end]), closed=closed))
    if not closed:
      errors.append(FormatError(UNCLOSED_TAG, match.start(), f"{opening(tag)} is never closed"))
      break
    pos = inner.end()
  return steps, errors


def extract_code(content: str) -> str | None:
  """Returns the body of the first fenced python block of a `code` step, or None."""
  match = _CODE_BLOCK_RE.search(content)
  return match.group(1) if match else None


def tags_in_content(steps: Iterable[Step], tool_tags: tuple[str, ...] = TOOL_TAGS
                    ) -> list[FormatError]:
  """Returns a NESTED_TAG error for each step given as (tag, content) whose content holds a tag
  (an observation's: its own closing tag), which its text would read as another step: a tool's
  output inside a thought would be trained on as the model's own text."""
  errors = []
  for i, step in enumerate(steps):
    found = (closing(OBSERVATION) in step.content if step.tag == OBSERVATION
             else _tag_re(tuple(tool_tags)).search(step.content))
    if found:
      errors.append(FormatError(NESTED_TAG, i, f"the content of step {i} <{step.tag}> holds a "
                                               f"tag"))
  return errors


def validate(steps: list[Step], complete: bool = True) -> list[FormatError]:
  """Returns the transition-rule violations of `steps`.

  Rules: an observation follows a tool step and every tool step is followed by exactly one
  observation; after `suggested_answer` comes only `double_check`; `answer` ends the
  trajectory; tool calls are well formed (a `code` step holds a fenced python block, a query
  is not empty). With complete=True the trajectory must also end with `answer` and its last
  tool step must have its observation; with complete=False (a rollout in progress) a final
  tool step may still wait for it.
  """
  errors: list[FormatError] = []
  if not steps:
    return [FormatError(EMPTY, 0, "no steps")]
  for i, step in enumerate(steps):
    prev = steps[i - 1] if i else None
    if step.tag == OBSERVATION and (prev is None or not prev.is_tool):
      errors.append(FormatError(OBSERVATION_WITHOUT_TOOL, i,
                                f"step {i}: observation after {prev.tag if prev else 'nothing'}"))
    if prev is not None and prev.is_tool and step.tag != OBSERVATION:
      errors.append(FormatError(MISSING_OBSERVATION, i,
                                f"step {i - 1}: {prev.tag} is followed by {step.tag}"))
    if prev is not None and prev.tag == "suggested_answer" and step.tag != "double_check":
      errors.append(FormatError(ILLEGAL_TRANSITION, i,
                                f"step {i}: {step.tag} after suggested_answer"))
    if prev is not None and prev.tag == "answer":
      errors.append(FormatError(ILLEGAL_TRANSITION, i, f"step {i}: {step.tag} after answer"))
    if step.is_tool and step.closed:
      if step.tag == "code" and extract_code(step.content) is None:
        errors.append(FormatError(MALFORMED_TOOL_CALL, i,
                                  f"step {i}: code without a fenced python block"))
      elif not step.content.strip():
        errors.append(FormatError(MALFORMED_TOOL_CALL, i, f"step {i}: empty {step.tag} call"))
  if complete:
    last = steps[-1]
    if last.is_tool:
      errors.append(FormatError(MISSING_OBSERVATION, len(steps),
                                f"last step {last.tag} has no observation"))
    if "answer" not in [s.tag for s in steps]:
      errors.append(FormatError(MISSING_ANSWER, len(steps), "no answer step"))
  return errors


def parse_and_validate(text: str, complete: bool = True, tool_tags: tuple[str, ...] = TOOL_TAGS
                       ) -> tuple[list[Step], list[FormatError]]:
  """Returns parse(text, tool_tags) steps with both its syntax errors and the transition
  errors."""
  steps, errors = parse(text, tool_tags)
  return steps, errors + validate(steps, complete=complete)
