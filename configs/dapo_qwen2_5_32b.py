"""DAPO of a Qwen2.5-32B AFM (after CoA SFT) with the reference's RL settings (TPU pod scale).

The reference: clip ratios 0.2 / 0.28, dual clip c = 10 on negative advantages, token-mean
loss over the mini-batch, no KL, no entropy bonus, lr 1e-6, temperature 1.0, groups of 16
samples, 512 prompts per step in mini-batches of 32 prompts, dynamic sampling, overlong
shaping in the last 4k tokens of a long response budget. FSDP x tensor mesh, bf16 compute,
f32 master weights, full remat. `experiments/aot_compile.py --config=configs/dapo_qwen2_5_32b.py`
compiles its update step for `topology`.
"""

import ml_collections

from coa_jax.data import prompts
from configs import common
from tools_env import default_spec


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = common.model("qwen2_5_32b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="splash", attention_block=512)
  config.model.checkpoint = "/ckpt/afm-sft-qwen2.5-32b"  # the SFT model, a local HF folder
  config.tokenizer = common.tokenizer("/ckpt/afm-sft-qwen2.5-32b", "chatml")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=4)
  config.topology = "v5p:4x4x4"
  config.xla_flags = "tpu"  # coa_jax/runtime/xla_flags.py
  config.tasks = "/data/afm_rl_train.jsonl"
  config.max_tasks = 0
  config.eval_tasks = "/data/afm_rl_heldout.jsonl"
  config.eval_max_tasks = 256
  config.system_prompt = prompts.AGENT
  config.batch_size = 512  # decode rows
  config.chunk = 64
  config.sampling = common.sampling()
  config.rollout = common.rollout(
      group_size=16, max_prompt_tokens=2048, max_response_tokens=14336, max_turns=32,
      max_observation_tokens=2048, tool_workers=64, tool_timeout_s=120.0)
  config.tools = default_spec()  # replace with serper / http_crawl / sandbox for real tasks
  config.rewards = ml_collections.ConfigDict(dict(
      domains={"math": {"kind": "math"}, "qa": {"kind": "qa", "metric": "em"},
               "code": {"kind": "code"}},
      default_domain="qa", correct=1.0, incorrect=-1.0, format_penalty=0.0, timeout_s=10.0))
  config.reward_workers = 32
  config.rl = common.rl(steps=200, batch_groups=512, prompts_per_round=512, max_rounds=8,
                        mini_batch_groups=32, micro_batches=16, overlong_cache=4096,
                        eval_every=10)
  config.optimizer = common.optimizer(learning_rate=1e-6, warmup_steps=0, schedule="constant",
                                      weight_decay=0.1, grad_clip=1.0)
  config.checkpoint = common.checkpoint("gs://bucket/coa/dapo32b/ckpt", every=10)
  config.workdir = "runs/dapo_qwen2_5_32b"
  config.export_dir = "runs/dapo_qwen2_5_32b/hf_export"
  config.export_dtype = "bfloat16"
  return config
