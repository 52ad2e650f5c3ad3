"""Tools declared in a config: a new tag through the tokenizer, masks, parser and rollout;
config errors; MCP servers' tools as tags; rewards that see tool results."""

import os
import re
import sys

import pytest
from test_rollout import SYSTEM, ScriptedSampler

from coa_jax.data import coa_format, prompts, rewards
from coa_jax.data.tasks import Task
from coa_jax.data.tokenize import step_ids, tokenize_trajectory
from coa_jax.data.tokenizer import declared_tags, default_tokenizer
from coa_jax.distill.teacher import ChatTeacher
from coa_jax.model import ConfigError
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, stop_ids
from tools_env import Tool, ToolFailure, registry

SERVER = [sys.executable, os.path.join(os.path.dirname(__file__), "mcp_fixture_server.py")]


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
  assert tags == ("reverse", "code")
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
], ids=["malformed", "role", "clash", "kind", "import", "not-a-tool", "options", "mcp-both",
        "mcp-cannot-start", "mcp-unknown-tool"])
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
