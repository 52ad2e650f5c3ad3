"""Command-line helpers shared by the experiment scripts."""

from __future__ import annotations

import keyword
from typing import Sequence

from absl import logging

from coa_jax.runtime import distributed, xla_flags


def config_argv(argv: Sequence[str]) -> list[str]:
  """Returns `argv` with each config-override path segment that is a Python keyword written as
  a subscript (--config.rl.async.staleness=2 -> --config.rl['async'].staleness=2): ml_collections
  parses override paths as Python expressions, and `async` is a keyword."""
  out = []
  for arg in argv:
    if arg.startswith("--config.") and "=" in arg:
      path, value = arg.split("=", 1)
      parts = path.split(".")
      path = parts[0] + "".join(f"['{p}']" if keyword.iskeyword(p) else f".{p}"
                                for p in parts[1:])
      arg = f"{path}={value}"
    out.append(arg)
  return out


def start(flags: str = "") -> None:
  """Does what a job's entry script does before its job: applies the XLA flag set `flags`
  (`runtime.xla_flags`; before JAX starts a backend), joins the other hosts of a multi-host run
  (`distributed.initialize_from_env`) and quiets absl's INFO lines (orbax logs every checkpoint
  step at INFO)."""
  xla_flags.apply(flags)
  distributed.initialize_from_env()
  logging.set_verbosity(logging.WARNING)
