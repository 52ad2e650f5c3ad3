"""The chaos run: the main job SIGKILLed at seeded points in every stage, re-launched after each
kill until it completes, then compared with an uninterrupted run.

A kill point names an event of the run (a log line that starts with a given text, such as a
stage's banner "== seed 0 sft", or a file that appears, such as a committed checkpoint) and the
longest delay past it; the delay is drawn from a seeded generator. Nothing waits on wall-clock
time alone: a slow machine changes where in a stage a kill lands, never which event it follows.
Each launch serves the next point: its event must come from that launch (a line it prints, a
file that did not exist when it started); a point whose event never comes (the stage was reused,
or the launch ended first) is recorded as missed. The run's process group is killed (the job and
any helper it started in its group), as a lost machine would end it.

`compare` checks the killed run's results.json and HF exports against the uninterrupted run's:
equal metrics and byte-equal model.safetensors. `run` writes a JSON report (each kill's stage,
event, delay and exit status; the comparison)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import time
from typing import Any, Callable, Sequence

import numpy as np

from coa_jax.runtime.cache import write_json

# results.json entries that are not results: wall times and the plot's path.
VOLATILE = ("stage_seconds", "wall_s", "plot")
# The files compared byte for byte: the HF exports of SFT and DAPO (seed 0).
EXPORTS = ("seed-0/sft/hf_export/model.safetensors", "seed-0/dapo/hf_export/model.safetensors")


@dataclasses.dataclass(frozen=True)
class Point:
  """Where to kill: `max_delay_s` (at most; the delay is drawn) after the event: a log line
  starting with `line`, or the file `file` (relative to the run folder) appearing."""

  stage: str
  line: str = ""
  file: str = ""
  max_delay_s: float = 0.0

  def event(self) -> str:
    """Returns the event as the report names it."""
    return f"line {self.line!r}" if self.line else f"file {self.file}"


# The kill points of the quick main job (`experiments/pipeline.py --quick`, seed 0), in the order
# its stages run: each stage's banner, and inside the stages, the teacher's progress line
# (distillation: the filters, the held-out traces, writing the data), a few milliseconds after an
# HF export or an evaluation's metrics.json appears (while the job writes its outputs) and the
# results table and plot.
QUICK_POINTS = (
    Point("distill", line="== distill", max_delay_s=0.3),  # the world, then the teacher
    Point("distill", line="teacher: ", max_delay_s=0.2),
    Point("eval teacher", line="== eval teacher", max_delay_s=0.3),
    Point("eval teacher", file="eval_teacher/metrics.json", max_delay_s=0.005),
    Point("seed 0 sft", line="== seed 0 sft", max_delay_s=3.0),  # data, model, compiles, steps
    Point("seed 0 sft", file="seed-0/sft/hf_export", max_delay_s=0.005),
    Point("seed 0 eval sft", line="== seed 0 eval sft", max_delay_s=1.0),
    Point("seed 0 eval sft", file="seed-0/eval_sft/metrics.json", max_delay_s=0.005),
    Point("seed 0 dapo", line="== seed 0 dapo", max_delay_s=3.0),  # rollouts, the update
    Point("seed 0 dapo", file="seed-0/dapo/hf_export", max_delay_s=0.005),
    Point("seed 0 eval dapo", line="== seed 0 eval dapo", max_delay_s=1.0),
    Point("seed 0 eval dapo", file="seed-0/eval_dapo/metrics.json", max_delay_s=0.005),
    Point("results", line="== results", max_delay_s=0.3),  # the table, the plot, results.json
)


class Launch:
  """One launch of `command` (its own process group), its output appended to `log`."""

  def __init__(self, command: Sequence[str], log: str, cwd: str, env: dict[str, str]):
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    self.log, self.start = log, time.monotonic()
    self.offset = os.path.getsize(log) if os.path.exists(log) else 0
    with open(log, "a") as out:
      self.proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)

  def lines(self) -> list[str]:
    """Returns the complete lines this launch has printed so far."""
    with open(self.log, errors="replace") as f:
      f.seek(self.offset)
      text = f.read()
    return text.splitlines()[:-1] if not text.endswith("\n") else text.splitlines()

  def stage(self) -> str:
    """Returns the stage this launch last announced ("== <stage>", reused ones included)."""
    banners = [line[3:].split(": reusing")[0].split(" (")[0] for line in self.lines()
               if line.startswith("== ")]
    return banners[-1] if banners else "start-up"

  def kill(self) -> int:
    """SIGKILLs the launch's process group; returns its exit status."""
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it had ended
      pass
    return self.proc.wait()


