"""Command-line helpers shared by the experiment scripts."""

from __future__ import annotations

import keyword
from typing import Sequence


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
