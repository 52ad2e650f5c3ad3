"""Folders that may name a remote store: `gs://bucket/run` stays a URL, a plain path becomes
absolute.

Checkpoint directories, HF export folders and a training job's workdir go through etils'
`epath` (and orbax, which takes an `epath.Path`), so on a pod slice every host writes the same
bucket. `os.path.abspath("gs://bucket/run")` would give `<cwd>/gs:/bucket/run`, a folder on each
host's own disk. Outputs that only local files hold (evaluation samples, rollouts, distillation
data) refuse a URL with a clear error (`local`).
"""

from __future__ import annotations

import os
import re

from etils import epath

from coa_jax.model.config import ConfigError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path: str) -> bool:
  """Returns whether `path` names a scheme (gs://, s3://, ...)."""
  return bool(_SCHEME.match(str(path)))


def resolve(path: str) -> str:
  """Returns `path` unchanged when it names a scheme, else as an absolute local path."""
  return str(path) if is_remote(path) else os.path.abspath(path)


def to_epath(path: str) -> epath.Path:
  """Returns `resolve(path)` as an `epath.Path` (local files, or the store the URL names)."""
  return epath.Path(resolve(path))


def local(path: str, what: str) -> str:
  """Returns `path`; raises ConfigError when it names a remote store, which `what` (a config
  field) does not support."""
  if is_remote(path):
    raise ConfigError(f"{what}={path!r} names a remote store; this output is written with local "
                      f"files only: give a local folder (checkpoint directories, export folders "
                      f"and a training job's workdir take gs:// and other epath URLs)")
  return path
