"""The worked example's agent, built with the OpenAI Agents SDK (tools_env/examples/
shop_agents_sdk.py), runs through the trainer's endpoint: the SDK's function calls become the
model's `<sql>` steps and back, and every session is one append-only sample."""

import json

import jax
import pytest

from coa_jax.data import Task
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.model import build_config
from coa_jax.model.transformer import Transformer
from coa_jax.rollout.sampler import SamplingConfig
from coa_jax.rollout.tool_loop import RolloutConfig
from coa_jax.runtime import sharding
from coa_jax.serving.agent import AgentRollout
from tools_env import ToolRegistry
from tools_env.examples import shop_agents_sdk, sqlite_shop

pytest.importorskip("agents")

TOKENIZER = default_tokenizer("plain", tool_tags=("sql",))


def test_the_agents_sdk_shop_agent_trains_through_the_endpoint(tmp_path):
  paths = sqlite_shop.build(str(tmp_path), customers=20, train_tasks=4, heldout_tasks=2)
  tools = ToolRegistry({"sql": sqlite_shop.Sql(str(tmp_path / "shop.db"))})
  config = build_config({"preset": "tiny", "vocab_size": TOKENIZER.vocab_size, "num_layers": 1,
                         "tie_embeddings": False})
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  params = sharding.init_params(Transformer(config), mesh, jax.random.key(1))
  # A random model that closes a `sql` step often: its `</sql>` logit scaled up (where positive,
  # it wins), so sessions call the tool through the SDK within a few tokens.
  close = TOKENIZER.tag_id("sql", close=True)
  params = {**params, "lm_head": params["lm_head"].at[:, close].multiply(50.0)}
  rollout = RolloutConfig(group_size=2, max_prompt_tokens=128, max_response_tokens=96,
                          max_turns=3, max_observation_tokens=48)
  system = "Solve the question with tools:\nsql: one read-only query."
  engine = AgentRollout(shop_agents_sdk.solve, config, mesh, TOKENIZER, tools, rollout, system,
                        SamplingConfig(temperature=1.0), slots=8, chunk=16, seed=2)
  engine.params = params
  tasks = [Task(t["id"], t["question"], t["metadata"]) for t in
           (json.loads(line) for line in open(paths["train"]))]
  try:
    records = [r for group in engine.run(tasks) for r in group]
  finally:
    engine.close()
  assert len(records) == 8
  for record in records:
    assert record.reward in (0.0, 1.0) and not record.segments, record.task_data
    assert sum(record.loss_mask) > 0 and "error" not in record.task_data
  assert sum(r.turns for r in records) > 0  # the random policy's <sql> calls ran through the SDK
