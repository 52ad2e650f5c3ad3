"""The code sandbox contains hostile programs and reports each with a clear error kind."""

import contextlib
import dataclasses
import errno
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid

import numpy
import pytest

from tools_env import base, sandbox_boot
from tools_env import sandbox as sandbox_module
from tools_env.sandbox import pool as pool_module
from tools_env.sandbox import policy, runner, tool
from tools_env.registry import ToolRegistry
from tools_env.sandbox import CodeSandbox, IsolationUnavailable, SandboxLimits, extract_program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = SandboxLimits(wall_timeout_s=4, cpu_time_s=2, max_processes=32, max_capture_bytes=2**16,
                       max_output_chars=2000)


def unavailable(reason):
  """Skips a test of an isolation mode this machine lacks; fails it under CI (CI=true), which
  must never pass with an isolation mode untested."""
  if os.environ.get("CI") == "true":
    pytest.fail(f"CI=true, and {reason}")
  pytest.skip(reason)


def pooled(mode, limits=LIMITS, **options):
  """A sandbox in `mode` that runs programs on its persistent workers (the default)."""
  try:
    made = CodeSandbox(limits, isolation=mode, **options)
  except IsolationUnavailable as e:
    unavailable(str(e))
  if not made.persistent:
    unavailable(f"the persistent workers cannot run in mode {mode!r} here")
  return made


@pytest.fixture(scope="module", params=[("bwrap", True), ("unshare", True), ("bwrap", False)],
                ids=["bwrap", "unshare", "bwrap-per-run"])
def sandbox(request):
  """The sandbox in each namespace mode this machine permits with its persistent workers (the
  default), and in the bwrap mode with a process started per program (`persistent=False`;
  test_the_unshare_mode_contains_programs_without_persistent_workers for the other)."""
  mode, persistent = request.param
  if persistent:
    return pooled(mode, workers=8)
  try:
    return CodeSandbox(LIMITS, isolation=mode, workers=8, persistent=False)
  except IsolationUnavailable as e:
    unavailable(str(e))


def program(source, stdin=None):
  body = f"```python\n{source}\n```"
  return body + (f"\n```sh\n{stdin}\n```" if stdin is not None else "")


def processes_with(token):
  """Returns the pids whose command line contains `token`."""
  found = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        if token.encode() in f.read():
          found.append(int(entry))
    except (FileNotFoundError, NotADirectoryError, PermissionError, ProcessLookupError):
      pass
  return found


def test_extract_program_takes_the_last_python_block_and_the_sh_block_as_stdin():
  body = "plan\n```python\nprint(1)\n```\nfixed:\n```python\nprint(2)\n```\n```sh\n5 6\n```"
  assert extract_program(body) == ("print(2)\n", "5 6\n")
  assert extract_program("```py\nx = 1\n```") == ("x = 1\n", None)


def test_program_reads_stdin_and_prints(sandbox):
  result = sandbox(program("a, b = map(int, input().split())\nprint(a * b)", stdin="6 7"))
  assert result.ok and result.observation == "42\n"
  assert result.metadata["isolation"] == sandbox.isolation


def test_programs_import_installed_packages_and_exit_but_not_this_project(sandbox):
  source = ("import numpy, sys\nprint(numpy.arange(3).sum())\n"
            "try:\n  import coa_jax\nexcept ImportError:\n  print('isolated')\nexit(3)")
  result = sandbox(program(source))
  assert result.observation.endswith("3\nisolated\n") and result.metadata["returncode"] == 3


def test_infinite_loop_hits_the_cpu_limit(sandbox):
  # A wall clock far beyond the CPU limit: on a loaded machine the loop gets a fraction of a
  # core, and the 4 s wall clock would stop it before it has used 2 s of CPU.
  patient = CodeSandbox(dataclasses.replace(LIMITS, wall_timeout_s=300),
                        isolation=sandbox.isolation, workers=1, persistent=sandbox.persistent)
  result = patient(program("while True:\n  pass"))
  assert result.error_kind == base.TIMEOUT and "CPU time limit of 2 s" in result.observation


def test_sleeping_program_hits_the_wall_clock_limit(sandbox):
  result = sandbox(program("import time\ntime.sleep(600)"))
  assert result.error_kind == base.TIMEOUT and "after 4 s (wall clock)" in result.observation
  assert result.elapsed_s < 300  # stopped, not slept out


