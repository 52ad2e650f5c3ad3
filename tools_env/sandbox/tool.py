"""The `code` tool, `CodeSandbox`: chooses the isolation mode, runs each call in a process of
its own or on the worker pool, and reports a failed run as an error kind.

`CodeSandbox` is also the worker pool: at most `workers` programs run at once however many
threads call it, and `map(bodies)` runs a list of calls through the pool.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

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
from tools_env.sandbox.policy import (
  ISOLATION_MODES,
  IsolationUnavailable,
  SandboxLimits,
  environment,
  hidden_and_exposed,
  interpreter_paths,
  needed_paths,
  remade_dirs,
  untraversable,
  extract_program,
)
from tools_env.sandbox.pool import PRELOAD, WORKER_START_S, Worker, WorkerDead, WorkerPool
from tools_env.sandbox.runner import (
  UIDS,
  Launcher,
  Run,
  kill_uid,
  read_capped,
  user_task_count,
  write_program,
)

log = logging.getLogger(__name__)

# The self-test: imports the boot script has not made (so they run as the sandboxed user), a C
# extension among them, and numpy where the interpreter has it, as real programs use them.
_SELF_TEST = "import decimal, statistics\nassert statistics.median([decimal.Decimal(42)]) == 42\n"
_SELF_TEST_NUMPY = "import numpy\nassert numpy.prod([6, 7]) == 42\n"
_PROBED: dict[tuple[str, str], str | None] = {}  # (mode, python) -> why unusable, or None
_POOL_PROBED: dict[tuple[str, str], str | None] = {}  # the same, for the worker pool
_PROBE_LOCK = threading.Lock()
_WARNED: set[str] = set()  # each warning is given once per process


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    log.warning(message)


class CodeSandbox(Tool):
  """Runs `code` calls in isolated processes, at most `workers` at a time: by default in a pool
  of persistent workers that fork each program afresh (`persistent=False`: a process started
  for each program). A program's stderr is in its output (`merge_stderr`), or discarded (a
  judge comparing what it printed: the code reward). `preload`: the modules the workers
  import once (default: `PRELOAD`, and numpy where the interpreter has it). `close()` stops
  the workers; so do the sandbox's garbage collection and the interpreter's exit."""

  name = "code"

  def __init__(self, limits: SandboxLimits | None = None, isolation: str = "auto",
               workers: int = 4, python: str = sys.executable, workdir_root: str | None = None,
               persistent: bool = True, preload: Sequence[str] | None = None,
               merge_stderr: bool = True):
    self.limits = limits or SandboxLimits()
    super().__init__(self.limits.max_output_chars)
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    self.python, self.workdir_root, self.workers = python, workdir_root, workers
    self.merge_stderr = merge_stderr
    self._slots = threading.BoundedSemaphore(workers)
    # Programs start with `-S` (skipping site's .pth files, which import the editable install's
    # finder: 10 of a start's 17 ms) and get the interpreter's module path from the boot script.
    prefixes, self.module_path, numpy = interpreter_paths(python)
    self.needed = needed_paths(python, prefixes + self.module_path)
    self.hidden, self.exposed = hidden_and_exposed(self.needed)
    self.self_test = _SELF_TEST + (_SELF_TEST_NUMPY if numpy else "") + "print(6 * 7)\n"
    self._launcher = Launcher(python, tuple(self.module_path), tuple(self.hidden),
                               tuple(self.exposed), self.limits.scratch_bytes)
    self.isolation = self._choose_isolation(isolation)
    self.preload = tuple(PRELOAD + (("numpy",) if numpy else ()) if preload is None else preload)
    self._pool = WorkerPool(functools.partial(Worker, self._launcher, self.isolation,
                                               workdir_root, self.preload, WORKER_START_S))
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
    remade = remade_dirs(mode, self.hidden, self.exposed)
    for path in self.needed:
      blocked = untraversable(path, remade)
      if blocked:
        return (f"as root it runs programs under an unprivileged uid, which cannot enter "
                f"{blocked} (mode {os.stat(blocked).st_mode & 0o777:o}) to reach {path}; "
                f"use a python installed where every user can read it")
    return None

  def _environment(self, workdir: str) -> dict[str, str]:
    return environment(workdir)

  def _command(self, mode: str, workdir: str, uid: int | None) -> list[str]:
    """Returns the argv that runs main.py in `workdir` under `mode`."""
    rlimits = self.limits.rlimits()
    if mode == "rlimit" and os.geteuid() != 0:
      # RLIMIT_NPROC counts every process of this user, the host's included.
      rlimits["RLIMIT_NPROC"] += user_task_count(os.getuid())
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

  def _execute(self, source: str, stdin: str | None, mode: str) -> Run:
    """Runs `source` once under `mode` in a fresh working directory; kills all it started."""
    workdir = tempfile.mkdtemp(prefix="coa_sandbox_", dir=self.workdir_root)
    lease = UIDS.lease() if os.geteuid() == 0 else contextlib.nullcontext()
    try:
      with lease as uid:
        write_program(workdir, source, stdin, uid)
        with open(os.path.join(workdir, "stdin.txt"), "rb") as stdin_file:
          proc = subprocess.Popen(self._command(mode, workdir, uid), stdin=stdin_file,
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT if self.merge_stderr
                                  else subprocess.DEVNULL,
                                  env=self._environment(workdir), cwd=workdir,
                                  start_new_session=True)
        try:
          output, stopped = self._collect(proc, uid)
        finally:
          self._kill(proc, uid)
        code = proc.wait()
        return Run(output, 128 - code if code < 0 else code, stopped)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  def _execute_pooled(self, source: str, stdin: str | None) -> Run:
    """Runs `source` on a pool worker (another one if the worker turns out dead before it
    takes the program)."""
    for attempt in range(2):
      worker, reusable = self._pool.take(), False
      try:
        run, reusable = self._run_on(worker, source, stdin)
        return run
      except WorkerDead:
        if attempt:
          raise ToolFailure(TOOL_ERROR, "the sandbox workers die before taking programs") \
              from None
      finally:
        self._pool.give(worker, reusable)
    raise AssertionError("unreachable")

  def _run_on(self, worker: Worker, source: str, stdin: str | None) -> tuple[Run, bool]:
    """Runs `source` on `worker` in a fresh working directory under a leased uid (as root);
    kills everything the run started. Returns the run and whether the worker is reusable."""
    lease = UIDS.lease() if os.geteuid() == 0 else contextlib.nullcontext()
    reusable = False
    with lease as uid:
      workdir = tempfile.mkdtemp(prefix="run_", dir=worker.root)
      try:
        write_program(workdir, source, stdin, uid)
        rlimits = self.limits.rlimits()
        if self.isolation == "rlimit" and uid is None:
          # RLIMIT_NPROC counts every process of this user, the host's included.
          rlimits["RLIMIT_NPROC"] += user_task_count(os.getuid())
        request = {"workdir": workdir, "rlimits": rlimits, "uid": uid,
                   "env": environment(workdir)}
        run, reusable = worker.run(request, os.path.join(workdir, "stdin.txt"), self.limits,
                                   uid, self.merge_stderr)
        return run, reusable
      finally:
        # A run that ended cleanly left no process: its init's exit took its pid namespace
        # (the rlimit mode swept the uid on the status). Else, the uid is swept here (and in
        # any case when it is next leased).
        if uid is not None and not reusable:
          kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)

  def _kill(self, proc: subprocess.Popen, uid: int | None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, signal.SIGKILL)
    if uid is not None:
      kill_uid(uid)

  def _collect(self, proc: subprocess.Popen, uid: int | None) -> tuple[bytes, str | None]:
    """Reads merged output until the program ends; kills it on timeout or excess output."""
    limits = self.limits
    deadline = time.monotonic() + limits.wall_timeout_s
    output, stopped, drain_until = bytearray(), None, None
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
        read = read_capped(fd, output, limits.max_capture_bytes)
        if read == "eof":
          break
        if read:
          stopped = read
          break
    proc.stdout.close()
    return bytes(output[:limits.max_capture_bytes]), stopped

  def _failure(self, run: Run) -> ToolFailure | None:
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
    for text in (source, stdin or ""):
      try:  # as `write_program` writes it (a lone surrogate cannot be)
        text.encode("utf-8", errors="surrogateescape")
      except UnicodeEncodeError as e:
        raise ToolFailure(BAD_REQUEST, f"the call holds a character UTF-8 cannot write "
                                       f"({e.reason}: {text[e.start:e.end]!a})") from None
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
