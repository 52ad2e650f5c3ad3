"""Crash recovery of the real entry points: a run killed with SIGKILL mid-run resumes from its last
checkpoint and ends exactly where an uninterrupted run ends (SFT and RL); a SIGTERM (a TPU
preemption notice) saves before a clean exit. Each run is a separate process.

The RL run is the DAPO job with a PPO critic (experiments/dapo.py, rl.advantage = "gae"): it
saves and restores all that a DAPO run does, and the critic, so one run covers both
(test_dapo_job checks a DAPO run's own resume in-process).

Nothing here depends on timing: a signal is sent once the event it needs has happened (a
committed checkpoint, a logged step), and the moment past that event is drawn from a seeded
generator, so a slow or busy machine changes how long a test takes, never what it checks.

The uninterrupted reference starts once the first interrupted run has compiled its programs, so
it loads them from the session's compilation cache (conftest) instead of compiling them again."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from coa_jax.runtime.safetensors_io import SafetensorsFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}  # with conftest's XLA_FLAGS: 8 devices, fast compile
SFT_STEPS = 40  # the kill lands after a checkpoint of step 4-8 commits: 32+ steps before the end
SFT = ["experiments/sft.py", f"--config.train.steps={SFT_STEPS}",
       f"--config.optimizer.total_steps={SFT_STEPS}",
       "--config.optimizer.warmup_steps=2",
       "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
       "--config.model.num_layers=1", "--config.batch_size=8", "--config.seq_len=256",
       "--config.train.log_every=1", "--config.checkpoint.every=2"]
DAPO = ["experiments/dapo.py", "--config.model.checkpoint=", "--config.max_tasks=16",
        "--config.eval_tasks=", "--config.mesh.data=2", "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2", "--config.batch_size=4", "--config.chunk=16",
        "--config.rollout.group_size=2", "--config.rollout.max_response_tokens=32",
        "--config.rollout.max_observation_tokens=32", "--config.rollout.max_turns=2",
        "--config.rl.steps=4", "--config.rl.batch_groups=2", "--config.rl.prompts_per_round=2",
        "--config.rl.mini_batch_groups=2", "--config.rl.overlong_cache=16",
        "--config.rl.log_every=1", "--config.optimizer.learning_rate=1e-3",
        "--config.checkpoint.every=1"]


def _args(script, folder):
  flags = [f"--config.workdir={folder}", f"--config.checkpoint.directory={folder}/ckpt",
           f"--config.export_dir={folder}/hf_export", "--config.export_dtype=float32"]
  return [sys.executable] + script + flags


def _start(script, folder, *extra):
  os.makedirs(folder, exist_ok=True)
  log = open(os.path.join(folder, "log.txt"), "a")
  return subprocess.Popen(_args(script, folder) + list(extra), cwd=ROOT, env=ENV, stdout=log,
                          stderr=subprocess.STDOUT)


def _finish(proc, folder, timeout=300):
  assert proc.wait(timeout=timeout) == 0, open(os.path.join(folder, "log.txt")).read()[-3000:]


def _steps_logged(folder):
  path = os.path.join(folder, "metrics.jsonl")
  return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def _committed_steps(folder):
  """The steps whose checkpoint is complete (orbax renames a step's folder into place when done)."""
  path = os.path.join(folder, "ckpt")
  return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def _interrupt(proc, ready, sig, delay_s=0.0, timeout=240):
  """Sends `sig` `delay_s` after `ready()` first holds; returns the exit status. Fails if the
  run ended before that or `ready()` never held."""
  deadline = time.monotonic() + timeout
  while not ready():
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the signal"
    assert time.monotonic() < deadline, "the event never came"
    time.sleep(0.01)
  time.sleep(delay_s)
  proc.send_signal(sig)
  return proc.wait(timeout=120)


def _last_rows(folder):
  """Each step's last metrics row (a resumed run logs again the steps after its checkpoint)."""
  rows = {}
  for line in open(os.path.join(folder, "metrics.jsonl")):
    row = json.loads(line)
    rows[row["step"]] = row
  return [rows[step] for step in sorted(rows)]


def _assert_same_end(folder, reference, keys, exports=("hf_export",)):
  got, want = _last_rows(folder), _last_rows(reference)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for key in keys:
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5,
                               err_msg=key)
  for export in exports:
    a, b = (SafetensorsFile(os.path.join(f, export, "model.safetensors"))
            for f in (folder, reference))
    for name in a.names():
      np.testing.assert_allclose(a.get(name), b.get(name), rtol=1e-5, atol=1e-7, err_msg=name)


def test_sft_killed_mid_run_resumes_to_the_uninterrupted_end(tmp_path):
  draw = np.random.default_rng(0)
  kill_at, delay_s = 2 * int(draw.integers(2, 5)), float(draw.uniform(0.0, 0.05))
  killed = tmp_path / "killed"
  victim = _start(SFT, killed)
  at_checkpoint = lambda: any(step >= kill_at for step in _committed_steps(killed))  # noqa: E731
  assert _interrupt(victim, at_checkpoint, signal.SIGKILL, delay_s) == -signal.SIGKILL
  assert _steps_logged(killed) < SFT_STEPS, "the run ended before the kill"
  resume_from = max(_committed_steps(killed))
  # The reference saves no checkpoint before its last step (saving does not change the run).
  reference = _start(SFT, tmp_path / "whole", f"--config.checkpoint.every={SFT_STEPS}")
  _finish(_start(SFT, killed), killed)
  _finish(reference, tmp_path / "whole")
  assert f"resumed from step {resume_from}" in open(killed / "log.txt").read()
  _assert_same_end(killed, tmp_path / "whole", ("loss", "grad_norm"))


# The DAPO job with a critic, checkpointed and resumed with the policy.
PPO = DAPO + ["--config.rl.advantage=gae"]


def test_rl_preempted_then_killed_resumes_to_the_uninterrupted_end(tmp_path):
  run = tmp_path / "interrupted"
  first_step = lambda: _steps_logged(run) >= 1  # noqa: E731
  # The first step compiles every program of the run (PPO: the critic's too); a loaded machine
  # needs minutes.
  assert _interrupt(_start(PPO, run), first_step, signal.SIGTERM, timeout=600) == 0
  reference = _start(PPO, tmp_path / "whole", "--config.checkpoint.every=4")  # at its end only
  log = open(run / "log.txt").read()
  assert "saving a checkpoint, then stopping" in log
  saved = max(_committed_steps(run))
  assert saved == _steps_logged(run)  # the step it was in is saved
  victim = _start(PPO, run)
  next_step = lambda: _steps_logged(run) >= saved + 1  # noqa: E731
  assert _interrupt(victim, next_step, signal.SIGKILL) == -signal.SIGKILL
  _finish(_start(PPO, run), run)
  _finish(reference, tmp_path / "whole")
  assert f"resumed from step {saved}" in open(run / "log.txt").read()
  keys = ("reward", "response_len", "pg_loss", "entropy", "value_loss", "explained_variance",
          "critic_grad_norm")
  _assert_same_end(run, tmp_path / "whole", keys, ("hf_export", "hf_export_critic"))
