"""HTTP adapters (search API, crawl, summarizer) against a fake server on 127.0.0.1."""

import collections
import concurrent.futures
import contextlib
import http.server
import json
import os
import threading
import time

import pytest

from tools_env import base, faulty_http
from tools_env.remote import ChatSummarizer, HttpCrawl, HttpLimits, RemoteSearch, html_to_text

FAST = HttpLimits(timeout_s=5.0, retries=2, backoff_s=0.01, max_response_bytes=2**16)

PAGE = """<html><head><title>Lake Zurich</title><style>p {color: red}</style>
<script>var secret = 1;</script></head>
<body><h1>Lake Zurich</h1><p>It lies at 406&nbsp;m &amp; is   fed by the Linth.</p>
<ul><li>Area: 88.66 km&sup2;</li></ul></body></html>"""


class FakeServer(http.server.ThreadingHTTPServer):
  """Routes by path; counts requests per path and keeps the last JSON payloads."""

  def __init__(self):
    super().__init__(("127.0.0.1", 0), Handler)
    self.hits = collections.Counter()
    self.payloads = []

  def url(self, path):
    return f"http://127.0.0.1:{self.server_address[1]}{path}"


class Handler(http.server.BaseHTTPRequestHandler):

  def log_message(self, *args):
    pass

  def reply(self, status, body, content_type="application/json"):
    data = body if isinstance(body, bytes) else body.encode()
    try:
      self.send_response(status)
      self.send_header("Content-Type", content_type)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
      pass  # the client timed out and left

  def do_GET(self):
    self.server.hits[self.path] += 1
    routes = {
        "/page.html": (200, PAGE, "text/html; charset=utf-8"),
        "/notes.txt": (200, "plain notes", "text/plain"),
        "/odd.txt": (200, "odd notes", "text/plain; charset=x-unknown"),
        "/big.html": (200, "<p>" + "word " * 100_000 + "</p>", "text/html"),
        "/image.png": (200, b"\x89PNG\r\n", "image/png"),
    }
    if self.path == "/slow.html":
      time.sleep(1.0)
    self.reply(*routes.get(self.path, (404, "missing", "text/plain")))

  def do_POST(self):
    self.server.hits[self.path] += 1
    payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    headers = {key.lower(): value for key, value in self.headers.items()}
    self.server.payloads.append((self.path, payload, headers))
    if self.path == "/search":
      q = payload["q"]
      self.reply(200, json.dumps({"organic": [
          {"title": f"About {q}", "link": f"https://a.example/{len(q)}", "snippet": "first"},
          {"title": "Second", "link": "https://b.example/", "snippet": "second"},
          {"title": "no link"}]}))
    elif self.path.startswith("/flaky/"):  # /flaky/<status>: that status twice, then 200
      failing = self.server.hits[self.path] <= 2
      self.reply(int(self.path.split("/")[2]) if failing else 200, json.dumps({"organic": [
          {"title": "Up", "link": "https://up.example/", "snippet": "recovered"}]}))
    elif self.path == "/down":
      self.reply(500, "internal error", "text/plain")
    elif self.path == "/forbidden":
      self.reply(403, "no", "text/plain")
    elif self.path == "/garbled":
      self.reply(200, '{"organic": [')
    elif self.path == "/huge":
      self.reply(200, json.dumps({"organic": [{"link": "x", "snippet": "y" * 2**17}]}))
    elif self.path == "/slow":
      time.sleep(1.0)
      self.reply(200, json.dumps({"organic": []}))
    elif self.path == "/v1/chat/completions":
      goal = payload["messages"][0]["content"].split("Goal: ")[1].split("\n")[0]
      self.reply(200, json.dumps({"choices": [{"message": {"content": f"Summary for {goal}"}}]}))
    else:
      self.reply(500, "{}")


@pytest.fixture(scope="module")
def server():
  fake = FakeServer()
  thread = threading.Thread(target=fake.serve_forever, daemon=True)
  thread.start()
  yield fake
  fake.shutdown()
  fake.server_close()


def search(server, path, **kwargs):
  return RemoteSearch(server.url(path), api_key_env=None, limits=FAST, top_k=2, **kwargs)


def test_search_success_formats_ranked_results_and_sends_the_key(server, monkeypatch):
  monkeypatch.setenv("TEST_SEARCH_KEY", "k-123")
  tool = RemoteSearch(server.url("/search"), api_key_env="TEST_SEARCH_KEY", limits=FAST, top_k=2)
  result = tool("capital of Peru")
  assert result.ok
  assert result.observation == ("1. [About capital of Peru](https://a.example/15)\nfirst\n"
                                "2. [Second](https://b.example/)\nsecond")
  path, payload, headers = server.payloads[-1]
  assert payload == {"q": "capital of Peru", "num": 2} and headers["x-api-key"] == "k-123"


