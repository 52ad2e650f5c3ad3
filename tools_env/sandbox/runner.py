"""What runs one program in a sandboxed process: the command that starts the sandboxed
interpreter (a single run's, or a pool worker's), the program's files, the uid leased for a run
when the host is root, and the killing of every process a run started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import tempfile
import time
from typing import Any, Iterator

from tools_env.base import TOOL_ERROR, ToolFailure
from tools_env.sandbox.policy import BOOT, environment, parents_below

log = logging.getLogger(__name__)

_WORKER = os.path.join(os.path.dirname(BOOT), "sandbox_worker.py")  # a pool's worker


@dataclasses.dataclass(frozen=True)
class Run:
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
      kill_uid(uid)  # leftovers of a process that died holding it
      yield uid
    finally:
      os.close(fd)  # releases the lock


UIDS = _UidPool()


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


def kill_uid(uid: int) -> None:
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


def user_task_count(uid: int) -> int:
  """Returns the number of threads owned by `uid` (RLIMIT_NPROC counts them all)."""
  count = 0
  for pid in _processes_of(uid):
    with contextlib.suppress(FileNotFoundError):
      count += len(os.listdir(f"/proc/{pid}/task"))
  return count


def write_program(workdir: str, source: str, stdin: str | None, uid: int | None) -> None:
  """Writes a run's main.py and stdin.txt into `workdir`; with a leased `uid` (as root), the
  folder and the program become that uid's, the folder closed to others."""
  for name, text in (("main.py", source), ("stdin.txt", stdin or "")):
    with open(os.path.join(workdir, name), "w", encoding="utf-8", errors="surrogateescape") as f:
      f.write(text)
  if uid is not None:
    os.chmod(workdir, 0o700)
    for path in (workdir, os.path.join(workdir, "main.py")):
      os.chown(path, uid, uid)


# Capabilities a pool worker keeps inside bubblewrap as root (as a single run's boot does, it
# drops them for good when it switches to the run's uid): uid/gid switches, namespaces and
# mounts, and the loopback of each program's network namespace.
_WORKER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN", "CAP_NET_ADMIN")


@dataclasses.dataclass(frozen=True)
class Launcher:
  """What starts the sandboxed interpreter, a single run or a pool worker: the interpreter,
  its module path, the home directories hidden and the paths in them exposed."""

  python: str
  module_path: tuple[str, ...]
  hidden: tuple[str, ...]
  exposed: tuple[str, ...]
  scratch_bytes: int  # the size of each scratch tmpfs (`SandboxLimits.scratch_bytes`)

  def command(self, mode: str, workdir: str, spec: dict[str, Any], worker: bool = False
              ) -> list[str]:
    """Returns the argv that runs the boot script with `spec` (plus the mode's keys) in
    `workdir` under `mode`: a single run, or with `worker` a pool worker (`workdir` is then
    its root: the programs' working directories are made in it)."""
    root = os.geteuid() == 0
    spec = {"workdir": workdir, "uid": None, "read_only": False, "init": False,
            "path": list(self.module_path), "scratch_bytes": self.scratch_bytes, **spec}
    sized = ["--size", str(self.scratch_bytes), "--tmpfs"]
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
      prefix += ["--new-session", "--ro-bind", "/", "/", "--dev", "/dev", *sized, "/dev/shm",
                 "--proc", "/proc", *sized, "/tmp"]
      for path in self.hidden:
        prefix += [*sized, path]
      for path in self.exposed:
        # bwrap would create them traversable by root only
        for parent in parents_below(path, (*self.hidden, "/tmp")):
          prefix += ["--perms", "0755", "--dir", parent]
        prefix += ["--ro-bind", path, path]
      prefix += ["--bind", workdir, workdir, "--chdir", workdir, "--clearenv"]
      for key, value in environment(workdir).items():
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
    return prefix + [self.python, "-I", "-S", "-X", "utf8", _WORKER if worker else BOOT,
                     json.dumps(spec)]


def read_capped(fd: int, output: bytearray, limit: int) -> str | None:
  """Appends what the pipe `fd` holds to `output`; returns "eof" at its end, "too_large" once
  `output` holds more than `limit` bytes, else None (read on)."""
  data = os.read(fd, 1 << 16)
  if not data:
    return "eof"
  output += data
  return "too_large" if len(output) > limit else None
