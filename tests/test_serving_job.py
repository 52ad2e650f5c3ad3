"""`make serve`'s job in a process of its own: it prints where it serves, answers the official
client, and on SIGTERM under load ends every stream cleanly, refuses new requests and exits.
With no grace, the engine ends the streams at once: each gets its last chunk and `[DONE]`
(uvicorn's own cancel, a margin later, would cut them mid-body)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_answers_and_stops_cleanly_on_sigterm_under_load(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  log = open(tmp_path / "serve.log", "w")
  server = subprocess.Popen(  # port 0: it serves on a free port and says which
      [sys.executable, "experiments/serve.py", "--config.model.checkpoint=", "--config.port=0",
       "--config.batch_size=8", "--config.chunk=4", "--config.shutdown_grace_s=0",
       ], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  try:
    for _ in range(600):
      printed = (tmp_path / "serve.log").read_text()
      where = re.search(r" at (http://127\.0\.0\.1:(\d+))/v1\n", printed)
      if where:
        break
      assert server.poll() is None, printed
      time.sleep(0.2)
    assert where and int(where.group(2)) > 0, printed
    url = where.group(1)
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
      assert json.load(response)["status"] == "ok"
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    ends, streaming = [], threading.Semaphore(0)

    def stream(i):
      chunks = client.chat.completions.create(
          model=model, messages=[{"role": "user", "content": f"Task {i}"}], temperature=1.0,
          max_tokens=400, stream=True)
      reasons = []
      for chunk in chunks:
        if not reasons:
          streaming.release()
        reasons += [choice.finish_reason for choice in chunk.choices]
      ends.append(reasons[-1])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
      thread.start()
    for _ in threads:  # every stream under way
      assert streaming.acquire(timeout=120)
    server.send_signal(signal.SIGTERM)
    for thread in threads:
      thread.join(60)
    # Every stream ended cleanly: cut at the shutdown ("length"), or at its own end before it (a
    # random model closes a tool tag or samples the end token now and then).
    assert len(ends) == 4 and set(ends) <= {"stop", "length", "tool_calls"}, ends
    assert server.wait(timeout=60) == 0
  finally:
    if server.poll() is None:
      server.kill()
  printed = (tmp_path / "serve.log").read_text()
  assert f"{url}/v1" in printed and "curl" in printed and "stopped" in printed
