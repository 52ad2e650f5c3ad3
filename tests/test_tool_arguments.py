"""A tag's body as an MCP tool's arguments (tools_env/arguments.py): what a prompt asks for is
what the call parses, for each form of input schema."""

import pytest

from coa_jax.distill.chat_teacher import chat_agents
from tools_env import arguments, base
from tools_env.registry import ToolDecl

TEXT = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SEVERAL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
           "required": ["a"]}
NONE = {"type": "object", "properties": {}}


@pytest.mark.parametrize("schema, form, says, body, parsed", [
    (TEXT, arguments.TEXT, "the city itself, as plain text (not JSON)", " Paris \n",
     {"city": "Paris"}),
    (SEVERAL, arguments.JSON,
     'a JSON object of the arguments a (integer, required), b (string), of this schema: '
     '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, '
     '"required": ["a"]}', '{"a": 1, "b": "x"}', {"a": 1, "b": "x"}),
    (NONE, arguments.NONE, "empty (the tool takes no arguments)", "", {}),
], ids=["one-string", "several", "none"])
def test_the_teachers_prompt_asks_for_the_body_the_call_parses(schema, form, says, body,
                                                                parsed):
  assert arguments.body_form(schema) == form
  agent, prompt = chat_agents([ToolDecl("weather", "Returns the weather.", schema)])[
      "weather_agent"]
  assert (agent, prompt) == ("weather", "You are the weather agent: Returns the weather. Reply "
                                        f"with only the body of the call: {says}.")
  assert arguments.parse_body(schema, body, "weather") == parsed


def test_a_json_body_of_a_one_string_tool_is_the_string_itself():
  assert arguments.parse_body(TEXT, '{"city": "Paris"}', "weather") == {
      "city": '{"city": "Paris"}'}


def test_a_body_for_a_tool_without_arguments_is_a_bad_request():
  with pytest.raises(base.ToolFailure, match="now takes no arguments: leave its body empty; "
                                             "got 'today'") as raised:
    arguments.parse_body(NONE, "today", "now")
  assert raised.value.kind == base.BAD_REQUEST
  assert arguments.parse_body(NONE, "{}", "now") == {}


def test_a_blank_body_is_no_arguments_when_none_is_required():
  assert arguments.parse_body({"properties": {"a": {}, "b": {}}}, " ", "t") == {}
  with pytest.raises(base.ToolFailure, match=r"t takes a JSON object of arguments: a \(integer, "
                                             r"required\), b \(string\); got ''"):
    arguments.parse_body(SEVERAL, " ", "t")


def test_a_tool_without_a_schema_has_no_body_form_in_prompts():
  assert ToolDecl("sql", "Runs one SQL query.").body is None
  assert chat_agents([ToolDecl("sql", "Runs one SQL query.")])["sql_agent"][1] == (
      "You are the sql agent: Runs one SQL query. Reply with only the body of the call.")
