"""On two processes, host-side work that fails on one process before a collective ends both,
each exiting non-zero with that error (the other one naming it), long before the deadline: a
cached file process 0 cannot parse, a cached computation that raises on process 1, process 1's
SFT data failing, process 0's disk filling up during an HF export, process 0 unable to set a
damaged checkpoint step aside, to write a step's metrics or to close its metric file, process 1
unable to import the RL job's agent program, a sample of process 1's RL step that the update
cannot hold (tests/failure_worker.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST_COMPILE, PATIENT_COLLECTIVES
from test_multihost import _free_port

WORKER = os.path.join(os.path.dirname(__file__), "failure_worker.py")
DEADLINE_S = 120  # a pair that hangs is killed here; a failing pair ends in seconds


@pytest.mark.parametrize("scenario, failing, error", [
    ("cache-read", 0, "is not a cached result"),
    ("cache-compute", 1, "ValueError: the evaluation's tool crashed"),
    ("sft-data", 1, "OSError: [Errno 5] Input/output error"),
    ("export", 0, "OSError: [Errno 27] File too large"),
    ("set-aside", 0, "PermissionError: [Errno 13] Permission denied"),
    ("metrics", 0, "OSError: [Errno 28] No space left on device"),
    ("metrics-close", 0, "OSError: [Errno 5] Input/output error: 'gs://bucket/work/metrics"),
    ("agent-start", 1, "ConfigError: rl.agent='gone:agent': ModuleNotFoundError"),
    ("rl-batch", 1, "ValueError: task t sample 0: ids, loss_mask, logprobs and versions differ"),
])
def test_one_process_failing_ends_both_with_its_error(tmp_path, scenario, failing, error):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE} "
                       f"{PATIENT_COLLECTIVES}")
  port, logs, procs = str(_free_port()), [tmp_path / f"process-{i}.log" for i in range(2)], []
  for index, log in enumerate(logs):
    with open(log, "w") as f:
      procs.append(subprocess.Popen([sys.executable, WORKER, scenario, str(tmp_path), str(index),
                                     port], env=env, stdout=f, stderr=subprocess.STDOUT))
  deadline = time.monotonic() + DEADLINE_S
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.2)
  hung = [p for p in procs if p.poll() is None]
  for p in hung:  # past the deadline: each writes its threads' stacks to its log, then dies
    p.send_signal(signal.SIGUSR1)
  time.sleep(2 if hung else 0)
  for p in hung:
    p.kill()
  codes, texts = [p.wait() for p in procs], [log.read_text() for log in logs]
  assert codes == [1, 1], f"exit codes {codes} (a hang is killed at {DEADLINE_S} s):\n" + \
      "\n".join(t[-3000:] for t in texts)
  assert error in texts[failing]
  other = texts[1 - failing]
  assert "HostFailure: stopping: another process failed" in other
  assert f"process {failing}: " in other and error.split(": ", 1)[-1][:25] in other
