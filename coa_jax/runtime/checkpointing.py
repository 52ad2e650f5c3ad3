"""Orbax checkpoints of the whole run: train state (params, optimizer, step, PRNG) + data position.

Saves are asynchronous and keep the newest `max_to_keep`; `restore_latest` resumes from the
newest complete checkpoint with every array placed in its sharding. A save cut short (a killed
process) never becomes a step: orbax writes into a temporary folder and renames it when done.
A step that is there but cannot be read (corrupted files) is moved aside to
`<step>.corrupt-<time>` with a warning, and the previous one is used. A SIGTERM (TPU VM
preemption) only sets a flag: the training loop sees it, saves, and exits cleanly.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class CheckpointWarning(UserWarning):
  """A checkpoint could not be read and was skipped."""


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
    """Returns (state, data state) of the newest readable checkpoint, placed like
    `abstract_state` (ShapeDtypeStructs with shardings), or None when there is none."""
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any unreadable step is skipped the same way
        self._set_aside(step, e)
        continue
      # Every shard in place before the first step. An 8-device CPU resume under load hung in
      # the first step's collectives with one device missing from every rendezvous; likely the
      # devices whose shards landed first ran ahead and held every executor thread.
      return jax.block_until_ready(restored["state"]), restored["data"]
    return None

  def _set_aside(self, step: int, error: Exception) -> None:
    """Renames an unreadable step's folder (kept for inspection), so the run can go on and
    save that step again."""
    path = os.path.join(self.directory, str(step))
    aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
    warnings.warn(f"checkpoint step {step} in {self.directory} cannot be read "
                  f"({type(error).__name__}: {str(error)[:300]}); moved it to {aside} and "
                  f"falling back to the previous one", CheckpointWarning, stacklevel=3)
    if jax.process_index() == 0:
      os.replace(path, aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"set aside checkpoint {path}")
    self._manager.reload()

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
