"""The `code` tool: runs a fenced python block in an isolated, resource-limited process.

The body of a `code` call holds a ```python fenced block (the last one is run) and optionally
a ```sh block whose text is fed to the program's stdin, as in the reference code agent. The
program runs as `main.py` in a fresh temporary working directory, deleted afterwards; stdout
and stderr are merged in order and cut to `max_output_chars` keeping head and tail.

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

`CodeSandbox` is also the worker pool: at most `workers` programs run at once however many
threads call it, and `map(bodies)` runs a list of calls through the pool.

Persistent workers (the default; `persistent=False` starts a process per program, as above).
Each of the `workers` slots holds a worker: the mode's sandbox (the same bwrap or unshare
command, or none for "rlimit") started once, running `sandbox_worker.serve`, an interpreter that
has imported the standard modules of `PRELOAD` and numpy (where the interpreter has it). The
worker never runs a program's code, nor reads its code, input or output: the host writes them
to a fresh working directory in the worker's own directory and hands the worker two
descriptors (the stdin file and the write end of the output pipe). For each program the worker
forks a process that takes them as fds 0-2, closes every other descriptor, makes new
sys.stdin/stdout/stderr on them and sets the program's environment, then, as a single run
does, applies the limits and (as root) drops to the run's uid, and sets no_new_privs and drops
every capability before running main.py. In the namespace modes:

- as root, the fork enters new network (under bwrap with a loopback of its own), ipc and uts
  namespaces and a new session. It shares the worker's mounts, which the worker made
  read-only at its start (bwrap: /dev and its tmpfs too), all but the worker's directory,
  which is root's and holds nothing else while the program runs. When the program ends, the
  host kills every process of the run's uid (the worker its process group) before the worker
  takes another program.
- without root (the run's uid is the worker's), the fork is pid 1 of a new pid namespace, the
  program's init: it enters new mount, network, ipc and uts namespaces, replaces every
  directory the worker's user may write (bwrap: /tmp, /dev/shm, the hidden home directories;
  the worker's directory) with an empty tmpfs, binds the program's working directory and the
  interpreter's exposed paths back in, mounts a /proc of its own, remounts every other writable
  mount read-only, brings up a loopback (bwrap) and forks the program. When the program ends
  its init exits, and the kernel kills every process left in its pid namespace before that
  exit is reported.

In the rlimit mode the fork runs the program in a new session; when it ends its process group
is killed, and as root every process of its uid.

Why a program cannot affect the next one: it runs in a copy of the worker's memory made by
fork, and the worker runs no program code: what a program starts from is the worker's state
after its start-up plus its loop's bookkeeping (the last request: a path, a uid, limits), so
modules, globals, sys settings, the environment (set afresh for each program) and the
standard streams (made anew on the program's descriptors) are never a previous program's; the
random module reseeds after each fork. In the namespace modes nothing it wrote outside its
working directory (deleted afterwards) outlives it (as root it can write nowhere else; without
root only in tmpfs of its own mount namespace), no process it started outlives it (as root
every process of its uid is killed; without root its pid namespace dies), nor any socket, IPC
object or hostname (its own network, ipc and uts namespaces). It cannot reach the worker: it
runs under another uid (as root) or in another pid namespace, with no capability, and the
worker is not dumpable (no ptrace, no /proc/<pid>/mem). A worker that dies, or a run that
times out or prints too much, is killed with everything in it and replaced by a new one on the
next call: a dead worker's program gets a `tool_error` result, or another worker if it died
before taking it. Workers stop on `close()`, when the sandbox is garbage collected and at
interpreter exit, and exit by themselves when the host goes away (their control socket
closes).

Differences a program can see: the preloaded modules are already in sys.modules (and, numpy
among them, count against RLIMIT_AS: ~85 MB of a 2 GiB default); str hashes are the same in
every program of a worker (one hash seed per worker); interpreter exit runs the program's
threads, atexit functions and garbage collection but does not tear down the modules
(`sandbox_worker.exit_program`); as root, /proc shows the worker's processes beside the
program's, and the program's pid and parent's are the worker's numbering. The rlimit mode
keeps no more than its single-run guarantees: what a program writes where its uid may (/tmp,
as root; anywhere its user may, without) is seen by later programs, and without root a
process that leaves its process group survives. When the pool's own self-test fails on a
machine, the sandbox warns once and starts a process per program instead, in the same
isolation mode.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

from tools_env import sandbox_boot
from tools_env.base import (
  BAD_REQUEST,
  MEMORY_LIMIT,
  PROCESS_LIMIT,
  RUNTIME_ERROR,
  SYNTAX_ERROR,
  TIMEOUT,
  TOO_LARGE,
  TOOL_ERROR,
  Tool,
  ToolFailure,
  ToolResult,
)

log = logging.getLogger(__name__)

ISOLATION_MODES = ("bwrap", "unshare", "rlimit")
HIDDEN_DIRS = ("/root", "/home")  # replaced by empty directories in the namespace modes
_BOOT = os.path.abspath(sandbox_boot.__file__)
_WORKER = os.path.join(os.path.dirname(_BOOT), "sandbox_worker.py")  # a pool's worker
# What bubblewrap makes read-only in the /proc it mounts (so does a program's init in a worker).
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus")
_PYTHON_BLOCK_RE = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL)
_STDIN_BLOCK_RE = re.compile(r"```(?:sh|bash|stdin|text)[ \t]*\n(.*?)```", re.DOTALL)
# The self-test: imports the boot script has not made (so they run as the sandboxed user), a C
# extension among them, and numpy where the interpreter has it, as real programs use them.
_SELF_TEST = "import decimal, statistics\nassert statistics.median([decimal.Decimal(42)]) == 42\n"
_SELF_TEST_NUMPY = "import numpy\nassert numpy.prod([6, 7]) == 42\n"
# What pool workers import once, for every program (numpy too where the interpreter has it).
PRELOAD = ("bisect", "collections", "decimal", "fractions", "functools", "heapq", "itertools",
           "json", "math", "random", "re", "statistics", "string", "typing")
_WORKER_START_S = 60.0  # a worker that is not ready by then is killed


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


@dataclasses.dataclass(frozen=True)
class _Run:
  output: bytes
  returncode: int  # 128 + N for death by signal N, whatever the mode
  stopped: str | None  # "timeout" or "too_large" when the host killed the run


class _UidPool:
  """Dedicated uids for concurrent runs when the host is root: RLIMIT_NPROC then counts each
  run's processes alone (it never applies to root), and a run's leftovers can be found and
  killed. The range sits far above the uids of real users and of container id maps.

  A uid is leased with an exclusive lock on its file in `lock_dir`, so that every process on
  the host (two jobs, test workers, the hosts of a one-machine multi-process run) gets uids of
  its own: one run never counts, or kills, another's processes. The kernel drops a dead
  process's locks; whatever its runs left behind is killed when the uid is next leased."""

  def __init__(self, base: int = 1_900_000_000, size: int = 1024,
               lock_dir: str = os.path.join(tempfile.gettempdir(), "coa_jax_sandbox_uids")):
    self.uids = range(base, base + size)
    self.lock_dir = lock_dir
    self.next = os.getpid() % size  # processes start their searches apart

  def _acquire(self) -> tuple[int, int]:
    os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
    if os.stat(self.lock_dir).st_uid != os.geteuid():  # planted by another user
      raise ToolFailure(TOOL_ERROR, f"{self.lock_dir} belongs to another user")
    for i in range(len(self.uids)):
      uid = self.uids[(self.next + i) % len(self.uids)]
      fd = os.open(os.path.join(self.lock_dir, str(uid)),
                   os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      self.next = (self.next + i + 1) % len(self.uids)
      return uid, fd
    raise ToolFailure(TOOL_ERROR, f"all {len(self.uids)} sandbox uids are in use on this host")

  @contextlib.contextmanager
  def lease(self) -> Iterator[int]:
    uid, fd = self._acquire()
    try:
      _kill_uid(uid)  # leftovers of a process that died holding it
      yield uid
    finally:
      os.close(fd)  # releases the lock


_UIDS = _UidPool()
_PROBED: dict[tuple[str, str], str | None] = {}  # (mode, python) -> why unusable, or None
_POOL_PROBED: dict[tuple[str, str], str | None] = {}  # the same, for the worker pool
_PROBE_LOCK = threading.Lock()
_WARNED: set[str] = set()  # each warning is given once per process


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    log.warning(message)


def _processes_of(uid: int) -> Iterator[int]:
  """Yields the pids of the live (not zombie) processes owned by `uid`."""
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      if os.stat(f"/proc/{entry}").st_uid != uid:
        continue
      with open(f"/proc/{entry}/stat", "rb") as f:
        if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
          continue  # a zombie: already dead, waiting for its parent to reap it
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
      continue
    yield int(entry)


def _kill_uid(uid: int) -> None:
  """SIGKILLs every process owned by `uid` (as root, on a run's dedicated uid), until none is
  left: a process may fork between one sweep and the next."""
  for _ in range(100):
    pids = list(_processes_of(uid))
    if not pids:
      return
    for pid in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.01)
  log.error("code sandbox: processes of uid %d survive repeated SIGKILL sweeps", uid)