def test_fork_bomb_is_contained_and_the_host_stays_responsive(sandbox):
  token = uuid.uuid4().hex
  result = sandbox(program(f"import os\n# {token}\nwhile True:\n  os.fork()"))
  assert result.error_kind in (base.PROCESS_LIMIT, base.TIMEOUT)
  assert not processes_with(token)
  assert sandbox(program("print('still here')")).observation == "still here\n"


def limited(sandbox, **limits):
  """A one-worker sandbox in `sandbox`'s mode with some limits changed."""
  return CodeSandbox(dataclasses.replace(LIMITS, **limits), isolation=sandbox.isolation,
                     workers=1, persistent=sandbox.persistent)


def test_forking_past_max_processes_is_a_process_limit(sandbox):
  # The children sleep: only RLIMIT_NPROC, never a time limit, can stop the loop.
  source = ("import os, time\nfor _ in range(8):\n  if os.fork() == 0:\n    time.sleep(60)\n"
            "    os._exit(0)\nprint('all forked')")
  result = limited(sandbox, max_processes=4)(program(source))
  assert result.error_kind == base.PROCESS_LIMIT and result.metadata["returncode"] == 253
  assert result.observation.startswith("Error: process limit of 4 reached\n")
  assert "BlockingIOError" in result.observation and "all forked" not in result.observation


def test_writing_past_max_file_bytes_fails_the_write(sandbox):
  source = ("import errno\nwith open('out.bin', 'wb', buffering=0) as f:\n"
            "  f.write(b'x' * 1000)\n  try:\n    f.write(b'x')\n"
            "  except OSError as e:\n    print(errno.errorcode[e.errno])")
  assert limited(sandbox, max_file_bytes=1000)(program(source)).observation == "EFBIG\n"


def test_opening_past_max_open_files_fails_the_open(sandbox):
  # stdin, stdout and stderr hold 3 of the 16 descriptors.
  source = ("import errno\nfiles = []\ntry:\n  while True:\n    files.append(open('f', 'w'))\n"
            "except OSError as e:\n  print(errno.errorcode[e.errno], len(files))")
  assert limited(sandbox, max_open_files=16)(program(source)).observation == "EMFILE 13\n"


def test_an_uncaught_file_limit_error_is_a_runtime_error(sandbox):
  source = "with open('out.bin', 'wb') as f:\n  f.write(b'x' * 1001)"
  result = limited(sandbox, max_file_bytes=1000)(program(source))
  assert result.error_kind == base.RUNTIME_ERROR
  assert result.observation.startswith("Error: the program exited with status 1\n")
  assert "OSError: [Errno 27] File too large" in result.observation


@pytest.mark.parametrize("persistent", [True, False], ids=["pooled", "per-run"])
def test_a_sandbox_may_discard_stderr(persistent):
  source = program("import sys\nprint(1)\nprint('debug', file=sys.stderr)\nprint(2)")
  for merge_stderr, expected in ((False, "1\n2\n"), (True, "debug\n1\n2\n")):
    with CodeSandbox(LIMITS, isolation="bwrap", workers=1, persistent=persistent,
                     merge_stderr=merge_stderr) as sandbox:
      assert sandbox(source).observation == expected  # stdout flushed at exit: printed last


def test_a_program_holding_a_lone_surrogate_is_a_bad_request(sandbox):
  result = sandbox(program("print('\ud800')"))
  assert result.error_kind == base.BAD_REQUEST
  assert result.observation == ("Error: the call holds a character UTF-8 cannot write "
                                "(surrogates not allowed: '\\ud800')")
  assert sandbox(program("print(1)")).observation == "1\n"


def test_a_program_longer_than_max_code_chars_is_refused_unrun(sandbox):
  result = sandbox(program("print('ran')\n" + "#" * 199_987))
  assert result.error_kind == base.BAD_REQUEST
  assert result.observation == "Error: program of 200001 characters; at most 200000"


def test_allocating_50_gb_hits_the_memory_limit(sandbox):
  result = sandbox(program("block = bytearray(50 * 2**30)"))
  assert result.error_kind == base.MEMORY_LIMIT and "MemoryError" in result.observation


_FILL_SCRATCH = ("for scratch in ['/tmp', '/dev/shm']:\n  written = 0\n  try:\n"
                 "    for i in range(16):\n      with open(f'{scratch}/f{i}', 'wb') as f:\n"
                 "        f.write(b'x' * (4 << 20))\n      written += 4\n"
                 "  except OSError:\n    pass\n  print(written)")
