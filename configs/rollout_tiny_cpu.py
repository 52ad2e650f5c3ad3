"""Rollouts of the tiny SFT model (`make demo` exports it) with the embedded tools, on a CPU."""


import ml_collections

from coa_jax.data import SAMPLE_PATH, prompts
from configs import common
from tools_env import default_spec


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  # The SFT demo's model; an empty checkpoint rolls out a fresh (untrained) one.
  config.model = common.model("tiny", hidden_size=128, intermediate_size=256, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16)
  config.model.checkpoint = "runs/sft_tiny/hf_export"
  config.tokenizer = common.tokenizer("default", "plain")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.tasks = SAMPLE_PATH  # JSONL with "question" (and any other fields)
  config.max_tasks = 16  # 0: all
  config.system_prompt = prompts.AGENT
  config.batch_size = 8  # decode rows (a multiple of rollout.group_size)
  config.chunk = 32  # decode steps per device call
  config.sampling = common.sampling()
  config.rollout = common.rollout(
      group_size=2, max_prompt_tokens=256, max_response_tokens=768, max_turns=8,
      max_observation_tokens=256, tool_timeout_s=60.0)
  config.tools = default_spec()  # tag -> {"kind": ..., options}; see tools_env.registry
  config.output_dir = "runs/rollout_tiny"
  config.transcripts = 4  # samples written out as readable text
  return config
