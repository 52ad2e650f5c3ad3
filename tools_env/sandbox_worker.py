"""The code sandbox's persistent worker (the "zygote" of its pool): forks a process for each
program, which runs it as `sandbox_boot` runs a single one.

Invoked by `tools_env.sandbox` as `python -I -S sandbox_worker.py '<json spec>'`, standard
library only: the spec of `sandbox_boot` (with the worker's directory as `workdir`) and a
`serve` mapping (see `serve`). A separate script so that a single run's, compiled at each
start, stays short.

A worker is started once per pool slot, inside the isolation of its mode (the same bwrap or
unshare command line as a single run, or none for "rlimit"), with a working directory root R
of its own. It runs this file's `serve`, which finishes the isolation as `main` would (the
read-only remount of the unshare mode; bwrap as root: every mount but R made read-only),
imports the `preload` modules and then, for each program the host sends (a JSON request and
two descriptors: the program's stdin file and the write end of its output pipe):

1. forks. Without root in a namespace mode (`pid_namespace`: the programs share the worker's
   user, so only a pid namespace can find and kill all a program started), the fork goes
   into a new pid namespace (unshare(CLONE_NEWPID) before it, setns back after it; or, where
   the worker may not setns back, through a runner process that makes the namespace and
   waits): the child is pid 1 there, the program's init;
2. the child takes the program's stdin and output as fds 0-2 (2: the output too, or a third
   descriptor the host sent: /dev/null, for a program whose stderr is discarded), closes every
   other descriptor (the control socket among them) and makes fresh sys.stdin/stdout/stderr.
   An init then
   enters new mount, network, ipc and uts namespaces, replaces the writable scratch
   directories (bwrap's /tmp, /dev/shm, hidden homes; R) with empty tmpfs, binds the
   program's own working directory R/<run> (made by the host) and the exposed interpreter
   paths back in, makes R's tmpfs read-only, mounts a /proc of the new pid namespace,
   remounts every other writable mount read-only and (bwrap) brings up a loopback of its
   own; then forks the program and waits for it. Otherwise (as root: the program gets a uid
   of its own, all of whose processes the host kills when it ends; rlimit) the child starts a
   new session and, in a namespace mode, enters new network (bwrap: with its loopback), ipc
   and uts namespaces: the worker's mounts are read-only but for R, which is root's;
3. the program's process sets the environment the host sent, applies the limits and drops to
   the run's uid as `main` does, chdirs into its working directory, hardens itself
   (`sandbox_boot.apply_hardening`, as a single run does) and runs main.py as a single run
   does, then exits (`exit_program`);
4. the worker waits for its child (watching the control socket: if the host goes away it
   kills the child and exits), kills the program's process group (no pid namespace), reaps
   orphans and reports the exit status. An init's exit has already killed every process of
   the program's pid namespace; as root the host kills every process of the run's uid.

The worker never reads a program's code, input or output, and never runs it: a program
starts from a copy of the worker's memory (the interpreter and the preloaded modules as the
worker imported them) and nothing it does reaches the worker's memory, descriptors or
namespaces; the host kills and replaces a worker whenever a run does not end cleanly.
"""

import ctypes
import importlib.util
import json
import os
import resource
import sys

