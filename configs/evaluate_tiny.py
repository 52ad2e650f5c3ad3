"""Evaluation on the embedded world's held-out tasks (run `make distill` first for the world)."""

import ml_collections

from coa_jax.data import World, WorldConfig, prompts
from configs import common, distill_tiny

_WORLD = "runs/distill_tiny/world"


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.system = "model"  # "model": the checkpoint below with tools; "teacher": the teacher
  config.model = common.model("tiny", hidden_size=128, intermediate_size=256, num_layers=2,
                              num_heads=4, num_kv_heads=2)
  config.model.checkpoint = "runs/pipeline_tiny/sft/hf_export"
  config.tokenizer = common.tokenizer("default", "plain")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.tasks = f"{_WORLD}/heldout.jsonl"
  config.max_tasks = 0
  # Held-out teacher trajectories for the copy probe (coa_jax.copy_probe); "" skips it.
  config.copy_probe = ""
  config.k = 3  # samples per task
  config.system_prompt = prompts.WORLD
  config.batch_size = 24  # decode rows (a multiple of k)
  config.chunk = 32
  config.sampling = ml_collections.ConfigDict(dict(temperature=1.0, top_k=0, top_p=1.0))
  config.rollout = ml_collections.ConfigDict(dict(
      group_size=3, max_prompt_tokens=256, max_response_tokens=2048, max_turns=12,
      max_observation_tokens=384, tool_workers=8, tool_timeout_s=30.0))
  distill = distill_tiny.get_config()  # the world and the teacher that distillation used
  world = dict(distill.world, train_tasks=0, heldout_tasks=0)
  config.tools = World(WorldConfig(**world)).tools_spec(f"{_WORLD}/corpus.jsonl")
  config.teacher = distill.teacher
  config.rewards = ml_collections.ConfigDict(dict(
      domains={"math": {"kind": "math"}, "qa": {"kind": "qa"}}, default_domain="qa"))
  config.output_dir = "runs/evaluate_tiny"
  return config
