"""Tools declared in a config, the registry from tool tags to tools, and per-trajectory state.

A config's `tools` maps names to specs (`declare`, `build_registry`): a built-in kind (the
four CoA tools are the default set, `default_spec`), a Python class by import path, or an MCP
server whose listed tools become tags (`mcp_tag` maps a server's name that cannot be a tag,
`rename` in the spec overrides it). Tags are declared in one order, whatever holds the spec (a
dict, a JSON file, a ConfigDict, which sorts its keys): the entries sorted by name; an MCP
entry's tools in the order of its `tools` list, else sorted by tag. `ToolRegistry.call(tag,
body)` dispatches to the tool of a tag (an unknown tag is an error observation).
`TrajectoryTools` wraps a registry for one trajectory: a call identical to an earlier one (same
tag, same normalized body) is answered with a notice instead of being run again, as the
reference does, and calls are counted per tag.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys
import threading
from typing import Any, Mapping

from tools_env.arguments import describe_body
from tools_env.base import (BAD_RESPONSE, HTTP_ERROR, REPEATED, TIMEOUT, TOOL_ERROR, UNKNOWN_TOOL,
                            Delayed, Tool, ToolResult, error_result, import_object)

TOOL_TAGS = ("web_search", "crawl_page", "wiki_search", "code")
SEARCH_TAGS = ("web_search", "wiki_search")
# Failures on the tool's side, not the call's: a repeat of the call may succeed.
_TOOL_SIDE = (TOOL_ERROR, HTTP_ERROR, BAD_RESPONSE)
BUILTIN_KINDS = ("bm25", "local_crawl", "serper", "http_crawl", "sandbox")
# What a built-in tool's tag holds, for the system prompt (a spec's `description` overrides).
BUILTIN_DESCRIPTIONS = {"bm25": "a search query", "serper": "a search query",
                        "local_crawl": "URLs separated by |", "http_crawl": "URLs separated by |",
                        "sandbox": "a fenced python block"}
# The options of a `python` and an `mcp` spec beside `kind` (an MCP entry's name is the
# server's, not a tag: each of its tools is one).
PYTHON_OPTIONS = ("class", "description", "options")
MCP_OPTIONS = ("command", "url", "tools", "rename", "env", "cwd", "start_timeout_s", "timeout_s",
               "start_backoff_s", "max_start_backoff_s", "restart_after_timeouts")
# What a tag can be, as coa_jax.data.coa_format checks it (tools_env imports nothing from
# coa_jax; a test keeps the two the same): a lower-case identifier of at most 32 characters,
# none of the role tags or the observation's.
TAG_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
RESERVED_TAGS = ("think", "plan", "reflection", "suggested_answer", "double_check", "answer",
                 "observation")
# A stdio MCP server's command that names these runs this interpreter (sys.executable), not the
# first `python` on PATH.
PYTHON_COMMANDS = ("python", "python3")


@dataclasses.dataclass(frozen=True)
class ToolDecl:
  """A declared tool: its tag, what its tag holds, and (an MCP tool's) its input schema."""

  tag: str
  description: str
  input_schema: Mapping[str, Any] | None = None

  @property
  def body(self) -> str | None:
    """Returns what the body of a call holds, for prompts (`arguments.describe_body`): the
    one string argument as plain text, nothing, or a JSON object; None without a schema (a
    built-in or Python tool takes the body as it is, as its description says)."""
    return None if self.input_schema is None else describe_body(self.input_schema)


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
    """Returns the tool's result, or a REPEATED notice for a call already made: a search
    with the same words in any case or spacing, another call with the same body (a program's
    indentation and names, a URL's path, are its meaning). A call whose tool failed on its own
    side (an error, a remote service down or slow) may be made again."""
    text = str(body)
    text = " ".join(text.split()).lower() if tag in SEARCH_TAGS else text.strip()
    key = (tag, text, self.goal if tag == "crawl_page" else "")
    with self._lock:
      self.calls[tag] += 1
      if key in self._seen:
        self.repeats[tag] += 1
        return ToolResult(f"Notice: this exact {tag} call was already made in this task; use "
                          f"its earlier result or try something different.", False, REPEATED)
      self._seen.add(key)
    result = self.registry.call(tag, body, self.goal)
    if result.error_kind in _TOOL_SIDE or (result.error_kind == TIMEOUT and tag != "code"):
      with self._lock:
        self._seen.discard(key)
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


def mcp_tag(name: str) -> str:
  """Returns the tag of an MCP tool named `name`: the name itself when it can be a tag, else
  the name with its camelCase words split by `_`, lower-cased, every run of characters that
  are not letters or digits made one `_` (trimmed at the ends), "tool_" before it when it does
  not start with a letter, cut to 32 characters: "getWeather" -> "get_weather", "get-time" ->
  "get_time", "HTTPFetch" -> "http_fetch", "2fa" -> "tool_2fa"."""
  if TAG_RE.fullmatch(name):
    return name
  words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
  words = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", words)
  tag = re.sub(r"[^a-z0-9]+", "_", words.lower()).strip("_")
  if not re.match(r"[a-z]", tag):
    tag = f"tool_{tag}".rstrip("_")
  return tag[:32].rstrip("_")


def tag_problem(tag: Any) -> str | None:
  """Returns why `tag` cannot be a tool's tag, or None when it can."""
  if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
    return "is not a lower-case identifier of at most 32 characters ([a-z][a-z0-9_]*)"
  if tag in RESERVED_TAGS:
    return f"is the role tag <{tag}>"
  return None


def _mcp_server(name: str, spec: Mapping):
  """Returns the McpServer of an `mcp` spec (not started); a command `python` or `python3` runs
  this interpreter."""
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
  command = [command] if isinstance(command, str) else command
  if command and command[0] in PYTHON_COMMANDS:
    command = [sys.executable, *command[1:]]
  settings = {key: spec[key] for key in ("start_timeout_s", "start_backoff_s",
                                         "max_start_backoff_s", "restart_after_timeouts")
              if key in spec}
  if "timeout_s" in spec:
    settings["call_timeout_s"] = spec["timeout_s"]
  try:
    return mcp_tools.McpServer(command=command, url=spec.get("url"), env=spec.get("env"),
                               cwd=spec.get("cwd"), **settings)
  except ValueError as e:
    raise ValueError(f"tools.{name} (mcp): {e}") from None


def _kept_names(name: str, spec: Mapping) -> list[str] | None:
  """Returns the tool names an `mcp` spec keeps (its `tools`: a list, or one name as a string;
  None: all)."""
  kept = spec.get("tools")
  if kept is None:
    return None
  kept = [kept] if isinstance(kept, str) else kept
  if not isinstance(kept, (list, tuple)) or not all(isinstance(n, str) for n in kept):
    raise ValueError(f"tools.{name}.tools must be a list of the server's tool names (or one "
                     f"name), got {spec.get('tools')!r}")
  twice = sorted({n for n in kept if kept.count(n) > 1})
  if twice:
    raise ValueError(f"tools.{name}.tools lists {twice} twice")
  return list(kept)


def _mcp_tools(name: str, spec: Mapping, server) -> dict:
  """Returns {tag: McpTool} of the server's tools that `spec` keeps (all by default), each
  under its tag (`rename`, else `mcp_tag`), in the order of `tools`, else sorted by tag."""
  from tools_env import mcp_tools

  where = f"tools.{name} (MCP server {server.label})"
  kept = _kept_names(name, spec)
  rename = spec.get("rename") or {}
  if not isinstance(rename, Mapping):
    raise ValueError(f"tools.{name}.rename must map the server's tool names to tags, got "
                     f"{rename!r}")
  try:
    tools = mcp_tools.server_tools(server, kept)
  except (mcp_tools.McpError, ValueError) as e:
    raise ValueError(f"tools.{name} (mcp): {e}") from None
  stray = sorted(set(rename) - set(tools))
  if stray:
    raise ValueError(f"{where}: rename names {stray}, not among its tools "
                     f"{'kept' if kept is not None else 'listed'}: {sorted(tools)}")
  tagged: dict[str, Any] = {}
  for tool_name, tool in tools.items():
    tag = rename.get(tool_name, mcp_tag(tool_name))
    problem = tag_problem(tag)
    if problem:
      how = (f"tools.{name}.rename gives it" if tool_name in rename else "its name maps to")
      raise ValueError(f"{where}: tool {tool_name!r}: {how} the tag {tag!r}, which {problem}; "
                       f"give it another with `rename`: {{{tool_name!r}: 'a_tag'}}")
    if tag in tagged:
      raise ValueError(f"{where}: tools {tagged[tag].info.name!r} and {tool_name!r} both map to "
                       f"the tag {tag!r}; give one another with `rename`")
    tool.name = tag
    tagged[tag] = tool
  return tagged if kept is not None else dict(sorted(tagged.items()))


def _origin(name: str, tool: Any = None) -> str:
  """Returns where a tag comes from: a config entry, or a tool of an entry's MCP server."""
  if tool is None:
    return f"tools.{name}"
  return f"tools.{name} (MCP server {tool.server.label}, tool {tool.info.name!r})"


def _check_once(origins: Mapping[str, list[str]]) -> None:
  """Raises ValueError naming every tag declared more than once and where each came from."""
  twice = sorted(tag for tag, where in origins.items() if len(where) > 1)
  if twice:
    raise ValueError(f"tool tag(s) {twice} declared twice (an MCP server's tools are tags "
                     f"too): " + "; ".join(f"{tag}: {', '.join(origins[tag])}" for tag in twice))


def _kind(name: str, spec: Any) -> str:
  kind = spec.get("kind") if isinstance(spec, Mapping) else None
  if kind not in BUILTIN_KINDS + ("python", "mcp"):
    raise ValueError(f"tools.{name}.kind must be one of {sorted(BUILTIN_KINDS + ('python', 'mcp'))}"
                     f", got {kind!r}")
  return kind


def declare(spec: Mapping[str, Mapping]) -> list[ToolDecl]:
  """Returns the tools `spec` declares, in order: one per entry (entries sorted by name), or
  each tool an `mcp` entry's server lists (it is started, listed and stopped) under its tag, in
  the order of the entry's `tools`, else sorted by tag. Raises ValueError naming the entry
  whose kind, class, options or server is wrong, an MCP tool whose tag cannot be one (naming
  the entry and the server), or a tag declared twice (an entry's own name as a tag is checked
  by `coa_jax.data.coa_format.check_tool_tags`)."""
  declared: list[ToolDecl] = []
  origins: dict[str, list[str]] = collections.defaultdict(list)
  for name, tool_spec in _entries(spec):
    kind = _kind(name, tool_spec)
    if kind == "mcp":
      with ToolRegistry({}, (_mcp_server(name, tool_spec),)) as registry:
        tools = _mcp_tools(name, tool_spec, registry.servers[0])
      for tag, tool in tools.items():
        declared.append(ToolDecl(tag, tool.info.description, tool.info.input_schema))
        origins[tag].append(_origin(name, tool))
      continue
    description = tool_spec.get("description")
    if kind == "python":
      cls = _python_class(name, tool_spec)
      description = description or " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    declared.append(ToolDecl(name, description or BUILTIN_DESCRIPTIONS[kind]))
    origins[name].append(_origin(name))
  _check_once(origins)
  return declared


def _entries(spec: Any) -> list[tuple[str, Any]]:
  """Returns a `tools` spec's (name, spec) entries sorted by name (a ConfigDict's as plain
  dicts): a ConfigDict keeps its keys sorted, so that a spec declares the same tags in the same
  order whether a dict, a JSON file or a config holds it. Raises ValueError for a spec that is
  not a mapping of names to specs."""
  if hasattr(spec, "to_dict"):  # an ml_collections ConfigDict, which is no Mapping
    spec = spec.to_dict()
  if not isinstance(spec, Mapping):
    raise ValueError(f"tools must map names to tool specs ({{name: {{'kind': ...}}}}), got "
                     f"{spec!r}")
  return sorted(spec.items(), key=lambda entry: str(entry[0]))


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
  tools, `rename` ({server's tool name: tag}), `env`, `cwd`, `start_timeout_s`, `timeout_s`,
  `start_backoff_s`, `max_start_backoff_s`, `restart_after_timeouts` (McpServer's): each listed
  tool becomes a tag, `declare`'s). Any spec may have `description` (for the system prompt,
  `declare`). An `http` mapping holds HttpLimits fields. Any tool may have `latency_s: [low,
  high]`, a modelled service latency (`base.Delayed`) for benchmarks. The registry's `close`
  stops the MCP servers.
  """
  tools, servers = {}, []
  origins: dict[str, list[str]] = collections.defaultdict(list)
  try:
    for name, tool_spec in _entries(spec):
      if _kind(name, tool_spec) == "mcp":
        servers.append(_mcp_server(name, tool_spec))
        for tag, tool in _mcp_tools(name, tool_spec, servers[-1]).items():
          tools[tag] = tool
          origins[tag].append(_origin(name, tool))
      else:
        tools[name] = _build_tool(name, tool_spec)
        origins[name].append(_origin(name))
    _check_once(origins)
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
