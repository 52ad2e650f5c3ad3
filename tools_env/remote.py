"""Remote services behind the Tool interface: a search API, an HTTP crawler, a summarizer.

- `RemoteSearch`: a Serper-style search API (POST {"q", "num"} -> {"organic": [{"title",
  "link", "snippet"}]}), results in the same `1. [Title](url)` format as the embedded BM25
  search, with an on-disk cache keyed by endpoint, query and k.
- `HttpCrawl`: `crawl_page` over HTTP(S): `|`-separated URLs, each fetched with a size cap
  and turned from HTML into text; optionally condensed toward the task's goal by a
  `ChatSummarizer` (any OpenAI-compatible /chat/completions endpoint), falling back to the
  page text when the summarizer fails.

Every request goes through `fetch` with the limits of an `HttpLimits`: a timeout per socket
wait, a deadline over the whole request (every attempt, wait and byte of it: a server that
drips its answer a byte at a time never keeps a call longer), retries with exponential backoff
on timeouts, connection errors, truncated or malformed responses, 429 and 5xx, and a response
size cap. Loopback addresses never go through a proxy. Standard library only.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import html.parser
import http.client
import io
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from tools_env.base import (
  BAD_REQUEST,
  BAD_RESPONSE,
  HTTP_ERROR,
  NO_RESULTS,
  NOT_FOUND,
  TIMEOUT,
  Tool,
  ToolFailure,
)
from tools_env.search import Crawl, format_results

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class HttpLimits:
  """Limits of every HTTP request a tool makes."""

  timeout_s: float = 10.0  # per socket wait: connect, send, each read
  retries: int = 2  # extra attempts after a timeout, connection error, 429 or 5xx
  backoff_s: float = 0.5  # the k-th retry waits backoff_s * 2**k
  max_response_bytes: int = 2 * 2**20  # larger responses are cut here (crawl) or refused
  # The whole request, every attempt and backoff included; None: what the attempts and backoffs
  # take when each attempt waits out a timeout to connect and another for the answer.
  deadline_s: float | None = None

  def __post_init__(self):
    if self.deadline_s is None:
      object.__setattr__(self, "deadline_s", (self.retries + 1) * 2 * self.timeout_s
                         + self.backoff_s * (2 ** self.retries - 1))
    if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0 or \
        self.max_response_bytes <= 0 or self.deadline_s <= 0:
      raise ValueError(f"invalid HttpLimits {self}: need timeout_s > 0, retries >= 0, "
                       f"backoff_s >= 0, max_response_bytes > 0, deadline_s > 0")


@dataclasses.dataclass(frozen=True)
class Response:
  body: bytes
  content_type: str
  charset: str
  cut: bool  # the body was longer than max_response_bytes and is cut there
  attempts: int


def _wait_s(deadline: float, timeout_s: float) -> float:
  """Returns how long the next socket wait may last; raises TimeoutError past `deadline`."""
  left = deadline - time.monotonic()
  if left <= 0:
    raise TimeoutError("the request's deadline passed")
  return min(timeout_s, left)


class _BoundedReader(io.RawIOBase):
  """A socket's reader whose every wait ends by `deadline` (of time.monotonic)."""

  def __init__(self, sock: socket.socket, deadline: float, timeout_s: float):
    super().__init__()
    self.sock, self.deadline, self.timeout_s = sock, deadline, timeout_s
    self.raw = sock.makefile("rb", buffering=0)  # holds the socket open until closed

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int | None:
    self.sock.settimeout(_wait_s(self.deadline, self.timeout_s))
    return self.raw.readinto(buffer)

  def close(self) -> None:
    if not self.closed:
      self.raw.close()
    super().close()


class _BoundedSocket:
  """What an HTTPResponse asks of its socket: a file whose every read ends by the deadline."""

  def __init__(self, sock: socket.socket, deadline: float, timeout_s: float):
    self.sock, self.deadline, self.timeout_s = sock, deadline, timeout_s

  def makefile(self, mode: str) -> io.BufferedReader:
    return io.BufferedReader(_BoundedReader(self.sock, self.deadline, self.timeout_s))


class _BoundedResponse(http.client.HTTPResponse):
  """An HTTP response whose status line, headers and body are read by a deadline."""

  def __init__(self, sock, *args, deadline: float, timeout_s: float, **kwargs):
    super().__init__(_BoundedSocket(sock, deadline, timeout_s), *args, **kwargs)