def _user_task_count(uid: int) -> int:
  """Returns the number of threads owned by `uid` (RLIMIT_NPROC counts them all)."""
  count = 0
  for pid in _processes_of(uid):
    with contextlib.suppress(FileNotFoundError):
      count += len(os.listdir(f"/proc/{pid}/task"))
  return count


def _interpreter_paths(python: str) -> tuple[list[str], list[str], bool]:
  """Returns `python -I`'s ([sys.prefix, sys.base_prefix], sys.path, whether numpy is there)."""
  query = ("import importlib.util, json, sys; print(json.dumps([[sys.prefix, sys.base_prefix], "
           "sys.path, importlib.util.find_spec('numpy') is not None]))")
  prefixes, path, numpy = json.loads(subprocess.run(
      [python, "-I", "-c", query], capture_output=True, check=True, timeout=60).stdout)
  return prefixes, path, numpy


def _needed_paths(python: str, paths: list[str]) -> list[str]:
  """Returns the directories that `python` (with its prefixes and module `paths`) and the boot
  script need, symlinks resolved."""
  return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)}
                | {os.path.dirname(os.path.dirname(os.path.realpath(python))),
                   os.path.dirname(_BOOT)})


def _untraversable(path: str, remade: frozenset[str] = frozenset()) -> str | None:
  """Returns the first directory on the way to `path` that other users cannot enter, or None;
  the `remade` directories (made anew by the sandbox, enterable by all) are passed over."""
  parts = path.split("/")
  for i in range(1, len(parts) + 1):
    directory = "/".join(parts[:i]) or "/"
    if directory not in remade and not os.stat(directory).st_mode & 0o001:
      return directory
  return None


