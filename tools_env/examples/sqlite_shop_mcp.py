"""The shop's `sql` tool (`sqlite_shop.Sql`) served by an MCP server over stdio: the same tool a
config can declare as a Python class, reached as a user's MCP server is.

  python -m tools_env.examples.sqlite_shop_mcp DATABASE

Declared as {"shop": {"kind": "mcp", "command": [python, "-m",
"tools_env.examples.sqlite_shop_mcp", DATABASE]}}, its one tool `sql` becomes the tag <sql>. A
failed query is an MCP tool error with the text and the error kind (in `_meta`) that the Python
class gives, so both give the same observations and records.
"""

from __future__ import annotations

import sys

from mcp.server import MCPServer
from mcp.types import CallToolResult, TextContent

from tools_env.examples.sqlite_shop import Sql
from tools_env.mcp_tools import ERROR_KIND_META


def serve(database: str) -> None:
  """Serves `sql` over stdio until the client closes the connection."""
  tool = Sql(database)
  server = MCPServer("sqlite-shop", log_level="WARNING")

  @server.tool(name="sql", description=Sql.__doc__)
  def sql(query: str) -> CallToolResult:
    result = tool(query)
    text = result.observation if result.ok else result.observation.removeprefix("Error: ")
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=not result.ok,
                          meta=None if result.ok else {ERROR_KIND_META: result.error_kind})

  server.run()


if __name__ == "__main__":
  serve(sys.argv[1])
