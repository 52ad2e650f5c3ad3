"""What an agent program's calls to the endpoint become for RL: recorded ids, then samples.

An agent program gets a base URL with a session id in its path (`/sessions/<id>/v1`); every
completion served under it is recorded as a `Call`: the prompt's ids, the sampled ids, their
log-probs and the version of the weights that sampled each. The samples are built from those
ids, never from text tokenized again (`session_record`):

- when every call's prompt extends the previous call's prompt and completion (an append-only
  conversation: the CoA tool loop, or any chat that sends back what it got), the session is one
  sequence, with loss on the sampled tokens only;
- otherwise each call is a sample of its own (a framework that rewrites its history), all with
  the session's reward: packed in one row of the update, each its own segment (positions
  restart, attention stays within it).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Sequence

from coa_jax.rollout.tool_loop import RolloutRecord


@dataclasses.dataclass(frozen=True)
class Call:
  """One completion served in a session."""

  prompt_ids: tuple[int, ...]
  completion_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  versions: tuple[int, ...]
  finish_reason: str


class Sessions:
  """The calls of each open session, recorded by the server and taken by the trainer."""

  def __init__(self):
    self._calls: dict[str, list[Call]] = collections.defaultdict(list)
    self._budgets: dict[str, int] = {}
    self._lock = threading.Lock()

  def budget(self, session: str, prompt_len: int, response_tokens: int) -> int:
    """Returns the session's token budget: its first call's prompt and `response_tokens`."""
    with self._lock:
      return self._budgets.setdefault(session, prompt_len + response_tokens)

  def record(self, session: str, call: Call) -> None:
    with self._lock:
      self._calls[session].append(call)

  def pop(self, session: str) -> list[Call]:
    """Returns the session's calls in the order they finished, and forgets them."""
    with self._lock:
      self._budgets.pop(session, None)
      return self._calls.pop(session, [])

  def __len__(self) -> int:
    with self._lock:
      return len(self._calls)


def append_only(calls: Sequence[Call]) -> bool:
  """Returns whether each call's prompt starts with the previous call's prompt and completion."""
  for before, after in zip(calls, calls[1:]):
    seen = before.prompt_ids + before.completion_ids
    if after.prompt_ids[:len(seen)] != seen:
      return False
  return True


def session_record(calls: Sequence[Call], task_id: str, sample: int, max_len: int = 0
                   ) -> RolloutRecord | None:
  """Returns the sample of one session's calls (see the module docstring): the conversation as
  one sequence when it is append-only, else each call's prompt and completion packed one after
  another (`RolloutRecord.segments`), the latest calls that fit in `max_len` tokens (0: all;
  `task_data["calls_dropped"]` counts the others). None for a session without calls."""
  if not calls:
    return None
  if append_only(calls):
    return _record(calls, task_id, sample)
  parts, length = [], 0
  for call in reversed(calls):
    size = len(call.prompt_ids) + len(call.completion_ids)
    if max_len and length + size > max_len and parts:
      break
    parts.insert(0, _record([call], task_id, sample))
    length += size
  record = RolloutRecord(task_id, sample, [], [], [], 0)
  for part in parts:
    record.ids += part.ids
    record.loss_mask += part.loss_mask
    record.logprobs += part.logprobs
    record.versions += part.versions
  record.segments = [len(part.ids) for part in parts]
  # The response (what rewards read, and overlong shaping counts) is the last call's.
  record.prompt_len = len(record.ids) - len(calls[-1].completion_ids)
  record.finish_reason, record.turns = calls[-1].finish_reason, len(calls) - 1
  tool_calls = sum(call.finish_reason == "tool_calls" for call in calls)
  if tool_calls:
    record.tool_calls = {"endpoint": tool_calls}
  if len(parts) < len(calls):
    record.task_data["calls_dropped"] = len(calls) - len(parts)
  return record


def _record(calls: Sequence[Call], task_id: str, sample: int) -> RolloutRecord:
  """The record of append-only calls: the first prompt, then each call's new prompt tokens
  (what the program added: tool results, its own messages; mask 0, tagged with the version that
  prefilled them) and its sampled tokens (mask 1, with their log-probs and versions)."""
  first = calls[0]
  record = RolloutRecord(task_id, sample, [], [], [], len(first.prompt_ids))
  record.append(list(first.prompt_ids), version=_first_version(first))
  for call in calls:
    new = call.prompt_ids[len(record.ids):]
    if new:
      record.append(list(new), version=_first_version(call))
    for token, logprob, version in zip(call.completion_ids, call.logprobs, call.versions):
      record.append([token], [logprob], version=version)
  record.finish_reason = calls[-1].finish_reason
  record.turns = len(calls) - 1
  tool_calls = sum(call.finish_reason == "tool_calls" for call in calls)
  if tool_calls:
    record.tool_calls = {"endpoint": tool_calls}
  return record


def _first_version(call: Call) -> int:
  return call.versions[0] if call.versions else 0
