"""Multi-host start-up through JAX's own multi-controller runtime (`jax.distributed`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from coa_jax.model.config import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-host run.

  mode: "off" (single process, the default), "auto" (cluster auto-detection: TPU pod slices,
  SLURM, ...), or "explicit" (the coordinator address, process count and id below).
  """

  mode: str = "off"
  coordinator_address: str = ""
  num_processes: int = 1
  process_id: int = 0
  cpu_collectives: str = "gloo"  # used when the platform is CPU (tests of multi-host code)


def initialize(config: DistributedConfig = DistributedConfig()) -> bool:
  """Joins the multi-host run described by `config`; returns False (a no-op) on one process."""
  if config.mode == "off" or (config.mode == "explicit" and config.num_processes == 1):
    return False
  if config.mode not in ("auto", "explicit"):
    raise ConfigError(f"distributed mode={config.mode!r}: expected 'off', 'auto' or 'explicit'")
  if jax.config.jax_platforms and "cpu" in jax.config.jax_platforms.split(","):
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
  if config.mode == "auto":
    jax.distributed.initialize()
    return True
  if not config.coordinator_address:
    raise ConfigError("distributed mode='explicit' needs coordinator_address (host:port)")
  if not 0 <= config.process_id < config.num_processes:
    raise ConfigError(f"process_id={config.process_id} is outside [0, {config.num_processes})")
  jax.distributed.initialize(coordinator_address=config.coordinator_address,
                             num_processes=config.num_processes, process_id=config.process_id)
  return True


ENV = "COA_JAX_DISTRIBUTED"


def initialize_from_env() -> bool:
  """Joins a multi-host run when the environment asks for one: COA_JAX_DISTRIBUTED=auto (TPU
  pod slices, SLURM: JAX finds the other processes itself). Unset or "off": one process.
  Every experiment script calls this first; `experiments/launch_tpu.py` sets it."""
  return initialize(DistributedConfig(mode=os.environ.get(ENV, "off")))


class HostFailure(RuntimeError):
  """Another process failed before a collective; this one stops with it."""


def gather_json(value: Any, where: str = "") -> list[Any]:
  """Returns every process's `value` (anything JSON can hold), in process order. Every process
  must call it (a collective); on one process it is [value]. Each process sends where in the
  code it gathers: when they differ (one host left a computation early, say, and gathers its
  error while the others gather inside it), every process raises HostFailure naming each one's
  gather (and `where`), where they would otherwise take each other's values and go on out of
  step."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps([_call_site(), where, value]).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int64)).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = [json.loads(bytes(row[:int(size)]))
          for row, size in zip(multihost_utils.process_allgather(padded), sizes)]
  if len({site for site, _, _ in rows}) > 1:
    raise HostFailure("the processes are out of step: " + "; ".join(
        f"process {i} gathers at {site}" + (f" ({tag})" if tag else "")
        for i, (site, tag, _) in enumerate(rows)))
  return [row for _, _, row in rows]


def _call_site() -> str:
  """Returns file:line of the nearest caller outside this module (the same on every process
  that runs the same code to the same gather)."""
  frame = sys._getframe(1)
  while frame is not None and frame.f_code.co_filename == __file__:
    frame = frame.f_back
  return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def agreed(fn: Callable[[], T], where: str) -> T:
  """Collective: returns fn() once it has returned on every process. When it raised on any,
  every process raises: those where it failed their own error (noting the others'), the rest
  HostFailure naming each failure. So one host's error (a tool crash, a worker's error) ends
  every host, where raising alone would leave the others waiting in the next collective.
  `where` says what was being done."""
  result, error = _attempt(fn)
  _raise_together(error, where)
  return result


def agreed_all(fn: Callable[[], T], where: str) -> list[T]:
  """Collective: as `agreed`, and returns every process's fn() (JSON values) in process order."""
  result, error = _attempt(fn)
  reports = gather_json([_describe(error), None if error else result], where)
  _raise_reported(error, [r for r, _ in reports], where)
  return [value for _, value in reports]


def _attempt(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
  """Returns (fn(), None), or (None, what it raised), for the caller to raise on every process."""
  try:
    return fn(), None
  except Exception as e:  # noqa: BLE001 - every process hears of it, then raises
    return None, e


def _raise_together(error: BaseException | None, where: str) -> None:
  """Collective: raises on every process when `error` is set on any (see `agreed`)."""
  _raise_reported(error, gather_json(_describe(error), where), where)


def _describe(error: BaseException | None) -> str | None:
  return None if error is None else f"{type(error).__name__}: {error}"


def _raise_reported(error: BaseException | None, reports: list[str | None], where: str) -> None:
  failures = [f"process {i}: {r}" for i, r in enumerate(reports) if r]
  if error is not None:
    if len(failures) > 1:
      error.add_note(f"every process stopped ({where}): {'; '.join(failures)}")
    raise error
  if failures:
    raise HostFailure(f"stopping: another process failed ({where}): {'; '.join(failures)}")


class FirstError:
  """Keeps the first exception of host-side work instead of raising it, so the process goes on
  taking part in the collectives that follow; `raise_together` then ends every process with it.

      errors = FirstError()
      for shard in shards:
        errors.run(write, shard)  # skipped once a write failed
        gather(shard)            # a collective every process still joins
      errors.raise_together("writing the export")
  """

  def __init__(self):
    self.error: Exception | None = None

  def run(self, fn: Callable[..., T], *args: Any) -> T | None:
    """Returns fn(*args), or None once anything run here has raised (the first error kept)."""
    if self.error is not None:
      return None
    result, self.error = _attempt(lambda: fn(*args))
    return result

  def raise_together(self, where: str) -> None:
    """Collective: raises the kept error on this process and HostFailure on the others."""
    _raise_together(self.error, where)


def say(*args: Any, **kwargs: Any) -> None:
  """Prints on process 0 only, so a multi-host run prints each line once."""
  if jax.process_index() == 0:
    print(*args, **kwargs, flush=True)
