"""A local HTTP service that fails the way real ones do: the remote tools' tests and benchmark.

Every path answers GET and POST with the same Serper-style JSON result (`BODY`, which the
crawl reads as a text page too), in the way its first segment names:

- `/ok/...`: at once.
- `/reset/...`: never; once the request is read the connection is reset (an RST).
- `/cut/...`: headers announcing the whole body, then half of it, then the connection closes.
- `/garble/...`: a status line that is not HTTP, then the connection closes.
- `/longheader/...`: a header line longer than http.client reads (64 KiB), then the body.
- `/manyheaders/...`: more headers than http.client reads (100), then the body.
- `/drip/<ms>/...`: the whole response, status line and headers included, one byte every
  <ms> milliseconds, so that no single socket read waits long.

`python -m tools_env.faulty_http` serves on a free port of 127.0.0.1, prints `port <n>`, and
stops when its stdin closes (so it never outlives the process that started it); `start()`
does that from Python. Standard library only.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Iterator

BODY = json.dumps({"organic": [{"title": "Lake Zurich", "link": "https://lake.example/zurich",
                                "snippet": "It lies at 406 m."}]}).encode()


class FaultyHandler(http.server.BaseHTTPRequestHandler):
  """Answers every request as its path's first segment says."""

  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def do_GET(self):
    self._answer()

  def do_POST(self):
    self.rfile.read(int(self.headers.get("Content-Length", 0)))
    self._answer()

  def _answer(self):
    self.close_connection = True
    route = self.path.split("/")
    with contextlib.suppress(OSError):  # the client left (a broken pipe, a reset)
      if route[1] == "reset":
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()  # with a zero linger time: an RST, not a FIN
      elif route[1] == "cut":
        self._head(len(BODY))
        self.wfile.write(BODY[:len(BODY) // 2])
      elif route[1] == "garble":
        self.wfile.write(b"SMTP ready\r\n\r\n")
      elif route[1] == "longheader":
        self._head(len(BODY), {"X-Long": "a" * 70_000})
        self.wfile.write(BODY)
      elif route[1] == "manyheaders":
        self._head(len(BODY), {f"X-Header-{i}": "a" for i in range(101)})
        self.wfile.write(BODY)
      elif route[1] == "drip":
        self._drip(float(route[2]) / 1000)
      else:
        self._head(len(BODY))
        self.wfile.write(BODY)

  def _head(self, length: int, extra: dict[str, str] | None = None) -> None:
    self.send_response(200)
    for key, value in (extra or {}).items():
      self.send_header(key, value)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(length))
    self.end_headers()

  def _drip(self, every_s: float) -> None:
    response = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n").encode() + BODY
    for i in range(len(response)):
      self.wfile.write(response[i:i + 1])
      time.sleep(every_s)


class FaultyServer(http.server.ThreadingHTTPServer):
  """The faulty service on 127.0.0.1 (port 0: a free one), a thread per connection."""

  request_queue_size = 1024  # hundreds of concurrent clients connect at once

  def __init__(self, port: int = 0):
    super().__init__(("127.0.0.1", port), FaultyHandler)


@contextlib.contextmanager
def start() -> Iterator[str]:
  """Yields the base URL of the faulty service running in a child process, stopped at exit."""
  proc = subprocess.Popen([sys.executable, "-m", "tools_env.faulty_http"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  try:
    line = proc.stdout.readline().decode()
    if not line.startswith("port "):
      raise RuntimeError(f"the faulty HTTP service did not start: {line!r}")
    yield f"http://127.0.0.1:{int(line.split()[1])}"
  finally:
    proc.stdin.close()  # its stdin closes: it stops
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    proc.stdout.close()


def main() -> None:
  server = FaultyServer()
  threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
  print(f"port {server.server_address[1]}", flush=True)
  sys.stdin.buffer.read()  # until the parent closes it
  server.shutdown()
  server.server_close()


if __name__ == "__main__":
  main()
