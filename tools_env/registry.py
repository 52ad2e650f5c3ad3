"""The registry from CoA tool tags to tools, and per-trajectory call state.

`ToolRegistry.call(tag, body)` dispatches to the tool configured for a tag (an unknown tag
is an error observation). `TrajectoryTools` wraps a registry for one trajectory: a call
identical to an earlier one (same tag, same normalized body) is answered with a notice
instead of being run again, as the reference does, and calls are counted per tag.
"""

from __future__ import annotations

import collections
import threading
from typing import Mapping

from tools_env.base import REPEATED, UNKNOWN_TOOL, Delayed, Tool, ToolResult, error_result

TOOL_TAGS = ("web_search", "crawl_page", "wiki_search", "code")
SEARCH_TAGS = ("web_search", "wiki_search")


class ToolRegistry:
  """Maps CoA tool tags to configured tool instances; safe to call from many threads."""

  def __init__(self, tools: Mapping[str, Tool]):
    unknown = set(tools) - set(TOOL_TAGS)
    if unknown:
      raise ValueError(f"not CoA tool tags: {sorted(unknown)}; expected some of {TOOL_TAGS}")
    self.tools = dict(tools)

  def call(self, tag: str, body: str, goal: str = "") -> ToolResult:
    """Returns the result of the tool registered for `tag` (never raises)."""
    tool = self.tools.get(tag)
    if tool is None:
      return error_result(UNKNOWN_TOOL, f"unknown tool {tag!r}; available: "
                                        f"{', '.join(sorted(self.tools)) or 'none'}")
    return tool(body, goal)


class TrajectoryTools:
  """One trajectory's view of a registry: repeated calls get a notice (a crawl toward another
  goal is not a repeat); calls are counted.

  A goal is passed to every call, for tools that condense toward it: the task's question, and
  once a search has run, its query (what the agent is looking for now).
  """

  def __init__(self, registry: ToolRegistry, goal: str = ""):
    self.registry, self.goal = registry, goal
    self.calls: collections.Counter = collections.Counter()
    self.repeats: collections.Counter = collections.Counter()
    self._seen: set[tuple[str, str]] = set()
    self._lock = threading.Lock()

  def call(self, tag: str, body: str) -> ToolResult:
    """Returns the tool's result, or a REPEATED notice for a call already made."""
    key = (tag, " ".join(str(body).split()).lower(), self.goal if tag == "crawl_page" else "")
    with self._lock:
      self.calls[tag] += 1
      if key in self._seen:
        self.repeats[tag] += 1
        return ToolResult(f"Notice: this exact {tag} call was already made in this task; use "
                          f"its earlier result or try something different.", False, REPEATED)
      self._seen.add(key)
    result = self.registry.call(tag, body, self.goal)
    if tag in SEARCH_TAGS and result.ok:
      self.goal = str(body).strip()
    return result


def _build_tool(tag: str, spec: Mapping) -> Tool:
  from tools_env import remote, sandbox, search

  options = {key: dict(value) if isinstance(value, Mapping) else value
             for key, value in spec.items() if key not in ("kind", "latency_s")}
  if "latency_s" in spec:
    return Delayed(_build_tool(tag, {k: v for k, v in spec.items() if k != "latency_s"}),
                   *spec["latency_s"])
  kind = spec.get("kind")
  builders = {"bm25": search.Bm25Search, "local_crawl": search.LocalCrawl,
              "serper": remote.RemoteSearch, "http_crawl": remote.HttpCrawl,
              "sandbox": sandbox.CodeSandbox}
  if kind not in builders:
    raise ValueError(f"tools.{tag}.kind must be one of {sorted(builders)}, got {kind!r}")
  try:
    if "http" in options:
      options["limits"] = remote.HttpLimits(**options.pop("http"))
    if kind == "sandbox" and "limits" in options:
      options["limits"] = sandbox.SandboxLimits(**options["limits"])
    if kind == "http_crawl" and options.get("summarizer"):
      options["summarizer"] = remote.ChatSummarizer(**options["summarizer"])
    if kind in ("bm25", "serper"):
      options["name"] = tag
    return builders[kind](**options)
  except TypeError as e:
    raise ValueError(f"tools.{tag}: {e}") from None


def build_registry(spec: Mapping[str, Mapping]) -> ToolRegistry:
  """Returns the registry a config describes: {tag: {"kind": ..., **options}}.

  Kinds: `bm25` (Bm25Search), `local_crawl` (LocalCrawl), `serper` (RemoteSearch),
  `http_crawl` (HttpCrawl; `summarizer`: ChatSummarizer options), `sandbox` (CodeSandbox;
  `limits`: SandboxLimits fields). An `http` mapping holds HttpLimits fields. Any tool may
  have `latency_s: [low, high]`, a modelled service latency (`base.Delayed`) for benchmarks.
  """
  return ToolRegistry({tag: _build_tool(tag, tool_spec) for tag, tool_spec in spec.items()})


def default_spec() -> dict[str, dict]:
  """Returns the embedded default tools: BM25 search and crawl over the shipped corpus and
  the code sandbox, with every limit at its default."""
  return {"web_search": {"kind": "bm25"}, "wiki_search": {"kind": "bm25"},
          "crawl_page": {"kind": "local_crawl"}, "code": {"kind": "sandbox"}}
