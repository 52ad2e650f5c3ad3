"""Reading trajectories: our JSONL and the reference release's LLaMA-Factory SFT data.

Record layouts, detected per record:
- ours: {"system", "question", "steps": [{"tag", "content"}, ...], "metadata"};
- alpaca: {"instruction", "input", "output", "system"}, the output holding the whole
  trajectory text with inline observation blocks;
- sharegpt: {"conversations": [{"from", "value"}, ...]} or {"messages": [{"role",
  "content"}, ...]}: a system turn (or a "system" field), one user turn, one assistant turn.

Files are JSON arrays (`.json`) or one record per line (`.jsonl`). A record that does not
parse or fails validation is dropped and counted by reason; `DropCounter.check` fails the
run when too large a fraction was dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Iterable, Iterator

from coa_jax.data import coa_format
from coa_jax.data.coa_format import Step, Trajectory

BAD_JSON = object()  # stands for a line that did not parse


class DataError(ValueError):
  """A data file is missing, empty or unreadable, or too many of its examples were dropped."""


@dataclasses.dataclass
class DropCounter:
  """Counts kept examples and dropped ones by reason."""

  kept: int = 0
  dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def drop(self, reason: str) -> None:
    self.dropped[reason] += 1

  @property
  def total(self) -> int:
    return self.kept + sum(self.dropped.values())

  def summary(self) -> str:
    """Returns a one-line report: kept, dropped and the count of each reason."""
    reasons = ", ".join(f"{r}: {n}" for r, n in self.dropped.most_common())
    return (f"kept {self.kept} of {self.total} examples; dropped "
            f"{sum(self.dropped.values())}" + (f" ({reasons})" if reasons else ""))

  def check(self, max_drop_fraction: float) -> None:
    """Raises DataError when nothing was kept or more than `max_drop_fraction` was dropped."""
    if self.kept == 0:
      raise DataError(f"no usable examples: {self.summary()}")
    fraction = 1 - self.kept / self.total
    if fraction > max_drop_fraction:
      raise DataError(f"dropped {fraction:.1%} of examples, more than the allowed "
                      f"{max_drop_fraction:.1%}: {self.summary()}")


def _text(value: Any, what: str = "") -> str:
  """Returns a record's text field: a string, or a number as text; None (JSON null, a parquet
  null) is "" where `what` is empty (an optional field), else ValueError(`what`)."""
  if value is None and not what:
    return ""
  if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
    return str(value)
  raise ValueError(what or "not_text")


def _from_steps_record(record: dict[str, Any], tool_tags: tuple[str, ...]
                       ) -> tuple[Trajectory, list]:
  tags = coa_format.ROLE_TAGS + tuple(tool_tags) + (coa_format.OBSERVATION,)
  steps = []
  for s in record["steps"] or ():
    if not isinstance(s, dict) or s.get("tag") not in tags:
      raise ValueError("unknown_tag")
    steps.append(Step(s["tag"], _text(s.get("content"))))
  trajectory = Trajectory(_text(record.get("system")), _text(record["question"], "no_question"),
                          tuple(steps), dict(record.get("metadata") or {}))
  return trajectory, coa_format.validate(steps) + coa_format.tags_in_content(steps, tool_tags)


def _from_text(system: str, question: str, response: str, metadata: dict[str, Any],
               tool_tags: tuple[str, ...]) -> tuple[Trajectory, list]:
  # Windows line ends as the reference format's: a CR would be trained on beside each tag.
  steps, errors = coa_format.parse_and_validate(response.replace("\r\n", "\n"), True, tool_tags)
  return Trajectory(system, question, tuple(steps), metadata), errors


_ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
               "system": "system", "observation": "observation", "function_call": "tool"}


def _from_turns(record: dict[str, Any], turns: list[dict[str, Any]],
                tool_tags: tuple[str, ...]) -> tuple[Trajectory, list]:
  system = _text(record.get("system"))
  users, assistants = [], []
  for turn in turns:
    if not isinstance(turn, dict):
      raise ValueError("bad_turn")
    role = _ROLE_NAMES.get(str(turn.get("from", turn.get("role", ""))).lower(), "other")
    text = _text(turn.get("value", turn.get("content")))
    if role == "system":
      system = text
    elif role == "user":
      users.append(text)
    elif role == "assistant":
      assistants.append(text)
    else:
      raise ValueError("unsupported_turn")
  if len(users) != 1 or len(assistants) != 1:
    raise ValueError("not_single_turn")
  return _from_text(system, users[0], assistants[0], {}, tool_tags)


def trajectory_from_record(record: Any, tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS
                           ) -> tuple[Trajectory, list]:
  """Returns (trajectory, format errors) of one record in any supported layout, its tool steps
  those of the declared `tool_tags`.

  Raises ValueError whose message is a drop reason when the record is not of a known layout.
  """
  if not isinstance(record, dict):
    raise ValueError("not_an_object")
  if "steps" in record and "question" in record:
    return _from_steps_record(record, tool_tags)
  if "output" in record and "instruction" in record:
    question = _text(record["instruction"], "no_question")
    if record.get("input"):
      question += "\n" + _text(record["input"])
    return _from_text(_text(record.get("system")), question, _text(record["output"]), {},
                      tool_tags)
  for key in ("conversations", "messages"):
    if isinstance(record.get(key), list):
      return _from_turns(record, record[key], tool_tags)
  raise ValueError("unknown_layout")


_BOM = b"\xef\xbb\xbf"


def read_records(path: str) -> Iterator[Any]:
  """Yields the records of a JSONL file (or a .json array), BAD_JSON for a line that does not
  parse; raises DataError for a missing or empty file."""
  if not os.path.isfile(path):
    raise DataError(f"data file {path!r} does not exist")
  if os.path.getsize(path) == 0:
    raise DataError(f"data file {path!r} is empty")
  # Bytes, decoded strictly (JSON is UTF-8: a line that is not is not JSON), a BOM dropped.
  with open(path, "rb") as f:
    head = f.read(4096).removeprefix(_BOM).lstrip()[:1]
    f.seek(0)
    if path.endswith(".json") and head == b"[":
      try:
        records = json.loads(f.read().removeprefix(_BOM).decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
      yield from records
      return
    for number, line in enumerate(f):
      line = line.removeprefix(_BOM) if number == 0 else line
      if line.strip():
        try:
          yield json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
          yield BAD_JSON


def valid_trajectories(records: Iterable[Any], counter: DropCounter,
                       tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> Iterator[Trajectory]:
  """Yields the trajectories of records that parse and validate; counts the others by reason
  (BAD_JSON stands for a line that did not parse)."""
  for record in records:
    if record is BAD_JSON:
      counter.drop("bad_json")
      continue
    try:
      trajectory, errors = trajectory_from_record(record, tool_tags)
    except (ValueError, KeyError, TypeError) as e:
      counter.drop(str(e) if isinstance(e, ValueError) else "missing_field")
      continue
    if errors:
      counter.drop(errors[0].kind)
      continue
    counter.kept += 1
    yield trajectory


def read_trajectories(path: str, counter: DropCounter | None = None,
                      tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> Iterator[Trajectory]:
  """Yields the valid trajectories of a file; invalid ones are counted in `counter`."""
  return valid_trajectories(read_records(path), counter if counter is not None else DropCounter(),
                            tool_tags)
