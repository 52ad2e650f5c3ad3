"""Tools declared in a config, the registry from tool tags to tools, and per-trajectory state.

A config's `tools` maps names to specs (`declare`, `build_registry`): a built-in kind (the
four CoA tools are the default set, `default_spec`), a Python class by import path, or an MCP
server whose listed tools become tags. `ToolRegistry.call(tag, body)` dispatches to the tool
of a tag (an unknown tag is an error observation). `TrajectoryTools` wraps a registry for one
trajectory: a call identical to an earlier one (same tag, same normalized body) is answered
with a notice instead of being run again, as the reference does, and calls are counted per tag.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Mapping

from tools_env.base import (REPEATED, UNKNOWN_TOOL, Delayed, Tool, ToolResult, error_result,
                            import_object)

TOOL_TAGS = ("web_search", "crawl_page", "wiki_search", "code")
SEARCH_TAGS = ("web_search", "wiki_search")
BUILTIN_KINDS = ("bm25", "local_crawl", "serper", "http_crawl", "sandbox")
# What a built-in tool's tag holds, for the system prompt (a spec's `description` overrides).
BUILTIN_DESCRIPTIONS = {"bm25": "a search query", "serper": "a search query",
                        "local_crawl": "URLs separated by |", "http_crawl": "URLs separated by |",
                        "sandbox": "a fenced python block"}
# The options of a `python` and an `mcp` spec beside `kind` (an MCP entry's name is the
# server's, not a tag: each of its tools is one).
PYTHON_OPTIONS = ("class", "description", "options")
MCP_OPTIONS = ("command", "url", "tools", "env", "cwd", "start_timeout_s", "timeout_s")


@dataclasses.dataclass(frozen=True)
class ToolDecl:
  """A declared tool: its tag, what its tag holds, and (an MCP tool's) its input schema."""

  tag: str
  description: str
  input_schema: Mapping[str, Any] | None = None


class ToolRegistry:
  """Maps tool tags to tool instances; safe to call from many threads. `close` stops the
  processes of its MCP servers (`servers`) and of its tools that have some (the code
  sandbox's workers)."""

  def __init__(self, tools: Mapping[str, Tool], servers: tuple = ()):
    self.tools, self.servers = dict(tools), tuple(servers)

  def close(self) -> None:
    """Stops every MCP server this registry started, and the processes its tools keep (the
    code sandbox's workers, which a later call starts anew); idempotent."""
    for server in self.servers:
      server.close()
    for tool in self.tools.values():
      close = getattr(getattr(tool, "inner", tool), "close", None)  # inside a base.Delayed
      if callable(close):
        close()

  def __enter__(self) -> "ToolRegistry":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

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


def _python_class(name: str, spec: Mapping) -> type:
  """Returns the Tool subclass a `python` spec names, its options checked."""
  unknown = set(spec) - {"kind", *PYTHON_OPTIONS}
  if unknown or "class" not in spec:
    raise ValueError(f"tools.{name} (python): needs `class`; unknown options {sorted(unknown)} "
                     f"(expected some of {list(PYTHON_OPTIONS)})")
  cls = import_object(str(spec["class"]), f"tools.{name}.class")
  if not (isinstance(cls, type) and issubclass(cls, Tool)):
    raise ValueError(f"tools.{name}.class: {spec['class']!r} is not a tools_env.Tool subclass")
  return cls


def _mcp_server(name: str, spec: Mapping):
  """Returns the McpServer of an `mcp` spec (not started)."""
  try:
    from tools_env import mcp_tools
  except ImportError as e:
    raise ValueError(f"tools.{name} (mcp): needs the `mcp` extra (pip install "
                     f"'coa-jax[mcp]'): {e}") from None
  unknown = set(spec) - {"kind", *MCP_OPTIONS}
  if unknown or ("command" in spec) == ("url" in spec):
    raise ValueError(f"tools.{name} (mcp): needs exactly one of `command` and `url`; unknown "
                     f"options {sorted(unknown)} (expected some of {list(MCP_OPTIONS)})")
  command = spec.get("command")
  return mcp_tools.McpServer(
      command=[command] if isinstance(command, str) else command, url=spec.get("url"),
      env=spec.get("env"), cwd=spec.get("cwd"),
      start_timeout_s=spec.get("start_timeout_s", 20.0), call_timeout_s=spec.get("timeout_s", 30.0))


def _mcp_tools(name: str, spec: Mapping, server) -> dict:
  """Returns {tag: McpTool} of the server's tools that `spec` keeps (all by default)."""
  from tools_env import mcp_tools

  try:
    return mcp_tools.server_tools(server, spec.get("tools"))
  except (mcp_tools.McpError, ValueError) as e:
    raise ValueError(f"tools.{name} (mcp): {e}") from None


def _kind(name: str, spec: Any) -> str:
  kind = spec.get("kind") if isinstance(spec, Mapping) else None
  if kind not in BUILTIN_KINDS + ("python", "mcp"):
    raise ValueError(f"tools.{name}.kind must be one of {sorted(BUILTIN_KINDS + ('python', 'mcp'))}"
                     f", got {kind!r}")
  return kind


def declare(spec: Mapping[str, Mapping]) -> list[ToolDecl]:
  """Returns the tools `spec` declares, in order: one per entry, or each tool an `mcp` entry's
  server lists (it is started, listed and stopped). Raises ValueError naming the entry whose
  kind, class, options or server is wrong, or a tag declared twice (the tags themselves are
  checked by `coa_jax.data.coa_format.check_tool_tags`)."""
  declared: list[ToolDecl] = []
  for name, tool_spec in spec.items():
    kind = _kind(name, tool_spec)
    if kind == "mcp":
      with ToolRegistry({}, (_mcp_server(name, tool_spec),)) as registry:
        tools = _mcp_tools(name, tool_spec, registry.servers[0])
      declared.extend(ToolDecl(tag, tool.info.description, tool.info.input_schema)
                      for tag, tool in tools.items())
      continue
    description = tool_spec.get("description")
    if kind == "python":
      cls = _python_class(name, tool_spec)
      description = description or " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    declared.append(ToolDecl(name, description or BUILTIN_DESCRIPTIONS[kind]))
  tags = [tool.tag for tool in declared]
  twice = sorted({tag for tag in tags if tags.count(tag) > 1})
  if twice:
    raise ValueError(f"tool tag(s) {twice} declared twice (an MCP server's tools are tags too)")
  return declared


def _build_tool(tag: str, spec: Mapping) -> Tool:
  from tools_env import remote, sandbox, search

  if "latency_s" in spec:
    return Delayed(_build_tool(tag, {k: v for k, v in spec.items() if k != "latency_s"}),
                   *spec["latency_s"])
  kind = _kind(tag, spec)
  if kind == "python":
    cls = _python_class(tag, spec)
    try:
      return cls(**dict(spec.get("options") or {}))
    except TypeError as e:
      raise ValueError(f"tools.{tag}.options: {e}") from None
  options = {key: dict(value) if isinstance(value, Mapping) else value
             for key, value in spec.items() if key not in ("kind", "description")}
  builders = {"bm25": search.Bm25Search, "local_crawl": search.LocalCrawl,
              "serper": remote.RemoteSearch, "http_crawl": remote.HttpCrawl,
              "sandbox": sandbox.CodeSandbox}
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
  """Returns the registry a config describes: {name: {"kind": ..., **options}}.

  Kinds: `bm25` (Bm25Search), `local_crawl` (LocalCrawl), `serper` (RemoteSearch),
  `http_crawl` (HttpCrawl; `summarizer`: ChatSummarizer options), `sandbox` (CodeSandbox;
  `limits`: SandboxLimits fields); `python` (`class`: the import path of a Tool subclass,
  built with `options`); `mcp` (`command` or `url` of a server, `tools` to keep some of its
  tools, `env`, `cwd`, `start_timeout_s`, `timeout_s`: each listed tool becomes a tag). Any
  spec may have `description` (for the system prompt, `declare`). An `http` mapping holds
  HttpLimits fields. Any tool may have `latency_s: [low, high]`, a modelled service latency
  (`base.Delayed`) for benchmarks. The registry's `close` stops the MCP servers.
  """
  tools, servers = {}, []
  try:
    for name, tool_spec in spec.items():
      if _kind(name, tool_spec) == "mcp":
        servers.append(_mcp_server(name, tool_spec))
        tools.update(_mcp_tools(name, tool_spec, servers[-1]))
      else:
        tools[name] = _build_tool(name, tool_spec)
  except BaseException:
    for server in servers:
      server.close()
    raise
  return ToolRegistry(tools, tuple(servers))


def default_spec() -> dict[str, dict]:
  """Returns the embedded default tools: BM25 search and crawl over the shipped corpus and
  the code sandbox, with every limit at its default."""
  return {"web_search": {"kind": "bm25"}, "wiki_search": {"kind": "bm25"},
          "crawl_page": {"kind": "local_crawl"}, "code": {"kind": "sandbox"}}