class _BoundedConnection:
  """Makes an http.client connection class end every socket wait (connect and TLS handshake,
  each send, each read) by `deadline`."""

  def __init__(self, *args, deadline: float, **kwargs):
    super().__init__(*args, **kwargs)
    self.deadline, self.wait_timeout_s = deadline, self.timeout
    self.response_class = functools.partial(_BoundedResponse, deadline=deadline,
                                            timeout_s=self.timeout)

  def connect(self) -> None:
    self.timeout = _wait_s(self.deadline, self.wait_timeout_s)
    super().connect()

  def send(self, data) -> None:
    if self.sock is not None:
      self.sock.settimeout(_wait_s(self.deadline, self.wait_timeout_s))
    super().send(data)


@functools.cache
def _bounded(connection_class: type) -> type:
  return type(f"Bounded{connection_class.__name__}", (_BoundedConnection, connection_class), {})


class _BoundedOpen:
  """Makes a urllib handler open its connections through `_bounded` classes."""

  def __init__(self, deadline: float):
    super().__init__()
    self.deadline = deadline

  def do_open(self, http_class, request, **kwargs):
    return super().do_open(functools.partial(_bounded(http_class), deadline=self.deadline),
                           request, **kwargs)


class _HttpHandler(_BoundedOpen, urllib.request.HTTPHandler):
  pass


class _HttpsHandler(_BoundedOpen, urllib.request.HTTPSHandler):
  pass


def _opener(url: str, deadline: float) -> urllib.request.OpenerDirector:
  host = urllib.parse.urlsplit(url).hostname or ""
  proxies = {} if host in _LOOPBACK else None  # None: the environment's proxies
  return urllib.request.build_opener(urllib.request.ProxyHandler(proxies),
                                     _HttpHandler(deadline), _HttpsHandler(deadline))


def _read_body(reply: http.client.HTTPResponse, limits: HttpLimits) -> bytes:
  """Returns up to max_response_bytes + 1 bytes of the body; raises http.client.IncompleteRead
  if the server closed the connection before the length it announced."""
  body = reply.read(limits.max_response_bytes + 1)
  if len(body) <= limits.max_response_bytes and reply.length:  # bytes announced, never sent
    raise http.client.IncompleteRead(body, reply.length)
  return body


def fetch(url: str, limits: HttpLimits, payload: Any = None,
          headers: dict[str, str] | None = None) -> Response:
  """Returns the response to GET `url` (POST of `payload` as JSON if given); raises
  ToolFailure after the retries are spent, at the deadline, or at once for a 4xx but 429."""
  if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
    raise ToolFailure(BAD_REQUEST, f"not an http(s) URL: {url[:200]!r}")
  data = None if payload is None else json.dumps(payload).encode()
  headers = {"User-Agent": "coa-jax-tools/1.0", **(headers or {})}
  if data is not None:
    headers["Content-Type"] = "application/json"
  deadline = time.monotonic() + limits.deadline_s
  failure, attempts = None, 0
  for attempt in range(limits.retries + 1):
    if attempt:
      wait = limits.backoff_s * 2 ** (attempt - 1)
      if time.monotonic() + wait >= deadline:
        break
      time.sleep(wait)
    attempts += 1
    try:
      return _attempt(url, data, headers, limits, deadline, attempt + 1)
    except ToolFailure as e:
      failure = e
      status = e.metadata.get("status", 500)
      if status < 500 and status != 429:  # a 404 or a refusal that no retry changes
        raise ToolFailure(e.kind, str(e)) from None
    if time.monotonic() >= deadline:
      failure = ToolFailure(TIMEOUT, f"no complete answer within the deadline of "
                                     f"{limits.deadline_s:g} s: {url[:200]}")
      break
  raise ToolFailure(failure.kind, f"{failure} (after {attempts} attempt{'s' * (attempts > 1)})")


def _known_charset(charset: str | None) -> str:
  """Returns the response's charset, or utf-8 for none or one Python has no codec for."""
  try:
    return codecs.lookup(charset).name if charset else "utf-8"
  except LookupError:
    return "utf-8"


