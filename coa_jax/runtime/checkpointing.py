"""Orbax checkpoints of the whole run: train state (params, optimizer, step, PRNG) + data position.

Saves are asynchronous and keep the newest `max_to_keep`; `restore_latest` resumes from the
newest complete checkpoint with every array placed in its sharding. A save cut short (a killed
process) never becomes a step: orbax writes into a temporary folder and renames it when done.

Resume is exact or fails loudly, and every process takes the same decision:

- the candidates are the steps every process sees, newest first;
- a step whose tree, shapes, dtypes or mesh differ from what the run expects (another model
  size, optimizer or mesh) raises `CheckpointMismatchError` naming the differences, and moves
  nothing: it is the wrong run, or the wrong config, not a damaged checkpoint;
- a step that cannot be read (truncated or missing files) on any process is moved aside to
  `<step>.corrupt-<time>` with a warning, and every process goes on to the previous one.

The fit is checked on the step's metadata before orbax reads an array, so a mismatch or an
unreadable metadata file is agreed on before any collective. One hazard is left: orbax's
restore synchronises the processes with device collectives of its own, so an array read that
fails on some processes only leaves the others inside one. On the CPU (gloo) that ended both
processes at once with a collective-mismatch abort: loud and bounded, but without the
fallback to the previous step.

A SIGTERM (TPU VM preemption) asks the loop to save and stop at a step every process agrees on
(`PreemptionFlag`).
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from coa_jax.runtime import distributed


class CheckpointWarning(UserWarning):
  """A checkpoint could not be read and was skipped."""


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit the run's config (tree, shape, dtype or mesh)."""


class Checkpointer:
  """Saves and restores (TrainState, data iterator state) pairs under one directory."""

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=async_save)
    # Named handlers let a fresh manager read a step's metadata before restoring it.
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers=dict(state=ocp.StandardCheckpointHandler(),
                           data=ocp.JsonCheckpointHandler()))

  def latest_step(self) -> int | None:
    """Returns the step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict[str, Any], force: bool = False) -> None:
    """Starts saving `state` and the data position at `step` (returns before it is written)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """Returns (step, state, data state) of the newest readable checkpoint, placed like
    `abstract_state` (ShapeDtypeStructs with shardings), or None when there is none; the same
    step on every process. Raises CheckpointMismatchError when it does not fit
    `abstract_state`."""
    seen = distributed.gather_json(sorted(self._manager.all_steps()))
    for step in sorted(set(seen[0]).intersection(*seen[1:]), reverse=True):
      try:
        mismatch, problem = mismatches(self._manager.item_metadata(step)["state"],
                                       abstract_state), ""
      except Exception as e:  # noqa: BLE001 - unreadable metadata: a damaged step
        mismatch, problem = [], f"{type(e).__name__}: {str(e)[:300]}"
      reports = distributed.gather_json([mismatch, problem])
      if any(m for m, _ in reports):
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {self.directory} does not fit this run's config "
            f"(another model, optimizer or mesh?); nothing was moved. Resume with the config "
            f"that wrote it, or point checkpoint.directory elsewhere. Differences: "
            f"{'; '.join(next(m for m, _ in reports if m))}")
      restored = None
      if not any(p for _, p in reports):
        try:
          restored = self._manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
          # Every shard in place (and any read error raised here, where it is caught).
          jax.block_until_ready(restored["state"])
        except Exception as e:  # noqa: BLE001 - any unreadable step is set aside the same way
          problem = f"{type(e).__name__}: {str(e)[:300]}"
        reports = distributed.gather_json([[], problem])
      problems = [f"process {i}: {p}" for i, (_, p) in enumerate(reports) if p]
      if problems:
        self._set_aside(step, "; ".join(problems))
        continue
      return step, restored["state"], restored["data"]
    return None

  def _set_aside(self, step: int, problem: str) -> None:
    """Renames an unreadable step's folder (kept for inspection), so the run can go on and
    save that step again."""
    path = os.path.join(self.directory, str(step))
    aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
    warnings.warn(f"checkpoint step {step} in {self.directory} cannot be read ({problem}); "
                  f"moved it to {aside} and falling back to the previous one",
                  CheckpointWarning, stacklevel=3)
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


def mismatches(saved: Any, abstract_state: Any, limit: int = 5) -> list[str]:
  """Returns how the saved tree metadata differs from `abstract_state` (missing or unexpected
  leaves, shapes, dtypes, mesh axis sizes), at most `limit` of them; [] when it fits."""
  flat = lambda tree: {_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  have, want = flat(saved), flat(abstract_state)
  out = [f"{p}: not in the checkpoint" for p in want if p not in have]
  out += [f"{p}: in the checkpoint, not in this run" for p in have if p not in want]
  for p in have.keys() & want.keys():
    old, new = have[p], want[p]
    if tuple(old.shape) != tuple(new.shape) or np.dtype(old.dtype) != np.dtype(new.dtype):
      out.append(f"{p}: saved {np.dtype(old.dtype).name}{list(old.shape)}, this run "
                 f"{np.dtype(new.dtype).name}{list(new.shape)}")
    elif _mesh(old.sharding) and _mesh(new.sharding) and _mesh(old.sharding) != _mesh(new.sharding):
      out.append(f"{p}: saved on mesh {_mesh(old.sharding)}, this run's mesh is "
                 f"{_mesh(new.sharding)}")
  return sorted(out)[:limit]


def _path(path: tuple) -> str:
  """Returns a tree path as 'a/b/0', whatever the node types (attribute, key or index)."""
  return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                  for k in path)


def _mesh(sharding: Any) -> dict[str, int] | None:
  """Returns {axis: size} of a NamedSharding or orbax's metadata of one, else None."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return dict(sharding.mesh.shape)
  names, shape = getattr(sharding, "axis_names", None), getattr(sharding, "shape", None)
  if names is None or shape is None:
    return None
  return dict(zip(names, (int(s) for s in np.asarray(shape).reshape(-1))))


class PreemptionFlag:
  """Tells the loop when to save and stop after a SIGTERM (TPU VM preemption) or SIGINT:
  `reached(step)` is True at the same step on every process.

  One process: a Python signal handler sets a flag, seen at the next step. Several: JAX's
  preemption service (installed by `jax.distributed.initialize`) catches SIGTERM on whichever
  host gets it, tells every host through the coordinator, and
  `multihost_utils.reached_preemption_sync_point` is True on all of them at one agreed step;
  a host that acted on its own signal alone would start a save the others never join.
  """

  def __init__(self):
    self.requested = False
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "PreemptionFlag":
    if jax.process_count() == 1:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def reached(self, step: int) -> bool:
    """Returns whether to save and stop after `step` (every process must call it at every
    step)."""
    if jax.process_count() > 1:
      self.requested = self.requested or multihost_utils.reached_preemption_sync_point(step)
      if self.requested:
        distributed.say(f"preemption notice: every process saves at step {step}, then stops")
    return self.requested

  def _handle(self, signum, frame) -> None:
    del frame
    print(f"received signal {signum}: saving a checkpoint, then stopping", flush=True)
    self.requested = True

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