# sandbox_boot, next to this file, which runs as a script (`-I`: its folder is not on sys.path).
_spec = importlib.util.spec_from_file_location(
    "sandbox_boot", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py"))
boot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(boot)

_MS_PRIVATE = 1 << 18
_READ_ONLY_REMOUNT = (boot._MS_REMOUNT | boot._MS_BIND | boot._MS_RDONLY | boot._MS_NOSUID
                      | boot._MS_NODEV)
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = boot._PR_SET_PDEATHSIG, 4
_libc, _check = boot._libc, boot._check


def exit_program(status):
  """Ends a pooled program as the interpreter's exit would, as far as a program can tell, in
  the same order: waits for its non-daemon threads, runs its atexit functions, collects its
  garbage (its globals among it: so its objects' __del__ run), flushes every file still open
  for writing, stdout and stderr, and exits with `status`. The modules it inherited from its
  worker are not torn down: that would write to every page of them, copying the worker's
  whole memory (25 ms a program, more than the rest of its run)."""
  import gc
  import io
  try:
    threading = sys.modules.get("threading")
    if threading is not None:
      threading._shutdown()  # noqa: SLF001 - what interpreter exit calls
    import atexit
    atexit._run_exitfuncs()  # noqa: SLF001 - likewise
    gc.collect()
    for obj in gc.get_objects():  # the program's own: the worker's objects are frozen
      if isinstance(obj, (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)):
        try:
          if not obj.closed and obj.writable():
            obj.flush()
        except Exception:  # noqa: BLE001 - as at interpreter exit, a failed flush is dropped
          pass
  except BaseException:  # noqa: BLE001 - e.g. a KeyboardInterrupt in a thread's join
    pass
  boot._flush_and_exit(status)


def _make_dirs(path):
  """Creates the missing directories of `path`, each of mode 755 (as bwrap's --dir)."""
  missing = []
  while not os.path.isdir(path):
    missing.insert(0, path)
    path = os.path.dirname(path)
  for directory in missing:
    os.mkdir(directory)
    os.chmod(directory, 0o755)


def isolate_program(libc, workdir, fresh, expose, proc_read_only, root, scratch_bytes):
  """In the program's new mount namespace: replaces the `fresh` directories with empty tmpfs
  (of `scratch_bytes` each),
  binds `workdir` and the `expose` paths found in them back at their places, makes the tmpfs
  on `root` (the worker's, which holds workdir) read-only, mounts a /proc for the new pid
  namespace (with bubblewrap's read-only parts when `proc_read_only`) and remounts every other
  writable mount read-only. Raises OSError on any failure."""
  boot._mount(libc, None, "/", boot._MS_REC | _MS_PRIVATE)  # nothing here reaches the worker
  roots = [os.fsencode(p) for p in fresh]
  kept = [p for p in (*expose, workdir) if boot._under(os.fsencode(p), roots)]
  keep = {path: os.open(path, os.O_PATH) for path in kept}
  for path in fresh:
    boot._mount_tmpfs(libc, path, scratch_bytes)
  for path, fd in keep.items():
    _make_dirs(path)
    boot._mount(libc, f"/proc/self/fd/{fd}".encode(), path, boot._MS_BIND | boot._MS_REC)
    os.close(fd)
  if root in fresh:
    boot._mount(libc, None, root, _READ_ONLY_REMOUNT)
  _check(libc.mount(b"proc", b"/proc", b"proc",
                    boot._MS_NOSUID | boot._MS_NODEV | boot._MS_NOEXEC, None), "mount /proc")
  for name in proc_read_only:
    path = f"/proc/{name}"
    if os.path.exists(path):
      boot._mount(libc, path.encode(), path, boot._MS_BIND | boot._MS_REC)
      boot._mount(libc, None, path, _READ_ONLY_REMOUNT | boot._MS_NOEXEC)
  seal_mounts(libc, {os.fsencode(workdir), *roots}, roots, expose)


def seal_mounts(libc, writable, hidden=(), expose=()):
  """Remounts read-only every writable mount but the `writable` ones (mount points), /proc and
  /dev/pts (pseudo-terminals) and those below, and the mounts under the `hidden` mount points
  (no path reaches them) except the `expose` paths."""
  top = {target: options for _, target, options in boot._mounts()}  # the last mount at a path wins
  exposed = [os.fsencode(p) for p in expose]
  for target, options in top.items():
    if (b"ro" in options or target in writable or boot._under(target, [b"/proc", b"/dev/pts"])
        or (boot._under(target, hidden) and not boot._under(target, exposed))):
      continue
    flags = boot._MS_REMOUNT | boot._MS_BIND | boot._MS_RDONLY
    flags |= sum(bit for name, bit in boot._KEPT_FLAGS.items() if name in options)
    boot._mount(libc, None, target, flags)


def _loopback_up():
  """Brings up `lo` in this (new) network namespace, as bubblewrap does."""
  import fcntl
  import socket
  import struct
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    request = struct.pack("16sH14s", b"lo", 0, b"")
    flags = struct.unpack("16sH14s", fcntl.ioctl(sock, 0x8913, request))[1]  # SIOCGIFFLAGS
    fcntl.ioctl(sock, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # IFF_UP


def _fresh_stdio():
  """Makes new sys.stdin/stdout/stderr on fds 0-2, as the interpreter made the worker's at
  start-up: nothing buffered or set on the worker's streams reaches the program."""
  import io
  made = []
  for fd, old in enumerate((sys.__stdin__, sys.__stdout__, sys.__stderr__)):
    buffer = io.open(fd, "wb" if fd else "rb", closefd=False)
    buffer.raw.name = old.buffer.raw.name
    stream = io.TextIOWrapper(buffer, old.encoding, old.errors, "\n", old.line_buffering,
                              old.write_through)
    stream.mode = old.mode
    made.append(stream)
  sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _tasks_of(uid):
  """Returns the number of threads of `uid` that this process's /proc shows."""
  count = 0
  for entry in os.listdir("/proc"):
    try:
      if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
        count += len(os.listdir(f"/proc/{entry}/task"))
    except OSError:
      continue
  return count


def _start_program(libc, config, request, stdin_fd, out_fd, err_fd, lifeline):
  """Runs in the process the worker forked for a program: sets it up (see the comment above).
  Returns the program's spec for `main`, in the program's process only; pid 1 of a program's
  namespace exits with the program's status."""
  import signal
  namespaces, own_init = config["namespaces"], config["pid_namespace"]
  try:
    libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    import select
    if select.select([lifeline], [], [], 0)[0]:
      os._exit(boot.SETUP_FAILED)  # the worker died before the line above took effect
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    _fresh_stdio()
  except BaseException:  # noqa: BLE001 - nothing may return into the worker's loop
    os._exit(boot.SETUP_FAILED)
  try:
    if own_init:  # pid 1 of the program's pid namespace: sets up the rest, then forks it
      _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS),
             "unshare")
      isolate_program(libc, request["workdir"], config["fresh"], config["expose"],
                      config["proc_read_only"], config["root"], config["scratch_bytes"])
      if config["loopback"]:
        _loopback_up()
      child = os.fork()
      if child:
        _, status = os.waitpid(child, 0)
        boot._flush_and_exit(boot._exit_status(status))
    else:
      os.setsid()  # the program's process group, killed when it ends
      if namespaces:  # as root: the run's uid is killed whole; the worker's mounts read-only
        _check(libc.unshare(_CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS), "unshare")
        if config["loopback"]:
          _loopback_up()
    os.environ.clear()
    os.environ.update(request["env"])
  except Exception as e:  # noqa: BLE001 - reported as the program's output
    print(f"sandbox setup failed: {e}", file=sys.stderr)
    boot._flush_and_exit(boot.SETUP_FAILED)
  return {"workdir": request["workdir"], "rlimits": request["rlimits"], "uid": request["uid"],
          "path": config["path"],
          "orphan_signal": 0 if own_init else int(signal.SIGKILL)}


