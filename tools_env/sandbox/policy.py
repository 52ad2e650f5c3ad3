"""The code sandbox's policy: its limits, its isolation modes, what a program may see.

Isolation (`isolation=`), from strongest to weakest; "auto" takes the first that passes its
self-test on this machine (probed once per process) and logs a warning naming why each stronger
mode cannot be used; a named mode is required: if it cannot work, `IsolationUnavailable` says
why, and nothing weaker is used. The self-test runs, as the sandboxed user, a program that
imports the standard library and numpy (where the interpreter has it):

- "bwrap": bubblewrap, new mount/pid/network/ipc/uts namespaces, the filesystem bound
  read-only with a private /tmp and only the working directory writable, running as uid
  65534 in a user namespace (as root: under a dedicated uid per concurrent run). No network
  at all (a loopback of its own).
- "unshare": util-linux `unshare` into new pid/network/mount/ipc/uts namespaces (as root;
  otherwise with a user namespace); every mount remounted read-only except the working
  directory (a mount that cannot be remounted read-only makes the mode unusable); as root the
  program runs under a dedicated uid per concurrent run.
- "rlimit": resource limits only, with a warning: the program can reach the network and
  write wherever its user may. What is left where no namespace is permitted (e.g. a non-root
  TPU VM without unprivileged user namespaces). As root the program runs under a dedicated
  uid, so the mode is refused when that uid cannot reach the interpreter (e.g. a pyenv under a
  root-only /root).

In every mode the environment is scrubbed (PATH, HOME and TMPDIR pointing at the working
directory, UTF-8 locale, one BLAS thread) and the limits in `SandboxLimits` apply. A run
ends by killing everything it started: its pid namespace dies with it, and its process group
and (when the host is root) every process of its dedicated uid are killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from typing import Sequence

from tools_env import sandbox_boot
from tools_env.base import BAD_REQUEST, ToolFailure

ISOLATION_MODES = ("bwrap", "unshare", "rlimit")
HIDDEN_DIRS = ("/root", "/home")  # replaced by empty directories in the namespace modes
BOOT = os.path.abspath(sandbox_boot.__file__)
_PYTHON_BLOCK_RE = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL)
_STDIN_BLOCK_RE = re.compile(r"```(?:sh|bash|stdin|text)[ \t]*\n(.*?)```", re.DOTALL)


class IsolationUnavailable(ValueError):
  """The isolation asked for cannot work on this machine; the message says why."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one sandboxed run; the defaults suit contest-style snippets."""

  wall_timeout_s: float = 10.0  # wall clock, then the whole run is killed
  cpu_time_s: int = 10  # RLIMIT_CPU of each process
  memory_bytes: int = 2 * 2**30  # RLIMIT_AS (address space) of each process
  max_processes: int = 64  # RLIMIT_NPROC: processes and threads of the program's user
  max_file_bytes: int = 64 * 2**20  # RLIMIT_FSIZE: largest file the program may write
  # Each scratch tmpfs (/tmp, /dev/shm, the hidden homes: a program's to write without root,
  # in bwrap): its files are memory, which RLIMIT_AS does not count.
  scratch_bytes: int = 256 * 2**20
  max_open_files: int = 256  # RLIMIT_NOFILE
  max_capture_bytes: int = 2**20  # output beyond this kills the program (too_large)
  max_output_chars: int = 8000  # observation size, head and tail kept
  max_code_chars: int = 200_000  # longer programs are refused

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"SandboxLimits.{field.name} must be > 0, got "
                         f"{getattr(self, field.name)!r}")

  def rlimits(self) -> dict[str, int]:
    """Returns the resource limits applied to the program, by `resource` constant name."""
    return {"RLIMIT_CPU": int(self.cpu_time_s), "RLIMIT_AS": int(self.memory_bytes),
            "RLIMIT_NPROC": int(self.max_processes), "RLIMIT_FSIZE": int(self.max_file_bytes),
            "RLIMIT_NOFILE": int(self.max_open_files), "RLIMIT_CORE": 0}


