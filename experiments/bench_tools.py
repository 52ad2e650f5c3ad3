"""Tool latency and throughput: the code sandbox per isolation mode, and BM25 search.

  python experiments/bench_tools.py [--snippets=64 --workers=1,2,4,8 --output=...]

The sandbox's peer is the same snippet run as a bare `python -c` subprocess with no
isolation and no limits, measured in the same run: the ratio is the price of isolation.
Search latency is over the shipped corpus, with the index built cold and then loaded from
its disk cache. Writes a JSON file of the figures.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from tools_env import search
from tools_env.sandbox import ISOLATION_MODES, CodeSandbox

_SNIPPETS = flags.DEFINE_integer("snippets", 64, "snippets per measurement")
_WORKERS = flags.DEFINE_list("workers", ["1", "2", "4", "8"], "pool sizes for throughput")
_OUTPUT = flags.DEFINE_string("output", "runs/bench_tools.json", "where to write the figures")

SNIPPET = "total = sum(i * i for i in range(20000))\nprint(total)"
QUERIES = ["capital of Kenya", "highest mountain above sea level", "Nobel prize radioactivity",
           "movement of water through a membrane", "Zürich Switzerland lake", "speed of light",
           "who wrote the theory of relativity", "largest ocean on Earth"]


def percentiles(seconds: list[float]) -> dict[str, float]:
  """Returns p50 and p95 of `seconds`, in milliseconds."""
  ordered = sorted(seconds)
  return {"p50_ms": 1e3 * statistics.median(ordered),
          "p95_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]}


def timed(fn, repeats: int) -> list[float]:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def bench_sandbox(mode: str, python: str, count: int, workers: list[int]) -> dict:
  """Returns per-snippet latency and pool throughput of one isolation mode."""
  sandbox = CodeSandbox(isolation=mode, python=python, workers=max(workers))
  body = f"```python\n{SNIPPET}\n```"
  assert sandbox(body).ok
  row = {"mode": mode, **percentiles(timed(lambda: sandbox(body), count))}
  for n in workers:
    pool = CodeSandbox(isolation=mode, python=python, workers=n)
    start = time.perf_counter()
    results = pool.map([body] * count)
    row[f"per_s_{n}_workers"] = count / (time.perf_counter() - start)
    assert all(r.ok for r in results)
  return row


def main(argv):
  del argv
  count, workers = _SNIPPETS.value, [int(w) for w in _WORKERS.value]
  print(f"{os.cpu_count()} CPUs; {count} snippets per figure; snippet: {SNIPPET!r}")
  peer = percentiles(timed(lambda: subprocess.run([sys.executable, "-I", "-c", SNIPPET],
                                                  capture_output=True, check=True), count))
  print(f"{'bare subprocess':>16}: p50 {peer['p50_ms']:6.1f} ms  p95 {peer['p95_ms']:6.1f} ms")
  rows = []
  for mode in ISOLATION_MODES:
    # As root the rlimit mode drops privileges, so it needs a python every uid can run.
    python = "/usr/bin/python3" if mode == "rlimit" and os.geteuid() == 0 else sys.executable
    try:
      row = bench_sandbox(mode, python, count, workers)
    except (ValueError, OSError) as e:
      print(f"{mode:>16}: unavailable ({e})")
      continue
    row["ratio_to_bare_p50"] = row["p50_ms"] / peer["p50_ms"]
    rows.append(row)
    rates = "  ".join(f"{n}w {row[f'per_s_{n}_workers']:5.1f}/s" for n in workers)
    print(f"{mode:>16}: p50 {row['p50_ms']:6.1f} ms  p95 {row['p95_ms']:6.1f} ms  "
          f"({row['ratio_to_bare_p50']:.2f}x bare)  throughput {rates}", flush=True)

  with tempfile.TemporaryDirectory() as cache:
    start = time.perf_counter()
    search.Bm25Search(cache_dir=cache)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    engine = search.Bm25Search(cache_dir=cache)
    warm_s = time.perf_counter() - start
  latencies = timed(lambda: [engine(q) for q in QUERIES], max(1, count // len(QUERIES)))
  search_row = {"docs": len(engine.docs), "index_build_ms": 1e3 * cold_s,
                "index_load_ms": 1e3 * warm_s,
                **percentiles([t / len(QUERIES) for t in latencies])}
  print(f"{'bm25 search':>16}: p50 {search_row['p50_ms']:6.2f} ms per query over "
        f"{search_row['docs']} docs; index build {search_row['index_build_ms']:.0f} ms, "
        f"cached load {search_row['index_load_ms']:.0f} ms")
  os.makedirs(os.path.dirname(_OUTPUT.value) or ".", exist_ok=True)
  with open(_OUTPUT.value, "w") as f:
    json.dump({"bare_subprocess": peer, "sandbox": rows, "search": search_row}, f, indent=2)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
