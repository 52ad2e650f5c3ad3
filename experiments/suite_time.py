"""The test suite's time at two commits, back to back on this machine (docs/testing.md).

  make suite-time ARGS=--base=c5dc3b3                 # the base commit, then HEAD
  make suite-time ARGS="--base=c5dc3b3 --head=abc123 --out=/tmp/ab.json"
  make suite-time ARGS="--base=c5dc3b3 --tests=tests/test_rl.py,tests/test_gae.py"   # some files

Checks out each commit into a worktree of its own (under --work, emptied first) and runs the whole
suite (or --tests) there with `make test`'s pytest options (and --durations=0) and CI=true, on this
checkout's environment (`.venv`: the same packages for both), the worktree first on PYTHONPATH so
that the tests and the programs they start import that commit's code. Writes, per commit, the wall
time, pytest's summary line, and the seconds per test file (setup, call and teardown summed, from
`--durations=0`) to --out. A machine's speed moves from day to day by 2x and more: only two runs
taken back to back, with nothing else running, compare.
"""

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time

from absl import app, flags

_BASE = flags.DEFINE_string("base", None, "the commit to compare against")
_HEAD = flags.DEFINE_string("head", "HEAD", "the commit measured after it")
_OUT = flags.DEFINE_string("out", "runs/suite_time/results.json", "the results file")
_WORK = flags.DEFINE_string("work", "runs/suite_time/worktrees", "the worktrees' folder")
_TESTS = flags.DEFINE_list("tests", ["tests"], "the test files or folders (default: the suite)")
flags.mark_flag_as_required("base")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--dist", "loadfile",
          "--no-loadscope-reorder", "--durations=0"]
DURATION = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/[^:\s]+)")
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).* in [\d.]+s.*?)\s*=*$")


def git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                        text=True).stdout.strip()


def seconds_by_file(output: str) -> dict[str, float]:
  """Returns the seconds of each test file in a `--durations=0` report."""
  by_file = collections.defaultdict(float)
  for line in output.splitlines():
    match = DURATION.match(line)
    if match:
      by_file[match.group(2)] += float(match.group(1))
  return {name: round(s, 1) for name, s in sorted(by_file.items(), key=lambda kv: -kv[1])}


def summary_line(output: str) -> str:
  """Returns pytest's last summary line ("N passed, ... in S s"), or "" without one."""
  lines = [m.group(1) for m in map(SUMMARY.match, output.splitlines()) if m]
  return lines[-1] if lines else ""


def measure(commit: str, work: str) -> dict:
  """Runs the suite at `commit` in a fresh worktree; returns its figures."""
  sha = git("rev-parse", "--short", commit)
  tree = os.path.join(work, sha)
  git("worktree", "add", "--detach", "--force", tree, sha)
  env = {**os.environ, "CI": "true", "JAX_PLATFORMS": "cpu", "PYTHONPATH": tree}
  print(f"== {sha}: the suite in {tree}", flush=True)
  start = time.perf_counter()
  try:
    done = subprocess.run([sys.executable, *PYTEST, *_TESTS.value], cwd=tree, env=env,
                          capture_output=True, text=True)
  finally:
    git("worktree", "remove", "--force", tree)
  wall = round(time.perf_counter() - start)
  by_file = seconds_by_file(done.stdout)
  result = {"commit": sha, "returncode": done.returncode, "wall_s": wall,
            "pytest_summary": summary_line(done.stdout),
            "test_seconds": round(sum(by_file.values()), 1), "seconds_by_file": by_file}
  print(f"   {result['pytest_summary'] or done.stdout[-2000:]} (wall {wall} s)", flush=True)
  return result


def main(argv):
  del argv
  work = os.path.abspath(_WORK.value)
  shutil.rmtree(work, ignore_errors=True)
  os.makedirs(work)
  runs = {"A": measure(_BASE.value, work), "B": measure(_HEAD.value, work)}
  a, b = runs["A"], runs["B"]
  command = " ".join(["python", *PYTEST, *_TESTS.value])
  report = {"what": f"`{command}` (CI=true) at {a['commit']} (A) and {b['commit']} (B), back "
                    f"to back on this machine",
            "runs": runs, "wall_delta_s": b["wall_s"] - a["wall_s"],
            "test_seconds_delta": round(b["test_seconds"] - a["test_seconds"], 1)}
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(report, f, indent=1)
  print(f"B - A: {report['wall_delta_s']:+d} s wall, {report['test_seconds_delta']:+.1f} "
        f"test-seconds; {_OUT.value}")
  if a["returncode"] or b["returncode"]:
    sys.exit("a run failed: its summary is in the results file")


if __name__ == "__main__":
  app.run(main)
