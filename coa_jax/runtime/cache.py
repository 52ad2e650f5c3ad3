"""Results cached on disk under the settings that decide them.

`cached_json(path, key, compute)` returns the value stored at `path` when it was stored under
an equal `key`, else computes it and stores it (atomically, so an interrupted run leaves no
half-written file). `fingerprint(value)` names a folder after its settings, so two runs of the
same settings share it and different settings never collide.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable, Iterable

import jax

from coa_jax.model.config import ConfigError
from coa_jax.runtime import distributed
from coa_jax.runtime.distributed import say


def canonical(value: Any) -> Any:
  """Returns `value` as JSON would read it back (tuples as lists, keys as strings, in their
  order), so a key compares equal to the stored copy of itself."""
  return json.loads(json.dumps(value, default=str))


def fingerprint(value: Any, length: int = 12) -> str:
  """Returns a short hex digest of `value`'s canonical JSON."""
  text = json.dumps(canonical(value), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:length]


def file_fingerprint(path: str) -> str:
  """Returns a digest of a file's bytes, or of a folder's file names, sizes and modification
  times (a model export: hashing its weights would cost as much as reading them)."""
  if os.path.isfile(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()[:16]
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path} does not exist")
  entries = []
  for root, _, files in sorted(os.walk(path)):
    for name in sorted(files):
      stat = os.stat(os.path.join(root, name))
      entries.append([os.path.relpath(os.path.join(root, name), path), stat.st_size,
                      stat.st_mtime_ns])
  return fingerprint(entries, 16)


def _write_atomically(path: str, write: Callable[[Any], None]) -> None:
  """Calls `write(file)` on a temporary file beside `path`, then renames it to `path`."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  # processes sharing a folder (the hosts of a pod on one file system) never share one
  temporary = f"{path}.tmp{jax.process_index()}-{os.getpid()}"
  with open(temporary, "w") as f:
    write(f)
  os.replace(temporary, path)


def write_json(path: str, value: Any) -> None:
  """Writes `value` as JSON to `path` atomically (a temporary file, then a rename)."""
  _write_atomically(path, lambda f: json.dump(value, f, indent=1))


def write_jsonl(path: str, rows: Iterable[Any]) -> None:
  """Writes one JSON line per row to `path` atomically."""
  _write_atomically(path, lambda f: f.writelines(json.dumps(row) + "\n" for row in rows))


def _first(value: Any, where: str) -> Any:
  """Returns process 0's `value` on every process (`value` itself on one)."""
  return distributed.gather_json(value, where)[0] if jax.process_count() > 1 else value


def exists(path: str) -> bool:
  """Returns whether `path` exists on process 0, on every process: a run or an evaluation that
  only one host found done would be skipped by it alone while its peers run collectives."""
  return bool(_first(os.path.exists(path), f"checking {path}"))


def check_shared(folder: str, what: str, wait_s: float = 10.0) -> None:
  """Collective: raises ConfigError on every process unless `folder` is one folder for all of
  them. On a pod, process 0 writes there what the others read (a stage's outputs, its export):
  a local path that is each host's own disk would fail later, and less clearly. A host looks
  for process 0's file for up to `wait_s` seconds (a network file system's cache)."""
  if jax.process_count() == 1:
    return
  marker = os.path.join(folder, f".shared-{_first(os.urandom(6).hex(), 'naming a file')}")
  distributed.agreed(lambda: jax.process_index() or write_json(marker, {}), f"writing {marker}")
  deadline = time.monotonic() + wait_s
  while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.2)
  seen = distributed.gather_json(os.path.exists(marker), f"looking for {marker}")
  distributed.agreed(lambda: jax.process_index() or os.remove(marker), f"removing {marker}")
  blind = [i for i, found in enumerate(seen) if not found]
  if blind:
    raise ConfigError(f"{what}={folder!r} is not shared by the hosts: process(es) {blind} do "
                      f"not see the file process 0 wrote there. On several hosts, point it at "
                      f"one file system that every host mounts (a bucket mounted with gcsfuse, "
                      f"NFS)")


def cached_json(path: str, key: Any, compute: Callable[[], Any]) -> Any:
  """Returns the value stored at `path` under `key`, or computes, stores and returns it. A file
  stored under another key is recomputed (and says so).

  On several processes, process 0's file decides for all (a host that alone found the value
  would skip a computation its peers run collectives in), every process computes, process 0's
  value is returned everywhere (its evaluation wrote the files it read) and process 0 stores
  it. Reading, computing and storing are each agreed (`distributed.agreed`): a host-side
  failure on one process ends every process, none left waiting in the next collective (a
  computation that runs collectives of its own agrees inside them, as the jobs do)."""
  key = canonical(key)
  first = jax.process_index() == 0
  stored = distributed.agreed_all(lambda: _stored(path, key) if first else None,
                                  f"reading the cached {path}")[0]
  if stored is not None:
    return stored["value"]
  value = distributed.agreed_all(lambda: canonical(compute()), f"computing {path}")[0]
  distributed.agreed(lambda: first and write_json(path, {"key": key, "value": value}),
                     f"storing {path}")
  return value


def _stored(path: str, key: Any) -> dict[str, Any] | None:
  """Returns the file at `path` ({"key", "value"}) when it was stored under `key`, else None."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    try:
      stored = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not a cached result ({e}); it was not written by this "
                       f"code (its writes are atomic): delete it to recompute") from e
  if stored.get("key") != key:
    say(f"{path} was computed under other settings: recomputing")
    return None
  return stored
