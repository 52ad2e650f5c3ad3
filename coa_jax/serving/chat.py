"""OpenAI chat messages as CoA token ids, and a completion's ids as an OpenAI message.

A CoA conversation is one prompt (a system prompt and one user message, the question) and one
assistant response whose tool steps are each followed by an observation. In OpenAI's terms:

- a request's `tools` (function schemas) name tools whose tags the model's tokenizer has; the
  system prompt, unless the request brings one, is the one the model was trained with when
  they are its tools, else lists them as the main job's prompt does ("Solve the question with
  tools: web_search, code.");
- a completion that ends in a closing tool tag is an assistant message with the steps before
  the call as its `content` and one `tool_calls` entry (name = the tag, arguments = the body as
  JSON: `{"<the one string parameter>": body}`, or the body itself when it is a JSON object);
- a `tool` message is an observation span, as the built-in rollout appends it
  (`rollout.tool_loop.observation_ids`).

Token in, token out: the ids of every completion served are remembered (`Transcripts`, by the
message the client got), so an assistant message sent back unchanged is its sampled ids, never
its text tokenized again; a message the server never wrote is tokenized from its text.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Sequence

from coa_jax.data import coa_format
from coa_jax.data.tokenize import step_ids
from coa_jax.data.tokenizer import CoATokenizer
from coa_jax.rollout.tool_loop import call_body, observation_ids
from coa_jax.serving.requests import EngineError

PREAMBLE = "Solve the question with tools:"


class ChatError(EngineError):
  """A conversation that cannot be a CoA prompt (400)."""


@dataclasses.dataclass(frozen=True)
class Function:
  """A declared tool: its name (a tool tag of the model) and its parameters' JSON schema."""

  name: str
  parameters: dict

  @property
  def text_parameter(self) -> str | None:
    """The name of its one string parameter, which holds a call's body; None otherwise."""
    props = self.parameters.get("properties") or {}
    if len(props) == 1:
      (name, schema), = props.items()
      if isinstance(schema, dict) and schema.get("type", "string") == "string":
        return name
    return None

  def arguments(self, body: str) -> str:
    """Returns a call's body as OpenAI's `arguments` (a JSON object, as a string)."""
    if self.text_parameter:
      return json.dumps({self.text_parameter: body})
    try:
      value = json.loads(body)
    except json.JSONDecodeError:
      value = None
    return json.dumps(value if isinstance(value, dict) else {"input": body})

  def body(self, arguments: str) -> str:
    """Returns the CoA body of a call from its `arguments` (the inverse of `arguments`)."""
    try:
      value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
      raise ChatError(f"tool call {self.name!r}: arguments are not JSON: {arguments[:80]!r}")
    if not isinstance(value, dict):
      raise ChatError(f"tool call {self.name!r}: arguments must be a JSON object")
    if self.text_parameter and set(value) == {self.text_parameter}:
      return str(value[self.text_parameter])
    if set(value) == {"input"} and isinstance(value["input"], str):
      return value["input"]
    return json.dumps(value)


def declared_functions(tools: Sequence[dict] | None, tokenizer: CoATokenizer) -> list[Function]:
  """Returns a request's `tools` as Functions; each must name one of the model's tool tags."""
  functions = []
  for tool in tools or ():
    spec = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type", "function") != "function" or not isinstance(spec, dict):
      raise ChatError("tools: each entry must be {\"type\": \"function\", \"function\": {...}}")
    name = spec.get("name")
    if name not in tokenizer.tool_tags:
      raise ChatError(f"tool {name!r}: the model has no tag for it; its tools are "
                      f"{', '.join(tokenizer.tool_tags)}")
    functions.append(Function(name, spec.get("parameters") or {}))
  return functions


def tools_prompt(functions: Sequence[Function]) -> str:
  """Returns the system prompt that declares `functions` (the main job's form)."""
  return f"{PREAMBLE} {', '.join(f.name for f in functions)}."


