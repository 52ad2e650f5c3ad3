"""A tag's body as the arguments of a tool that has an input schema (an MCP tool), and the one
sentence that tells a model or a teacher how to write that body: both come from `body_form`, so
what a prompt asks for is what the call parses.

Three forms, by the schema's properties:
- TEXT: exactly one property and it is a string: the stripped body is that string, as is (a body
  that happens to be JSON is still the string);
- NONE: no properties: the body is blank (or the JSON object `{}`);
- JSON: anything else: the body is a JSON object of the arguments (blank: none, when none is
  required).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from tools_env.base import BAD_REQUEST, ToolFailure

TEXT, NONE, JSON = "text", "none", "json"


def json_type(spec: Any) -> str:
  """Returns the JSON Schema type of a property ("any" when it names none)."""
  return str(spec.get("type", "any")) if isinstance(spec, Mapping) else "any"


def properties(schema: Mapping) -> dict[str, Any]:
  """Returns an input schema's properties ({} when it has none)."""
  found = schema.get("properties") if isinstance(schema, Mapping) else None
  return dict(found) if isinstance(found, Mapping) else {}


def body_form(schema: Mapping) -> str:
  """Returns how a body holds the arguments of a tool with this input schema: TEXT, NONE or
  JSON."""
  props = properties(schema)
  if not props:
    return NONE
  if len(props) == 1 and json_type(next(iter(props.values()))) == "string":
    return TEXT
  return JSON


def describe_properties(schema: Mapping) -> str:
  """Returns an input schema's properties as text: "a (integer, required), b (string)"."""
  required = set(schema.get("required") or ())
  return ", ".join(f"{name} ({json_type(spec)}{', required' if name in required else ''})"
                   for name, spec in properties(schema).items()) or "none"


def describe_body(schema: Mapping) -> str:
  """Returns what a call's body holds, a clause for a prompt ("Body: <it>."): the one string
  argument as plain text, nothing, or a JSON object of this schema."""
  form = body_form(schema)
  if form == TEXT:
    return f"the {next(iter(properties(schema)))} itself, as plain text (not JSON)"
  if form == NONE:
    return "empty (the tool takes no arguments)"
  return (f"a JSON object of the arguments {describe_properties(schema)}, of this schema: "
          f"{json.dumps(dict(schema))}")


def parse_body(schema: Mapping, body: str, tool: str) -> dict[str, Any]:
  """Returns the arguments a body holds for a tool with this input schema (`body_form`); raises
  ToolFailure(BAD_REQUEST) naming `tool` and saying what it expects for any other body."""
  form = body_form(schema)
  text = body.strip()
  if form == TEXT:
    return {next(iter(properties(schema))): text}
  if not text and (form == NONE or not schema.get("required")):
    return {}
  try:
    arguments = json.loads(text)
  except ValueError:
    arguments = None
  if form == NONE and arguments != {}:
    raise ToolFailure(BAD_REQUEST, f"{tool} takes no arguments: leave its body empty; got "
                                   f"{text[:200]!r}")
  if not isinstance(arguments, dict):
    raise ToolFailure(BAD_REQUEST, f"{tool} takes a JSON object of arguments: "
                                   f"{describe_properties(schema)}; got {text[:200]!r}")
  return arguments
