"""Tools declared in a config: a new tag through the tokenizer, masks, parser and rollout;
config errors; MCP servers' tools as tags; rewards that see tool results."""

import json
import os
import re
import shlex
import sys

import ml_collections
import pytest
from test_rollout import SYSTEM, ScriptedSampler

from coa_jax.data import coa_format, prompts, rewards
from coa_jax.data.tasks import Task
from coa_jax.data.tokenize import step_ids, tokenize_trajectory
from coa_jax.data.tokenizer import declared_tags, default_tokenizer
from coa_jax.distill.chat_teacher import ChatTeacher
from coa_jax.model import ConfigError
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, stop_ids
from tools_env import Tool, ToolFailure, registry

SERVER = [sys.executable, os.path.join(os.path.dirname(__file__), "mcp_fixture_server.py")]
ODD = SERVER + ["--odd-names"]  # adds the tools getWeather, get-time and answer


class Reverse(Tool):
  """Reverses its text."""

  name = "reverse"

  def __init__(self, suffix: str = ""):
    super().__init__()
    self.suffix = suffix

  def _run(self, body, goal):
    if not body.strip():
      raise ToolFailure("bad_request", "nothing to reverse")
    return body.strip()[::-1] + self.suffix, {}


SPEC = {"reverse": {"kind": "python", "class": "test_declared_tools:Reverse",
                    "options": {"suffix": "!"}},
        "code": {"kind": "sandbox"}}


def test_a_declared_tag_flows_through_tokenizer_masks_parser_and_rollout():
  tags = declared_tags(SPEC)
  assert tags == ("code", "reverse")  # the entries sorted by name
  tokenizer = default_tokenizer("plain", tool_tags=tags)
  base = default_tokenizer("plain")
  # Two new special tokens past the base vocabulary; every other id unchanged.
  assert tokenizer.vocab_size == base.vocab_size + 2
  assert {tokenizer.tag_id("reverse"), tokenizer.tag_id("reverse", close=True)} == {
      base.vocab_size, base.vocab_size + 1}
  assert tokenizer.tag_id("code") == base.tag_id("code")
  assert tokenizer.encode("<reverse>") == base.encode("<reverse>")  # text stays text

  steps = (coa_format.Step("think", "Reverse it."), coa_format.Step("reverse", "abc"),
           coa_format.Step("observation", "cba!"), coa_format.Step("answer", "cba!"))
  text = coa_format.render_steps(steps)
  assert coa_format.parse_and_validate(text, tool_tags=tags) == (list(steps), [])
  assert coa_format.parse(text)[1]  # undeclared, <reverse> is stray text
  example = tokenize_trajectory(coa_format.Trajectory(SYSTEM, "q", steps), tokenizer, 256)
  observation = step_ids(tokenizer, steps[2], first=False)
  start = example.response_start + sum(len(step_ids(tokenizer, s, i == 0))
                                       for i, s in enumerate(steps[:2]))
  assert list(example.input_ids[start:start + len(observation)]) == observation
  assert not example.loss_mask[start:start + len(observation)].any()
  assert example.loss_mask[start - 1] == 1  # </reverse> is the model's

  # The rollout stops on </reverse>, runs the declared tool and masks its observation.
  written = (step_ids(tokenizer, steps[0], True) + step_ids(tokenizer, steps[1], False))
  answer = step_ids(tokenizer, coa_format.Step("answer", "cba!"), False)
  sampler = ScriptedSampler({"q": written + answer}, 2, stop_ids=stop_ids(tokenizer))
  with registry.build_registry(SPEC) as tools:
    engine = Rollout(sampler, None, tokenizer, tools, RolloutConfig(max_prompt_tokens=64,
                                                                    max_response_tokens=200),
                     SYSTEM)
    (record,), = engine.run([Task("q", "q")])
  obs = step_ids(tokenizer, coa_format.Step("observation", "cba!"), False)
  assert record.ids[record.prompt_len:] == written + obs + answer
  assert record.loss_mask[record.prompt_len:] == [1] * len(written) + [0] * len(obs) + [1] * len(
      answer)
  assert (record.finish_reason, record.tool_calls) == ("answer", {"reverse": 1})


