"""Agent programs as RL rollouts through the endpoint (coa_jax.serving.agent): the built-in tool
loop written as an agent function over the OpenAI client samples exactly what the built-in
rollout samples, and an agent's own reward, errors and async functions reach the samples."""


import concurrent.futures
import time

import jax
import numpy as np
import pytest

from coa_jax.data import Task
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.model import ConfigError, build_config
from coa_jax.model.transformer import Transformer
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, stop_ids
from coa_jax.runtime import sharding
from coa_jax.serving.agent import AgentContext, AgentRollout, coa_loop, load_agent
from tools_env import Tool, ToolRegistry, TrajectoryTools

TOKENIZER = default_tokenizer("plain")
SYSTEM = "You are an agent."
CONFIG = build_config({"preset": "tiny", "vocab_size": TOKENIZER.vocab_size,
                       "tie_embeddings": False})
ROLLOUT = RolloutConfig(group_size=2, max_prompt_tokens=64, max_response_tokens=96, max_turns=3,
                        max_observation_tokens=48)
HOT = SamplingConfig(temperature=1.0)
TASKS = [Task(f"t{i}", f"What is {i} + {i}?") for i in range(6)]


class Echo(Tool):
  def __init__(self, tag):
    super().__init__()
    self.tag = tag

  def _run(self, body, goal):
    return f"{self.tag} says: {body}", {}


@pytest.fixture(scope="module")
def policy():
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  params = sharding.init_params(Transformer(CONFIG), mesh, jax.random.key(0))
  tools = ToolRegistry({"code": Echo("code"), "web_search": Echo("web_search")})
  return mesh, params, tools


def agent_rollout(policy, agent, **kwargs):
  mesh, params, tools = policy
  engine = AgentRollout(agent, CONFIG, mesh, TOKENIZER, tools, ROLLOUT, SYSTEM, HOT, slots=8,
                        chunk=16, seed=3, **kwargs)
  engine.params = params
  return engine


def by_sample(groups):
  return {(r.task_id, r.sample): r for group in groups for r in group}


def test_the_builtin_loop_through_the_endpoint_samples_what_the_builtin_rollout_does(policy):
  mesh, params, tools = policy
  sampler = Sampler(CONFIG, mesh, batch_size=4, chunk=16, cache_size=ROLLOUT.cache_size,
                    stop_ids=stop_ids(TOKENIZER), sampling=HOT)
  builtin = by_sample(Rollout(sampler, params, TOKENIZER, tools, ROLLOUT, SYSTEM,
                              seed=3).run(TASKS))
  engine = agent_rollout(policy, coa_loop)
  try:
    served = by_sample(engine.run(TASKS))
  finally:
    engine.close()
  assert served.keys() == builtin.keys()
  assert sum(r.turns for r in builtin.values()) > 0  # the random policy did call tools
  for key, record in builtin.items():
    other = served[key]
    assert other.ids == record.ids, key
    assert other.loss_mask == record.loss_mask, key
    np.testing.assert_allclose(other.logprobs, record.logprobs, atol=1e-5)
    assert other.turns == record.turns and other.prompt_len == record.prompt_len


def own_reward(task, client):
  reply = client.chat.completions.create(model="policy", max_tokens=5,
                                         messages=[{"role": "user", "content": task.question}])
  return float(len(reply.choices[0].message.content or "") % 2)


async def async_agent(task, client):
  await client.chat.completions.create(model="policy", max_tokens=3,
                                       messages=[{"role": "user", "content": task.question}])


def failing_agent(task, client):
  raise ValueError("the agent broke")


def test_an_agents_reward_async_functions_and_failures_reach_the_samples(policy):
  for agent, check in [
      (own_reward, lambda r: r.reward in (0.0, 1.0) and sum(r.loss_mask) == 5),
      (async_agent, lambda r: r.reward is None and sum(r.loss_mask) == 3),
      (failing_agent, lambda r: r.finish_reason == "error" and "the agent broke" in
       r.task_data["error"] and r.reward == 0.0)]:
    engine = agent_rollout(policy, agent)
    try:
      records = list(by_sample(engine.run(TASKS[:2])).values())
    finally:
      engine.close()
    assert len(records) == 4 and all(check(r) for r in records), agent.__name__


def test_an_agent_is_named_module_colon_function():
  assert load_agent("coa_jax.serving.agent:coa_loop") is coa_loop
  for bad in ("coa_loop", "coa_jax.serving.agent:nothing", "no.such.module:f"):
    with pytest.raises(ConfigError, match="rl.agent"):
      load_agent(bad)


class Slow(Tool):
  tag = "slow"

  def _run(self, body, goal):
    if body == "raise":
      raise RuntimeError("it broke")
    time.sleep(float(body))
    return "done", {}


def test_an_agents_tool_calls_run_as_the_builtin_loop_runs_them():
  """On the rollout's tool workers, with its timeout and its error observations."""
  config = RolloutConfig(group_size=1, tool_workers=2, tool_timeout_s=2.0)  # "0": well within
  pool = concurrent.futures.ThreadPoolExecutor(config.tool_workers)
  context = AgentContext("policy", ToolRegistry({"slow": Slow()}), ("slow",), config, SYSTEM, pool)
  session = TrajectoryTools(context.tools, "a question")
  try:
    assert context.call_tool(session, "slow", "0").observation == "done"
    late = context.call_tool(session, "slow", "5")
    assert (late.ok, late.error_kind) == (False, "timeout") and "2 s" in late.observation
    broken = context.call_tool(session, "slow", "raise")
    assert broken.error_kind == "tool_error" and "it broke" in broken.observation
    assert context.call_tool(session, "slow", "").error_kind == "bad_request"  # not run
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
