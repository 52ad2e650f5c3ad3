"""Two JAX processes with 4 fake CPU devices each form one global 8-device mesh (gloo
collectives, a 127.0.0.1 coordinator). In it: SFT where each process reads only its own data
shard, an orbax checkpoint written by both and restored by both, a DAPO step whose rollouts
each host decodes on its own devices with its own tools, and an evaluation split over hosts.
Everything equals one process with 8 devices. Then asynchronous DAPO, whose rollouts each host
runs on half its devices while the other halves train: with staleness 1 (within the bound), and
with staleness 0, equal to one process. The processes run under a deadline: if one dies
or hangs, all are killed and the test fails with their logs."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import FAST_COMPILE, PATIENT_COLLECTIVES

from coa_jax.runtime.safetensors_io import SafetensorsFile

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
DEADLINE_S = 480


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(out, processes: int, port: int) -> list[tuple[subprocess.Popen, str]]:
  os.makedirs(out, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes} "
             f"{FAST_COMPILE} {PATIENT_COLLECTIVES}")
  started = []
  for index in range(processes):
    log = os.path.join(out, f"process-{index}.log")
    with open(log, "w") as f:
      started.append((subprocess.Popen([sys.executable, WORKER, str(out), str(processes),
                                        str(index), str(port)], env=env, stdout=f,
                                       stderr=subprocess.STDOUT), log))
  return started


def _wait(started, deadline: float) -> None:
  """Waits for every process; on a failure or past the deadline, kills them all and fails.
  Past the deadline, each live process first writes every thread's Python stack to its log
  (SIGUSR1, faulthandler), so a hang shows where it waits."""
  procs = [p for p, _ in started]
  while any(p.poll() is None for p in procs):
    failed = any(p.poll() not in (None, 0) for p in procs)
    if failed or time.monotonic() > deadline:
      if not failed:
        for p in procs:
          if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
        time.sleep(2)
      for p in procs:
        p.kill()
      for p in procs:
        p.wait()
      break
    time.sleep(0.5)
  if any(p.returncode != 0 for p in procs):
    logs = "\n".join(f"--- {log} (exit {p.returncode}):\n" + open(log).read()[-6000:]
                     for p, log in started)
    pytest.fail(f"a process failed or the {DEADLINE_S} s deadline passed:\n{logs}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(two-process result dir, one-process result dir), run side by side."""
  tmp = tmp_path_factory.mktemp("multihost")
  two = _start(tmp / "two", 2, _free_port())
  one = _start(tmp / "one", 1, _free_port())
  deadline = time.monotonic() + DEADLINE_S
  _wait(two, deadline)
  _wait(one, deadline)
  return tmp / "two", tmp / "one"


def _result(folder):
  return json.load(open(folder / "result.json"))


def _weights(folder):
  file = SafetensorsFile(str(folder / "model.safetensors"))
  return {name: file.get(name) for name in file.names()}


def test_sft_resumes_from_a_checkpoint_both_processes_wrote(runs):
  two, _ = runs
  result = _result(two)
  assert result["processes"] == 2
  assert result["sft_steps"] == [2, 4] and result["sft_resumed_from"] == 2
  assert sorted(p.name for p in (two / "sft" / "ckpt").iterdir() if p.name.isdigit()) == [
      "2", "4"]


def _assert_equal_weights(a, b, largest_lr):
  """Every tensor of `a` equals `b`'s to rtol 1e-4 / atol 2e-5, but for at most 1 element in
  10,000, which must still lie within `largest_lr`: a gradient near zero that another reduction
  order moves in its last bits can become an Adam step of another size (up to about the
  learning rate), and which elements it hits depends on the CPU's kernels."""
  assert a.keys() == b.keys()
  for name in a:
    close = np.isclose(a[name], b[name], rtol=1e-4, atol=2e-5)
    assert (~close).mean() <= 1e-4, (name, int((~close).sum()), a[name].size)
    np.testing.assert_allclose(a[name], b[name], rtol=0, atol=largest_lr, err_msg=name)


def test_two_processes_equal_one(runs):
  two, one = map(_result, runs)
  np.testing.assert_allclose(two["sft_loss"], one["sft_loss"], rtol=1e-5)
  assert len(two["sft_loss"]) == 4
  (step_two,), (step_one,) = two["dapo"], one["dapo"]
  for key in ("reward", "accuracy", "response_len", "truncated", "kept"):
    assert step_two[key] == step_one[key], key  # the same samples, decoded per host
  assert two["eval"] == one["eval"]  # each host evaluated its share of the tasks
  for key in ("pg_loss", "entropy", "grad_norm"):
    np.testing.assert_allclose(step_two[key], step_one[key], rtol=1e-4, err_msg=key)
  (ppo_two,), (ppo_one,) = two["ppo"], one["ppo"]
  for key in ("reward", "response_len", "return_mean"):
    assert ppo_two[key] == ppo_one[key], key
  for key in ("pg_loss", "grad_norm", "value_loss", "explained_variance", "advantage_std",
              "critic_grad_norm"):
    np.testing.assert_allclose(ppo_two[key], ppo_one[key], rtol=1e-4, atol=1e-7, err_msg=key)
  for stage in ("sft", "dapo", "ppo", "ppo/hf_export_critic"):
    export = "" if stage.endswith("critic") else "hf_export"
    _assert_equal_weights(*(_weights(folder / stage / export) for folder in runs), 3e-3)


def test_asynchronous_dapo_trains_across_processes_while_each_host_decodes(runs):
  two, _ = runs
  rows = _result(two)["async"]
  assert [r["step"] for r in rows] == [1, 2]
  for row in rows:
    # 4 groups a step (2 from each host), none older than the bound of 1.
    assert row["staleness_0"] + row["staleness_1"] == 4
    assert np.isfinite(row["pg_loss"]) and row["trainer_tokens_per_s"] > 0
  weights = _weights(two / "async" / "hf_export")
  assert all(np.isfinite(w).all() for w in weights.values())


def test_asynchronous_dapo_with_staleness_0_on_two_processes_equals_one(runs):
  two, one = (_result(folder)["async0"] for folder in runs)
  assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
  for row_two, row_one in zip(two, one):
    assert row_two["staleness_0"] == row_one["staleness_0"] == 4 and row_two["stale"] == 0
    for key in ("reward", "accuracy", "response_len", "truncated"):
      assert row_two[key] == row_one[key], key  # the same samples, decoded per host
    for key in ("pg_loss", "entropy", "grad_norm"):
      np.testing.assert_allclose(row_two[key], row_one[key], rtol=1e-4, err_msg=key)
  _assert_equal_weights(*(_weights(folder / "async0" / "hf_export") for folder in runs), 3e-3)
