"""Tools of a local MCP (Model Context Protocol) server as CoA tools, with the `mcp` SDK (2.x).

`McpServer` is one server: a subprocess spoken to over stdio (`command`) or a streamable-HTTP
endpoint (`url`). The SDK's asyncio client runs on a private event loop in a daemon thread;
any thread may call, and calls run concurrently over the one session. `McpTool` is one of
the server's tools behind the `Tool` interface; `server_tools` builds them from the listing.

A call never raises; its failures become error results:
- past its timeout: TIMEOUT; the server is sent a cancellation and the session stays up, unless
  that makes `restart_after_timeouts` calls in a row without an answer: the server is taken
  for hung and stopped, and the next call starts it afresh.
- the server exits or hangs up (before or during the call): TOOL_ERROR "... exited ...";
  the next call starts a fresh server process (a fresh session for a URL).
- the server cannot start: TOOL_ERROR saying why; for a cooldown after that (`start_backoff_s`,
  doubling with each failed start in a row), calls fail at once with the same reason.
- a response that is JSON-RPC but not a valid MCP result: BAD_RESPONSE.
- a line on the server's stdout that is not JSON-RPC at all: the SDK logs it (logger
  `mcp.client.stdio`) and drops it; the call gets its real answer (no error kind).
- a tool result flagged isError: the tool's text, its kind the tools_env kind that the
  result's `_meta` names under "error_kind" (`ERROR_KIND_META`), else TOOL_ERROR.
Configuration-time failures (`list_tools`: the server cannot start, exits, times out or
answers garbage) raise McpError instead.

A stdio server runs as its own process, in its own process group, with the user's privileges
and outside the code sandbox. Its environment is the SDK's short safe list (HOME, LOGNAME,
PATH, SHELL, TERM, USER) plus `env`. `close()` (also run at exit) closes its stdin and, if it
has not exited within 2 s, signals its process group (SIGTERM, then SIGKILL); if this Python
process is killed outright, the server sees its stdin close, on which MCP servers exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import shlex
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Mapping, Sequence

import anyio
import mcp
import mcp.types
import pydantic
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from tools_env.arguments import parse_body
from tools_env.base import (
           ERROR_KINDS,
           BAD_RESPONSE,
           TIMEOUT,
           TOOL_ERROR,
           Tool,
           ToolFailure,
           ToolResult,
           error_result,
)

# Past a call's own deadline (enforced on the event loop), how long a caller waits for the
# loop to report before giving up on it; and how long a server may take to shut down.
_GRACE_S = 5.0
_STOP_TIMEOUT_S = 10.0
ERROR_KIND_META = "error_kind"  # a failed result's `_meta` key naming its tools_env kind


class McpError(RuntimeError):
  """An MCP server could not be started or listed, or answered something that is not MCP."""


@dataclasses.dataclass(frozen=True)
class McpToolInfo:
  """One tool as the server lists it: its name, description and JSON Schema of arguments."""

  name: str
  description: str
  input_schema: dict


class _EndWatcher:
  """A transport's read stream that sets `ended` when the server's side ends (it exited or
  hung up), so the next call can start a fresh session instead of failing."""

  def __init__(self, stream: Any, ended: threading.Event):
    self._stream, self._ended = stream, ended

  async def receive(self) -> Any:
    """Returns the next message; raises EndOfStream (after setting `ended`) at the end."""
    try:
      return await self._stream.receive()
    except (anyio.EndOfStream, anyio.ClosedResourceError):
      self._ended.set()
      raise

  def __aiter__(self) -> _EndWatcher:
    return self

  async def __anext__(self) -> Any:
    try:
      return await self.receive()
    except (anyio.EndOfStream, anyio.ClosedResourceError):
      raise StopAsyncIteration from None

  async def aclose(self) -> None:
    await self._stream.aclose()

  async def __aenter__(self) -> _EndWatcher:
    return self

  async def __aexit__(self, *exc_info: Any) -> None:
    await self.aclose()


@contextlib.asynccontextmanager
async def _watched(transport: Any, ended: threading.Event) -> AsyncIterator[tuple[Any, Any]]:
  """Yields a transport's (read, write) streams, the read one watched for its end."""
  async with transport as (read_stream, write_stream):
    yield _EndWatcher(read_stream, ended), write_stream