def test_search_cache_answers_a_repeated_query_without_a_request(server, tmp_path):
  tool = search(server, "/search", cache_dir=str(tmp_path))
  before = server.hits["/search"]
  first, second = tool("tallest tree"), tool("tallest tree")
  assert server.hits["/search"] == before + 1
  assert first.observation == second.observation
  assert (first.metadata["cached"], second.metadata["cached"]) == (False, True)
  again = search(server, "/search", cache_dir=str(tmp_path))  # a new process reuses it too
  assert again("tallest tree").metadata["cached"]


@pytest.mark.parametrize("status", [429, 503])
def test_search_retries_429_and_5xx_then_succeeds(server, status):
  result = search(server, f"/flaky/{status}")("anything")
  assert result.ok and "recovered" in result.observation
  assert server.hits[f"/flaky/{status}"] == 3


def test_search_gives_up_after_the_retries(server):
  result = search(server, "/down")("anything")
  assert result.error_kind == base.HTTP_ERROR and "after 3 attempts" in result.observation
  assert server.hits["/down"] == 3
  forbidden = search(server, "/forbidden")("anything")
  assert forbidden.error_kind == base.HTTP_ERROR and server.hits["/forbidden"] == 1


def test_search_timeout(server):
  limits = HttpLimits(timeout_s=0.2, retries=1, backoff_s=0.0)
  tool = RemoteSearch(server.url("/slow"), api_key_env=None, limits=limits)
  result = tool("anything")  # the server answers after 1 s
  assert result.error_kind == base.TIMEOUT and "timed out after 0.2 s" in result.observation


def test_search_malformed_and_oversized_json_are_bad_responses(server):
  garbled = search(server, "/garbled")("anything")
  assert garbled.error_kind == base.BAD_RESPONSE and "malformed JSON" in garbled.observation
  huge = search(server, "/huge")("anything")
  assert huge.error_kind == base.BAD_RESPONSE and "size cap" in huge.observation


def test_missing_api_key_is_a_clear_construction_error(monkeypatch):
  monkeypatch.delenv("SERPER_API_KEY", raising=False)
  with pytest.raises(ValueError, match="SERPER_API_KEY"):
    RemoteSearch()


def test_html_to_text_drops_scripts_and_styles():
  text = html_to_text(PAGE)
  assert text == "Lake Zurich\nLake Zurich\nIt lies at 406\xa0m & is fed by the Linth.\nArea: 88.66 km²"


def test_crawl_fetches_pages_and_reports_failures_per_url(server):
  crawl = HttpCrawl(limits=FAST)
  result = crawl(f"{server.url('/page.html')} | {server.url('/notes.txt')} | "
                 f"{server.url('/missing')} | {server.url('/image.png')}")
  assert result.ok
  assert "fed by the Linth" in result.observation and "secret" not in result.observation
  assert "plain notes" in result.observation
  assert result.metadata["failed"] == [server.url("/missing"), server.url("/image.png")]
  assert "unsupported content type image/png" in result.observation
  assert crawl(server.url("/missing")).error_kind == base.NOT_FOUND
  # A charset Python has no codec for reads as utf-8 (it failed the whole call).
  assert crawl(server.url("/odd.txt")).observation.endswith("odd notes")
  assert crawl("file:///etc/passwd").error_kind == base.BAD_REQUEST


def test_crawl_cuts_an_oversized_page_and_times_out_a_slow_one(server):
  crawl = HttpCrawl(limits=FAST, max_page_chars=1000)
  big = crawl(server.url("/big.html"))
  assert big.ok and big.metadata["pages"][server.url("/big.html")]["cut"]
  assert big.observation.endswith("[the rest of the page is cut]")
  slow = HttpCrawl(limits=HttpLimits(timeout_s=0.2, retries=0))(server.url("/slow.html"))
  assert slow.error_kind == base.TIMEOUT


def test_crawl_summarizes_toward_the_goal_and_falls_back_to_the_page(server):
  summarizer = ChatSummarizer(server.url("/v1"), model="fake", api_key_env=None, limits=FAST)
  crawl = HttpCrawl(limits=FAST, summarizer=summarizer)
  result = crawl(server.url("/page.html"), goal="How deep is Lake Zurich?")
  assert result.observation.endswith("Summary for How deep is Lake Zurich?")
  path, payload, _ = server.payloads[-1]
  assert payload["model"] == "fake" and "fed by the Linth" in payload["messages"][0]["content"]
  broken = ChatSummarizer(server.url("/broken/v1"), model="fake", api_key_env=None, limits=FAST)
  fallback = HttpCrawl(limits=FAST, summarizer=broken)(server.url("/page.html"), goal="depth")
  assert fallback.ok and "fed by the Linth" in fallback.observation
  assert "HTTP 500" in fallback.metadata["pages"][server.url("/page.html")]["summary_error"]


# --- a faulty service: resets, responses cut short, dripped bytes, many concurrent calls -----

@pytest.fixture(scope="module")
def faulty():
  with faulty_http.start() as url:
    yield url


