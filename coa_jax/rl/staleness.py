"""Bounded staleness between a rollout worker and a trainer (host-side, thread-safe).

Versions count updates: the trainer's version is the number of updates applied; a group's
version is the oldest policy version among its tokens (the one its prompt was encoded with).
With batches of B groups and a staleness bound k:

- the worker may start a group with its weights of version v only while fewer than
  (v + k + 1) x B groups have been started (groups that never reach the trainer, e.g. dropped
  by dynamic sampling, are given back), so it runs at most k batches ahead and the queue
  holds at most (k + 1) x B groups;
- the trainer takes the B oldest-issued ready groups whose staleness (its version minus the
  group's) is at most k, and discards older ones (a group that outlived its window: it started
  in time but finished late), giving their places back.

k = 0 is the synchronous schedule: the worker starts exactly one batch per version, and the
trainer waits for all of it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any


@dataclasses.dataclass
class Ready:
  """A finished group waiting for the trainer."""

  seq: int  # issue order
  version: int  # the oldest policy version among its tokens
  group: Any


class QueueClosed(RuntimeError):
  """The other side stopped; `__cause__` holds its error, if it failed."""


class StalenessQueue:
  """The bounded queue of finished groups and the worker's start budget (see module doc)."""

  def __init__(self, batch_groups: int, staleness: int, version: int = 0):
    if batch_groups < 1 or staleness < 0:
      raise ValueError(f"need batch_groups >= 1 and staleness >= 0, got {batch_groups}, "
                       f"{staleness}")
    self.batch_groups, self.staleness = batch_groups, staleness
    self.version = version
    self.started = version * batch_groups  # groups counted against the budget
    self.issued = 0  # issue numbers handed out
    self.stale_dropped = 0
    self.ready: list[Ready] = []
    self._cond = threading.Condition()
    self._closed = False
    self._error: BaseException | None = None

  # --- the worker's side -------------------------------------------------------------------

  def _may_start(self, version: int) -> bool:
    budget = (min(version, self.version) + self.staleness + 1) * self.batch_groups
    return self.started < budget

  def try_start(self, version: int) -> int | None:
    """Returns the issue number of a new group that starts with policy `version` (the worker's
    weights) when the budget allows one, else None."""
    with self._cond:
      self._check_open()
      if not self._may_start(version):
        return None
      self.started += 1
      self.issued += 1
      return self.issued - 1

  def wait(self, version: int, timeout: float | None = None) -> None:
    """Blocks until a group may start with `version`, or a newer version is out (or `timeout`
    seconds pass); raises once closed."""
    with self._cond:
      self._cond.wait_for(
          lambda: self._closed or self.version > version or self._may_start(version), timeout)
      self._check_open()

  def give_back(self) -> None:
    """Returns a started group's place (it will not reach the trainer)."""
    with self._cond:
      self.started -= 1
      self._cond.notify_all()

  def put(self, seq: int, version: int, group: Any) -> None:
    """Queues a finished group."""
    with self._cond:
      self._check_open()
      self.ready.append(Ready(seq, version, group))
      self._cond.notify_all()

  # --- the trainer's side ------------------------------------------------------------------

  def take(self, count: int, timeout: float | None = None) -> tuple[list[Ready], int]:
    """Returns `count` usable groups in issue order (blocking until there are; TimeoutError
    after `timeout` seconds) and the queue depth when they were taken. Groups older than the
    bound are discarded and their places given back."""
    with self._cond:
      def usable():
        fresh = [r for r in self.ready if self.version - r.version <= self.staleness]
        dropped = len(self.ready) - len(fresh)
        if dropped:
          self.ready, self.started = fresh, self.started - dropped
          self.stale_dropped += dropped
          self._cond.notify_all()
        return self._closed or len(self.ready) >= count

      if not self._cond.wait_for(usable, timeout):
        raise TimeoutError(f"{len(self.ready)} of {count} groups ready after {timeout} s")
      self._check_open()
      depth = len(self.ready)
      self.ready.sort(key=lambda r: r.seq)
      taken, self.ready = self.ready[:count], self.ready[count:]
      return taken, depth

  def advance(self) -> int:
    """Counts one update (the worker's budget grows by a batch); returns the new version."""
    with self._cond:
      self.version += 1
      self._cond.notify_all()
      return self.version

  def close(self, error: BaseException | None = None) -> None:
    """Wakes both sides; they raise QueueClosed (from `error`, when given) from now on."""
    with self._cond:
      self._closed, self._error = True, self._error or error
      self._cond.notify_all()

  def _check_open(self) -> None:
    if self._closed:
      raise QueueClosed("the rollout worker or the trainer stopped") from self._error
