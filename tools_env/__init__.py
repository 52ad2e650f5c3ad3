"""Python tool environments for CoA agents; imports nothing from coa_jax.

- `base`: the Tool interface (body of the tag in, `ToolResult` out, never raising),
  error kinds and head+tail truncation.
- `search`: BM25 search (`web_search`, `wiki_search`) and page serving (`crawl_page`) over
  a local JSONL corpus (`data/corpus.jsonl` ships a small one).
- `remote`: a Serper-style search API, HTTP crawling with HTML to text, and an
  OpenAI-compatible summarizer, behind the same interface (timeouts, a deadline per request,
  retries, size caps).
- `faulty_http`: a local HTTP service that resets, cuts short or drips its answers (tests and
  benchmarks of the remote tools).
- `sandbox`: the `code` tool, programs run isolated under resource limits by a bounded pool
  (`policy`: limits and isolation modes; `runner`: one sandboxed process; `pool`: persistent
  workers; `tool`: `CodeSandbox`); `sandbox_boot` and `sandbox_worker` run inside it.
- `mcp_tools`: the tools of a local MCP server (stdio or streamable HTTP) as CoA tools (the
  `mcp` extra).
- `arguments`: a tag's body as the arguments of a tool with an input schema (an MCP tool), and
  the words that tell a prompt how to write it.
- `registry`: tag -> tool dispatch, building tools from a config spec, and per-trajectory
  state (repeated-call notices, counters).

Every limit is a constructor argument or a field of `SandboxLimits` / `HttpLimits`, with a
default; docs/tools_and_rollouts.md lists them.
"""

from tools_env.base import Tool, ToolFailure, ToolResult, truncate_middle
from tools_env.registry import (
           TOOL_TAGS,
           ToolRegistry,
           TrajectoryTools,
           build_registry,
           default_spec,
)

__all__ = ["TOOL_TAGS", "Tool", "ToolFailure", "ToolRegistry", "ToolResult", "TrajectoryTools",
           "build_registry", "default_spec", "truncate_middle"]
