"""The end-to-end recipe on the embedded world with a tiny model, on a CPU (the README's main
job): distil with the scripted teacher, SFT from scratch, DAPO, evaluate on held-out tasks.

`quick(config)` shrinks it to a smoke test (a few minutes) for CI.
"""

import ml_collections

from configs import common, distill_tiny
from coa_jax.sample_data import SYSTEM_PROMPT


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.output_dir = "runs/pipeline_tiny"
  config.system_prompt = SYSTEM_PROMPT
  config.workers = 4
  config.log_every = 20
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  distill = distill_tiny.get_config()  # the world, the teacher's error rates, the filters
  config.world, config.teacher, config.filters = distill.world, distill.teacher, distill.filters
  config.model = ml_collections.ConfigDict(dict(
      preset="tiny", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
      num_kv_heads=2, attention_impl="blockwise"))
  config.sft = ml_collections.ConfigDict(dict(steps=200, seq_len=2048, batch_size=8,
                                              learning_rate=3e-3, warmup_steps=10))
  config.rollout = ml_collections.ConfigDict(dict(
      group_size=4, max_prompt_tokens=256, max_response_tokens=1792, max_turns=12,
      max_observation_tokens=384, tool_workers=8, tool_timeout_s=30.0))
  config.eval = ml_collections.ConfigDict(dict(k=3, max_tasks=60, batch_size=24))
  config.dapo = ml_collections.ConfigDict(dict(
      batch_size=16, group_size=4, learning_rate=2e-5,
      rl=dict(steps=10, batch_groups=4, prompts_per_round=4, max_rounds=8, mini_batch_groups=2,
              overlong_cache=256, eval_every=1000, dynamic_sampling=True)))
  return config


def quick(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns `config` shrunk to a smoke test of every stage."""
  config.output_dir = config.output_dir + "_quick"
  config.world.update(entities=6, train_tasks=48, heldout_tasks=8)
  config.sft.update(steps=4, seq_len=1024, batch_size=4, warmup_steps=1)
  config.rollout.update(max_response_tokens=128, max_observation_tokens=96, max_turns=3)
  config.eval.update(k=2, max_tasks=4, batch_size=8)
  config.dapo.update(batch_size=8, group_size=2)
  config.dapo.rl.update(steps=1, batch_groups=2, prompts_per_round=2, mini_batch_groups=2,
                        overlong_cache=32, dynamic_sampling=False)
  return config