_SCRATCH_PROBE = f"""
import json
from tools_env.sandbox import CodeSandbox, SandboxLimits
limits = SandboxLimits(wall_timeout_s=20, cpu_time_s=10, scratch_bytes=8 << 20)
for persistent in (True, False):
  with CodeSandbox(limits, isolation="bwrap", workers=1, persistent=persistent) as sandbox:
    print(json.dumps(sandbox({program(_FILL_SCRATCH)!r}).observation.split()))
"""


def test_scratch_tmpfs_hold_at_most_scratch_bytes_without_root():
  # Without root, bwrap's /tmp and /dev/shm are a program's own tmpfs: memory RLIMIT_AS does
  # not count, half the machine's RAM each before they were sized. As root they are not the
  # program's to write: as root, the probe runs as nobody.
  if shutil.which("bwrap") is None:
    unavailable("no bwrap")
  as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
  argv = [*(as_nobody if os.geteuid() == 0 else []), rlimit_python(), "-c", _SCRATCH_PROBE]
  env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "PYTHONPATH": ROOT}
  done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/", env=env)
  assert done.returncode == 0, done.stderr[-2000:]
  assert [json.loads(line) for line in done.stdout.split("\n") if line] == [["8", "8"]] * 2


def test_printing_1_gb_is_stopped_and_truncated(sandbox):
  result = sandbox(program("import sys\nfor _ in range(1024):\n  sys.stdout.write('x' * 2**20)"))
  assert result.error_kind == base.TOO_LARGE and result.truncated
  assert len(result.observation) < LIMITS.max_output_chars + 100
  assert "characters omitted" in result.observation


def test_network_is_unreachable(sandbox):
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    source = (f"import socket\n"
              f"for host, port in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:\n"
              f"  try:\n"
              f"    socket.create_connection((host, port), timeout=2)\n"
              f"    print(host, 'connected')\n"
              f"  except OSError as e:\n"
              f"    print(host, 'blocked')")
    result = sandbox(program(source))
    with pytest.raises(socket.timeout):
      server.accept()
  assert result.observation == "127.0.0.1 blocked\n8.8.8.8 blocked\n"


def test_writes_outside_the_working_directory_fail(sandbox, tmp_path):
  os.chmod(tmp_path, 0o777)
  outside = tmp_path / "escaped.txt"
  source = (f"open('inside.txt', 'w').write('ok')\n"
            f"for path in ['{outside}', '../escaped.txt', '/etc/escaped.txt']:\n"
            f"  try:\n"
            f"    open(path, 'w').write('x')\n"
            f"    print(path, 'written')\n"
            f"  except OSError:\n"
            f"    print(path, 'refused')")
  result = sandbox(program(source))
  assert result.ok and "written" not in result.observation
  assert not outside.exists() and not os.path.exists("/etc/escaped.txt")


def test_environment_is_scrubbed(sandbox, monkeypatch):
  monkeypatch.setenv("COA_TEST_SECRET", "hunter2")
  result = sandbox(program("import os\nprint(sorted(os.environ.items()))"))
  assert result.ok and "hunter2" not in result.observation and "COA_TEST" not in result.observation


def test_home_directories_are_hidden(sandbox):
  source = "import os\nprint(sorted(os.listdir('/root')) if os.path.isdir('/root') else [])"
  listing = eval(sandbox(program(source)).observation)  # noqa: S307 - a printed list
  assert set(listing) <= {os.path.relpath(p, "/root").split("/")[0] for p in sandbox.exposed}


def test_a_child_that_outlives_the_program_is_killed(sandbox):
  token = uuid.uuid4().hex
  source = (f"import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {token}'],"
            f" start_new_session=True)\nprint('parent done')")
  result = sandbox(program(source))
  assert result.observation == "parent done\n"
  assert not processes_with(token)


def test_working_directory_is_fresh_and_deleted(sandbox):
  first = sandbox(program("import os\nopen('state', 'w').write('1')\nprint(os.getcwd())"))
  second = sandbox(program("import os\nprint(os.path.exists('state'))"))
  assert second.observation == "False\n"
  assert not os.path.exists(first.observation.strip())


def test_non_utf8_output_is_replaced_not_fatal(sandbox):
  result = sandbox(program("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')"))
  assert result.ok and result.observation == "ok \ufffd\ufffd end"


def test_syntax_error_and_missing_fence_are_reported(sandbox):
  result = sandbox(program("def f(:"))
  assert result.error_kind == base.SYNTAX_ERROR and "SyntaxError" in result.observation
  assert "main.py" in result.observation
  missing = sandbox("print('no fence')")
  assert missing.error_kind == base.BAD_REQUEST and "```python" in missing.observation


