"""An MCP server for tests/test_mcp_tools.py, written with the SDK's `MCPServer`.

`python tests/mcp_fixture_server.py` serves over stdio; `--port N` serves streamable HTTP on
127.0.0.1:N (path /mcp). Its tools misbehave on request: `sleep` outlasts a timeout, `crash`
kills the process mid-call, `freeze` stops the process (alive, answering nothing), `garbage`
writes a line that is not JSON-RPC onto the wire, `bad_result` answers its call with what is
not a tool result; `pid` tells which process runs. `--odd-names` adds tools whose names are not
tags (`getWeather`, `get-time`) or are a role's (`answer`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver import Context

# The SDK's stdio transport points fd 1 at stderr while it serves (stray prints never reach
# the client), so `garbage` writes to a copy of the wire taken before: what a server that
# prints to its real stdout does.
WIRE_FD = os.dup(1)

server = MCPServer("coa-fixture", log_level="WARNING")


@server.tool()
def echo(text: str) -> str:
  """Returns the text unchanged."""
  return text


@server.tool()
def add(a: int, b: int) -> str:
  """Returns the sum of two integers."""
  return str(a + b)


@server.tool()
async def sleep(seconds: float) -> str:
  """Waits `seconds`, then says so."""
  await anyio.sleep(seconds)
  return f"slept {seconds}"


@server.tool()
def crash() -> str:
  """Ends the server process at once (exit status 3) in the middle of the call."""
  os._exit(3)


@server.tool()
def freeze() -> str:
  """Stops the server process (SIGSTOP): it stays alive and answers nothing from then on."""
  os.kill(os.getpid(), signal.SIGSTOP)
  return "thawed"


@server.tool()
def garbage() -> str:
  """Writes a line that is not JSON-RPC onto the server's stdout, then answers normally."""
  os.write(WIRE_FD, b"this line is not JSON-RPC\n")
  return "garbage written"


@server.tool()
def bad_result(ctx: Context) -> str:
  """Answers its own call first with a JSON-RPC response that is not a valid tool result."""
  bad = {"jsonrpc": "2.0", "id": int(ctx.request_id), "result": {"content": "not a list"}}
  os.write(WIRE_FD, json.dumps(bad).encode() + b"\n")
  return "the real answer, too late"


@server.tool()
def pid() -> str:
  """Returns the server's process id."""
  return str(os.getpid())


def add_odd_names() -> None:
  """Adds tools named as MCP servers often name theirs, which are not CoA tags as they are."""

  @server.tool(name="getWeather")
  def get_weather(city: str) -> str:
    """Returns the weather in a city."""
    return f"sunny in {city}"

  @server.tool(name="get-time")
  def get_time() -> str:
    """Returns the time."""
    return "12:00"

  @server.tool(name="answer")
  def answer(text: str) -> str:
    """Returns its text (a tool named like the role tag <answer>)."""
    return text


def main() -> None:
  """Serves over stdio, or over streamable HTTP on 127.0.0.1 with --port."""
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--port", type=int, help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
  parser.add_argument("--odd-names", action="store_true", help="add getWeather, get-time, answer")
  args = parser.parse_args()
  if args.odd_names:
    add_odd_names()
  if args.port:
    server.run("streamable-http", host="127.0.0.1", port=args.port)
  else:
    server.run("stdio")


if __name__ == "__main__":
  main()
