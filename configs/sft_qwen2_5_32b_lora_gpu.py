"""LoRA SFT of Qwen2.5-32B-Instruct on one node of 8 GPUs (e.g. 8 x H100 80 GB): the TPU LoRA
recipe (configs/sft_qwen2_5_32b_lora.py) with FSDP over the 8 GPUs and cuDNN's fused attention."""

import ml_collections

from configs import common, sft_qwen2_5_32b_lora


def get_config() -> ml_collections.ConfigDict:
  config = sft_qwen2_5_32b_lora.get_config()
  config.model.attention_impl = "cudnn"
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)  # all GPUs of all nodes
  config.topology = "h100:8"
  config.xla_flags = "gpu"  # coa_jax/runtime/xla_flags.py
  config.batch_size = 16  # 2 micro-batches of 8 rows: one 16k-token row per GPU each
  config.train.micro_batches = 2
  config.checkpoint.directory = "runs/sft_qwen2_5_32b_lora_gpu/checkpoints"
  config.workdir = "runs/sft_qwen2_5_32b_lora_gpu"
  config.export_dir = "runs/sft_qwen2_5_32b_lora_gpu/hf_export"
  return config
