"""DAPO of a Qwen2.5-32B AFM with LoRA on one node of 8 GPUs (e.g. 8 x H100 80 GB): the TPU LoRA
recipe (configs/dapo_qwen2_5_32b_lora.py) with 8-way tensor parallelism over the node (NVLink)
and cuDNN's fused attention: the base frozen in bf16 is 8 GB a GPU, and the node decodes 64
rows (4 groups of 16) at a time."""

import ml_collections

from configs import common, dapo_qwen2_5_32b_lora


def get_config() -> ml_collections.ConfigDict:
  config = dapo_qwen2_5_32b_lora.get_config()
  config.model.attention_impl = "cudnn"
  config.mesh = common.mesh(data=1, fsdp=1, tensor=8)
  config.topology = "h100:8"
  config.xla_flags = "gpu"  # coa_jax/runtime/xla_flags.py
  config.batch_size = 64  # decode rows per node
  config.checkpoint.directory = "runs/dapo_qwen2_5_32b_lora_gpu/checkpoints"
  config.workdir = "runs/dapo_qwen2_5_32b_lora_gpu"
  config.export_dir = "runs/dapo_qwen2_5_32b_lora_gpu/hf_export"
  return config
