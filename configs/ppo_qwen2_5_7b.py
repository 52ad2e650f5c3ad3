"""PPO of a Qwen2.5-7B AFM (after CoA SFT) with a learned critic, as the reference release trains
its multi-hop QA agent with verl (`adv_estimator=gae`): configs/dapo_qwen2_5_7b.py's slice,
mesh and sample budget (4,096 responses a step in mini-batches of 256 rows), one response per
prompt, GAE with gamma = lambda = 1 over the policy's own tokens, the critic at 10x the actor's
learning rate with value clipping 0.5 (the `rl.critic` defaults). The critic's train state
stays on the same chips as the actor's: `make pod-fit` compiles both updates with the other's
state resident."""

import ml_collections

from configs import common, dapo_qwen2_5_7b


def get_config() -> ml_collections.ConfigDict:
  config = common.as_ppo(dapo_qwen2_5_7b.get_config())
  config.checkpoint.directory = "gs://bucket/coa/ppo7b/ckpt"
  config.workdir = "runs/ppo_qwen2_5_7b"
  config.export_dir = "runs/ppo_qwen2_5_7b/hf_export"
  return config
