"""DAPO of the tiny SFT demo model (`make demo` exports it) on the shipped tasks, on a CPU.

The tasks carry their domain (math or qa) and ground truth in `metadata`; rewards are +1/-1
by exact checks, with overlong shaping over the last quarter of the response budget. The demo's
2-layer model is too weak to answer these tasks correctly, so every group would be uniform and
dynamic sampling would stop the run: here it is off and a format penalty gives the samples of
a group different rewards, so the run learns the CoA format. The real configs
(e.g. dapo_qwen2_5_32b.py) use the reference's settings.
"""


import ml_collections

from coa_jax.data import SAMPLE_PATH, prompts
from configs import common
from tools_env import default_spec


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = common.model("tiny", hidden_size=128, intermediate_size=256, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16)
  config.model.checkpoint = "runs/sft_tiny/hf_export"  # empty: a fresh (untrained) model
  config.tokenizer = common.tokenizer("default", "plain")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.topology = "v5e:2x2"  # for experiments/aot_compile.py
  config.tasks = SAMPLE_PATH  # JSONL with "question" and the reward's fields
  config.max_tasks = 0  # 0: all
  config.eval_tasks = SAMPLE_PATH  # held-out tasks ("" skips evaluation)
  config.eval_max_tasks = 8
  config.system_prompt = prompts.AGENT
  config.batch_size = 16  # decode rows (a multiple of rollout.group_size)
  config.chunk = 32  # decode steps per device call
  config.sampling = common.sampling()
  config.rollout = common.rollout(
      group_size=4, max_prompt_tokens=192, max_response_tokens=512, max_turns=6,
      max_observation_tokens=192)
  config.tools = default_spec()  # tag -> {"kind": ..., options}; see tools_env.registry
  config.rewards = ml_collections.ConfigDict(dict(
      domains={"math": {"kind": "math"}, "qa": {"kind": "qa", "metric": "em"}},
      default_domain="qa", correct=1.0, incorrect=-1.0, format_penalty=0.5, timeout_s=10.0))
  config.reward_workers = 4
  config.rl = common.rl(steps=8, batch_groups=4, prompts_per_round=4, max_rounds=6,
                        mini_batch_groups=2, overlong_cache=128, eval_every=4,
                        dynamic_sampling=False)
  config.optimizer = common.optimizer(learning_rate=1e-5, warmup_steps=0, schedule="constant",
                                      weight_decay=0.0)
  config.checkpoint = common.checkpoint("runs/dapo_tiny/checkpoints", every=4, max_to_keep=2)
  config.workdir = "runs/dapo_tiny"
  config.export_dir = "runs/dapo_tiny/hf_export"
  config.export_dtype = "float32"
  return config