def extract_program(body: str) -> tuple[str, str | None]:
  """Returns (python source, stdin text or None) of a `code` call; raises ToolFailure."""
  blocks = _PYTHON_BLOCK_RE.findall(body)
  if not blocks:
    raise ToolFailure(BAD_REQUEST, "no fenced python block; write the program as "
                                   "```python\n...\n``` (and its input, if any, as ```sh)")
  stdin = _STDIN_BLOCK_RE.findall(body)
  return blocks[-1], (stdin[-1] if stdin else None)


def interpreter_paths(python: str) -> tuple[list[str], list[str], bool]:
  """Returns `python -I`'s ([sys.prefix, sys.base_prefix], sys.path, whether numpy is there)."""
  query = ("import importlib.util, json, sys; print(json.dumps([[sys.prefix, sys.base_prefix], "
           "sys.path, importlib.util.find_spec('numpy') is not None]))")
  prefixes, path, numpy = json.loads(subprocess.run(
      [python, "-I", "-c", query], capture_output=True, check=True, timeout=60).stdout)
  return prefixes, path, numpy


def needed_paths(python: str, paths: list[str]) -> list[str]:
  """Returns the directories that `python` (with its prefixes and module `paths`) and the boot
  script need, symlinks resolved."""
  return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)}
                | {os.path.dirname(os.path.dirname(os.path.realpath(python))),
                   os.path.dirname(BOOT)})


def untraversable(path: str, remade: frozenset[str] = frozenset()) -> str | None:
  """Returns the first directory on the way to `path` that other users cannot enter, or None;
  the `remade` directories (made anew by the sandbox, enterable by all) are passed over."""
  parts = path.split("/")
  for i in range(1, len(parts) + 1):
    directory = "/".join(parts[:i]) or "/"
    if directory not in remade and not os.stat(directory).st_mode & 0o001:
      return directory
  return None


def parents_below(path: str, roots: Sequence[str]) -> list[str]:
  """Returns the directories between the one of `roots` that holds `path` and `path`,
  outermost first."""
  parents = []
  parent = os.path.dirname(path)
  while parent not in (*roots, "/"):
    parents.insert(0, parent)
    parent = os.path.dirname(parent)
  return parents


def remade_dirs(mode: str, hidden: Sequence[str], exposed: Sequence[str]) -> frozenset[str]:
  """Returns the directories that `mode` replaces with fresh ones of mode 755: the hidden ones
  (and the bwrap mode's private /tmp) and those made on the way to the exposed paths in them."""
  if mode == "rlimit":
    return frozenset()
  roots = (*hidden, "/tmp") if mode == "bwrap" else tuple(hidden)
  remade = set(roots)
  for path in exposed:
    if any(path.startswith(root + "/") for root in roots):
      remade.update(parents_below(path, roots))
  return frozenset(remade)


def hidden_and_exposed(needed: list[str]) -> tuple[list[str], list[str]]:
  """Returns the home directories to hide from programs, and the `needed` paths within them or
  /tmp (private in the bwrap mode): e.g. a pyenv under /root, a virtualenv under /tmp."""
  hidden = [path for path in HIDDEN_DIRS if os.path.isdir(path)]
  exposed = []
  for path in needed:
    inside = any(path == h or path.startswith(h + "/") for h in (*hidden, "/tmp"))
    if inside and not any(path == e or path.startswith(e + "/") for e in exposed):
      exposed.append(path)
  return hidden, exposed


def environment(workdir: str) -> dict[str, str]:
  """Returns a program's whole environment."""
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
          "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
          "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def weakest(modes: Sequence[str | None]) -> str | None:
  """Returns the weakest of several isolation modes (e.g. one per host); None if all are."""
  known = [mode for mode in modes if mode is not None]
  return max(known, key=ISOLATION_MODES.index) if known else None