def _parents_below(path: str, roots: Sequence[str]) -> list[str]:
  """Returns the directories between the one of `roots` that holds `path` and `path`,
  outermost first."""
  parents = []
  parent = os.path.dirname(path)
  while parent not in (*roots, "/"):
    parents.insert(0, parent)
    parent = os.path.dirname(parent)
  return parents


def _remade_dirs(mode: str, hidden: Sequence[str], exposed: Sequence[str]) -> frozenset[str]:
  """Returns the directories that `mode` replaces with fresh ones of mode 755: the hidden ones
  (and the bwrap mode's private /tmp) and those made on the way to the exposed paths in them."""
  if mode == "rlimit":
    return frozenset()
  roots = (*hidden, "/tmp") if mode == "bwrap" else tuple(hidden)
  remade = set(roots)
  for path in exposed:
    if any(path.startswith(root + "/") for root in roots):
      remade.update(_parents_below(path, roots))
  return frozenset(remade)


def _hidden_and_exposed(needed: list[str]) -> tuple[list[str], list[str]]:
  """Returns the home directories to hide from programs, and the `needed` paths within them or
  /tmp (private in the bwrap mode): e.g. a pyenv under /root, a virtualenv under /tmp."""
  hidden = [path for path in HIDDEN_DIRS if os.path.isdir(path)]
  exposed = []
  for path in needed:
    inside = any(path == h or path.startswith(h + "/") for h in (*hidden, "/tmp"))
    if inside and not any(path == e or path.startswith(e + "/") for e in exposed):
      exposed.append(path)
  return hidden, exposed


def _write_program(workdir: str, source: str, stdin: str | None, uid: int | None) -> None:
  """Writes a run's main.py and stdin.txt into `workdir`; with a leased `uid` (as root), the
  folder and the program become that uid's, the folder closed to others."""
  for name, text in (("main.py", source), ("stdin.txt", stdin or "")):
    with open(os.path.join(workdir, name), "w", encoding="utf-8", errors="surrogateescape") as f:
      f.write(text)
  if uid is not None:
    os.chmod(workdir, 0o700)
    for path in (workdir, os.path.join(workdir, "main.py")):
      os.chown(path, uid, uid)


def _environment(workdir: str) -> dict[str, str]:
  """Returns a program's whole environment."""
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
          "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
          "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# Capabilities a pool worker keeps inside bubblewrap as root (as a single run's boot does, it
# drops them for good when it switches to the run's uid): uid/gid switches, namespaces and
# mounts, and the loopback of each program's network namespace.
_WORKER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN", "CAP_NET_ADMIN")


@dataclasses.dataclass(frozen=True)
class _Launcher:
  """What starts the sandboxed interpreter, a single run or a pool worker: the interpreter,
  its module path, the home directories hidden and the paths in them exposed."""

  python: str
  module_path: tuple[str, ...]
  hidden: tuple[str, ...]
  exposed: tuple[str, ...]

  def command(self, mode: str, workdir: str, spec: dict[str, Any], worker: bool = False
              ) -> list[str]:
    """Returns the argv that runs the boot script with `spec` (plus the mode's keys) in
    `workdir` under `mode`: a single run, or with `worker` a pool worker (`workdir` is then
    its root: the programs' working directories are made in it)."""
    root = os.geteuid() == 0
    spec = {"workdir": workdir, "uid": None, "read_only": False, "init": False,
            "path": list(self.module_path), **spec}
    if mode == "bwrap":
      if root:  # no user namespace: the boot drops to the run's uid, which root cannot be
        prefix = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        if worker:
          prefix += ["--cap-drop", "ALL"]
        for cap in _WORKER_CAPS if worker else _WORKER_CAPS[:2]:
          prefix += ["--cap-add", cap]
      else:
        prefix = ["bwrap", "--unshare-all", "--uid", "65534", "--gid", "65534"]
        if worker:  # in its user namespace: over the namespaces it makes for each program
          prefix += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"]
      # A worker outlives the host thread that started it, whose exit --die-with-parent
      # would take for its parent's; it exits when the host closes its control socket.
      prefix += [] if worker else ["--die-with-parent"]
      prefix += ["--new-session", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                 "--tmpfs", "/tmp"]
      for path in self.hidden:
        prefix += ["--tmpfs", path]
      for path in self.exposed:
        # bwrap would create them traversable by root only
        for parent in _parents_below(path, (*self.hidden, "/tmp")):
          prefix += ["--perms", "0755", "--dir", parent]
        prefix += ["--ro-bind", path, path]
      prefix += ["--bind", workdir, workdir, "--chdir", workdir, "--clearenv"]
      for key, value in _environment(workdir).items():
        prefix += ["--setenv", key, value]
      prefix.append("--")
    elif mode == "unshare":
      prefix = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
                "--uts", "--mount-proc"]
      if not root:
        prefix += ["--user", "--map-root-user"]
      prefix.append("--")
      spec.update(read_only=True, init=not worker, hide=list(self.hidden),
                  expose=list(self.exposed))
    else:
      prefix = []
    return prefix + [self.python, "-I", "-S", "-X", "utf8", _WORKER if worker else _BOOT,
                     json.dumps(spec)]