@pytest.mark.parametrize("spec, culprit", [
    ({"Bad-Tag": {"kind": "python", "class": "test_declared_tools:Reverse"}}, "'Bad-Tag'"),
    ({"think": {"kind": "python", "class": "test_declared_tools:Reverse"}}, "role tag <think>"),
    ({"reverse": {"kind": "python", "class": "test_declared_tools:Reverse"},
      "fixture": {"kind": "mcp", "command": SERVER, "tools": ["echo"]},
      "echo": {"kind": "sandbox"}}, "['echo'] declared twice"),
    ({"reverse": {"kind": "shell"}}, "tools.reverse.kind"),
    ({"reverse": {"kind": "python", "class": "no_such_module:Tool"}}, "cannot import"),
    ({"reverse": {"kind": "python", "class": "test_declared_tools:SPEC"}}, "not a tools_env.Tool"),
    ({"reverse": {"kind": "python", "class": "test_declared_tools:Reverse", "opts": {}}},
     "unknown options ['opts']"),
    ({"srv": {"kind": "mcp", "command": SERVER, "url": "http://127.0.0.1:1/mcp"}},
     "exactly one of `command` and `url`"),
    ({"srv": {"kind": "mcp", "command": ["/no/such/server"]}}, "tools.srv (mcp)"),
    ({"srv": {"kind": "mcp", "command": SERVER, "tools": ["nope"]}}, "no tool 'nope'"),
    ({"odd": {"kind": "mcp", "command": ODD, "tools": ["answer"]}},
     f"tools.odd (MCP server {shlex.join(ODD)}): tool 'answer': its name maps to the tag "
     f"'answer', which is the role tag <answer>; give it another with `rename`"),
    ({"odd": {"kind": "mcp", "command": ODD, "tools": ["getWeather"],
              "rename": {"getWeather": "Weather!"}}},
     f"tools.odd (MCP server {shlex.join(ODD)}): tool 'getWeather': tools.odd.rename gives it "
     f"the tag 'Weather!', which is not a lower-case identifier"),
    ({"odd": {"kind": "mcp", "command": ODD, "tools": ["echo"], "rename": {"getWeather": "w"}}},
     "rename names ['getWeather'], not among its tools kept: ['echo']"),
    ({"odd": {"kind": "mcp", "command": ODD, "tools": ["echo", "getWeather"],
              "rename": {"getWeather": "echo"}}},
     "tools 'echo' and 'getWeather' both map to the tag 'echo'"),
    ({"srv": {"kind": "mcp", "command": SERVER, "tools": 3}},
     "tools.srv.tools must be a list of the server's tool names (or one name), got 3"),
], ids=["malformed", "role", "clash", "kind", "import", "not-a-tool", "options", "mcp-both",
        "mcp-cannot-start", "mcp-unknown-tool", "mcp-role-name", "mcp-bad-rename",
        "mcp-stray-rename", "mcp-same-tag", "mcp-tools-not-a-list"])
def test_tool_config_errors_name_the_culprit(spec, culprit):
  with pytest.raises(ConfigError, match=re.escape(culprit)):
    declared_tags(spec)


def test_mcp_tools_are_tags_with_their_schemas_in_the_prompt():
  spec = {"fixture": {"kind": "mcp", "command": SERVER, "tools": ["echo", "add"]}}
  assert declared_tags(spec) == ("echo", "add")
  prompt = prompts.for_tools(spec)
  assert prompt.splitlines()[1].startswith("echo: ") and '"a": {' in prompt
  chat = ChatTeacher(None, None, declared=registry.declare(spec))
  assert chat.agents["add_agent"][0] == "add" and '"b"' in chat.agents["add_agent"][1]
  with registry.build_registry(spec) as tools:
    assert tools.call("add", '{"a": 2, "b": 3}').observation == "5"
    server = tools.servers[0]
  assert server.closed  # the registry stops its servers