def _fork_init(libc, pid_namespace, own_pid_ns):
  """Forks the program's init, pid 1 of a new pid namespace (without `pid_namespace`: the
  program); returns 0 in it, and in the worker the pid of that process or of the runner that
  waits for it (with no `own_pid_ns` to return to after unshare(CLONE_NEWPID): the runner
  makes the namespace)."""
  if not pid_namespace:
    return os.fork()
  if own_pid_ns is not None:
    _check(libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    pid = -1
    try:
      pid = os.fork()
    finally:
      if pid != 0:  # the worker, whether the fork worked or not
        _check(libc.setns(own_pid_ns, _CLONE_NEWPID), "setns")
    return pid
  runner = os.fork()
  if runner:
    return runner
  import signal
  try:
    libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    _check(libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    child = os.fork()
  except BaseException:  # noqa: BLE001 - nothing may return into the worker's loop
    os._exit(boot.SETUP_FAILED)
  if child == 0:
    return 0
  try:
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # its init has them
    _, status = os.waitpid(child, 0)
    os._exit(boot._exit_status(status))
  finally:
    os._exit(boot.SETUP_FAILED)


def _reap_children():
  """Reaps this process's exited children without waiting."""
  while True:
    try:
      if os.waitpid(-1, os.WNOHANG)[0] == 0:
        return
    except ChildProcessError:
      return


def _await(pid, control, rlimit_mode):
  """Waits for the worker's child `pid`; returns its exit status. Exits the worker, killing the
  child, if the host closes the control socket meanwhile."""
  import select
  import signal
  try:
    pidfd = os.pidfd_open(pid)
  except (AttributeError, OSError):
    pidfd = None  # a kernel before 5.3: poll
  try:
    while True:
      ready = select.select([control] + ([pidfd] if pidfd is not None else []), [], [],
                            None if pidfd is not None else 0.02)[0]
      if control in ready and not control.recv(1 << 16):
        for kill in (os.kill, os.killpg) if rlimit_mode else (os.kill,):
          try:
            kill(pid, signal.SIGKILL)
          except OSError:
            pass
        os._exit(0)
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        return boot._exit_status(status)
  finally:
    if pidfd is not None:
      os.close(pidfd)


def serve(spec):
  """The worker's loop (see the comment above). Returns only in a program's process, with the
  spec `main` runs it by."""
  import fcntl  # noqa: F401 - every module the loop and its children use is imported here, once
  import importlib
  import io  # noqa: F401
  import select  # noqa: F401
  import signal
  import socket
  import struct  # noqa: F401
  config = spec["serve"]
  control = socket.socket(fileno=config["control_fd"])
  libc = _libc()
  try:
    if spec.get("read_only"):
      boot.make_read_only(spec["workdir"], spec.get("hide", ()), spec.get("expose", ()),
                          spec["scratch_bytes"])
    elif config.get("seal"):
      # bwrap as root: its /dev and scratch tmpfs read-only here once (each program gets
      # fresh ones), so that the check in each program's namespace finds nothing left to do
      # (without root, bwrap's mounts belong to a parent user namespace: only the check then)
      seal_mounts(libc, {os.fsencode(spec["workdir"])})
    os.chdir(spec["workdir"])
  except OSError as e:
    control.send(json.dumps({"error": f"sandbox setup failed: {e}"}).encode())
    os._exit(boot.SETUP_FAILED)
  sys.path[:] = spec["path"]
  for name in config.get("preload", ()):
    try:
      importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a program importing it gets the error itself
      pass
  sys.path[:] = spec["path"]
  config["path"] = spec["path"]
  import gc
  gc.collect()
  gc.freeze()  # the worker's objects: never scanned by a program's collections
  # No program, even one of the worker's user, may trace the worker or read its memory.
  libc.prctl(_PR_SET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0))
  pid_namespace = config["pid_namespace"]
  # Without root, bwrap's pid namespace belongs to a parent user namespace, which the worker
  # cannot setns back into: a runner process then makes each program's pid namespace.
  own_pid_ns = (os.open("/proc/self/ns/pid", os.O_RDONLY)
                if pid_namespace and not config.get("runner") else None)
  lifeline, lifeline_w = os.pipe()  # readable (EOF) in a child once the worker is gone
  control.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
  while True:
    try:
      message, fds, _, _ = socket.recv_fds(control, 1 << 16, 3)
    except OSError:
      os._exit(0)
    if not message:
      os._exit(0)  # the host closed its end: it is done with this worker, or gone
    try:
      request = json.loads(message)
      stdin_fd, out_fd, *err = fds  # stderr: the output, or where the host sends it apart
      err_fd = err[0] if err else out_fd
      rlimits = request["rlimits"]
      if pid_namespace and request["uid"] is None and "RLIMIT_NPROC" in rlimits:
        # The worker's user runs the program: its other processes here (the program's init,
        # its runner) count too.
        rlimits["RLIMIT_NPROC"] += (_tasks_of(os.getuid()) + (2 if own_pid_ns is None else 1)
                                    + config.get("nproc_extra", 0))
      pid = _fork_init(libc, pid_namespace, own_pid_ns)
      if pid == 0:
        os.close(lifeline_w)
        control.close()
        return _start_program(libc, config, request, stdin_fd, out_fd, err_fd, lifeline)
    except Exception as e:  # noqa: BLE001 - reported, and the host replaces this worker
      control.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
      os._exit(boot.SETUP_FAILED)
    for fd in fds:
      os.close(fd)
    control.send(json.dumps({"pid": pid}).encode())
    status = _await(pid, control, not pid_namespace)
    if not pid_namespace:
      try:
        os.killpg(pid, signal.SIGKILL)  # whatever the program left in its process group
      except OSError:
        pass
      _reap_children()  # its orphans, where the worker is its pid namespace's init
    control.send(json.dumps({"status": status}).encode())


def main():
  spec = serve(json.loads(sys.argv[1]))  # returns in a program's process only
  workdir = spec["workdir"]
  try:
    # The worker's rights do not reach the run uid's working directory: chdir after the drop.
    boot.apply_limits(spec["rlimits"], spec["uid"])
    os.chdir(workdir)
    boot.apply_hardening(spec["uid"], spec["orphan_signal"])
  except OSError as e:
    print(f"sandbox setup failed: {e}", file=sys.stderr)
    boot._flush_and_exit(boot.SETUP_FAILED)
  exit_program(boot.run_program(os.path.join(workdir, "main.py"), spec["path"]))


if __name__ == "__main__":
  main()