def test_runtime_error_shows_the_traceback(sandbox):
  result = sandbox(program("x = 1\nraise ValueError('bad value')"))
  assert result.error_kind == base.RUNTIME_ERROR
  assert 'File "main.py", line 2' in result.observation and "ValueError: bad value" in result.observation
  assert "sandbox_boot" not in result.observation


def test_64_snippets_through_8_workers_keep_their_outputs_apart(sandbox):
  source = ("import time\nstart = time.monotonic()\n"
            "for line in range(50):\n  print({i}, line, flush=True)\n  time.sleep(0.001)\n"
            "print('span', start, time.monotonic())")
  results = sandbox.map([program(source.format(i=i)) for i in range(64)])
  spans = []
  for i, result in enumerate(results):
    *lines, span = result.observation.splitlines()
    assert lines == [f"{i} {line}" for line in range(50)]
    spans.append(tuple(map(float, span.split()[1:])))
  # At no moment were more than 8 programs running.
  assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 8


def test_exit_waits_for_threads_and_runs_atexit_and_finalizers(sandbox):
  # What a fresh interpreter's exit does, a pooled program's does too.
  source = ("import atexit, sys, threading, time\n"
            "class Noisy:\n  def __del__(self):\n    print('finalizer')\n"
            "noisy = Noisy()\natexit.register(print, 'atexit')\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
            "sys.stdout.write('main\\n')\nsys.exit(3)")
  result = sandbox(program(source))
  assert result.metadata["returncode"] == 3
  assert sorted(result.observation.split("Error: the program exited with status 3\n")[1]
                .splitlines()) == ["atexit", "finalizer", "main", "thread"]


# --- the persistent workers ------------------------------------------------------------------

@pytest.fixture(params=["bwrap", "unshare"])
def one_worker(request):
  """A pooled sandbox with one worker, so that consecutive programs run on the same one."""
  made = pooled(request.param, workers=1)
  yield made
  made.close()


def worker_processes(pool):
  """Returns the pids of the pool's workers and of every process in them."""
  return {pid for root in pool._pool.pids() for pid in [root, *pool_module._descendants(root)]}


def signal_all(pids, sig):
  """Sends `sig` to each of `pids` that still exists (killing a worker may end its children)."""
  for pid in pids:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, sig)


def alive(pids):
  return [pid for pid in pids if os.path.exists(f"/proc/{pid}")
          and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]


def test_a_program_finds_nothing_the_previous_one_left(one_worker):
  token = uuid.uuid4().hex
  first = one_worker(program(
      f"import builtins, json, os, random, subprocess, sys, xml.dom.minidom\n"
      f"open('state', 'w').write('1')\n"
      f"for path in ['/tmp/state', '/dev/shm/state', '../state', '/home/state']:\n"
      f"  try:\n    open(path, 'w').write('1')\n  except OSError:\n    pass\n"
      f"os.environ['COA_LEFT'] = '1'\nos.putenv('COA_PUT', '1')\nos.umask(0)\n"
      f"json.left = builtins.left = sys.left = 1\nsys.path += ['/left']\n"
      f"sys.setrecursionlimit(123)\nsys.stdout.reconfigure(errors='strict')\n"
      f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {token}'],"
      f" start_new_session=True)\n"
      f"print(random.random(), os.getcwd())"))
  workers = worker_processes(one_worker)
  second = one_worker(program(
      f"import builtins, json, os, random, sys\n"
      f"print(random.random())\n"
      f"print([p for p in ['state', '/tmp/state', '/dev/shm/state', '../state', '/home/state']"
      f" if os.path.exists(p)], os.listdir('..') == [os.path.basename(os.getcwd())])\n"
      f"print(sorted(k for k in os.environ if k.startswith('COA')), os.umask(0o22))\n"
      f"print(hasattr(json, 'left'), hasattr(builtins, 'left'), hasattr(sys, 'left'),"
      f" '/left' in sys.path, sys.getrecursionlimit(), sys.stdout.errors)\n"
      f"print('xml.dom.minidom' in sys.modules)\n"
      f"print([p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())"
      f" and os.stat(f'/proc/{{p}}').st_uid == os.getuid()])\n"
      f"print([p for p in os.listdir('/proc') if p.isdigit() and "
      f"b'{token}' in open(f'/proc/{{p}}/cmdline', 'rb').read()])"))
  assert len(one_worker._pool.pids()) == 1 and worker_processes(one_worker) & workers
  host_umask = os.umask(0)
  os.umask(host_umask)
  random_first, workdir = first.observation.split()
  random_second, *lines = second.observation.splitlines()
  assert random_second != random_first  # the random module is seeded afresh
  assert lines == ["[] True", f"[] {host_umask}",
                   "False False False False 1000 surrogateescape", "False", "[]", "[]"]
  assert not processes_with(token) and not os.path.exists(workdir)