def test_mcp_tool_names_that_cannot_be_tags_are_mapped_to_tags():
  spec = {"odd": {"kind": "mcp", "command": ODD, "tools": ["getWeather", "get-time"]}}
  assert declared_tags(spec) == ("get_weather", "get_time")
  with registry.build_registry(spec) as tools:
    assert tools.call("get_weather", "Paris").observation == "sunny in Paris"
    assert tools.call("get_time", "").observation == "12:00"


def test_rename_gives_an_mcp_tool_the_tag_the_config_names():
  spec = {"odd": {"kind": "mcp", "command": ODD, "tools": ["getWeather", "answer"],
                  "rename": {"getWeather": "weather", "answer": "say"}}}
  assert declared_tags(spec) == ("weather", "say")


@pytest.mark.parametrize("name, tag", [
    ("getWeather", "get_weather"), ("get-time", "get_time"), ("HTTPFetch", "http_fetch"),
    ("search.web", "search_web"), ("2fa", "tool_2fa"), ("web_search", "web_search"),
    ("a" * 40, "a" * 32)])
def test_mcp_tag_maps_a_tool_name_to_a_tag(name, tag):
  assert registry.mcp_tag(name) == tag
  assert coa_format.check_tool_tags([tag]) == (tag,)


def test_the_registry_checks_tags_as_the_format_does():
  assert registry.TAG_RE.pattern == coa_format.TOOL_TAG_RE.pattern
  assert registry.RESERVED_TAGS == coa_format.ROLE_TAGS + (coa_format.OBSERVATION,)


def test_tools_given_as_a_string_is_one_tool_name():
  assert declared_tags({"fixture": {"kind": "mcp", "command": SERVER, "tools": "echo"}}) == (
      "echo",)


def test_tags_are_in_one_order_whatever_holds_the_spec():
  spec = {"zeta": {"kind": "python", "class": "test_declared_tools:Reverse"},
          "srv": {"kind": "mcp", "command": SERVER},
          "alpha": {"kind": "python", "class": "test_declared_tools:Reverse"}}
  # The entries sorted by name; an MCP entry without `tools`, its tools sorted by tag.
  expected = ("alpha", "add", "bad_result", "crash", "echo", "freeze", "garbage", "pid", "sleep",
              "zeta")
  assert declared_tags(spec) == expected
  assert declared_tags(ml_collections.ConfigDict(spec)) == expected


def test_an_mcp_entrys_tools_list_keeps_its_order():
  spec = {"srv": {"kind": "mcp", "command": SERVER, "tools": ["sleep", "echo", "add"]}}
  assert declared_tags(spec) == ("sleep", "echo", "add")