def _attempt(url: str, data: bytes | None, headers: dict[str, str], limits: HttpLimits,
             deadline: float, number: int) -> Response:
  """Returns the response of one attempt; raises ToolFailure (with the HTTP `status` in its
  metadata when the server answered with an error)."""
  request = urllib.request.Request(url, data=data, headers=headers)
  try:
    with _opener(url, deadline).open(request, timeout=limits.timeout_s) as reply:
      body = _read_body(reply, limits)
      return Response(body[:limits.max_response_bytes], reply.headers.get_content_type(),
                      _known_charset(reply.headers.get_content_charset()),
                      len(body) > limits.max_response_bytes, number)
  except urllib.error.HTTPError as e:
    e.close()
    kind = NOT_FOUND if e.code == 404 else HTTP_ERROR
    raise ToolFailure(kind, f"HTTP {e.code} for {url[:200]}", status=e.code) from None
  except (TimeoutError, socket.timeout):
    raise ToolFailure(TIMEOUT, f"timed out after {limits.timeout_s:g} s: {url[:200]}") from None
  except urllib.error.URLError as e:
    if isinstance(e.reason, (TimeoutError, socket.timeout)):
      raise ToolFailure(TIMEOUT, f"timed out after {limits.timeout_s:g} s: {url[:200]}") from None
    raise ToolFailure(HTTP_ERROR, f"cannot reach {url[:200]}: {e.reason}") from None
  except http.client.IncompleteRead as e:
    raise ToolFailure(HTTP_ERROR, f"the connection to {url[:200]} closed after "
                                  f"{len(e.partial)} bytes, {e.expected} short of the "
                                  f"announced length") from None
  except (OSError, ValueError, http.client.HTTPException) as e:  # resets, malformed responses
    raise ToolFailure(HTTP_ERROR, f"request to {url[:200]} failed: {type(e).__name__}: {e}") \
        from None


def _json(response: Response, what: str) -> Any:
  if response.cut:
    raise ToolFailure(BAD_RESPONSE, f"{what} response larger than the size cap")
  try:
    return json.loads(response.body.decode(response.charset, errors="replace"))
  except json.JSONDecodeError as e:
    raise ToolFailure(BAD_RESPONSE, f"{what} returned malformed JSON ({e})") from None


def _api_key(env_var: str | None) -> str | None:
  if env_var is None:
    return None
  key = os.environ.get(env_var)
  if not key:
    raise ValueError(f"environment variable {env_var} (the API key) is not set; set it or "
                     f"pass api_key_env=None for an endpoint without a key")
  return key


class RemoteSearch(Tool):
  """A Serper-style search API as `web_search`/`wiki_search`, cached on disk by query."""

  def __init__(self, endpoint: str = "https://google.serper.dev/search",
               api_key_env: str | None = "SERPER_API_KEY", top_k: int = 5,
               cache_dir: str | None = None, limits: HttpLimits | None = None,
               max_query_chars: int = 2000, max_output_chars: int = 8000,
               name: str = "web_search"):
    super().__init__(max_output_chars)
    self.endpoint, self.top_k, self.cache_dir, self.name = endpoint, top_k, cache_dir, name
    self.limits, self.max_query_chars = limits or HttpLimits(), max_query_chars
    self._headers = {"X-API-KEY": key} if (key := _api_key(api_key_env)) else {}

  def _cache_path(self, query: str) -> str | None:
    if self.cache_dir is None:
      return None
    key = hashlib.sha256(json.dumps([self.endpoint, query, self.top_k]).encode()).hexdigest()
    return os.path.join(self.cache_dir, key[:2], key + ".json")

  def search(self, query: str) -> tuple[list[tuple[str, str, str]], bool]:
    """Returns the (title, url, snippet) results for `query` and whether they were cached."""
    path = self._cache_path(query)
    if path and os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        return [tuple(r) for r in json.load(f)], True
    reply = _json(fetch(self.endpoint, self.limits, {"q": query, "num": self.top_k},
                        self._headers), "search API")
    organic = reply.get("organic") if isinstance(reply, dict) else None
    if not isinstance(organic, list):
      raise ToolFailure(BAD_RESPONSE, "search API response has no 'organic' result list")
    results = [(str(r.get("title", "")), str(r["link"]), str(r.get("snippet", "")))
               for r in organic if isinstance(r, dict) and r.get("link")][:self.top_k]
    if path:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      # A temporary file of this thread's own: two threads may search the same query at once.
      temporary = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
      with open(temporary, "w", encoding="utf-8") as f:
        json.dump(results, f)
      os.replace(temporary, path)
    return results, False

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    query = body.strip()[:self.max_query_chars]
    if not query:
      raise ToolFailure(BAD_REQUEST, "empty search query")
    results, cached = self.search(query)
    if not results:
      raise ToolFailure(NO_RESULTS, f"no results for {query[:100]!r}")
    return format_results(results), {"urls": [url for _, url, _ in results], "cached": cached}