class _Connection:
  """One client session, kept open by an owner task on the loop until `stop` is set."""

  def __init__(self):
    self.client: mcp.Client | None = None
    self.stop = asyncio.Event()
    self.ended = threading.Event()  # the server exited or hung up
    self.garbage = ""  # the last line from the server that was not JSON-RPC
    self.owner: concurrent.futures.Future | None = None
    self.timeouts = 0  # calls that timed out since the server last answered one

  async def note_message(self, message: Any) -> None:
    """The session's message handler: remembers the last line that was not JSON-RPC."""
    if isinstance(message, pydantic.ValidationError) and message.errors():
      self.garbage = repr(str(message.errors()[0].get("input", ""))[:200])


def _first_error(exc: BaseException) -> BaseException:
  """Returns the first leaf of a (possibly nested) exception group, or the exception."""
  while isinstance(getattr(exc, "exceptions", None), (list, tuple)) and exc.exceptions:
    exc = exc.exceptions[0]
  return exc


def _is_closed(exc: BaseException) -> bool:
  """Returns whether an error means the server exited or closed the connection."""
  return isinstance(exc, mcp.MCPError) and exc.code == mcp.types.CONNECTION_CLOSED


def _summary(error: pydantic.ValidationError) -> str:
  """Returns the first few problems of a validation error, one line."""
  return "; ".join(f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}"
                   for problem in error.errors()[:3])


def _block_text(block: Any) -> str:
  """Returns a content block as text: text as is, anything else described ("[image ...]")."""
  if block.type == "text":
    return block.text
  if block.type == "resource":
    text = getattr(block.resource, "text", None)
    return text if text is not None else f"[resource {block.resource.uri}]"
  if block.type == "resource_link":
    return f"[resource link {block.uri}]"
  mime_type = getattr(block, "mime_type", "")
  return f"[{block.type}{' ' + mime_type if mime_type else ''}]"


def result_text(result: mcp.types.CallToolResult) -> str:
  """Returns a tool result as text: its content blocks joined by newlines, or its structured
  content as JSON when it has no content."""
  if not result.content and result.structured_content is not None:
    return json.dumps(result.structured_content, ensure_ascii=False)
  return "\n".join(_block_text(block) for block in result.content)


def _error_kind(result: mcp.types.CallToolResult) -> str:
  """Returns the error kind of a failed tool result: the `error_kind` its `_meta` names (a
  tools_env kind, so a server can say what failed as a Python tool does), else TOOL_ERROR."""
  kind = (result.meta or {}).get(ERROR_KIND_META)
  return kind if isinstance(kind, str) and kind in ERROR_KINDS else TOOL_ERROR


