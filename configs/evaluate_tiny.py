"""Evaluation on the embedded world's held-out tasks, by default the main job's model (run `make
pipeline` first: it writes the world and the model), sampled as the main job samples.

To evaluate a trained model on a task file of your own, use `experiments/evaluate.py --model=DIR
--tasks=FILE` (docs/distill_and_eval.md): it reads the settings the model's run saved."""

import ml_collections

from coa_jax.data import World, WorldConfig, prompts
from configs import common, distill_tiny

_WORLD = "runs/pipeline_tiny/distill/world"


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.system = "model"  # "model": the checkpoint below with tools; "teacher": the teacher
  # The shape comes from the checkpoint: a field named here would have to agree with it.
  config.model = common.model("tiny")
  config.model.checkpoint = "runs/pipeline_tiny/seed-0/dapo/hf_export"
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
  # The main job's sampling and limits (configs/pipeline_tiny_cpu.py).
  config.sampling = common.sampling(temperature=0.6)
  config.rollout = common.rollout(
      group_size=3, max_prompt_tokens=128, max_response_tokens=512, max_turns=12,
      max_observation_tokens=256)
  distill = distill_tiny.get_config()  # the world and the teacher that distillation used
  world = dict(distill.world, train_tasks=0, heldout_tasks=0)
  config.tools = World(WorldConfig(**world)).tools_spec(f"{_WORLD}/corpus.jsonl")
  config.teacher = distill.teacher
  config.rewards = ml_collections.ConfigDict(dict(
      domains={"math": {"kind": "math"}, "qa": {"kind": "qa"}}, default_domain="qa"))
  config.output_dir = "runs/evaluate_tiny"
  return config
