"""DAPO through the endpoint: a toy agent program, trained on its sessions' recorded ids (two
calls a session, packed), gains reward over updates (`rl.agent`, coa_jax.serving.agent), with
the synchronous trainer and with the asynchronous one (its worker's sessions on the rollout
devices, the weights swapped while they run, staleness bounded)."""

import json

import numpy as np
import pytest

from coa_jax.rl import job as rl_job
from configs import common, dapo_tiny_cpu

VOCAB_HALF = 512


def low_ids_agent(task, client):
  """Rewards completions whose first token's id is below 512 (about half of a fresh model's): a
  preference the policy learns in a few updates from what the endpoint recorded. It asks
  twice, the second time without the first answer in its history: its session is not
  append-only, so its two calls are packed as two samples of one row."""
  ask = lambda question: client.chat.completions.create(
      model="policy", max_tokens=2, messages=[{"role": "user", "content": question}],
      extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
  firsts = [ask(task.question)[0], ask("Once more: " + task.question)[0]]
  return sum(i < VOCAB_HALF for i in firsts) / 2


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_toy_agent_gains_reward_through_the_endpoint(tmp_path, asynchronous):
  config = dapo_tiny_cpu.get_config()
  config.model.checkpoint = ""
  config.max_tasks, config.eval_tasks = 16, ""
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)  # the 8 fake devices
  config.batch_size, config.chunk = 32, 4
  config.rollout.update(group_size=8, max_prompt_tokens=192, max_response_tokens=8)
  config.rl = common.rl(steps=6, batch_groups=4, prompts_per_round=4, max_rounds=1,
                        mini_batch_groups=2, overlong_shaping=False, eval_every=100,
                        dynamic_sampling=False, agent="test_serving_rl:low_ids_agent")
  if asynchronous:  # 4 devices decode, 4 train; PPO, its critic on each call's sample
    config.mesh = common.mesh(data=1, fsdp=2, tensor=2)
    config.rl["async"].update(enabled=True, staleness=1)
    config.rl.update(advantage="gae", negative_weight=1.0)
  config.optimizer = common.optimizer(learning_rate=1e-2, schedule="constant", weight_decay=0.0)
  config.checkpoint = common.checkpoint(str(tmp_path / "ckpt"), every=100, async_save=False)
  config.workdir, config.export_dir = str(tmp_path), ""
  rl_job.run(config)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rewards = [row["reward"] for row in rows]
  assert len(rewards) == 6
  assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards
  # The recorded log-probs equal the update's teacher-forced ones, segment by segment, where
  # the policy that sampled them is the one updated (asynchronously: no stale token).
  assert all(row["logp_diff_max"] < 1e-5 for row in rows if not row.get("stale"))
  if asynchronous:
    assert all(row["staleness_0"] + row["staleness_1"] == 4 for row in rows)  # bounded
    assert all(np.isfinite(row["value_loss"]) for row in rows)
    assert sum(row["staleness_1"] + row["stale_dropped"] for row in rows) > 0  # ran ahead
