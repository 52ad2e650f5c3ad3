"""Tool latency and throughput: the code sandbox per isolation mode, BM25 search, and the HTTP
tools under load against a faulty service.

  python experiments/bench_tools.py [--snippets=64 --workers=1,2,4,8 --parts=sandbox,search,http
                                     --http_calls=256 --http_concurrency=64,256 --output=...]

The sandbox's peer is the same snippet run as a bare `python -c` subprocess with no
isolation and no limits, measured in the same run: the ratio is the price of isolation. Each
isolation mode is measured twice, with a process started per snippet (`persistent=False`) and
with the pool's persistent workers (the default), started before the figures are taken; the
ratio of the two is printed.
Search latency is over the shipped corpus, with the index built cold and then loaded from
its disk cache. The HTTP part sends `--http_calls` remote search and crawl calls, so many at
a time, to `tools_env.faulty_http` (in a child process): half are answered at once, the rest
reset, cut short or dripped a byte every 20 ms; it reports calls/s, latency per call, error
kinds, calls that raised, and the threads and file descriptors of this process before and
after. Writes a JSON file of the figures.
"""

import collections
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

from tools_env import faulty_http, search
from tools_env.remote import HttpCrawl, HttpLimits, RemoteSearch
from tools_env.sandbox import ISOLATION_MODES, CodeSandbox

_SNIPPETS = flags.DEFINE_integer("snippets", 64, "snippets per measurement")
_WORKERS = flags.DEFINE_list("workers", ["1", "2", "4", "8"], "pool sizes for throughput")
_PARTS = flags.DEFINE_list("parts", ["sandbox", "search", "http"], "what to measure")
_HTTP_CALLS = flags.DEFINE_integer("http_calls", 256, "HTTP tool calls per measurement")
_HTTP_CONCURRENCY = flags.DEFINE_list("http_concurrency", ["64", "256"],
                                      "HTTP tool calls in flight at once, per measurement")
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


def bench_sandbox(mode: str, python: str, count: int, workers: list[int],
                  persistent: bool) -> dict:
  """Returns per-snippet latency and pool throughput of one isolation mode, with persistent
  workers or a process started per snippet. Persistent workers are started (and timed) before
  the figures: `start_ms` is the first call of a new sandbox, which starts a worker."""
  body = f"```python\n{SNIPPET}\n```"
  start = time.perf_counter()
  sandbox = CodeSandbox(isolation=mode, python=python, workers=max(workers),
                        persistent=persistent)
  assert sandbox(body).ok
  row = {"mode": mode, "persistent": sandbox.persistent,
         "first_call_ms": 1e3 * (time.perf_counter() - start),
         **percentiles(timed(lambda: sandbox(body), count))}
  sandbox.close()
  for n in workers:
    pool = CodeSandbox(isolation=mode, python=python, workers=n, persistent=persistent)
    assert all(r.ok for r in pool.map([body] * n))  # every worker started
    start = time.perf_counter()
    results = pool.map([body] * count)
    row[f"per_s_{n}_workers"] = count / (time.perf_counter() - start)
    assert all(r.ok for r in results)
    pool.close()
  return row


# Limits of the HTTP load: a request ends within 1 s whatever the server does.
HTTP_LIMITS = HttpLimits(timeout_s=2.0, retries=2, backoff_s=0.05, deadline_s=1.0)
HTTP_ROUTES = ["/ok/q", "/reset/q", "/ok/q", "/cut/q", "/ok/q", "/drip/20/q"]


def tail_ms(seconds: list[float]) -> dict[str, float]:
  """Returns p50, p99 and max of `seconds`, in milliseconds."""
  ordered = sorted(seconds)
  return {"p50_ms": 1e3 * statistics.median(ordered),
          "p99_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
          "max_ms": 1e3 * ordered[-1]}


def open_fds() -> int:
  """Returns the number of file descriptors this process holds."""
  return len(os.listdir("/proc/self/fd"))