class Transcripts:
  """The ids of the assistant messages this server wrote, by the message (bounded, LRU)."""

  def __init__(self, capacity: int = 4096):
    self.capacity = capacity
    self._ids: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
    self._lock = threading.Lock()

  @staticmethod
  def key(content: str | None, tool_calls: Sequence[dict] | None, session: str = "") -> str:
    """A message's key: its content and calls (each call's id, which is unique, with them),
    within its session's path (RL sessions never read each other's: two completions may
    decode to the same text from other ids, e.g. broken multi-byte characters)."""
    calls = [(c.get("id", ""), c["function"]["name"], c["function"].get("arguments", ""))
             for c in tool_calls or ()]
    return json.dumps([session, content or "", calls])

  def remember(self, key: str, ids: list[int]) -> None:
    with self._lock:
      self._ids[key] = list(ids)
      self._ids.move_to_end(key)
      while len(self._ids) > self.capacity:
        self._ids.popitem(last=False)

  def recall(self, key: str) -> list[int] | None:
    with self._lock:
      ids = self._ids.get(key)
      if ids is not None:
        self._ids.move_to_end(key)
      return ids


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A request's messages as the engine's prompt: its ids, and where the response begins."""

  ids: list[int]
  response_start: int
  functions: tuple[Function, ...]


def prompt_ids(tokenizer: CoATokenizer, messages: Sequence[dict], tools: Sequence[dict] | None,
               default_system: str, transcripts: Transcripts,
               max_observation_tokens: int, session: str = "") -> Conversation:
  """Returns the CoA prompt of `messages` (see the module docstring); raises ChatError for a
  conversation that is not one: no question, two questions, or a tool result without a call."""
  functions = declared_functions(tools, tokenizer)
  messages = list(messages)
  # The prompt the model was trained with, unless the request declares other tools than its.
  system = default_system
  if functions and {f.name for f in functions} != set(tokenizer.tool_tags):
    system = tools_prompt(functions)
  if messages and messages[0].get("role") in ("system", "developer"):
    system = _text(messages.pop(0))
  if not messages or messages[0].get("role") != "user":
    raise ChatError("a CoA conversation starts with one user message (the question), after an "
                    "optional system message")
  ids = tokenizer.prompt_ids(system, _text(messages[0]))
  start = len(ids)
  pending_call = False
  for message in messages[1:]:
    role = message.get("role")
    if role == "assistant":
      ids += _assistant_ids(tokenizer, message, functions, transcripts, len(ids) == start,
                            session)
      pending_call = bool(message.get("tool_calls"))
    elif role == "tool":
      if not pending_call:
        raise ChatError("a tool message must follow an assistant message with a tool call")
      ids += observation_ids(tokenizer, _text(message), max_observation_tokens)
      pending_call = False
    elif role == "user":
      raise ChatError("a CoA conversation has one user message (the question); later turns "
                      "are assistant and tool messages")
    else:
      raise ChatError(f"unknown message role {role!r}")
  if messages[-1].get("role") == "assistant" and pending_call:
    raise ChatError("the last assistant message calls a tool: send the tool's result first")
  return Conversation(ids, start, tuple(functions))


def _text(message: dict) -> str:
  content = message.get("content")
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # content parts: their text joined
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
  raise ChatError("message content must be a string or a list of text parts")


def _assistant_ids(tokenizer: CoATokenizer, message: dict, functions: Sequence[Function],
                   transcripts: Transcripts, first: bool, session: str) -> list[int]:
  calls = message.get("tool_calls") or []
  remembered = transcripts.recall(Transcripts.key(message.get("content"), calls, session))
  if remembered is not None:
    return remembered
  steps, _ = coa_format.parse(_text(message), tokenizer.tool_tags)
  by_name = {f.name: f for f in functions}
  for call in calls:
    name = call.get("function", {}).get("name")
    function = by_name.get(name) or Function(name, {})
    if name not in tokenizer.tool_tags:
      raise ChatError(f"tool call {name!r}: the model has no tag for it")
    steps.append(coa_format.Step(name, function.body(call["function"].get("arguments", ""))))
  ids = []
  for i, step in enumerate(steps):
    ids += step_ids(tokenizer, step, first=first and i == 0)
  return ids


@dataclasses.dataclass(frozen=True)
class Reply:
  """A completion as an assistant message: its content, tool calls and finish reason."""

  content: str | None
  tool_calls: list[dict]
  finish_reason: str


def reply(tokenizer: CoATokenizer, ids: Sequence[int], reason: str,
          functions: Sequence[Function], call_id: str) -> Reply:
  """Returns the assistant message of a completion's `ids` that ended for `reason` ("stop" or
  "length"). A completion that closes a tool tag is a tool call, as the built-in rollout takes
  it (`rollout.tool_loop.call_body`): its body, or "" when the call is malformed (the program
  should answer as the built-in loop does, `malformed_call`); `content` is the text before the
  call's opening tag (all of it when there is none)."""
  ids = list(ids)
  if ids and ids[-1] == tokenizer.end_id:
    ids = ids[:-1]
  closes = {tokenizer.tag_id(tag, close=True): tag for tag in tokenizer.tool_tags}
  tag = closes.get(ids[-1]) if ids and reason == "stop" else None
  if tag is None:
    return Reply(tokenizer.decode(ids), [], reason)
  body = call_body(tokenizer, ids, tag) or ""
  opening = tokenizer.tag_id(tag)
  start = len(ids) - 1 - ids[::-1].index(opening) if opening in ids else len(ids)
  function = next((f for f in functions if f.name == tag), Function(tag, {}))
  content = tokenizer.decode(ids[:start]) or None
  call = {"id": call_id, "type": "function",
          "function": {"name": tag, "arguments": function.arguments(body)}}
  return Reply(content, [call], "tool_calls")


def text_until_call(tokenizer: CoATokenizer, ids: Sequence[int]) -> tuple[str, bool]:
  """Returns the text of `ids` up to an opening tool tag, and whether one was met (a stream
  holds a tool call back until it closes)."""
  openings = {tokenizer.tag_id(tag) for tag in tokenizer.tool_tags}
  for i, token in enumerate(ids):
    if token in openings:
      return tokenizer.decode(list(ids[:i])), True
  return tokenizer.decode(list(ids)), False