class _WorkerDead(Exception):
  """The worker died before it could take the program: another worker may run it."""


def _descendants(pid: int) -> list[int]:
  """Returns the pids of the live descendants of `pid` (from /proc, as this host sees them)."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat", "rb") as f:
          parent = int(f.read().rsplit(b")", 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        continue
      children.setdefault(parent, []).append(int(entry))
  found, queue = [], list(children.get(pid, []))
  while queue:
    child = queue.pop()
    found.append(child)
    queue += children.get(child, [])
  return found


class _Worker:
  """One persistent sandboxed interpreter of the pool (`sandbox_worker.serve`), its control
  socket and its root directory, where each program gets a fresh working directory. Used by
  one thread at a time."""

  def __init__(self, launcher: _Launcher, mode: str, workdir_root: str | None,
               preload: Sequence[str], start_timeout_s: float):
    self.mode = mode
    # Without root, each program's processes are found by their own pid namespace; as root by
    # their uid, leased for the run.
    self.pid_namespace = mode != "rlimit" and os.geteuid() != 0
    self.root = os.path.realpath(tempfile.mkdtemp(prefix="coa_sandbox_pool_", dir=workdir_root))
    # As root, programs run under other uids, and reach their directory through it (which
    # holds nothing else while they run); they cannot write in it.
    os.chmod(self.root, 0o755 if os.geteuid() == 0 else 0o700)
    self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self.log = tempfile.TemporaryFile()  # the worker's own stderr, for a failed start
    self.dead = False
    # Without root, what each program's init replaces with empty tmpfs (see sandbox_worker).
    fresh = ["/tmp", *launcher.hidden, "/dev/shm"] if mode == "bwrap" else []
    if mode != "rlimit" and not any(self.root.startswith(path + "/") for path in fresh):
      fresh.append(self.root)
    serve = {"control_fd": theirs.fileno(), "namespaces": mode != "rlimit",
             "pid_namespace": self.pid_namespace,
             "preload": list(preload), "fresh": fresh,
             "expose": list(launcher.exposed) if mode == "bwrap" else [],
             "proc_read_only": list(_PROC_READ_ONLY) if mode == "bwrap" else [],
             "loopback": mode == "bwrap", "root": self.root,
             "seal": mode == "bwrap" and os.geteuid() == 0,
             "runner": mode == "bwrap" and os.geteuid() != 0,
             # unshare's own process shares the user namespace of the worker (not root)
             "nproc_extra": 1 if mode == "unshare" else 0}
    argv = launcher.command(mode, self.root, {"serve": serve}, worker=True)
    try:
      self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=self.log, env=_environment(self.root), cwd=self.root,
                                   pass_fds=(theirs.fileno(),), start_new_session=True)
    except OSError as e:
      theirs.close()
      self.kill()
      raise ToolFailure(TOOL_ERROR, f"the sandbox worker could not start: {e}") from None
    theirs.close()
    reply = self._receive(start_timeout_s)
    if not reply or not reply.get("ready"):
      self.kill()
      reason = (reply or {}).get("error") or self._log_tail() or "no reply"
      raise ToolFailure(TOOL_ERROR, f"the sandbox worker could not start: {reason}")

  def _receive(self, timeout_s: float) -> dict[str, Any] | None:
    """Returns the worker's next message, or None if it closed the socket or said nothing
    within `timeout_s`."""
    ready = select.select([self.control], [], [], timeout_s)[0]
    try:
      message = self.control.recv(1 << 16) if ready else b""
    except OSError:
      message = b""
    return json.loads(message) if message else None

  def _log_tail(self) -> str:
    self.log.seek(0)
    lines = self.log.read().decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else ""

  def alive(self) -> bool:
    return not self.dead and self.proc.poll() is None

  def run(self, request: dict[str, Any], stdin_path: str, limits: SandboxLimits,
          uid: int | None) -> tuple[_Run, bool]:
    """Runs one program; returns its _Run and whether this worker may run another. Raises
    _WorkerDead if the worker was gone before it took the program."""
    if not self.alive():
      raise _WorkerDead()
    read_end, write_end = os.pipe()
    try:
      with open(stdin_path, "rb") as stdin_file:
        socket.send_fds(self.control, [json.dumps(request).encode()],
                        [stdin_file.fileno(), write_end])
    except OSError:
      os.close(read_end)
      raise _WorkerDead() from None
    finally:
      os.close(write_end)
    try:
      return self._collect(read_end, limits, uid)
    finally:
      os.close(read_end)

  def _collect(self, fd: int, limits: SandboxLimits, uid: int | None) -> tuple[_Run, bool]:
    """Reads the program's output until the worker reports its end; on timeout, excess
    output or the worker's death, kills the worker."""
    deadline = time.monotonic() + limits.wall_timeout_s
    chunks, size, stopped, status, error, drain_until = [], 0, None, None, None, None
    started = False  # the worker said it forked the program
    with selectors.DefaultSelector() as selector:
      selector.register(fd, selectors.EVENT_READ)
      selector.register(self.control, selectors.EVENT_READ)
      while stopped is None:
        now = time.monotonic()
        if drain_until is not None:
          if now > drain_until or fd not in selector.get_map():
            break
        elif now > deadline:
          stopped = "timeout"
          break
        for key, _ in selector.select(timeout=0.05):
          if key.fd == fd:
            data = os.read(fd, 1 << 16)
            if not data:
              selector.unregister(fd)
              continue
            chunks.append(data)
            size += len(data)
            if size > limits.max_capture_bytes:
              stopped = "too_large"
              break
            continue
          try:
            message = self.control.recv(1 << 16)
          except OSError:
            message = b""
          if not message and not started:
            self.kill()  # before it took the program: the caller may try another worker
            raise _WorkerDead()
          reply = json.loads(message) if message else {"error": "the sandbox worker died"}
          started = started or "pid" in reply
          if "status" in reply or "error" in reply:
            status, error = reply.get("status"), reply.get("error")
            selector.unregister(self.control)
            # The program is over; what it left (as root, every process of its uid; in its
            # own pid namespace nothing is left) is killed now, before the next program.
            if uid is not None and not self.pid_namespace:
              _kill_uid(uid)
            drain_until = now + 1.0
    output = b"".join(chunks)[:limits.max_capture_bytes]
    if stopped is not None or status is None:
      self.kill()
      if uid is not None:
        _kill_uid(uid)
      if stopped is None:
        worker_error = (error or "the sandbox worker died").encode()
        return _Run(output + (b"\n" if output else b"") + worker_error,
                    128 + signal.SIGKILL, "worker_died"), False
      return _Run(output, 128 + signal.SIGKILL, stopped), False
    return _Run(output, status, None), True

  def kill(self) -> None:
    """Kills the worker and everything in it (idempotent)."""
    self.dead = True
    proc = getattr(self, "proc", None)
    if proc is not None and proc.poll() is None:
      # Everything under the command this host started: the worker's init (bwrap's, or the
      # worker itself under unshare), whose pid namespace dies with it, or (rlimit) the
      # worker's program. The command then reaps it and exits, or the worker (rlimit) exits
      # as its control socket closes; else it is killed too.
      for pid in _descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.kill(pid, signal.SIGKILL)
      self.control.close()
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, signal.SIGCONT)  # were it stopped
      try:
        proc.wait(timeout=2)
      except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.killpg(proc.pid, signal.SIGKILL)
    if proc is not None:
      proc.wait()
    self.control.close()
    self.log.close()
    shutil.rmtree(self.root, ignore_errors=True)


