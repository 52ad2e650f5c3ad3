"""Orbax checkpoints of the whole run: train state (params, optimizer, step, PRNG) + data position.

Saves are asynchronous and keep the newest `max_to_keep`; `restore_latest` resumes from the
newest complete checkpoint with every array placed in its sharding. A save cut short (a killed
process) never becomes a step: orbax writes into a temporary folder and renames it when done.

The directory is a local folder or a URL (gs://bucket/run): orbax reads and writes it through
`epath`, and every host of a pod slice sees the same steps.

Resume is exact or fails loudly, and every process takes the same decision:

- the candidates are the steps every process sees, newest first;
- a step whose tree, shapes, dtypes or mesh differ from what the run expects (another model
  size, optimizer or mesh) raises `CheckpointMismatchError` naming the differences, and moves
  nothing: it is the wrong run, or the wrong config, not a damaged checkpoint;
- a step that is damaged on any process (missing, truncated, corrupt or unparsable files:
  `is_damage`) is passed over for the previous one; once a step is restored, the damaged newer
  ones are moved aside to `<step>.corrupt-<time>` with a warning;
- when every step is damaged, `CheckpointDamagedError` says so and moves nothing: the run never
  trains from step 0 over a folder of steps unless `start_over_if_all_damaged` asks for it;
- any other failure to read (out of memory, an I/O or permission error) is raised on every
  process as it is (the others raise `HostFailure`), with nothing moved: it says nothing about
  the checkpoint, and a retry may well succeed.

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

import dataclasses
import json
import os
import signal
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from coa_jax.model.config import ConfigError
from coa_jax.runtime import distributed, paths


class CheckpointWarning(UserWarning):
  """A damaged checkpoint step was set aside."""


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit the run's config (tree, shape, dtype or mesh)."""


class CheckpointDamagedError(RuntimeError):
  """Every checkpoint step in the folder is damaged, and the run may not start over."""


# tensorstore's status codes for data that are not there or not what was written; any other
# (RESOURCE_EXHAUSTED, PERMISSION_DENIED, UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...) says
# nothing about the checkpoint.
_DAMAGE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION")


def is_damage(error: BaseException) -> bool:
  """Returns whether a read's `error` says the checkpoint itself is damaged (missing,
  truncated, corrupt or unparsable files), not that the reading failed (out of memory, I/O,
  permissions, another host): only damage sets a step aside."""
  if isinstance(error, (FileNotFoundError, EOFError, UnicodeDecodeError, json.JSONDecodeError)):
    return True
  if isinstance(error, OSError) or not isinstance(error, ValueError):
    return False
  return str(error).startswith(_DAMAGE_CODES)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  """Where checkpoints go (a folder or a gs://... URL), how often (steps), how many are kept,
  whether saves are asynchronous, and whether a folder whose every step is damaged may be set
  aside for a run from step 0 (otherwise an error)."""

  directory: str
  every: int = 200
  max_to_keep: int = 3
  async_save: bool = True
  start_over_if_all_damaged: bool = False

  def __post_init__(self):
    if self.every < 1 or self.max_to_keep < 1:
      raise ConfigError(f"every={self.every}, max_to_keep={self.max_to_keep}: expected >= 1")


