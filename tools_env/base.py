"""The tool interface: a tool takes the body of its tag and returns a ToolResult, never raising.

Every failure becomes an observation the model can read ("Error: ...") plus a
machine-readable `error_kind`, so the rollout loop and the teacher system treat all tools
alike and a crashing tool can never take a run down.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import zlib
from typing import Any

# Machine-readable error kinds.
BAD_REQUEST = "bad_request"  # a malformed call: empty query, missing code fence, bad URL
NO_RESULTS = "no_results"
NOT_FOUND = "not_found"
TIMEOUT = "timeout"
TOO_LARGE = "too_large"
HTTP_ERROR = "http_error"
TOOL_ERROR = "tool_error"  # the tool itself failed unexpectedly
UNKNOWN_TOOL = "unknown_tool"
REPEATED = "repeated"  # the same call was already made in this trajectory
BAD_RESPONSE = "bad_response"  # a remote service answered with something unparsable
# The code sandbox's kinds.
SYNTAX_ERROR = "syntax_error"
RUNTIME_ERROR = "runtime_error"  # the program exited non-zero or died of a signal
MEMORY_LIMIT = "memory_limit"
PROCESS_LIMIT = "process_limit"
ERROR_KINDS = (BAD_REQUEST, NO_RESULTS, NOT_FOUND, TIMEOUT, TOO_LARGE, HTTP_ERROR, TOOL_ERROR,
               UNKNOWN_TOOL, REPEATED, BAD_RESPONSE, SYNTAX_ERROR, RUNTIME_ERROR, MEMORY_LIMIT,
               PROCESS_LIMIT)

TRUNCATION_MARKER = "\n... [{omitted} characters omitted] ...\n"


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """An observation plus what happened: ok or an error kind, time taken, truncation."""

  observation: str
  ok: bool
  error_kind: str | None = None
  elapsed_s: float = 0.0
  truncated: bool = False
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class ToolFailure(Exception):
  """Raised inside a tool for an expected failure; becomes an error ToolResult.

  The observation is "Error: <message>", followed by `output` (e.g. a traceback) if any.
  """

  def __init__(self, kind: str, message: str, output: str = "", **metadata: Any):
    super().__init__(message)
    self.kind, self.output, self.metadata = kind, output, metadata


def import_module(module: str) -> Any:
  """Returns the imported `module`. One that is not on sys.path but in the working directory
  (`my_shop.py`, or a package folder `my_shop/`) is imported from there, as `python -m` and
  `python -c` would find it (a script such as `python experiments/pipeline.py` has its own
  folder on sys.path instead of the working directory). sys.path is left as it is, so such a
  module's own imports of other modules beside it are not found: a package's modules import
  each other as `my_shop.helpers`."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    top = module.split(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) if e.name == top else None
    if spec is None:
      raise
  loaded = importlib.util.module_from_spec(spec)
  sys.modules[top] = loaded
  try:
    spec.loader.exec_module(loaded)
  except BaseException:
    sys.modules.pop(top, None)
    raise
  return importlib.import_module(module)


def import_object(path: str, where: str) -> Any:
  """Returns the object at `path` ("package.module:Name" or "package.module.Name"; the module
  as `import_module` finds it, in the working directory too); raises ValueError naming `where`
  (the config field) when it is not an import path or fails."""
  module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
  if not module or not name:
    raise ValueError(f"{where}: {path!r} is not an import path (package.module:Name)")
  try:
    return getattr(import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"{where}: cannot import {path!r}: {e}") from None


def truncate_middle(text: str, limit: int) -> tuple[str, bool]:
  """Returns text cut to at most ~`limit` characters keeping head and tail, and whether it was."""
  if len(text) <= limit:
    return text, False
  head = limit // 2
  tail = limit - head
  omitted = len(text) - head - tail
  return text[:head] + TRUNCATION_MARKER.format(omitted=omitted) + text[len(text) - tail:], True


def error_result(kind: str, message: str, elapsed_s: float = 0.0, **metadata: Any) -> ToolResult:
  """Returns the ToolResult of a failure: observation 'Error: <message>'."""
  return ToolResult(f"Error: {message}", False, kind, elapsed_s, False, dict(metadata))


class Tool(abc.ABC):
  """A tool: subclasses implement `_run(body, goal) -> (text, metadata)`; may raise ToolFailure."""

  name: str = "tool"

  def __init__(self, max_output_chars: int = 8000):
    self.max_output_chars = max_output_chars

  @abc.abstractmethod
  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    """Returns the observation text and metadata for a call (`goal`: the task, may be empty)."""

  def __call__(self, body: str, goal: str = "") -> ToolResult:
    """Runs the tool on the body of its tag; returns a ToolResult and never raises.

    `goal` is the task being solved, for tools that use it (the crawl summarizer).
    """
    start = time.perf_counter()
    ok, kind = True, None
    try:
      text, metadata = self._run(body if isinstance(body, str) else str(body), goal)
    except ToolFailure as e:
      ok, kind, metadata = False, e.kind, e.metadata
      text = f"Error: {e}" + (f"\n{e.output}" if e.output else "")
    except Exception as e:  # noqa: BLE001 - a tool must never raise into the caller
      return error_result(TOOL_ERROR, f"{self.name} failed: {type(e).__name__}: {e}",
                          time.perf_counter() - start)
    text, truncated = truncate_middle(text, self.max_output_chars)
    return ToolResult(text, ok, kind, time.perf_counter() - start, truncated, metadata)


class Delayed(Tool):
  """Another tool behind a modelled service latency (benchmarks of slow tools): each call
  first waits a time drawn uniformly from [low_s, high_s], seeded by the call's body and goal,
  so the same call always waits the same time."""

  def __init__(self, inner: Tool, low_s: float, high_s: float):
    super().__init__(inner.max_output_chars)
    if not 0 <= low_s <= high_s:
      raise ValueError(f"latency_s must be [low, high] with 0 <= low <= high, got "
                       f"[{low_s}, {high_s}]")
    self.inner, self.low_s, self.high_s = inner, low_s, high_s
    self.name = inner.name

  def delay_s(self, body: str, goal: str = "") -> float:
    """Returns the wait of a call."""
    fraction = zlib.crc32(f"{goal}\0{body}".encode()) / 0xFFFFFFFF
    return self.low_s + fraction * (self.high_s - self.low_s)

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    return self.inner._run(body, goal)

  def __call__(self, body: str, goal: str = "") -> ToolResult:
    delay = self.delay_s(str(body), goal)
    time.sleep(delay)
    result = self.inner(body, goal)
    return dataclasses.replace(result, elapsed_s=result.elapsed_s + delay)