def faulty_search(url, path, limits):
  return RemoteSearch(url + path, api_key_env=None, limits=limits)


def test_a_reset_connection_is_retried_then_reported_as_an_http_error(faulty):
  result = faulty_search(faulty, "/reset/q", FAST)("lake")
  assert result.observation == (f"Error: request to {faulty}/reset/q failed: ConnectionResetError: "
                                f"[Errno 104] Connection reset by peer (after 3 attempts)")
  assert result.error_kind == base.HTTP_ERROR


def test_a_response_cut_short_is_an_http_error_not_a_short_page(faulty):
  result = HttpCrawl(limits=FAST)(f"{faulty}/cut/page")
  half = len(faulty_http.BODY) // 2
  assert result.observation == (f"Error: the connection to {faulty}/cut/page closed after {half} "
                                f"bytes, {len(faulty_http.BODY) - half} short of the announced "
                                f"length (after 3 attempts)")
  assert result.error_kind == base.HTTP_ERROR


def test_a_status_line_that_is_not_http_is_an_http_error(faulty):
  result = faulty_search(faulty, "/garble/q", FAST)("lake")
  assert result.observation == (f"Error: request to {faulty}/garble/q failed: BadStatusLine: "
                                f"SMTP ready\r\n (after 3 attempts)")
  assert result.error_kind == base.HTTP_ERROR


@pytest.mark.parametrize("mode, error", [
    ("longheader", "LineTooLong: got more than 65536 bytes when reading header line"),
    ("manyheaders", "HTTPException: got more than 100 headers")], ids=["long", "many"])
def test_headers_past_http_client_limits_are_an_http_error(faulty, mode, error):
  result = faulty_search(faulty, f"/{mode}/q", FAST)("lake")
  assert result.observation == (f"Error: request to {faulty}/{mode}/q failed: {error} "
                                f"(after 3 attempts)")
  assert result.error_kind == base.HTTP_ERROR


def test_a_dripping_server_is_cut_off_at_the_deadline_of_the_whole_request(faulty):
  # A byte every 20 ms: no read waits near its 2 s timeout, the answer would take ~4 s a try.
  limits = HttpLimits(timeout_s=2.0, retries=2, backoff_s=0.01, deadline_s=0.3)
  result = faulty_search(faulty, "/drip/20/q", limits)("lake")
  assert result.observation == (f"Error: no complete answer within the deadline of 0.3 s: "
                                f"{faulty}/drip/20/q (after 1 attempt)")
  assert result.error_kind == base.TIMEOUT and result.elapsed_s < 1.5


def test_a_slow_but_steady_answer_within_the_deadline_is_read_whole(faulty):
  limits = HttpLimits(timeout_s=2.0, retries=0, deadline_s=10.0)
  result = faulty_search(faulty, "/drip/1/q", limits)("lake")  # ~0.2 s for ~190 bytes
  assert result.ok
  assert result.observation == "1. [Lake Zurich](https://lake.example/zurich)\nIt lies at 406 m."


def open_files():
  """Returns what this process's file descriptors point at (a socket by its inode)."""
  targets = set()
  for fd in os.listdir("/proc/self/fd"):
    with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, now closed
      targets.add(os.readlink(f"/proc/self/fd/{fd}"))
  return targets


def test_128_concurrent_calls_end_as_observations_in_bounded_time_and_leak_nothing(faulty):
  # A deadline that 128 threads on a loaded 2-core machine meet (CI once missed 0.5 s), against
  # a drip that needs ~15 s.
  limits = HttpLimits(timeout_s=2.0, retries=1, backoff_s=0.01, deadline_s=3.0)
  routes = {"/ok/q": None, "/reset/q": base.HTTP_ERROR, "/cut/q": base.HTTP_ERROR,
            "/drip/50/q": base.TIMEOUT}
  calls = [list(routes)[i % len(routes)] for i in range(128)]
  search = {path: faulty_search(faulty, path, limits) for path in routes}
  crawl = HttpCrawl(limits=limits)

  def call(i):
    path = calls[i]
    return search[path]("lake") if i % 2 else crawl(f"{faulty}{path}")

  call(0)  # whatever urllib sets up once per process
  threads, files = set(threading.enumerate()), open_files()  # the module's other server too
  with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
    results = list(pool.map(call, range(len(calls))))  # a tool that raised would raise here
  assert [r.error_kind for r in results] == [routes[path] for path in calls]
  assert max(r.elapsed_s for r in results) < limits.deadline_s + 1.5
  assert set(threading.enumerate()) - threads == set() and open_files() - files == set()


def test_the_default_deadline_covers_every_attempt_waiting_out_two_timeouts():
  assert HttpLimits().deadline_s == 3 * 2 * 10.0 + 0.5 + 1.0  # three attempts, two backoffs
  assert HttpLimits(timeout_s=60.0, retries=0).deadline_s == 120.0
  with pytest.raises(ValueError, match="deadline_s > 0"):
    HttpLimits(deadline_s=0.0)