class Checkpointer:
  """Saves and restores (TrainState, data iterator state) pairs under one directory: a local
  folder or a URL (gs://...) that orbax writes through `epath`."""

  def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True,
               start_over_if_all_damaged: bool = False):
    if not str(directory).strip():  # would resolve to the working directory
      raise ValueError("checkpoint.directory is empty: name a folder (or a gs:// URL), or set "
                       "checkpoint to None for a run without checkpoints")
    self.directory = paths.resolve(directory)
    self.start_over_if_all_damaged = start_over_if_all_damaged
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=async_save)
    # Named handlers let a fresh manager read a step's metadata before restoring it.
    self._manager = ocp.CheckpointManager(
        paths.to_epath(self.directory), options=options,
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
    `abstract_state` (ShapeDtypeStructs with shardings), or None when the folder holds no step;
    the same step on every process. Damaged steps newer than it are set aside. Raises
    CheckpointMismatchError when a step does not fit `abstract_state`, CheckpointDamagedError
    when every step is damaged (unless `start_over_if_all_damaged`), and any other failure to
    read (out of memory, I/O, permissions) as it is, on every process, moving nothing."""
    seen = distributed.agreed_all(lambda: sorted(self._manager.all_steps()),
                                  f"listing the checkpoint steps in {self.directory}")
    damaged: dict[int, str] = {}
    for step in sorted(set(seen[0]).intersection(*seen[1:]), reverse=True):
      reports = distributed.agreed_all(lambda: self._check_fit(step, abstract_state),
                                       f"reading checkpoint step {step}'s metadata")
      if any(m for m, _ in reports):
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {self.directory} does not fit this run's config "
            f"(another model, optimizer or mesh?); nothing was moved. Resume with the config "
            f"that wrote it, or point checkpoint.directory elsewhere. Differences: "
            f"{'; '.join(next(m for m, _ in reports if m))}")
      restored = {}
      if not any(d for _, d in reports):
        reports = distributed.agreed_all(lambda: [[], self._read(step, abstract_state, restored)],
                                         f"restoring checkpoint step {step}")
      problems = [f"process {i}: {d}" for i, (_, d) in enumerate(reports) if d]
      if problems:
        damaged[step] = "; ".join(problems)
        continue
      self._set_aside(damaged)
      return step, restored["state"], restored["data"]
    if damaged and not self.start_over_if_all_damaged:
      raise CheckpointDamagedError(
          f"every checkpoint step in {self.directory} is damaged, nothing was moved: "
          f"{'; '.join(f'step {s}: {d}' for s, d in damaged.items())}. Repair or remove them, "
          f"point checkpoint.directory elsewhere, or set "
          f"checkpoint.start_over_if_all_damaged=True to set them aside and train from step 0")
    self._set_aside(damaged)
    return None

  def _check_fit(self, step: int, abstract_state: Any) -> tuple[list[str], str]:
    """Returns (how the step's metadata differs from `abstract_state`, its damage or "");
    raises a failure to read that is not damage."""
    try:
      saved = self._manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 - damage is reported, anything else raised
      return [], _damage(e)
    if not jax.tree_util.tree_leaves(saved):
      return [], "the step's metadata lists no arrays"
    return mismatches(saved, abstract_state), ""

  def _read(self, step: int, abstract_state: Any, into: dict[str, Any]) -> str:
    """Restores `step`'s items into `into` and returns "", or returns the step's damage;
    raises a failure to read that is not damage."""
    try:
      into.update(self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())))
      jax.block_until_ready(into["state"])  # every shard in place, any read error here
      return ""
    except Exception as e:  # noqa: BLE001 - damage is reported, anything else raised
      return _damage(e)

  def _set_aside(self, damaged: dict[int, str]) -> None:
    """Renames each damaged step's folder to `<step>.corrupt-<time>` (kept for inspection), on
    process 0 with every process agreeing, so the run can save those steps again."""
    for step, problem in sorted(damaged.items()):
      path = f"{self.directory}/{step}"
      aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
      distributed.agreed(
          lambda: jax.process_index() == 0 and paths.to_epath(path).rename(aside),
          f"setting aside checkpoint {path}")
      warnings.warn(f"checkpoint step {step} in {self.directory} is damaged ({problem}); "
                    f"moved it to {aside}", CheckpointWarning, stacklevel=3)
    if damaged:
      self._manager.reload()

  def wait(self) -> None:
    """Blocks until pending saves are written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _damage(error: Exception) -> str:
  """Returns a damaged read's description; re-raises any other failure to read."""
  if not is_damage(error):
    raise error
  return f"{type(error).__name__}: {str(error)[:300]}"


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
  a host that acted on its own signal alone would start a save the others never join. A SIGINT
  (Ctrl-C on one host) is sent on as a SIGTERM to its own process, for the service to take.
  """

  def __init__(self):
    self.requested = False
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "PreemptionFlag":
    if jax.process_count() == 1:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    else:
      self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._as_sigterm)
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

  @staticmethod
  def _as_sigterm(signum, frame) -> None:
    del signum, frame
    print("received SIGINT: sent on as SIGTERM, for every process to save at one step and stop",
          flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
