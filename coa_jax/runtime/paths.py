"""Folders that may name a remote store: `gs://bucket/run` stays a URL, a plain path becomes
absolute.

Checkpoint directories, HF export folders and a training job's workdir go through etils'
`epath` (and orbax, which takes an `epath.Path`), so on a pod slice every host writes the same
bucket. `os.path.abspath("gs://bucket/run")` would give `<cwd>/gs:/bucket/run`, a folder on each
host's own disk. Outputs that only local files hold (evaluation samples, rollouts, distillation
data) refuse a URL with a clear error (`local`).

epath reaches gs:// through TensorFlow's gfile when TensorFlow is installed (the `tfds` extra),
else through fsspec, which needs gcsfs (the `gcs` extra): without either, `to_epath` says which
extra to install, before anything is read or written.
"""

from __future__ import annotations

import os
import re

from etils import epath
from etils.epath import backend as epath_backend

from coa_jax.model.config import ConfigError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# The fsspec protocol epath asks for, the package that serves it and the extra that installs it.
_STORES = {"gs": ("gcs", "gcsfs", "gcs")}


class StoreUnavailableError(ImportError):
  """A URL names a store whose filesystem package is not installed."""


def is_remote(path: str) -> bool:
  """Returns whether `path` names a scheme (gs://, s3://, ...)."""
  return bool(_SCHEME.match(str(path)))


def resolve(path: str) -> str:
  """Returns `path` unchanged when it names a scheme, else as an absolute local path."""
  return str(path) if is_remote(path) else os.path.abspath(path)


def to_epath(path: str) -> epath.Path:
  """Returns `resolve(path)` as an `epath.Path` (local files, or the store the URL names);
  raises StoreUnavailableError when the store's filesystem package is missing."""
  out = epath.Path(resolve(path))
  if is_remote(path):
    _check_store(out)
  return out


def _check_store(path: epath.Path) -> None:
  """Raises StoreUnavailableError when epath would serve `path` through fsspec and fsspec has no
  filesystem for its scheme (gs:// without gcsfs), naming the extra that installs one."""
  scheme = str(path).split("://", 1)[0]
  if scheme not in _STORES or getattr(path, "_backend", None) is not epath_backend.fsspec_backend:
    return  # a scheme of no extra, TensorFlow's gfile, or a test's stand-in serves it
  protocol, package, extra = _STORES[scheme]
  try:
    import fsspec

    fsspec.get_filesystem_class(protocol)
  except ImportError:
    raise StoreUnavailableError(
        f"{path}: {scheme}:// paths need {package}, which is not installed: pip install "
        f"'coa-jax[{extra}]' (or {package} itself)") from None


def local(path: str, what: str) -> str:
  """Returns `path`; raises ConfigError when it names a remote store, which `what` (a config
  field) does not support."""
  if is_remote(path):
    raise ConfigError(f"{what}={path!r} names a remote store; this output is written with local "
                      f"files only: give a local folder (checkpoint directories, export folders "
                      f"and a training job's workdir take gs:// and other epath URLs)")
  return path
