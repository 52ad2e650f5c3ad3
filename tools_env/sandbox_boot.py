"""Runs inside the code sandbox: finishes isolation, applies the limits, then runs main.py.

Invoked by `tools_env.sandbox` as `python -I -S sandbox_boot.py '<json spec>'`, standard
library only. Spec keys: `workdir`, `path` (the module path `python -I` would have: site is
skipped for speed, so the program gets it and site's `exit`/`quit` from here), `rlimits`
({name: value}), `uid` (drop to this uid/gid, or null), `read_only` (remount every other
mount read-only, after hiding the `hide` directories under empty tmpfs except for the
`expose` paths in them: the `unshare` mode, which runs this as root in fresh mount and pid
namespaces; a mount that cannot be made read-only fails the setup) and `init` (stay as pid 1
and run the program in a child, so the namespace dies with this process and signals reach the
program normally).

Exit status: the program's, 128 + N when it died of signal N, or one of the codes below.

`sandbox_worker` (the pool's persistent workers) runs programs with these functions too.
"""

import ctypes
import errno
import json
import os
import resource
import site
import sys
import traceback

SETUP_FAILED, SYNTAX_ERROR, MEMORY_ERROR, PROCESS_LIMIT = 250, 251, 252, 253

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
# What a read-only remount keeps of a mount's flags (a user namespace may not clear them).
_KEPT_FLAGS = {b"nosuid": _MS_NOSUID, b"nodev": _MS_NODEV, b"noexec": _MS_NOEXEC,
               b"noatime": _MS_NOATIME, b"nodiratime": _MS_NODIRATIME}


_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LIBC = []


def _libc():
  if not _LIBC:
    _LIBC.append(ctypes.CDLL(None, use_errno=True))
  return _LIBC[0]


def _check(result, what):
  if result != 0:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount_tmpfs(libc, target, size):
  options = b"mode=755,size=%d" % size
  if libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
    code = ctypes.get_errno()
    raise OSError(code, f"mount tmpfs on {target}: {os.strerror(code)}")


def _mount(libc, source, target, flags):
  if libc.mount(source, os.fsencode(target), None, flags, None) != 0:
    code = ctypes.get_errno()
    raise OSError(code, f"mount {os.fsdecode(target)}: {os.strerror(code)}")


def _unescape(field):
  """Returns a mountinfo path with its octal escapes (of space, tab, newline, backslash) decoded."""
  head, *rest = field.split(b"\\")
  return head + b"".join(bytes([int(part[:3], 8)]) + part[3:] for part in rest)


def _mounts():
  """Returns (mount id, mount point, per-mount options) of each mount this process sees."""
  with open("/proc/self/mountinfo", "rb") as f:
    return [(fields[0], _unescape(fields[4]), fields[5].split(b","))
            for fields in (line.split() for line in f)]


def _under(path, roots):
  return any(path == root or path.startswith(root.rstrip(b"/") + b"/") for root in roots)


def make_read_only(workdir, hide=(), expose=(), scratch_bytes=256 << 20):
  """Hides the `hide` directories under empty tmpfs (of `scratch_bytes`), re-exposes the
  `expose` paths within them, bind-mounts workdir onto itself, then remounts every other mount
  read-only; raises OSError if one cannot be (a mount left writable would be a way out)."""
  libc = _libc()
  keep = {path: os.open(path, os.O_PATH) for path in (*expose, workdir)}
  before = {mount_id for mount_id, _, _ in _mounts()}
  for path in hide:
    _mount_tmpfs(libc, path, scratch_bytes)
  for path, fd in keep.items():
    os.makedirs(path, exist_ok=True)
    _mount(libc, f"/proc/self/fd/{fd}".encode(), path, _MS_BIND | _MS_REC)
    os.close(fd)
  hidden, exposed = [os.fsencode(p) for p in hide], [os.fsencode(p) for p in expose]
  for mount_id, target, options in _mounts():
    if target == os.fsencode(workdir) or _under(target, [b"/proc"]):
      continue
    if mount_id in before and _under(target, hidden) and not _under(target, exposed):
      continue  # under an empty tmpfs now: no path reaches it
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    flags |= sum(bit for name, bit in _KEPT_FLAGS.items() if name in options)
    _mount(libc, None, target, flags)


def apply_limits(rlimits, uid):
  """Sets the resource limits, then drops to `uid` (with no supplementary groups)."""
  for name, value in rlimits.items():
    kind = getattr(resource, name)
    resource.setrlimit(kind, (value, value + 1 if name == "RLIMIT_CPU" else value))
  if uid is not None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def apply_hardening(uid, orphan_signal):
  """Steps a program takes after `apply_limits` (a single run, or one of the pool's): no
  privilege gained by exec (setuid binaries, file capabilities), no capability left (those of
  the unshare mode's namespace root or the pool's worker; as root, `setuid` already cleared
  them), a dumpable process when it kept its user as a fresh one would be, and, with
  `orphan_signal`, death with the worker that forked it."""
  libc = _libc()
  _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
                    ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl(PR_SET_NO_NEW_PRIVS)")
  libc.prctl(_PR_CAP_AMBIENT, ctypes.c_ulong(_PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0),
             ctypes.c_ulong(0), ctypes.c_ulong(0))  # EINVAL on kernels without ambient sets
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
  if uid is None:
    libc.prctl(_PR_SET_DUMPABLE, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
               ctypes.c_ulong(0))
  if orphan_signal:
    libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(orphan_signal), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))


def run_program(program, path):
  """Runs the program as __main__ with `path` as sys.path; returns its exit status
  (tracebacks go to stderr)."""
  with open(program, "rb") as f:
    source = f.read()
  try:
    code = compile(source, "main.py", "exec")
  except (SyntaxError, ValueError) as e:
    traceback.print_exception(type(e), e, None)
    return SYNTAX_ERROR
  sys.argv = ["main.py"]
  sys.path[:] = path
  site.setquit()  # exit() and quit(), which `-S` leaves undefined
  try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
  except BaseException as e:  # noqa: BLE001 - report everything the program raised
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    if isinstance(e, MemoryError):
      return MEMORY_ERROR
    if isinstance(e, OSError) and e.errno == errno.EAGAIN:
      return PROCESS_LIMIT  # fork() or thread creation refused by RLIMIT_NPROC
    return 1
  return 0


def _exit_status(status):
  if os.WIFSIGNALED(status):
    return 128 + os.WTERMSIG(status)
  return os.WEXITSTATUS(status)


def _flush_and_exit(code):
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001 - a closed or broken stream must not change the status
      pass
  os._exit(code)


def main():
  spec = json.loads(sys.argv[1])
  workdir = spec["workdir"]
  try:
    if spec.get("read_only"):
      make_read_only(workdir, spec.get("hide", ()), spec.get("expose", ()),
                     spec["scratch_bytes"])
    if spec.get("init"):
      child = os.fork()
      if child:
        _, status = os.waitpid(child, 0)
        _flush_and_exit(_exit_status(status))
    os.chdir(workdir)
    apply_limits(spec.get("rlimits", {}), spec.get("uid"))
    # The unshare mode runs this as root of its user namespace, with every capability: kept,
    # they would let the program remount the read-only mounts writable.
    apply_hardening(spec.get("uid"), 0)
  except OSError as e:
    print(f"sandbox setup failed: {e}", file=sys.stderr)
    _flush_and_exit(SETUP_FAILED)
  sys.exit(run_program(os.path.join(workdir, "main.py"), spec["path"]))


if __name__ == "__main__":
  main()