def wait_for(ready: Callable[[], bool], launch: Launch, timeout_s: float) -> bool:
  """Returns True once `ready()` holds, False if the launch ended first; raises TimeoutError
  after `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while not ready():
    if launch.proc.poll() is not None:
      return ready()
    if time.monotonic() > deadline:
      launch.kill()
      raise TimeoutError(f"no event in {timeout_s:.0f}s; log {launch.log}")
    time.sleep(0.01)
  return True


def _event(point: Point, launch: Launch, folder: str) -> Callable[[], bool] | None:
  """Returns the test of `point`'s event in `launch`, or None when it cannot come from it (the
  file existed before the launch)."""
  if point.line:  # a stage's banner, not the line saying the stage is reused
    return lambda: any(line.startswith(point.line) and
                       not line.startswith(point.line + ": reusing") for line in launch.lines())
  path = os.path.join(folder, point.file)
  if os.path.exists(path):
    return None
  return lambda: os.path.exists(path)


def _ended(launch: Launch, timeout_s: float) -> int:
  """Returns the exit status of a launch left to run to its end."""
  try:
    return launch.proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    launch.kill()
    raise TimeoutError(f"the launch did not end in {timeout_s:.0f}s; log {launch.log}")


def _failed(launch: Launch, status: int) -> RuntimeError:
  tail = "\n".join(launch.lines()[-30:])
  return RuntimeError(f"a launch after a kill failed (exit {status}); log {launch.log}:\n{tail}")


def kill_repeatedly(command: Sequence[str], folder: str, points: Sequence[Point], seed: int,
                    cwd: str, env: dict[str, str], log: str,
                    say: Callable[[str], None] = print,
                    timeout_s: float = 900.0) -> tuple[list[dict[str, Any]], int]:
  """Runs `command` (writing to `folder`), SIGKILLing it at each point in turn and launching it
  again, until it completes; returns one record per point (the stage it landed in, event, delay,
  exit status; or why it was missed) and the number of launches. Raises RuntimeError when a
  launch fails on its own."""
  draw = np.random.default_rng(seed)
  delays = [float(draw.uniform(0.0, p.max_delay_s)) for p in points]
  records: list[dict[str, Any]] = []
  launch, launches = Launch(command, log, cwd, env), 1
  for point, delay in zip(points, delays):
    record = dict(planned=point.stage, event=point.event(), delay_s=round(delay, 4),
                  launch=launches, killed=False)
    records.append(record)
    ready = launch and _event(point, launch, folder)
    if not ready or not wait_for(ready, launch, timeout_s):
      record["missed"] = ("the run had completed" if launch is None else
                          "the event did not come in this launch")
      say(f"chaos: {point.stage}: missed ({record['missed']})")
      if launch and launch.proc.poll() is not None:  # it ended: completed, or failed
        if launch.proc.returncode:
          raise _failed(launch, launch.proc.returncode)
        launch = None
      continue
    time.sleep(delay)
    stage, last = launch.stage(), (launch.lines() or [""])[-1][:160]
    status = launch.kill()
    record.update(stage=stage, exit=status, last_line=last,
                  launch_s=round(time.monotonic() - launch.start, 2))
    if status == 0:
      record["missed"], launch = "the run completed before the kill", None
      continue
    if status != -signal.SIGKILL:
      raise _failed(launch, status)
    record["killed"] = True
    say(f"chaos: kill {sum(r['killed'] for r in records)} at {point.event()} + {delay:.3f}s, "
        f"in stage {stage!r}; last line: {last}")
    launch, launches = Launch(command, log, cwd, env), launches + 1
  if launch is not None:
    status = _ended(launch, timeout_s)
    if status:
      raise _failed(launch, status)
  say(f"chaos: launch {launches} completed the run"
      + (f" in {time.monotonic() - launch.start:.1f}s" if launch else ""))
  return records, launches


def _results(folder: str) -> dict[str, Any]:
  with open(os.path.join(folder, "results.json")) as f:
    results = json.load(f)
  return {k: v for k, v in results.items() if k not in VOLATILE}


def _digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def compare(folder: str, reference: str, exports: Sequence[str]) -> dict[str, Any]:
  """Returns how the run in `folder` compares with the one in `reference`: results.json (less
  VOLATILE) equal, and each export file (relative path) byte-equal, with its digests."""
  got, want = _results(folder), _results(reference)
  differing = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
  files = {}
  for name in exports:
    a, b = (_digest(os.path.join(f, name)) for f in (folder, reference))
    files[name] = dict(equal=a == b, sha256=a, reference_sha256=b)
  return dict(results_equal=not differing, differing_results=differing, exports=files,
              equal=not differing and all(f["equal"] for f in files.values()))


def run(command: Sequence[str], folder: str, reference_command: Sequence[str] | None,
        reference: str, points: Sequence[Point], seed: int, exports: Sequence[str], cwd: str,
        env: dict[str, str], report_path: str, say: Callable[[str], None] = print,
        timeout_s: float = 900.0) -> dict[str, Any]:
  """Runs the chaos run into `folder` and, unless `reference` holds a finished run already,
  `reference_command` into `reference`; compares them and writes the report to
  `report_path`; returns it."""
  start = time.perf_counter()
  log = os.path.join(os.path.dirname(os.path.abspath(folder)), "chaos_log.txt")
  kills, launches = kill_repeatedly(command, folder, points, seed, cwd, env, log, say,
                                    timeout_s)
  chaos_s = time.perf_counter() - start
  if not os.path.exists(os.path.join(reference, "results.json")):
    if reference_command is None:
      raise FileNotFoundError(f"{reference} holds no finished run, and no command makes one")
    say(f"chaos: the uninterrupted run -> {reference}")
    whole = Launch(reference_command, os.path.join(os.path.dirname(os.path.abspath(reference)),
                                                   "reference_log.txt"), cwd, env)
    status = _ended(whole, timeout_s)
    if status:
      raise _failed(whole, status)
  comparison = compare(folder, reference, exports)
  landed: dict[str, int] = {}
  for k in kills:
    if k["killed"]:
      landed[k["stage"]] = landed.get(k["stage"], 0) + 1
  report = dict(command=list(command), seed=seed, kills=kills,
                killed=sum(k["killed"] for k in kills), kills_per_stage=landed,
                launches=launches,
                comparison=comparison, chaos_wall_s=round(chaos_s, 1),
                wall_s=round(time.perf_counter() - start, 1))
  write_json(report_path, report)
  say(f"chaos: {report['killed']} kills over {report['launches']} launches "
      f"({landed}); results {'equal' if comparison['results_equal'] else 'DIFFER'}; exports "
      + ", ".join(f"{n} {'equal' if f['equal'] else 'DIFFER'}"
                  for n, f in comparison["exports"].items()) + f"; report {report_path}")
  return report