class _TextExtractor(html.parser.HTMLParser):
  """Collects the visible text of an HTML page, one line per block element."""

  SKIP = {"script", "style", "noscript", "svg", "template", "iframe"}
  BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section",
           "article", "header", "footer", "blockquote", "pre", "table", "ul", "ol", "title"}

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.parts: list[str] = []
    self.skipping = 0

  def handle_starttag(self, tag, attrs):
    if tag in self.SKIP:
      self.skipping += 1
    elif tag in self.BLOCK:
      self.parts.append("\n")

  def handle_endtag(self, tag):
    if tag in self.SKIP:
      self.skipping = max(0, self.skipping - 1)
    elif tag in self.BLOCK:
      self.parts.append("\n")

  def handle_data(self, data):
    if not self.skipping:
      self.parts.append(data)


def html_to_text(page: str) -> str:
  """Returns the visible text of an HTML page: scripts and styles dropped, whitespace tidied."""
  extractor = _TextExtractor()
  extractor.feed(page)
  extractor.close()
  lines = (re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in
           "".join(extractor.parts).split("\n"))
  return "\n".join(line for line in lines if line)


class ChatClient:
  """An OpenAI-compatible /chat/completions client; HttpLimits give its timeout and retries."""

  def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
               limits: HttpLimits | None = None, max_tokens: int = 1024,
               temperature: float = 0.0, what: str = "chat"):
    self.url = base_url.rstrip("/") + "/chat/completions"
    self.model, self.max_tokens, self.temperature, self.what = model, max_tokens, temperature, what
    self.limits = limits or HttpLimits(timeout_s=60.0)
    key = _api_key(api_key_env)
    self._headers = {"Authorization": f"Bearer {key}"} if key else {}

  def complete(self, messages: list[dict[str, str]]) -> str:
    """Returns the reply's message text; raises ToolFailure."""
    payload = {"model": self.model, "temperature": self.temperature,
               "max_tokens": self.max_tokens, "messages": messages}
    reply = _json(fetch(self.url, self.limits, payload, self._headers), self.what)
    try:
      content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
      raise ToolFailure(BAD_RESPONSE, f"{self.what} response has no "
                                      f"choices[0].message.content") from None
    if not isinstance(content, str):
      raise ToolFailure(BAD_RESPONSE, f"{self.what} message content is not text")
    return content


class ChatSummarizer:
  """Condenses a page toward a goal through an OpenAI-compatible chat completions endpoint."""

  PROMPT = ("Extract from the page below everything relevant to the goal, keeping facts, "
            "numbers, names and dates exact. Say 'Nothing relevant.' if nothing is.\n\n"
            "Goal: {goal}\n\nPage ({url}):\n{page}")

  def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
               limits: HttpLimits | None = None, max_page_chars: int = 30000,
               max_tokens: int = 1024):
    self.client = ChatClient(base_url, model, api_key_env, limits, max_tokens,
                             what="summarizer")
    self.max_page_chars = max_page_chars

  def __call__(self, page: str, goal: str, url: str = "") -> str:
    """Returns the page condensed toward `goal`; raises ToolFailure."""
    prompt = self.PROMPT.format(goal=goal, url=url, page=page[:self.max_page_chars])
    content = self.client.complete([{"role": "user", "content": prompt}])
    if not content.strip():
      raise ToolFailure(BAD_RESPONSE, "summarizer returned an empty message")
    return content.strip()


class HttpCrawl(Crawl):
  """`crawl_page` over HTTP(S): HTML to text, optional summarizer toward the goal."""

  TEXT_TYPES = ("text/plain", "application/json", "application/xml", "text/xml",
                "text/markdown", "text/csv")

  def __init__(self, limits: HttpLimits | None = None, max_urls: int = 5,
               max_page_chars: int = 6000, summarizer: ChatSummarizer | None = None,
               max_output_chars: int = 12000):
    super().__init__(max_urls, max_page_chars, max_output_chars)
    self.limits, self.summarizer = limits or HttpLimits(), summarizer

  def page(self, url: str, goal: str) -> tuple[str, dict[str, Any]]:
    """Returns one page's text (condensed toward `goal` if there is a summarizer)."""
    response = fetch(url, self.limits)
    text = response.body.decode(response.charset, errors="replace")
    if response.content_type in ("text/html", "application/xhtml+xml"):
      text = html_to_text(text)
    elif response.content_type not in self.TEXT_TYPES:
      raise ToolFailure(BAD_RESPONSE, f"unsupported content type {response.content_type}")
    info: dict[str, Any] = {"cut": response.cut or len(text) > self.max_page_chars}
    if self.summarizer is not None and goal:
      try:
        return self.summarizer(text, goal, url), {**info, "summarized": True}
      except ToolFailure as e:
        info["summary_error"] = str(e)
    if info["cut"]:
      text = text[:self.max_page_chars] + "\n[the rest of the page is cut]"
    return text, {**info, "summarized": False}
