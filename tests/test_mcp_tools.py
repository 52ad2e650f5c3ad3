"""MCP servers as CoA tools, against tests/mcp_fixture_server.py (stdio, and HTTP once)."""

import concurrent.futures
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("mcp")

import mcp.types  # noqa: E402

from tools_env import base  # noqa: E402
from tools_env.mcp_tools import (  # noqa: E402
           McpError,
           McpServer,
           result_text,
           server_tools,
)

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcp_fixture_server.py")
FIXTURE_TOOLS = {"echo", "add", "sleep", "crash", "freeze", "garbage", "bad_result", "pid"}


def fixture_server(**options) -> McpServer:
  return McpServer([sys.executable, FIXTURE], **options)


@pytest.fixture(scope="module")
def server():
  with fixture_server(call_timeout_s=10.0) as started:
    yield started


@pytest.fixture(scope="module")
def tools(server):
  return server_tools(server)


def server_pid(server: McpServer) -> int:
  # a call meant to answer gets 10 s whatever the server's short default for those meant not to
  return int(server.call("pid", {}, timeout_s=10.0).observation)


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
  """Returns whether process `pid` is gone (exited and reaped) within the timeout."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.02)


def test_list_tools_gives_names_descriptions_and_schemas(server):
  infos = {info.name: info for info in server.list_tools()}
  assert set(infos) == FIXTURE_TOOLS
  assert infos["echo"].description == "Returns the text unchanged."
  assert infos["add"].input_schema["properties"]["a"]["type"] == "integer"
  assert infos["add"].input_schema["required"] == ["a", "b"]


def test_string_body_is_the_one_string_argument(tools):
  result = tools["echo"]("  hello, world \n")
  assert (result.ok, result.observation) == (True, "hello, world")


def test_json_body_gives_the_arguments(tools):
  result = tools["add"]('{"a": 2, "b": 40}')
  assert (result.ok, result.observation) == (True, "42")


def test_malformed_json_body_is_a_bad_request_listing_the_arguments(tools):
  result = tools["add"]("2 + 40")
  assert (result.ok, result.error_kind) == (False, base.BAD_REQUEST)
  assert "JSON object" in result.observation
  assert "a (integer, required), b (integer, required)" in result.observation


def test_tool_error_result_is_a_tool_error_with_its_text(tools):
  result = tools["add"]('{"a": "two", "b": 40}')
  assert (result.ok, result.error_kind) == (False, base.TOOL_ERROR)
  assert "valid integer" in result.observation


def test_call_past_the_timeout_times_out_and_the_next_call_works():
  with fixture_server(call_timeout_s=0.5) as quick:
    result = server_tools(quick, ["sleep"])["sleep"]('{"seconds": 30}')
    assert (result.ok, result.error_kind) == (False, base.TIMEOUT)
    assert result.elapsed_s < 5
    assert quick.call("echo", {"text": "still here"}, timeout_s=10.0).observation == "still here"


def test_crash_mid_call_is_an_error_and_the_next_call_restarts_the_server(server, tools):
  old_pid = server_pid(server)
  result = tools["crash"]("")
  assert (result.ok, result.error_kind) == (False, base.TOOL_ERROR)
  assert "exited" in result.observation
  assert tools["echo"]("again").observation == "again"
  assert server_pid(server) != old_pid
  assert wait_gone(old_pid)


def test_server_killed_between_calls_is_restarted_transparently(server):
  old_pid = server_pid(server)
  os.kill(old_pid, signal.SIGKILL)
  assert wait_gone(old_pid)
  deadline = time.monotonic() + 10  # until the session has read the end of the server's stdout
  while not server._connection.ended.is_set() and time.monotonic() < deadline:
    time.sleep(0.02)
  result = server.call("echo", {"text": "fresh"})
  assert (result.ok, result.observation) == (True, "fresh")


def test_garbage_on_stdout_is_dropped_and_the_run_goes_on(tools, caplog):
  with caplog.at_level(logging.ERROR, logger="mcp.client.stdio"):
    result = tools["garbage"]("")
  assert any(record.name == "mcp.client.stdio" for record in caplog.records)  # it arrived
  assert (result.ok, result.observation) == (True, "garbage written")
  assert tools["echo"]("after").observation == "after"


def test_invalid_result_is_a_bad_response(tools):
  result = tools["bad_result"]("")
  assert (result.ok, result.error_kind) == (False, base.BAD_RESPONSE)
  assert "invalid result" in result.observation
  assert tools["echo"]("after").observation == "after"


@pytest.mark.parametrize("command, reason", [
    (["/nonexistent/mcp-server"], "command not found"),
    ([sys.executable, "-c", "raise SystemExit(2)"], "exited"),
])
def test_server_that_cannot_start(command, reason):
  with McpServer(command, start_timeout_s=10.0) as broken:
    with pytest.raises(McpError, match=reason) as raised:
      broken.list_tools()
    assert command[0] in str(raised.value)
    result = broken.call("echo", {"text": "x"})
    assert (result.ok, result.error_kind) == (False, base.TOOL_ERROR)
    assert reason in result.observation


def failing_server(tmp_path, **options) -> McpServer:
  """A server that exits 0.2 s after it starts, before any handshake; each start appends a line
  to tmp_path/starts."""
  program = (f"import sys, time; open({str(tmp_path / 'starts')!r}, 'a').write('start\\n'); "
             f"time.sleep(0.2); sys.exit(2)")
  return McpServer([sys.executable, "-c", program], start_timeout_s=10.0, **options)


def starts(tmp_path) -> int:
  return len((tmp_path / "starts").read_text().splitlines())


def test_concurrent_calls_share_one_start_of_a_server_that_cannot_start(tmp_path):
  with failing_server(tmp_path, start_backoff_s=30.0) as broken:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      results = list(pool.map(lambda i: broken.call("echo", {"text": str(i)}), range(8)))
    assert starts(tmp_path) == 1
  assert [(r.ok, r.error_kind) for r in results] == [(False, base.TOOL_ERROR)] * 8
  assert all("did not start: it exited" in r.observation for r in results)


def test_calls_in_the_cooldown_after_a_failed_start_fail_at_once_with_the_reason(tmp_path):
  with failing_server(tmp_path, start_backoff_s=30.0) as broken:
    broken.call("echo", {"text": "x"})
    result = broken.call("echo", {"text": "x"})
    assert starts(tmp_path) == 1
  assert (result.ok, result.error_kind) == (False, base.TOOL_ERROR)
  assert result.elapsed_s < 0.5
  assert "did not start: it exited" in result.observation
  assert re.search(r"not started again for (29|30)\.\d s: 1 failed start\(s\) in a row",
                   result.observation)


def test_after_the_cooldown_the_server_is_started_again_and_the_cooldown_doubles(tmp_path):
  with failing_server(tmp_path, start_backoff_s=0.5, max_start_backoff_s=60.0) as broken:
    broken.call("echo", {"text": "x"})
    time.sleep(0.6)
    broken.call("echo", {"text": "x"})
    assert starts(tmp_path) == 2
    result = broken.call("echo", {"text": "x"})
  assert re.search(r"not started again for (0\.\d|1\.0) s: 2 failed start\(s\) in a row",
                   result.observation)


def test_a_hung_server_is_restarted_after_restart_after_timeouts_calls_in_a_row(tmp_path):
  with fixture_server(call_timeout_s=0.5, restart_after_timeouts=2) as hung:
    old_pid = server_pid(hung)
    first = hung.call("freeze", {})  # the server stops: alive, answering nothing
    second = hung.call("pid", {})
    assert [first.error_kind, second.error_kind] == [base.TIMEOUT, base.TIMEOUT]
    assert "restarted" not in first.observation and "answered none" not in first.observation
    assert "answered none of the last 2 calls: it is stopped, and the next call starts it " \
           "afresh" in second.observation
    assert server_pid(hung) != old_pid
    assert wait_gone(old_pid)


def test_an_answer_between_timeouts_starts_the_count_again():
  with fixture_server(call_timeout_s=10.0, restart_after_timeouts=2) as slow:
    old_pid = server_pid(slow)
    for _ in range(2):
      assert slow.call("sleep", {"seconds": 30}, timeout_s=0.5).error_kind == base.TIMEOUT
      assert slow.call("echo", {"text": "here"}).observation == "here"
    assert server_pid(slow) == old_pid


def test_server_answering_garbage_fails_to_start_saying_so():
  command = [sys.executable, "-c", "import sys; print('hello', flush=True); sys.stdin.read()"]
  with McpServer(command, start_timeout_s=3.0) as chatty:
    with pytest.raises(McpError, match="no MCP handshake within 3 s.*not JSON-RPC: 'hello'"):
      chatty.list_tools()


def test_close_stops_the_process_and_is_idempotent():
  closing = fixture_server()
  pid = server_pid(closing)
  closing.close()
  assert wait_gone(pid, timeout_s=0)
  closing.close()
  result = closing.call("echo", {"text": "x"})
  assert (result.ok, result.error_kind) == (False, base.TOOL_ERROR)
  assert "closed" in result.observation


def test_concurrent_calls_from_threads_are_all_answered(server):
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda i: server.call("add", {"a": i, "b": 1000}), range(8)))
  assert [result.observation for result in results] == [str(1000 + i) for i in range(8)]


def test_server_tools_keeps_the_named_tools_and_rejects_unknown_names(server):
  assert list(server_tools(server, ["add", "echo"])) == ["add", "echo"]
  with pytest.raises(ValueError, match="no tool 'search'.*has: add, bad_result, crash"):
    server_tools(server, ["echo", "search"])


def test_long_output_is_truncated(server):
  echo = server_tools(server, ["echo"], max_output_chars=100)["echo"]
  result = echo("x" * 1000)
  assert result.ok and result.truncated and len(result.observation) < 200


def test_non_text_content_is_described():
  result = mcp.types.CallToolResult(content=[
      mcp.types.TextContent(text="a chart:"),
      mcp.types.ImageContent(data="AAAA", mime_type="image/png")])
  assert result_text(result) == "a chart:\n[image image/png]"


def test_exactly_one_of_command_or_url():
  with pytest.raises(ValueError, match="exactly one"):
    McpServer()
  with pytest.raises(ValueError, match="exactly one"):
    McpServer(["x"], url="http://127.0.0.1:1/mcp")


@pytest.fixture
def http_url():
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  process = subprocess.Popen([sys.executable, FIXTURE, "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 20
  while time.monotonic() < deadline and process.poll() is None:
    try:
      socket.create_connection(("127.0.0.1", port), 0.1).close()
      break
    except OSError:
      time.sleep(0.05)
  yield f"http://127.0.0.1:{port}/mcp"
  process.terminate()
  process.wait(10)


def test_streamable_http_call(http_url):
  with McpServer(url=http_url) as remote:
    result = remote.call("echo", {"text": "over HTTP"})
  assert (result.ok, result.observation) == (True, "over HTTP")