class _WorkerPool:
  """The idle workers of a sandbox and every worker it started; thread-safe. Holds no
  reference to the sandbox, so that the sandbox's finalizer can close it."""

  def __init__(self, start: Callable[[], _Worker]):
    self._start, self._lock = start, threading.Lock()
    self._owner = os.getpid()  # a forked copy of this process must not stop its workers
    self._idle: list[_Worker] = []
    self._all: set[_Worker] = set()

  def take(self) -> _Worker:
    """Returns an idle live worker, or starts one (raises ToolFailure if it cannot)."""
    with self._lock:
      while self._idle:
        worker = self._idle.pop()
        if worker.alive():
          return worker
        self._all.discard(worker)
        worker.kill()
    worker = self._start()
    with self._lock:
      self._all.add(worker)
    return worker

  def give(self, worker: _Worker, reusable: bool) -> None:
    """Takes back a worker after a run; kills it unless `reusable`."""
    with self._lock:
      if reusable and worker in self._all and worker.alive():
        self._idle.append(worker)
        return
      self._all.discard(worker)
    worker.kill()

  def close(self) -> None:
    """Kills every worker, idle or running a program (whose run then ends in an error)."""
    with self._lock:
      workers, self._idle, self._all = list(self._all), [], set()
    if os.getpid() == self._owner:
      for worker in workers:
        worker.kill()

  def pids(self) -> list[int]:
    """Returns the host pids of the workers' outermost processes (for tests)."""
    with self._lock:
      return [worker.proc.pid for worker in self._all]