@pytest.mark.parametrize("mode", ["bwrap", "unshare"])
def test_programs_run_on_the_workers_from_many_threads(mode):
  small = pooled(mode, workers=3)
  outputs = {}

  def call(i):
    outputs[i] = [small(program(f"print({i}, {j})")).observation for j in range(3)]

  threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert outputs == {i: [f"{i} {j}\n" for j in range(3)] for i in range(6)}
  assert 1 <= len(small._pool.pids()) <= 3
  small.close()


def test_a_worker_that_dies_or_hangs_is_replaced(one_worker):
  ok = program("print('ok')")
  assert one_worker(ok).ok
  # Killed while idle: the next program gets a new worker.
  first = worker_processes(one_worker)
  signal_all(first, signal.SIGKILL)
  assert one_worker(ok).observation == "ok\n"
  # Killed while it runs a program: that program's result is an error, not an exception.
  second = worker_processes(one_worker)
  assert not second & first
  killer = threading.Timer(1.0, lambda: signal_all(second, signal.SIGKILL))
  killer.start()
  result = one_worker(program("import time\ntime.sleep(3)"))
  killer.join()
  assert result.error_kind == base.TOOL_ERROR and result.elapsed_s < 3
  assert "the sandbox worker failed while running the program" in result.observation
  assert one_worker(ok).observation == "ok\n"
  # Stopped (it hangs): the run times out at the wall clock and the worker is replaced.
  impatient = pooled(one_worker.isolation, dataclasses.replace(LIMITS, wall_timeout_s=3),
                     workers=1)  # time enough for a run that answers on a loaded machine
  assert impatient(ok).ok
  hanging = worker_processes(impatient)
  signal_all(hanging, signal.SIGSTOP)
  result = impatient(ok)
  assert result.error_kind == base.TIMEOUT and not alive(hanging)
  assert impatient(ok).observation == "ok\n"
  impatient.close()


def test_close_collection_and_exit_leave_no_process(one_worker):
  assert one_worker(program("print(1)")).ok
  pids, roots = worker_processes(one_worker), [w.root for w in one_worker._pool._all]
  one_worker.close()
  assert pids and not alive(pids) and not any(os.path.exists(root) for root in roots)
  assert one_worker(program("print(2)")).observation == "2\n"  # new workers after close
  pids = worker_processes(one_worker)
  registry = ToolRegistry({"code": base.Delayed(one_worker, 0.0, 0.0)})
  registry.close()  # closes the tools that keep processes, inside a Delayed too
  assert pids and not alive(pids)
  assert registry.call("code", program("print(2)")).observation == "2\n"
  pids = worker_processes(one_worker)
  collected = pooled(one_worker.isolation, workers=1)
  collected(program("print(3)"))
  more = worker_processes(collected)
  del collected
  gc.collect()
  assert more and not alive(more) and alive(pids)
  # At interpreter exit, without close().
  script = ("import sys\nfrom tools_env.sandbox import CodeSandbox\n"
            f"sandbox = CodeSandbox(isolation={one_worker.isolation!r}, workers=2)\n"
            # two programs at once (each a while), so that both workers start
            "sandbox.map(['```python\\nimport time\\ntime.sleep(0.5)\\n```'] * 2)\n"
            "print(sorted(w.root for w in sandbox._pool._all))")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
  roots = eval(done.stdout)  # noqa: S307 - a printed list
  assert len(roots) == 2 and not any(processes_with(root) or os.path.exists(root)
                                      for root in roots)


def test_without_persistent_workers_each_program_starts_a_process(caplog, monkeypatch):
  assert not CodeSandbox(LIMITS, persistent=False).persistent
  monkeypatch.setattr(tool, "_WARNED", set())
  monkeypatch.setitem(tool._POOL_PROBED, ("bwrap", sys.executable), "no mounts")
  try:
    with caplog.at_level(logging.WARNING, logger="tools_env.sandbox"):
      fallback = CodeSandbox(LIMITS, isolation="bwrap")
  except IsolationUnavailable as e:
    unavailable(str(e))
  assert not fallback.persistent and fallback(program("print(4)")).observation == "4\n"
  assert warnings_in(caplog) == ["code sandbox: no persistent workers in isolation 'bwrap' (no "
                                 "mounts); each program starts a process of its own"]


