"""The code sandbox's pool of persistent workers.

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

import contextlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from tools_env.base import TOOL_ERROR, ToolFailure
from tools_env.sandbox.policy import SandboxLimits, environment
from tools_env.sandbox.runner import Launcher, Run, kill_uid, read_capped

# What bubblewrap makes read-only in the /proc it mounts (so does a program's init in a worker).
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus")
# What pool workers import once, for every program (numpy too where the interpreter has it).
PRELOAD = ("bisect", "collections", "decimal", "fractions", "functools", "heapq", "itertools",
           "json", "math", "random", "re", "statistics", "string", "typing")
WORKER_START_S = 60.0  # a worker that is not ready by then is killed


class WorkerDead(Exception):
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


class Worker:
  """One persistent sandboxed interpreter of the pool (`sandbox_worker.serve`), its control
  socket and its root directory, where each program gets a fresh working directory. Used by
  one thread at a time."""

  def __init__(self, launcher: Launcher, mode: str, workdir_root: str | None,
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
             "preload": list(preload), "fresh": fresh, "scratch_bytes": launcher.scratch_bytes,
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
                                   stderr=self.log, env=environment(self.root), cwd=self.root,
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
          uid: int | None, merge_stderr: bool = True) -> tuple[Run, bool]:
    """Runs one program (its stderr in its output, or with `merge_stderr` False discarded);
    returns its Run and whether this worker may run another. Raises WorkerDead if the worker
    was gone before it took the program."""
    if not self.alive():
      raise WorkerDead()
    read_end, write_end = os.pipe()
    try:
      with open(stdin_path, "rb") as stdin_file, open(os.devnull, "wb") as devnull:
        socket.send_fds(self.control, [json.dumps(request).encode()],
                        [stdin_file.fileno(), write_end] +
                        ([] if merge_stderr else [devnull.fileno()]))
    except OSError:
      os.close(read_end)
      raise WorkerDead() from None
    finally:
      os.close(write_end)
    try:
      return self._collect(read_end, limits, uid)
    finally:
      os.close(read_end)

  def _collect(self, fd: int, limits: SandboxLimits, uid: int | None) -> tuple[Run, bool]:
    """Reads the program's output until the worker reports its end; on timeout, excess
    output or the worker's death, kills the worker."""
    deadline = time.monotonic() + limits.wall_timeout_s
    output, stopped, status, error, drain_until = bytearray(), None, None, None, None
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
            read = read_capped(fd, output, limits.max_capture_bytes)
            if read == "eof":
              selector.unregister(fd)
            elif read:
              stopped = read
              break
            continue
          try:
            message = self.control.recv(1 << 16)
          except OSError:
            message = b""
          if not message and not started:
            self.kill()  # before it took the program: the caller may try another worker
            raise WorkerDead()
          reply = json.loads(message) if message else {"error": "the sandbox worker died"}
          started = started or "pid" in reply
          if "status" in reply or "error" in reply:
            status, error = reply.get("status"), reply.get("error")
            selector.unregister(self.control)
            # The program is over; what it left (as root, every process of its uid; in its
            # own pid namespace nothing is left) is killed now, before the next program.
            if uid is not None and not self.pid_namespace:
              kill_uid(uid)
            drain_until = now + 1.0
    output = bytes(output[:limits.max_capture_bytes])
    if stopped is not None or status is None:
      self.kill()
      if uid is not None:
        kill_uid(uid)
      if stopped is None:
        worker_error = (error or "the sandbox worker died").encode()
        return Run(output + (b"\n" if output else b"") + worker_error,
                    128 + signal.SIGKILL, "worker_died"), False
      return Run(output, 128 + signal.SIGKILL, stopped), False
    return Run(output, status, None), True

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


class WorkerPool:
  """The idle workers of a sandbox and every worker it started; thread-safe. Holds no
  reference to the sandbox, so that the sandbox's finalizer can close it."""

  def __init__(self, start: Callable[[], Worker]):
    self._start, self._lock = start, threading.Lock()
    self._owner = os.getpid()  # a forked copy of this process must not stop its workers
    self._idle: list[Worker] = []
    self._all: set[Worker] = set()

  def take(self) -> Worker:
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

  def give(self, worker: Worker, reusable: bool) -> None:
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