def test_an_mcp_command_python_runs_this_interpreter(tmp_path, monkeypatch):
  fake = tmp_path / "python"  # the first `python` on PATH, which cannot serve
  fake.write_text("#!/bin/sh\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  spec = {"fixture": {"kind": "mcp", "command": ["python", SERVER[1]], "tools": ["echo"]}}
  assert declared_tags(spec) == ("echo",)


class PromptFollower:
  """A chat model that does what each prompt says: the controller calls the agents of `order`
  in turn; a tool agent writes its call's body in the form its prompt asks for."""

  def __init__(self, order):
    self.order = iter(order)

  def complete(self, messages):
    system = messages[0]["content"]
    if system.startswith("You coordinate"):
      return json.dumps({"agent": next(self.order), "instruction": "Go on."})
    if system.endswith("Reply with only the body of the call: the city itself, as plain text "
                       "(not JSON)."):
      return "Paris"
    if "Reply with only the body of the call: a JSON object of the arguments a (integer, " \
       "required), b (integer, required), of this schema: {" in system:
      return json.dumps({"a": 2, "b": 3})
    if system.endswith("Reply with only the body of the call: empty (the tool takes no "
                       "arguments)."):
      return ""
    return "sunny, 5, 12:00"  # a role agent


def test_a_chat_teacher_that_follows_its_prompts_calls_every_form_of_tool_right():
  spec = {"odd": {"kind": "mcp", "command": ODD, "tools": ["getWeather", "add", "get-time"]}}
  client = PromptFollower(["get_weather_agent", "add_agent", "get_time_agent", "proposer"])
  with registry.build_registry(spec) as tools:
    teacher = ChatTeacher(tools, client, declared=registry.declare(spec))
    trace = teacher.run({"id": "t", "question": "Weather, sum and time?"})
  calls = [(a.step, a.tool_call, a.tool_result) for a in trace.activations
           if a.tool_call is not None]
  assert calls == [("get_weather", "Paris", "sunny in Paris"),
                   ("add", '{"a": 2, "b": 3}', "5"), ("get_time", "", "12:00")]


def test_the_system_prompt_says_what_each_body_holds():
  spec = {"odd": {"kind": "mcp", "command": ODD, "tools": ["getWeather", "get-time"]}}
  assert prompts.for_tools(spec).splitlines()[1:] == [
      "get_weather: Returns the weather in a city. Body: the city itself, as plain text (not "
      "JSON).", "get_time: Returns the time. Body: empty (the tool takes no arguments)."]


def score_with_tools(response, bonus=0.0):
  """A reward that reads the tool results: correct when the answer is the last observation."""
  last = response.tool_calls[-1].result if response.tool_calls else None
  return float(response.answer is not None and response.answer == last), {
      "calls": [(c.tag, c.body, c.result) for c in response.tool_calls],
      "tokens": (response.response_tokens, response.sampled_tokens), "bonus": bonus}


def test_a_python_reward_sees_tool_results_and_token_counts():
  rewarder = rewards.build_rewarder({
      "domains": {"mine": {"kind": "python", "function": "test_declared_tools:score_with_tools",
                           "options": {"bonus": 1.0}}},
      "default_domain": "mine"}, ("reverse",))
  text = coa_format.render_steps([coa_format.Step("reverse", "abc"),
                                  coa_format.Step("observation", "cba"),
                                  coa_format.Step("answer", "cba")])
  reward = rewarder(text, {"question": "q"}, 40, 25)
  assert reward.correct and reward.score == 1.0
  assert reward.details["calls"] == [("reverse", "abc", "cba")]
  assert reward.details["tokens"] == (40, 25) and reward.details["bonus"] == 1.0
  assert not rewarder(text.replace("<answer>\ncba", "<answer>\nabc"), {}).correct


def raises(response):
  return 1 / len(response.task["gold"])


def test_rewards_and_tasks_are_checked_before_the_first_step():
  spec = {"domains": {"mine": {"kind": "python", "function": "test_declared_tools:raises"}},
          "default_domain": "mine"}
  with pytest.raises(ValueError, match="rewards.domains.mine: the reward function fails on task "
                                       "t1.*KeyError: 'gold'"):
    rewards.build_rewarder(spec).check([Task("t1", "q", {"answer": "x"})])
  rewards.build_rewarder(spec).check([Task("t1", "q", {"gold": [1]})])
  with pytest.raises(ValueError, match="task t2: domain 'sq1' is not a rewards domain"):
    rewards.build_rewarder(spec).check([Task("t2", "q", {"gold": [1], "domain": "sq1"})])
  with pytest.raises(ValueError, match="cannot import 'nowhere:f'"):
    rewards.build_rewarder({"domains": {"d": {"kind": "python", "function": "nowhere:f"}},
                            "default_domain": "d"})
  # At run time a raising reward scores 0 with the error, never raising.
  reward = rewards.build_rewarder(spec)("<answer>\nx\n</answer>", {})
  assert not reward.correct and "KeyError" in reward.details["error"]