def test_the_unshare_mode_contains_programs_without_persistent_workers(tmp_path):
  try:
    single = CodeSandbox(dataclasses.replace(LIMITS, max_processes=4), isolation="unshare",
                         workers=2, persistent=False)
  except IsolationUnavailable as e:
    unavailable(str(e))
  os.chmod(tmp_path, 0o777)
  token = uuid.uuid4().hex
  contained, forks, outlives, hardened = single.map([
      program(f"import os, socket\nprint(sorted(k for k in os.environ if 'SECRET' in k))\n"
              f"for path in ['{tmp_path}/out', '/etc/out']:\n  try:\n"
              f"    open(path, 'w')\n    print('written')\n  except OSError:\n    pass\n"
              f"try:\n  socket.create_connection(('8.8.8.8', 53), timeout=2)\n"
              f"except OSError:\n  print('offline')"),
      program("import os, time\nfor _ in range(8):\n  if os.fork() == 0:\n    time.sleep(60)\n"
              "    os._exit(0)"),
      program(f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)  # {token}'], start_new_session=True)\nprint('parent done')"),
      # No capability left (without root, the namespace's root had every one: enough to
      # remount the read-only mounts writable), and none to gain by exec.
      program("print(*(line for line in open('/proc/self/status') if line.startswith(("
              "'CapEff', 'NoNewPrivs'))), sep='', end='')")])
  assert hardened.observation == "CapEff:\t0000000000000000\nNoNewPrivs:\t1\n"
  assert not single.persistent and contained.observation == "[]\noffline\n"
  assert forks.error_kind == base.PROCESS_LIMIT
  assert outlives.observation == "parent done\n" and not processes_with(token)


def rlimit_python():
  """Returns a python every uid can run (the rlimit mode drops privileges when root; a probe
  runs as nobody)."""
  if os.geteuid() != 0:
    return sys.executable
  system = shutil.which("python3", path="/usr/bin:/bin")
  if system is None or subprocess.run([system, "-c", "pass"]).returncode:
    unavailable("no world-readable python for the rlimit mode")
  return system


def test_rlimit_mode_warns_and_still_limits(caplog, monkeypatch):
  monkeypatch.setattr(tool, "_WARNED", set())
  with caplog.at_level(logging.WARNING, logger="tools_env.sandbox"):
    weak = CodeSandbox(LIMITS, isolation="rlimit", python=rlimit_python())
  assert "resource limits only" in caplog.text
  assert weak(program("while True:\n  pass")).error_kind == base.TIMEOUT
  assert weak(program("print(2 + 2)")).observation == "4\n"


def test_bad_settings_are_rejected():
  with pytest.raises(ValueError, match="cpu_time_s must be > 0"):
    SandboxLimits(cpu_time_s=0)
  with pytest.raises(ValueError, match="isolation must be one of"):
    CodeSandbox(isolation="docker")
  with pytest.raises(ValueError, match="workers must be >= 1"):
    CodeSandbox(workers=0)


def test_processes_on_one_host_lease_different_uids(tmp_path):
  # flock locks belong to an open file, so two pools in one process stand for two processes.
  first, second = (runner._UidPool(base=2_000_000_000, size=2, lock_dir=str(tmp_path))
                   for _ in range(2))
  with first.lease() as a:
    with second.lease() as b:
      assert a != b
      with pytest.raises(base.ToolFailure, match="all 2 sandbox uids are in use"):
        with first.lease():
          pass
  with second.lease() as again:
    assert again in (a, b)  # released uids are free again


