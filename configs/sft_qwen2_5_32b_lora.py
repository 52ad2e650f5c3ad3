"""LoRA SFT of Qwen2.5-32B-Instruct on one TPU v5p-8 host (4 chips): the 32B recipe
(configs/sft_qwen2_5_32b.py) training rank-16 adapters on every projection, the base weights
frozen in bf16 (64 GB, 16 GB a chip with FSDP over the 4 chips) instead of float32 master
weights and two AdamW moments (512 GB, which needs the 64-chip slice)."""

import ml_collections

from configs import common, sft_qwen2_5_32b


def get_config() -> ml_collections.ConfigDict:
  config = sft_qwen2_5_32b.get_config()
  config.model = common.model("qwen2_5_32b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="splash", attention_block=512,
                              lora_rank=16, lora_alpha=32.0, lora_dropout=0.05)
  config.model.checkpoint = "/ckpt/Qwen2.5-32B-Instruct"
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.topology = "v5p:2x2x1"  # one host
  config.batch_size = 16  # 4 micro-batches of 4 rows: one 16k-token row per chip each
  config.train.micro_batches = 4
  config.optimizer.learning_rate = 2e-4  # adapters take a larger rate than full fine-tuning
  config.checkpoint.directory = "gs://bucket/coa/sft32b_lora/ckpt"
  config.workdir = "runs/sft_qwen2_5_32b_lora"
  config.export_dir = "runs/sft_qwen2_5_32b_lora/hf_export"
  return config
