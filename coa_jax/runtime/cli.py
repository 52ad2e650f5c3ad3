"""Command-line helpers shared by the experiment scripts."""

from __future__ import annotations

import keyword
import sys
from typing import Any, Callable, Sequence

from absl import app, logging
from ml_collections import config_flags

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


def run_job(job: Callable[[Any], None], default_config: str) -> None:
  """The whole of a job's entry script: a `--config` flag (a configs/ file, `default_config` when
  absent, its keys overridden as --config.a.b=v and never added to), `start` with the config's
  `xla_flags`, then `job(config)`."""
  sys.argv[:] = config_argv(sys.argv)  # e.g. --config.rl.async.staleness=2
  config = config_flags.DEFINE_config_file("config", default_config, lock_config=True)

  def main(argv):
    del argv
    start(config.value.get("xla_flags", ""))
    job(config.value)

  app.run(main)