def bench_http(url: str, calls: int, concurrency: int) -> dict:
  """Returns throughput, latency, outcomes and leaks of `calls` HTTP tool calls, `concurrency`
  at a time, against the faulty service at `url`: odd calls search, even ones crawl."""
  searches = {path: RemoteSearch(url + path, api_key_env=None, limits=HTTP_LIMITS)
              for path in set(HTTP_ROUTES)}
  crawl = HttpCrawl(limits=HTTP_LIMITS)

  def call(i):
    path = HTTP_ROUTES[i % len(HTTP_ROUTES)]
    start = time.perf_counter()
    try:
      result = searches[path]("lake") if i % 2 else crawl(url + path)
      outcome = result.error_kind or "ok"
    except Exception as e:  # noqa: BLE001 - counted: a tool must never raise
      outcome = f"raised {type(e).__name__}"
    return path, outcome, time.perf_counter() - start

  call(0)  # whatever urllib sets up once per process
  threads, fds = threading.active_count(), open_fds()
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    done = list(pool.map(call, range(calls)))
  wall_s = time.perf_counter() - start
  return {"calls": calls, "concurrency": concurrency, "calls_per_s": calls / wall_s,
         **tail_ms([s for _, _, s in done]),
         "outcomes": dict(collections.Counter(outcome for _, outcome, _ in done)),
         "by_route": {path.split("/")[1]: tail_ms([s for p, _, s in done if p == path])
                      for path in dict.fromkeys(HTTP_ROUTES)},
         "threads_before_after": [threads, threading.active_count()],
         "fds_before_after": [fds, open_fds()]}


def print_http(row: dict) -> dict:
  """Prints one HTTP load figure; returns it."""
  routes = "  ".join(f"{name} p50 {r['p50_ms']:.0f} max {r['max_ms']:.0f}"
                     for name, r in row["by_route"].items())
  print(f"{'http tools':>16}: {row['calls']} calls, {row['concurrency']} at a time: "
        f"{row['calls_per_s']:.0f} calls/s; p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} "
        f"ms, max {row['max_ms']:.0f} ms ({routes} ms); outcomes {row['outcomes']}; threads "
        f"{row['threads_before_after']}, fds {row['fds_before_after']} before/after", flush=True)
  return row


def run_sandbox() -> dict:
  """Returns the bare subprocess's figures and each isolation mode's."""
  count, workers = _SNIPPETS.value, [int(w) for w in _WORKERS.value]
  print(f"{os.cpu_count()} CPUs; {count} snippets per figure; snippet: {SNIPPET!r}")
  peer = percentiles(timed(lambda: subprocess.run([sys.executable, "-I", "-c", SNIPPET],
                                                  capture_output=True, check=True), count))
  print(f"{'bare subprocess':>16}: p50 {peer['p50_ms']:6.1f} ms  p95 {peer['p95_ms']:6.1f} ms")
  rows = []
  for mode in ISOLATION_MODES:
    # As root the rlimit mode drops privileges, so it needs a python every uid can run.
    python = "/usr/bin/python3" if mode == "rlimit" and os.geteuid() == 0 else sys.executable
    for persistent in (False, True):
      name = f"{mode} {'pool' if persistent else 'per-run'}"
      try:
        row = bench_sandbox(mode, python, count, workers, persistent)
      except (ValueError, OSError) as e:
        print(f"{name:>16}: unavailable ({e})")
        break
      row["ratio_to_bare_p50"] = row["p50_ms"] / peer["p50_ms"]
      rows.append(row)
      rates = "  ".join(f"{n}w {row[f'per_s_{n}_workers']:5.1f}/s" for n in workers)
      print(f"{name:>16}: p50 {row['p50_ms']:6.1f} ms  p95 {row['p95_ms']:6.1f} ms  "
            f"({row['ratio_to_bare_p50']:.2f}x bare)  throughput {rates}  (first call "
            f"{row['first_call_ms']:.0f} ms)", flush=True)
    if len(rows) >= 2 and rows[-1]["mode"] == rows[-2]["mode"] == mode:
      before, after = rows[-2], rows[-1]
      gains = "  ".join(f"{n}w {after[f'per_s_{n}_workers'] / before[f'per_s_{n}_workers']:.2f}x"
                        for n in workers)
      print(f"{'':>16}  pool / per-run: p50 {before['p50_ms'] / after['p50_ms']:.2f}x faster, "
            f"throughput {gains}", flush=True)
  return {"bare_subprocess": peer, "sandbox": rows}


def run_search() -> dict:
  """Returns BM25 search latency over the shipped corpus and its index build and load times."""
  count = _SNIPPETS.value
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
  return search_row


def main(argv):
  del argv
  figures = {}
  if "sandbox" in _PARTS.value:
    figures.update(run_sandbox())
  if "search" in _PARTS.value:
    figures["search"] = run_search()
  if "http" in _PARTS.value:
    print(f"{os.cpu_count()} CPUs; HTTP limits {HTTP_LIMITS}; routes {HTTP_ROUTES}")
    with faulty_http.start() as url:
      figures["http"] = [print_http(bench_http(url, _HTTP_CALLS.value, int(n)))
                         for n in _HTTP_CONCURRENCY.value]
  os.makedirs(os.path.dirname(_OUTPUT.value) or ".", exist_ok=True)
  with open(_OUTPUT.value, "w") as f:
    json.dump(figures, f, indent=2)
  print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
