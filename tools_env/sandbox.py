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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, Mapping, Sequence

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
_PYTHON_BLOCK_RE = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL)
_STDIN_BLOCK_RE = re.compile(r"```(?:sh|bash|stdin|text)[ \t]*\n(.*?)```", re.DOTALL)
# The self-test: imports the boot script has not made (so they run as the sandboxed user), a C
# extension among them, and numpy where the interpreter has it, as real programs use them.
_SELF_TEST = "import decimal, statistics\nassert statistics.median([decimal.Decimal(42)]) == 42\n"
_SELF_TEST_NUMPY = "import numpy\nassert numpy.prod([6, 7]) == 42\n"


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


class CodeSandbox(Tool):
  """Runs `code` calls in isolated processes, at most `workers` at a time."""

  name = "code"

  def __init__(self, limits: SandboxLimits | None = None, isolation: str = "auto",
               workers: int = 4, python: str = sys.executable, workdir_root: str | None = None):
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
    self.isolation = self._choose_isolation(isolation)

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
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

  def _command(self, mode: str, workdir: str, uid: int | None) -> list[str]:
    """Returns the argv that runs main.py in `workdir` under `mode`."""
    root = os.geteuid() == 0
    rlimits = self.limits.rlimits()
    spec = {"workdir": workdir, "rlimits": rlimits, "uid": None, "read_only": False,
            "init": False, "path": self.module_path}
    if mode == "bwrap":
      if root:  # no user namespace: the boot drops to the run's uid, which root cannot be
        prefix = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                  "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        spec["uid"] = uid
      else:
        prefix = ["bwrap", "--unshare-all", "--uid", "65534", "--gid", "65534"]
      prefix += ["--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--dev", "/dev",
                 "--proc", "/proc", "--tmpfs", "/tmp"]
      for path in self.hidden:
        prefix += ["--tmpfs", path]
      for path in self.exposed:
        # bwrap would create them traversable by root only
        for parent in _parents_below(path, (*self.hidden, "/tmp")):
          prefix += ["--perms", "0755", "--dir", parent]
        prefix += ["--ro-bind", path, path]
      prefix += ["--bind", workdir, workdir, "--chdir", workdir, "--clearenv"]
      for key, value in self._environment(workdir).items():
        prefix += ["--setenv", key, value]
      prefix.append("--")
    elif mode == "unshare":
      prefix = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
                "--uts", "--mount-proc"]
      if not root:
        prefix += ["--user", "--map-root-user"]
      prefix.append("--")
      spec.update(read_only=True, init=True, uid=uid, hide=self.hidden, expose=self.exposed)
    else:
      prefix = []
      spec["uid"] = uid
      if not root:  # RLIMIT_NPROC counts every process of this user, the host's included
        rlimits["RLIMIT_NPROC"] += _user_task_count(os.getuid())
    return prefix + [self.python, "-I", "-S", "-X", "utf8", _BOOT, json.dumps(spec)]

  # --- running -------------------------------------------------------------------------

  def _execute(self, source: str, stdin: str | None, mode: str) -> _Run:
    """Runs `source` once under `mode` in a fresh working directory; kills all it started."""
    workdir = tempfile.mkdtemp(prefix="coa_sandbox_", dir=self.workdir_root)
    lease = _UIDS.lease() if os.geteuid() == 0 else contextlib.nullcontext()
    try:
      with lease as uid:
        for name, text in (("main.py", source), ("stdin.txt", stdin or "")):
          with open(os.path.join(workdir, name), "w", encoding="utf-8",
                    errors="surrogateescape") as f:
            f.write(text)
        if uid is not None:
          os.chmod(workdir, 0o700)
          for path in (workdir, os.path.join(workdir, "main.py")):
            os.chown(path, uid, uid)
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
