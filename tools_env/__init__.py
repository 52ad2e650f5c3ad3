"""Python tool environments for CoA agents; imports nothing from coa_jax.

- `base`: the Tool interface (body of the tag in, `ToolResult` out, never raising),
  error kinds and head+tail truncation.
- `search`: BM25 search (`web_search`, `wiki_search`) and page serving (`crawl_page`) over
  a local JSONL corpus (`data/corpus.jsonl` ships a small one).
- `registry`: tag -> tool dispatch and per-trajectory state (repeated-call notices, counters).
"""

from tools_env.base import Tool, ToolFailure, ToolResult, truncate_middle
from tools_env.registry import TOOL_TAGS, ToolRegistry, TrajectoryTools

__all__ = ["TOOL_TAGS", "Tool", "ToolFailure", "ToolRegistry", "ToolResult", "TrajectoryTools",
           "truncate_middle"]
