"""On two processes (one CPU device each, gloo collectives), every decision that precedes a
collective is taken by both: one process's error ends both, processes in different gathers
both raise, a checkpoint step only one process cannot read is set aside by both, a mismatched
checkpoint fails on both, a cached result only process 0 holds is taken by both, the quick main
job runs on both (distilling on process 0 alone; an output folder they do not share is an
error), and a Ctrl-C (SIGINT, sent on as SIGTERM) that only one process gets makes both save at
the same step and stop (tests/agreement_worker.py)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import FAST_COMPILE, PATIENT_COLLECTIVES
from test_multihost import _free_port, _wait

WORKER = os.path.join(os.path.dirname(__file__), "agreement_worker.py")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
  out = tmp_path_factory.mktemp("agreement")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE} "
                       f"{PATIENT_COLLECTIVES}")
  port = str(_free_port())
  started = []
  for index in range(2):
    log = out / f"process-{index}.log"
    with open(log, "w") as f:
      started.append((subprocess.Popen([sys.executable, WORKER, str(out), str(index), port],
                                       env=env, stdout=f, stderr=subprocess.STDOUT), str(log)))
  _wait(started, time.monotonic() + 300)
  return out


def _results(out, scenario):
  return [json.loads((out / f"{scenario}-{i}.json").read_text()) for i in range(2)]


def test_one_process_error_ends_both(out):
  failed, other = _results(out, "failure")[::-1]
  assert (failed["error"], other["error"]) == ("ValueError", "HostFailure")
  assert "the code tool crashed" in other["message"] and "process 1" in other["message"]


def test_processes_in_different_gathers_both_raise_naming_them(out):
  for result in _results(out, "out-of-step"):
    assert result["error"] == "HostFailure"
    assert re.fullmatch(r"the processes are out of step: process 0 gathers at "
                        r"agreement_worker.py:\d+ \(inside\); process 1 gathers at "
                        r"agreement_worker.py:\d+ \(leaving early\)", result["message"])


def test_a_step_one_process_cannot_read_is_set_aside_by_both(out):
  assert [r["value"] for r in _results(out, "unreadable")] == [[1, 1.0, 1], [1, 1.0, 1]]


def test_a_mismatched_checkpoint_fails_on_both_and_moves_nothing(out):
  results = _results(out, "mismatch")
  assert [r["error"] for r in results] == ["CheckpointMismatchError"] * 2
  assert "w: saved float32[4], this run float32[8]" in results[0]["message"]
  assert results[0]["steps"][0] == "1" and results[0]["steps"][1].startswith("2.corrupt-")


def test_a_cache_decides_on_process_0_and_is_stored_by_it(out):
  for result in _results(out, "cache"):
    assert result["hit"] == "stored" and result["miss"] == {"process": 0}
    assert result["computed"] == 1  # the miss, on both
  assert sorted(p.name for p in out.glob("miss-*.json")) == ["miss-0.json"]


def test_the_quick_main_job_runs_on_two_processes_distilling_on_process_0_alone(out):
  zero, one = (r["value"] for r in _results(out, "pipeline"))
  assert zero == one and len(zero["stages"]) == 6, zero
  assert sorted(p.name for p in out.glob("distilled-*.json")) == ["distilled-0.json"]


def test_an_output_folder_the_hosts_do_not_share_is_an_error_on_both(out):
  for result in _results(out, "unshared"):
    assert result["error"] == "ConfigError" and "is not shared by the hosts: process(es) [1]" in (
        result["message"])
  assert not list(out.glob("own-0/.shared-*"))  # process 0 removed its file


def test_a_ctrl_c_on_one_process_stops_both_at_the_same_step(out):
  zero, one = _results(out, "preemption")
  assert zero["stopped_by_signal"] and one["stopped_by_signal"]
  assert zero["steps"] == one["steps"] >= 3
  assert zero["saved"] == [str(zero["steps"])]
