"""Orbax checkpoints of the whole run: train state (params, optimizer, step, PRNG) + data position.

Saves are asynchronous and keep the newest `max_to_keep`; `restore_latest` resumes from the
newest complete checkpoint with every array placed in its sharding. A SIGTERM (TPU VM
preemption) only sets a flag: the training loop sees it, saves, and exits cleanly.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores (TrainState, data iterator state) pairs under one directory."""

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """Returns the step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict[str, Any], force: bool = False) -> None:
    """Starts saving `state` and the data position at `step` (returns before it is written)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
    """Returns (state, data state) of the newest checkpoint, placed like `abstract_state`
    (ShapeDtypeStructs with shardings), or None when there is none."""
    step = self.latest_step()
    if step is None:
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def wait(self) -> None:
    """Blocks until pending saves are written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class PreemptionFlag:
  """Set by SIGTERM (and SIGINT) while installed; the loop checks `requested`."""

  def __init__(self):
    self.requested = False
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "PreemptionFlag":
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    if jax.process_index() == 0:
      print(f"received signal {signum}: saving a checkpoint, then stopping", flush=True)
    self.requested = True

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
