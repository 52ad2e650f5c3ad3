"""DAPO of a Qwen2.5-7B AFM on one node of 8 GPUs: configs/dapo_qwen2_5_7b.py with FSDP x 2-way
tensor parallelism over the node and cuDNN's fused attention. Each node decodes its share of
the rollouts on its own GPUs; on several nodes run it with COA_JAX_DISTRIBUTED=auto."""

import ml_collections

from configs import common, dapo_qwen2_5_7b


def get_config() -> ml_collections.ConfigDict:
  config = dapo_qwen2_5_7b.get_config()
  config.model = common.model("qwen2_5_7b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="cudnn")
  config.model.checkpoint = "/ckpt/afm-sft-qwen2.5-7b"
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=2)
  config.topology = "h100:8"  # one node of 8 H100s (experiments/aot_compile.py)
  # No GPU flag set: its pipelined collectives add 6 GiB a GPU to the update (65.4 -> 71.4 of
  # 79.6 GiB by an ahead-of-time compile), too little room beside cuDNN's workspace and NCCL.
  config.xla_flags = ""
  config.batch_size = 128  # decode rows per node
  # 16 micro-batches of 16 rows: 4 rows of 16k tokens per data x fsdp shard (8 did not fit
  # an 80 GB H100: 115 GiB per GPU by an ahead-of-time compile).
  config.rl.update(batch_groups=128, prompts_per_round=128, mini_batch_groups=16,
                   micro_batches=16)
  config.checkpoint.directory = "runs/dapo_qwen2_5_7b_gpu/checkpoints"
  config.workdir = "runs/dapo_qwen2_5_7b_gpu"
  config.export_dir = "runs/dapo_qwen2_5_7b_gpu/hf_export"
  return config