class McpServer:
  """A local MCP server: a stdio subprocess (`command`) or a streamable-HTTP `url`.

  The server starts on first use and restarts after it exits. Safe to call from many threads.
  `start_timeout_s` bounds the start and handshake; `call_timeout_s` is the default bound of a
  call (and of listing the tools).

  One start runs at a time: a call that needs the server while another call is starting it
  waits for that start (at most `start_timeout_s` and a shutdown) and shares its outcome; no
  call starts the server after another's failed start. After a failed start, the server is not
  started again for `start_backoff_s`, doubled after each further failure in a row up to
  `max_start_backoff_s`: calls in that cooldown fail at once with the reason. A server that
  leaves `restart_after_timeouts` calls in a row unanswered (each past its timeout, none
  answered in between) is taken for hung: it is stopped, and the next call starts it afresh
  (0: never).
  """

  def __init__(self, command: Sequence[str] | None = None, url: str | None = None,
               env: Mapping[str, str] | None = None, cwd: str | None = None,
               start_timeout_s: float = 20.0, call_timeout_s: float = 30.0,
               start_backoff_s: float = 5.0, max_start_backoff_s: float = 60.0,
               restart_after_timeouts: int = 3):
    if (command is None) == (url is None):
      raise ValueError("give exactly one of command (a stdio server) or url (streamable HTTP)")
    if command is not None and (isinstance(command, str) or not command):
      raise ValueError(f"command must be a non-empty list of arguments, got {command!r}")
    if url is not None and (env or cwd):
      raise ValueError("env and cwd apply to a command, not to a url")
    if not 0 <= start_backoff_s <= max_start_backoff_s:
      raise ValueError(f"need 0 <= start_backoff_s <= max_start_backoff_s, got "
                       f"{start_backoff_s} and {max_start_backoff_s}")
    if isinstance(restart_after_timeouts, bool) or not isinstance(restart_after_timeouts, int) \
        or restart_after_timeouts < 0:
      raise ValueError(f"restart_after_timeouts must be an integer >= 0 (0: never), got "
                       f"{restart_after_timeouts!r}")
    self.command = list(command) if command is not None else None
    self.url = url
    self.env, self.cwd = dict(env or {}), cwd
    self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
    self.start_backoff_s, self.max_start_backoff_s = start_backoff_s, max_start_backoff_s
    self.restart_after_timeouts = restart_after_timeouts
    self.label = shlex.join(self.command) if self.command else url
    self._lock = threading.Lock()  # guards the state below; never held while a server starts
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._connection: _Connection | None = None
    self._starting: concurrent.futures.Future | None = None  # the start in progress
    self._failed_starts = 0  # in a row
    self._retry_at = 0.0  # time.monotonic() before which no start is tried
    self._last_start_error: McpError | None = None
    self._retired: list[_Connection] = []  # sessions being stopped; `close` waits for them
    self._closed = False
    atexit.register(self.close)

  @property
  def closed(self) -> bool:
    """Whether `close` has stopped the server (no call starts it again)."""
    return self._closed

  def __enter__(self) -> McpServer:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def list_tools(self) -> list[McpToolInfo]:
    """Returns the server's tools, starting it if needed; raises McpError on any failure."""
    connection = self._connect()
    try:
      return self._submit(_list_all_tools(connection.client), self.call_timeout_s)
    except Exception as e:  # noqa: BLE001 - reported as McpError with the server named
      error = _first_error(e)
      if _is_closed(error):
        self._discard(connection)
        raise McpError(f"MCP server {self.label} exited while listing its tools") from e
      if isinstance(error, TimeoutError):
        raise McpError(f"MCP server {self.label} did not list its tools within "
                       f"{self.call_timeout_s:g} s") from e
      raise McpError(f"MCP server {self.label} failed to list its tools: "
                     f"{type(error).__name__}: {error}") from e

  def call(self, name: str, arguments: dict, timeout_s: float | None = None) -> ToolResult:
    """Returns the result of tool `name` with `arguments` (never raises): the text of the
    tool's answer, or an error result (see the module docstring for the kinds)."""
    timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
    start = time.perf_counter()
    try:
      connection = self._connect()
    except McpError as e:
      return error_result(TOOL_ERROR, str(e), time.perf_counter() - start, server=self.label)
    try:
      result = self._submit(connection.client.call_tool(name, arguments), timeout_s)
    except Exception as e:  # noqa: BLE001 - a call never raises
      return self._call_error(connection, name, timeout_s, _first_error(e),
                              time.perf_counter() - start)
    connection.timeouts = 0  # it answered
    elapsed_s = time.perf_counter() - start
    if result.is_error:
      return error_result(_error_kind(result), result_text(result) or f"{name} failed",
                          elapsed_s, server=self.label)
    return ToolResult(result_text(result), True, None, elapsed_s, metadata={"server": self.label})

  def close(self) -> None:
    """Stops the server and the event loop; idempotent. The server's stdin is closed; if it
    has not exited within 2 s, its process group is sent SIGTERM, then SIGKILL (the SDK's
    shutdown)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      connection, self._connection = self._connection, None
      retired, self._retired = self._retired, []
    atexit.unregister(self.close)
    if self._loop is None:
      return
    for each in retired + ([connection] if connection is not None else []):
      self._stop(each)
    with contextlib.suppress(Exception):
      self._submit(_cancel_other_tasks(), _STOP_TIMEOUT_S)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(_STOP_TIMEOUT_S)
    if not self._thread.is_alive():
      self._loop.close()

  def _call_error(self, connection: _Connection, name: str, timeout_s: float,
                  error: BaseException, elapsed_s: float) -> ToolResult:
    """Returns the error result of a failed call; forgets a session whose server is gone."""
    if _is_closed(error) or connection.ended.is_set():
      self._discard(connection)
      what = ("was closed" if self._closed else
              "exited or closed the connection; the next call starts it afresh")
      return error_result(TOOL_ERROR, f"MCP server {self.label} {what} (during {name})",
                          elapsed_s, server=self.label)
    if isinstance(error, TimeoutError):
      message = f"{name} did not answer within {timeout_s:g} s"
      if self._hung(connection):
        message += (f"; the server answered none of the last {self.restart_after_timeouts} "
                    f"calls: it is stopped, and the next call starts it afresh")
      return error_result(TIMEOUT, message, elapsed_s, server=self.label)
    connection.timeouts = 0  # it answered, if not with a tool result
    if isinstance(error, pydantic.ValidationError):
      return error_result(BAD_RESPONSE, f"MCP server {self.label} answered {name} with an "
                                        f"invalid result: {_summary(error)}", elapsed_s,
                          server=self.label)
    return error_result(TOOL_ERROR, f"{name} failed: {type(error).__name__}: {error}",
                        elapsed_s, server=self.label)

  def _submit(self, coroutine: Awaitable, timeout_s: float) -> Any:
    """Returns what `coroutine` returns, run on the loop under a deadline of `timeout_s`;
    raises what it raises, TimeoutError past the deadline."""

    async def bounded() -> Any:
      with anyio.fail_after(timeout_s):
        return await coroutine

    future = asyncio.run_coroutine_threadsafe(bounded(), self._loop)
    try:
      return future.result(timeout_s + _GRACE_S)
    except concurrent.futures.TimeoutError:
      future.cancel()
      raise TimeoutError(f"no answer within {timeout_s:g} s") from None

  def _hung(self, connection: _Connection) -> bool:
    """Counts a call of `connection` that timed out; returns whether that makes
    `restart_after_timeouts` in a row, in which case the session is retired (its server
    stopped; the next call starts a fresh one)."""
    with self._lock:
      connection.timeouts += 1
      hung = (0 < self.restart_after_timeouts <= connection.timeouts
              and self._connection is connection)
      if hung:
        self._retire(connection)
    return hung

  def _connect(self) -> _Connection:
    """Returns the live session, starting the server first if there is none or it has ended
    (or waiting for the start another call has begun); raises McpError when it cannot start,
    at once during the cooldown after a failed start."""
    with self._lock:
      if self._closed:
        raise McpError(f"MCP server {self.label} is closed")
      if self._connection is not None and self._connection.ended.is_set():
        self._retire(self._connection)
      if self._connection is not None:
        return self._connection
      starting, starter = self._starting, self._starting is None
      if starter:
        wait_s = self._retry_at - time.monotonic()
        if wait_s > 0:
          raise McpError(f"{self._last_start_error} (not started again for {wait_s:.1f} s: "
                         f"{self._failed_starts} failed start(s) in a row)")
        starting = self._starting = concurrent.futures.Future()
    if not starter:
      try:  # the other call's start: its session or its McpError
        return starting.result(self.start_timeout_s + _STOP_TIMEOUT_S)
      except concurrent.futures.TimeoutError:
        raise McpError(f"MCP server {self.label}: another call's start took longer than "
                       f"{self.start_timeout_s + _STOP_TIMEOUT_S:.0f} s") from None
    try:
      connection = self._start()
    except BaseException as e:
      error = e if isinstance(e, McpError) else McpError(
          f"MCP server {self.label} did not start: {type(e).__name__}: {e}")
      with self._lock:
        self._failed_starts += 1
        backoff_s = min(self.start_backoff_s * 2 ** (self._failed_starts - 1),
                        self.max_start_backoff_s)
        self._retry_at = time.monotonic() + backoff_s
        self._last_start_error, self._starting = error, None
      starting.set_exception(error)
      raise
    with self._lock:
      self._starting, closed = None, self._closed
      if not closed:
        self._connection, self._failed_starts = connection, 0
    if closed:  # `close` ran during the start
      self._stop(connection)
      error = McpError(f"MCP server {self.label} is closed")
      starting.set_exception(error)
      raise error
    starting.set_result(connection)
    return connection

  def _retire(self, connection: _Connection) -> None:
    """Forgets a session (the lock held) and has its server stopped without waiting for it
    (`close` waits); the next call starts a fresh one."""
    if self._connection is connection:
      self._connection = None
    if self._closed:  # `close` stops every session it took
      return
    self._retired = [c for c in self._retired if not c.owner.done()] + [connection]
    self._loop.call_soon_threadsafe(connection.stop.set)

  def _discard(self, connection: _Connection) -> None:
    """Retires a session whose server is gone, so that the next call starts a fresh one."""
    with self._lock:
      if connection not in self._retired:
        self._retire(connection)

  def _start(self) -> _Connection:
    """Returns a new session with the server; raises McpError when it cannot start."""
    if self._loop is None:
      self._loop = asyncio.new_event_loop()
      self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                      name=f"mcp {self.label}"[:60])
      self._thread.start()
    connection, ready = _Connection(), concurrent.futures.Future()
    connection.owner = asyncio.run_coroutine_threadsafe(self._own(connection, ready), self._loop)
    try:
      ready.result(self.start_timeout_s + _STOP_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - reported as McpError with the server named
      self._stop(connection)
      raise self._start_error(connection, _first_error(e)) from e
    return connection

  def _start_error(self, connection: _Connection, error: BaseException) -> McpError:
    """Returns the McpError saying why the server did not start."""
    if isinstance(error, FileNotFoundError):
      reason = f"command not found: {error}"
    elif isinstance(error, (TimeoutError, concurrent.futures.TimeoutError)):
      reason = f"no MCP handshake within {self.start_timeout_s:g} s"
    elif _is_closed(error):
      reason = "it exited or closed the connection before the MCP handshake"
    else:
      reason = f"{type(error).__name__}: {error}"
    if connection.garbage:
      reason += f"; its output was not JSON-RPC: {connection.garbage}"
    return McpError(f"MCP server {self.label} did not start: {reason}")

  async def _own(self, connection: _Connection, ready: concurrent.futures.Future) -> None:
    """Opens a session (handshake bounded by start_timeout_s), hands it over through `ready`
    and keeps it open until `connection.stop` is set; a failure to open goes to `ready`."""
    try:
      with anyio.fail_after(self.start_timeout_s) as scope:
        async with mcp.Client(_watched(self._transport(), connection.ended),
                              message_handler=connection.note_message) as client:
          scope.deadline = math.inf
          connection.client = client
          ready.set_result(connection)
          await connection.stop.wait()
    except Exception as e:  # noqa: BLE001 - handed to the thread that waits on `ready`
      if not ready.done():
        ready.set_exception(e)

  def _transport(self) -> Any:
    """Returns the SDK transport for the server: stdio for a command, else streamable HTTP."""
    if self.url is not None:
      return streamable_http_client(self.url)
    parameters = mcp.StdioServerParameters(command=self.command[0], args=self.command[1:],
                                           env=self.env or None, cwd=self.cwd)
    return stdio_client(parameters)

  def _stop(self, connection: _Connection) -> None:
    """Ends a session and waits (bounded) until its server has been stopped."""
    self._loop.call_soon_threadsafe(connection.stop.set)
    with contextlib.suppress(Exception):
      connection.owner.result(_STOP_TIMEOUT_S)


async def _list_all_tools(client: mcp.Client) -> list[McpToolInfo]:
  """Returns every tool a server lists, following pagination."""
  tools, cursor = [], None
  while True:
    page = await client.list_tools(cursor=cursor)
    tools += [McpToolInfo(tool.name, tool.description or "", dict(tool.input_schema))
              for tool in page.tools]
    cursor = page.next_cursor
    if cursor is None:
      return tools


async def _cancel_other_tasks() -> None:
  """Cancels every other task on the running loop (calls left when it closes)."""
  tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
  for task in tasks:
    task.cancel()
  await asyncio.gather(*tasks, return_exceptions=True)


class McpTool(Tool):
  """One tool of an MCP server as a CoA tool; the tag body becomes the call's arguments
  (`tools_env.arguments`): the stripped body itself when the tool takes exactly one argument
  and it is a string, nothing for a tool without arguments, else a JSON object. Its `name` is
  its tag (the registry's, which may differ from the server's name, `info.name`)."""

  def __init__(self, server: McpServer, info: McpToolInfo, max_output_chars: int = 8000):
    super().__init__(max_output_chars)
    self.server, self.info = server, info
    self.name = info.name

  def arguments(self, body: str) -> dict:
    """Returns the call's arguments from a tag body (`tools_env.arguments.parse_body`); raises
    ToolFailure(BAD_REQUEST) for a body that is not what the tool expects, saying what it
    expects."""
    return parse_body(self.info.input_schema, body, self.name)

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    result = self.server.call(self.info.name, self.arguments(body))
    if not result.ok:
      raise ToolFailure(result.error_kind, result.observation.removeprefix("Error: "),
                        **result.metadata)
    return result.observation, result.metadata


def server_tools(server: McpServer, names: Sequence[str] | None = None,
                 max_output_chars: int = 8000) -> dict[str, McpTool]:
  """Returns {name: McpTool} for the server's tools, or only for `names`; raises ValueError
  for a name the server does not have, McpError when it cannot list its tools."""
  infos = {info.name: info for info in server.list_tools()}
  unknown = [name for name in names or () if name not in infos]
  if unknown:
    raise ValueError(f"MCP server {server.label} has no tool {', '.join(map(repr, unknown))}; it "
                     f"has: {', '.join(sorted(infos)) or 'none'}")
  return {name: McpTool(server, infos[name], max_output_chars)
          for name in (names if names is not None else infos)}