class CodeSandbox(Tool):
  """Runs `code` calls in isolated processes, at most `workers` at a time: by default in a pool
  of persistent workers that fork each program afresh (`persistent=False`: a process started
  for each program). `preload`: the modules the workers import once (default: `PRELOAD`, and
  numpy where the interpreter has it). `close()` stops the workers; so do the sandbox's
  garbage collection and the interpreter's exit."""

  name = "code"

  def __init__(self, limits: SandboxLimits | None = None, isolation: str = "auto",
               workers: int = 4, python: str = sys.executable, workdir_root: str | None = None,
               persistent: bool = True, preload: Sequence[str] | None = None):
    self.limits = limits or SandboxLimits()
    super().__init__(self.limits.max_output_chars)
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    self.python, self.workdir_root, self.workers = python, workdir_root, workers
    self._slots = threading.BoundedSemaphore(workers)
    # Programs start with `-S` (skipping site's .pth files, which import the editable install's
    # finder: 10 of a start's 17 ms) and get the interpreter's module path from the boot script.
    prefixes, self.module_path, numpy = _interpreter_paths(python)
    self.needed = _needed_paths(python, prefixes + self.module_path)
    self.hidden, self.exposed = _hidden_and_exposed(self.needed)
    self.self_test = _SELF_TEST + (_SELF_TEST_NUMPY if numpy else "") + "print(6 * 7)\n"
    self._launcher = _Launcher(python, tuple(self.module_path), tuple(self.hidden),
                               tuple(self.exposed))
    self.isolation = self._choose_isolation(isolation)
    self.preload = tuple(PRELOAD + (("numpy",) if numpy else ()) if preload is None else preload)
    self._pool = _WorkerPool(functools.partial(_Worker, self._launcher, self.isolation,
                                               workdir_root, self.preload, _WORKER_START_S))
    weakref.finalize(self, self._pool.close)  # on garbage collection or at exit
    self.persistent = persistent and self._pool_usable()

  def close(self) -> None:
    """Stops the pool's workers (idempotent); a later call starts new ones."""
    self._pool.close()

  def __enter__(self) -> "CodeSandbox":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # --- isolation -----------------------------------------------------------------------

  def _choose_isolation(self, requested: str) -> str:
    """Returns `requested` if it works here (else raises IsolationUnavailable), or for "auto"
    the strongest mode that works, with a warning naming why each stronger one does not."""
    if requested not in ISOLATION_MODES + ("auto",):
      raise ValueError(f"isolation must be one of {ISOLATION_MODES + ('auto',)}, "
                       f"got {requested!r}")
    reasons = []
    for mode in ISOLATION_MODES if requested == "auto" else (requested,):
      reason = self._unusable(mode)
      if reason is None:
        break
      reasons.append(f"{mode!r} is unusable: {reason}")
    else:
      weaker = requested in ISOLATION_MODES[:-1]
      hint = "; isolation='auto' would accept a weaker mode" if weaker else ""
      raise IsolationUnavailable(f"code sandbox isolation {requested!r} cannot work on this "
                                 f"machine: {'; '.join(reasons)}{hint}")
    if reasons:
      _warn_once(f"code sandbox: falling back to isolation {mode!r}: {'; '.join(reasons)}")
    if mode == "rlimit":
      _warn_once("code sandbox: isolation 'rlimit' runs programs with resource limits only "
                 "(no network or filesystem isolation)")
    return mode

  def _unusable(self, mode: str) -> str | None:
    """Returns why `mode` cannot run programs here, or None (probed once per process and
    python)."""
    with _PROBE_LOCK:
      if (mode, self.python) not in _PROBED:
        _PROBED[mode, self.python] = self._probe(mode)
      return _PROBED[mode, self.python]

  def _probe(self, mode: str) -> str | None:
    """Returns why `mode` fails its self-test, or None if the test program ran."""
    if mode != "rlimit" and shutil.which(mode) is None:
      return f"{mode} is not installed"
    unreachable = self._unreachable(mode)
    if mode == "rlimit" and unreachable:  # the self-test could not even import its stdlib
      return unreachable
    try:
      run = self._execute(self.self_test, None, mode)
    except OSError as e:
      return f"its self-test could not start: {e}"
    if run.returncode == 0 and run.stopped is None and run.output.strip() == b"42":
      return None
    lines = run.output.decode("utf-8", errors="replace").strip().splitlines()
    failed = (f"its self-test (imports as the sandboxed user) failed with status "
              f"{run.returncode}{f' ({run.stopped})' if run.stopped else ''}: "
              f"{lines[-1] if lines else 'no output'}")
    return f"{failed}; {unreachable}" if unreachable else failed

  def _unreachable(self, mode: str) -> str | None:
    """Returns why the unprivileged uid that runs programs when the host is root cannot reach
    a directory the interpreter needs, as `mode` shows the filesystem; None if it can (or the
    host is not root: programs then reach what the host user reaches)."""
    if os.geteuid() != 0:
      return None
    remade = _remade_dirs(mode, self.hidden, self.exposed)
    for path in self.needed:
      blocked = _untraversable(path, remade)
      if blocked:
        return (f"as root it runs programs under an unprivileged uid, which cannot enter "
                f"{blocked} (mode {os.stat(blocked).st_mode & 0o777:o}) to reach {path}; "
                f"use a python installed where every user can read it")
    return None

  def _environment(self, workdir: str) -> dict[str, str]:
    return _environment(workdir)

  def _command(self, mode: str, workdir: str, uid: int | None) -> list[str]:
    """Returns the argv that runs main.py in `workdir` under `mode`."""
    rlimits = self.limits.rlimits()
    if mode == "rlimit" and os.geteuid() != 0:
      # RLIMIT_NPROC counts every process of this user, the host's included.
      rlimits["RLIMIT_NPROC"] += _user_task_count(os.getuid())
    return self._launcher.command(mode, workdir, {"rlimits": rlimits, "uid": uid})

  def _pool_usable(self) -> bool:
    """Returns whether the worker pool runs programs here: the self-test, run through a
    worker, passes (probed once per process, mode and python; a passing probe's worker is
    this sandbox's first). If not, warns once: programs then start a process each, in the
    same isolation mode."""
    key = (self.isolation, self.python)
    with _PROBE_LOCK:
      if key not in _POOL_PROBED:
        try:
          run = self._execute_pooled(self.self_test, None)
        except ToolFailure as e:
          _POOL_PROBED[key] = str(e)
        else:
          if run.returncode == 0 and run.stopped is None and run.output.strip() == b"42":
            _POOL_PROBED[key] = None
          else:
            lines = run.output.decode("utf-8", errors="replace").strip().splitlines()
            _POOL_PROBED[key] = (f"its self-test through a worker failed with status "
                                 f"{run.returncode}: {lines[-1] if lines else 'no output'}")
      reason = _POOL_PROBED[key]
    if reason is not None:
      self._pool.close()
      _warn_once(f"code sandbox: no persistent workers in isolation {self.isolation!r} "
                 f"({reason}); each program starts a process of its own")
    return reason is None

  # --- running -------------------------------------------------------------------------

  def _execute(self, source: str, stdin: str | None, mode: str) -> _Run:
    """Runs `source` once under `mode` in a fresh working directory; kills all it started."""
    workdir = tempfile.mkdtemp(prefix="coa_sandbox_", dir=self.workdir_root)
    lease = _UIDS.lease() if os.geteuid() == 0 else contextlib.nullcontext()
    try:
      with lease as uid:
        _write_program(workdir, source, stdin, uid)
        with open(os.path.join(workdir, "stdin.txt"), "rb") as stdin_file:
          proc = subprocess.Popen(self._command(mode, workdir, uid), stdin=stdin_file,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=self._environment(workdir), cwd=workdir,
                                  start_new_session=True)
        try:
          output, stopped = self._collect(proc, uid)
        finally:
          self._kill(proc, uid)
        code = proc.wait()
        return _Run(output, 128 - code if code < 0 else code, stopped)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  def _execute_pooled(self, source: str, stdin: str | None) -> _Run:
    """Runs `source` on a pool worker (another one if the worker turns out dead before it
    takes the program)."""
    for attempt in range(2):
      worker, reusable = self._pool.take(), False
      try:
        run, reusable = self._run_on(worker, source, stdin)
        return run
      except _WorkerDead:
        if attempt:
          raise ToolFailure(TOOL_ERROR, "the sandbox workers die before taking programs") \
              from None
      finally:
        self._pool.give(worker, reusable)
    raise AssertionError("unreachable")

  def _run_on(self, worker: _Worker, source: str, stdin: str | None) -> tuple[_Run, bool]:
    """Runs `source` on `worker` in a fresh working directory under a leased uid (as root);
    kills everything the run started. Returns the run and whether the worker is reusable."""
    lease = _UIDS.lease() if os.geteuid() == 0 else contextlib.nullcontext()
    reusable = False
    with lease as uid:
      workdir = tempfile.mkdtemp(prefix="run_", dir=worker.root)
      try:
        _write_program(workdir, source, stdin, uid)
        rlimits = self.limits.rlimits()
        if self.isolation == "rlimit" and uid is None:
          # RLIMIT_NPROC counts every process of this user, the host's included.
          rlimits["RLIMIT_NPROC"] += _user_task_count(os.getuid())
        request = {"workdir": workdir, "rlimits": rlimits, "uid": uid,
                   "env": _environment(workdir)}
        run, reusable = worker.run(request, os.path.join(workdir, "stdin.txt"), self.limits,
                                   uid)
        return run, reusable
      finally:
        # A run that ended cleanly left no process: its init's exit took its pid namespace
        # (the rlimit mode swept the uid on the status). Else, the uid is swept here (and in
        # any case when it is next leased).
        if uid is not None and not reusable:
          _kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)

  def _kill(self, proc: subprocess.Popen, uid: int | None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, signal.SIGKILL)
    if uid is not None:
      _kill_uid(uid)

  def _collect(self, proc: subprocess.Popen, uid: int | None) -> tuple[bytes, str | None]:
    """Reads merged output until the program ends; kills it on timeout or excess output."""
    limits = self.limits
    deadline = time.monotonic() + limits.wall_timeout_s
    chunks, size, stopped, drain_until = [], 0, None, None
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as selector:
      selector.register(fd, selectors.EVENT_READ)
      while True:
        now = time.monotonic()
        if drain_until is None and proc.poll() is not None:
          # The program is done; whatever it left behind holding the pipe is killed now.
          self._kill(proc, uid)
          drain_until = now + 1.0
        if drain_until is not None and now > drain_until:
          break
        if drain_until is None and now > deadline:
          stopped = "timeout"
          break
        if not selector.select(timeout=0.05):
          continue
        data = os.read(fd, 1 << 16)
        if not data:
          break
        chunks.append(data)
        size += len(data)
        if size > limits.max_capture_bytes:
          stopped = "too_large"
          break
    proc.stdout.close()
    return b"".join(chunks)[:limits.max_capture_bytes], stopped

  def _failure(self, run: _Run) -> ToolFailure | None:
    """Returns the failure a finished run amounts to, or None if it succeeded."""
    limits, code = self.limits, run.returncode
    output = run.output.decode("utf-8", errors="replace")
    if run.stopped == "timeout":
      return ToolFailure(TIMEOUT, f"timed out after {limits.wall_timeout_s:g} s (wall clock)",
                         output)
    if run.stopped == "worker_died":
      return ToolFailure(TOOL_ERROR, "the sandbox worker failed while running the program",
                         output)
    if run.stopped == "too_large":
      return ToolFailure(TOO_LARGE, f"the program printed more than {limits.max_capture_bytes} "
                                    f"bytes and was stopped", output)
    if code == 0:
      return None
    if code == 128 + signal.SIGXCPU:
      return ToolFailure(TIMEOUT, f"CPU time limit of {limits.cpu_time_s} s exceeded", output)
    known = {
        sandbox_boot.SYNTAX_ERROR: (SYNTAX_ERROR, "the program does not compile"),
        sandbox_boot.MEMORY_ERROR: (MEMORY_LIMIT, f"memory limit of "
                                                  f"{limits.memory_bytes / 2**30:g} GiB exceeded"),
        sandbox_boot.PROCESS_LIMIT: (PROCESS_LIMIT, f"process limit of {limits.max_processes} "
                                                    f"reached"),
        sandbox_boot.SETUP_FAILED: (TOOL_ERROR, "the sandbox could not start the program"),
    }
    if code in known:
      kind, message = known[code]
      return ToolFailure(kind, message, output)
    if code > 128:
      name = signal.Signals(code - 128).name if code - 128 in signal.valid_signals() else code
      return ToolFailure(RUNTIME_ERROR, f"the program was killed by {name}", output)
    return ToolFailure(RUNTIME_ERROR, f"the program exited with status {code}", output)

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    source, stdin = extract_program(body)
    if len(source) > self.limits.max_code_chars:
      raise ToolFailure(BAD_REQUEST, f"program of {len(source)} characters; at most "
                                     f"{self.limits.max_code_chars}")
    with self._slots:
      if self.persistent:
        run = self._execute_pooled(source, stdin)
      else:
        run = self._execute(source, stdin, self.isolation)
    failure = self._failure(run)
    if failure is not None:
      failure.metadata.update(returncode=run.returncode, isolation=self.isolation)
      raise failure
    output = run.output.decode("utf-8", errors="replace")
    return output or "(no output)", {"returncode": 0, "isolation": self.isolation}

  def map(self, bodies: Sequence[str], goal: str = "") -> list[ToolResult]:
    """Returns the results of many calls, run through the pool (in the order given)."""
    with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
      return list(pool.map(lambda body: self(body, goal), bodies))


def isolation_of(tools: Mapping[str, Tool]) -> str | None:
  """Returns the isolation mode of the code sandbox among `tools` (by tag), or None."""
  for tool in tools.values():
    tool = getattr(tool, "inner", tool)  # a base.Delayed wrapper
    if isinstance(tool, CodeSandbox):
      return tool.isolation
  return None


def weakest(modes: Sequence[str | None]) -> str | None:
  """Returns the weakest of several isolation modes (e.g. one per host); None if all are."""
  known = [mode for mode in modes if mode is not None]
  return max(known, key=ISOLATION_MODES.index) if known else None