def warnings_in(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_auto_falls_back_with_a_warning_that_gives_the_reason(caplog, monkeypatch):
  monkeypatch.setattr(tool, "_WARNED", set())
  monkeypatch.setattr(tool, "_PROBED", {("bwrap", sys.executable): "no user namespaces",
                                        ("unshare", sys.executable): None})
  with caplog.at_level(logging.WARNING, logger="tools_env.sandbox"):
    assert CodeSandbox(LIMITS, isolation="auto").isolation == "unshare"
  assert warnings_in(caplog) == ["code sandbox: falling back to isolation 'unshare': 'bwrap' is "
                                 "unusable: no user namespaces"]


@pytest.mark.parametrize("mode", ["bwrap", "unshare"])
def test_a_named_mode_that_cannot_work_fails_closed(mode, monkeypatch, tmp_path):
  monkeypatch.setattr(tool, "_PROBED", {})
  monkeypatch.setenv("PATH", str(tmp_path))  # neither bwrap nor unshare is found
  with pytest.raises(IsolationUnavailable) as raised:
    CodeSandbox(LIMITS, isolation=mode)
  assert str(raised.value) == (f"code sandbox isolation '{mode}' cannot work on this machine: "
                               f"'{mode}' is unusable: {mode} is not installed; "
                               f"isolation='auto' would accept a weaker mode")


@pytest.mark.parametrize("keep, missing", [("nothing", "decimal"), ("stdlib", "numpy")])
def test_self_test_rejects_a_mode_whose_programs_cannot_import(sandbox, keep, missing,
                                                               monkeypatch):
  prefixes, path, _ = policy.interpreter_paths(sys.executable)
  kept = [] if keep == "nothing" else [p for p in path if "-packages" not in p]
  monkeypatch.setattr(tool, "interpreter_paths",
                      lambda python: (prefixes, kept, True))  # numpy is expected
  monkeypatch.setattr(tool, "_PROBED", {})
  mode = sandbox.isolation
  with pytest.raises(IsolationUnavailable) as raised:
    CodeSandbox(LIMITS, isolation=mode)
  assert str(raised.value) == (
      f"code sandbox isolation '{mode}' cannot work on this machine: '{mode}' is unusable: its "
      f"self-test (imports as the sandboxed user) failed with status 1: ModuleNotFoundError: No "
      f"module named '{missing}'; isolation='auto' would accept a weaker mode")


def test_as_root_the_rlimit_mode_refuses_an_interpreter_its_uid_cannot_reach(monkeypatch):
  if os.geteuid() != 0:
    pytest.skip("the rlimit mode runs programs under another uid only as root")
  python = rlimit_python()
  prefixes, path, numpy = policy.interpreter_paths(python)
  private = os.path.realpath(tempfile.mkdtemp())  # mode 700, as /root usually is
  try:
    os.mkdir(f"{private}/lib")
    monkeypatch.setattr(tool, "interpreter_paths",
                        lambda python: (prefixes, path + [f"{private}/lib"], numpy))
    monkeypatch.setattr(tool, "_PROBED", {})
    with pytest.raises(IsolationUnavailable) as raised:
      CodeSandbox(LIMITS, isolation="rlimit", python=python)
  finally:
    shutil.rmtree(private)
  assert str(raised.value) == (
      f"code sandbox isolation 'rlimit' cannot work on this machine: 'rlimit' is unusable: as "
      f"root it runs programs under an unprivileged uid, which cannot enter {private} (mode 700) "
      f"to reach {private}/lib; use a python installed where every user can read it")


def test_as_root_a_namespace_mode_names_the_folder_that_hides_the_venv(sandbox, monkeypatch):
  if os.geteuid() != 0:
    pytest.skip("namespace modes run programs under another uid only as root")
  if not os.path.isdir("/var/tmp"):
    pytest.skip("no /var/tmp (the bwrap mode makes every folder of /tmp anew)")
  prefixes, path, _ = policy.interpreter_paths(sys.executable)
  private = os.path.realpath(tempfile.mkdtemp(dir="/var/tmp"))  # mode 700, as `mktemp -d` makes
  try:
    site = f"{private}/venv/lib/site-packages"
    os.makedirs(site)
    os.symlink(os.path.dirname(numpy.__file__), f"{site}/numpy")  # numpy is there, for root
    stdlib = [p for p in path if "-packages" not in p]
    monkeypatch.setattr(tool, "interpreter_paths",
                        lambda python: (prefixes + [f"{private}/venv"], stdlib + [site], True))
    monkeypatch.setattr(tool, "_PROBED", {})
    mode = sandbox.isolation
    with pytest.raises(IsolationUnavailable) as raised:
      CodeSandbox(LIMITS, isolation=mode)
  finally:
    shutil.rmtree(private)
  assert str(raised.value) == (
      f"code sandbox isolation '{mode}' cannot work on this machine: '{mode}' is unusable: its "
      f"self-test (imports as the sandboxed user) failed with status 1: ModuleNotFoundError: No "
      f"module named 'numpy'; as root it runs programs under an unprivileged uid, which cannot "
      f"enter {private} (mode 700) to reach {private}/venv; use a python installed where every "
      f"user can read it; isolation='auto' would accept a weaker mode")


def test_folders_a_mode_makes_anew_are_not_blamed_for_blocking():
  hidden, exposed = ["/root", "/home"], ["/root/.pyenv/versions/3.11", "/tmp/tmp.x/venv"]
  assert policy.remade_dirs("bwrap", hidden, exposed) == {
      "/root", "/home", "/tmp", "/root/.pyenv", "/root/.pyenv/versions", "/tmp/tmp.x"}
  # The unshare mode keeps the host's /tmp, whose folders keep their modes.
  assert policy.remade_dirs("unshare", hidden, exposed) == {
      "/root", "/home", "/root/.pyenv", "/root/.pyenv/versions"}
  assert policy.remade_dirs("rlimit", hidden, exposed) == set()


def fake_mounts(monkeypatch, before, after, fail=None):
  """Replaces the boot script's mount table (`before`, then `after` the hiding) and mount call
  (raising for `fail`); returns the list of the mount points it is asked to remount."""
  tables = iter([before, after])
  monkeypatch.setattr(sandbox_boot, "_mounts", lambda: next(tables))
  monkeypatch.setattr(sandbox_boot, "_mount_tmpfs", lambda libc, target, size: None)
  remounted = []

  def mount(libc, source, target, flags):
    if target == fail:
      raise OSError(errno.EPERM, f"mount {target.decode()}: Operation not permitted")
    if flags & sandbox_boot._MS_REMOUNT:
      remounted.append(target)

  monkeypatch.setattr(sandbox_boot, "_mount", mount)
  return remounted


def test_unshare_mode_remounts_every_reachable_mount_read_only(monkeypatch, tmp_path):
  home, venv, work = tmp_path / "home", tmp_path / "home" / "venv", tmp_path / "work"
  for path in (venv, work):
    path.mkdir(parents=True)
  old = [(b"1", b"/", []), (b"2", bytes(home) + b"/data", []), (b"3", b"/proc", [])]
  new = old + [(b"4", bytes(home), []), (b"5", bytes(venv), []), (b"6", bytes(work), [])]
  remounted = fake_mounts(monkeypatch, old, new)
  sandbox_boot.make_read_only(str(work), hide=[str(home)], expose=[str(venv)])
  # home/data lies under the empty tmpfs now; /proc is the namespace's own; work stays writable.
  assert remounted == [b"/", bytes(home), bytes(venv)]


def test_a_mount_that_cannot_be_made_read_only_fails_the_setup(monkeypatch, tmp_path):
  mounts = [(b"1", b"/", []), (b"2", b"/data", [b"nosuid"])]
  fake_mounts(monkeypatch, mounts, mounts, fail=b"/data")
  with pytest.raises(OSError, match="mount /data: Operation not permitted"):
    sandbox_boot.make_read_only(str(tmp_path))


def test_mountinfo_escapes_are_decoded():
  assert sandbox_boot._unescape(b"/mnt/my\\040disk\\134x") == b"/mnt/my disk\\x"


def test_outputs_of_several_hosts_report_the_weakest_isolation():
  delayed = base.Delayed(CodeSandbox(LIMITS), 0.0, 0.0)
  assert sandbox_module.isolation_of({"web_search": object(), "code": delayed}) == \
      delayed.inner.isolation
  assert sandbox_module.weakest(["bwrap", "unshare", None, "bwrap"]) == "unshare"
  assert sandbox_module.weakest([None]) is None


def test_the_evaluation_records_the_isolation_of_its_code_tool_and_code_reward(tmp_path):
  from coa_jax.data import World, WorldConfig
  from coa_jax.evaluation import job as evaluation
  from configs import evaluate_tiny

  world = World(WorldConfig(seed=0, entities=4, train_tasks=0, heldout_tasks=2))
  paths = world.write(str(tmp_path / "world"))
  config = evaluate_tiny.get_config()
  config.system, config.k, config.tasks = "teacher", 1, paths["heldout"]
  config.tools = world.tools_spec(paths["corpus"])
  config.output_dir = str(tmp_path / "eval")
  config.rewards.domains["code"] = {"kind": "code"}  # a code reward (no task of it here)
  expected = CodeSandbox(isolation="auto").isolation
  metrics = evaluation.run(config)
  assert metrics["sandbox_isolation"] == metrics["reward_sandbox_isolation"] == expected
  with open(tmp_path / "eval" / "metrics.json") as f:
    saved = json.load(f)
  assert saved["sandbox_isolation"] == saved["reward_sandbox_isolation"] == expected
