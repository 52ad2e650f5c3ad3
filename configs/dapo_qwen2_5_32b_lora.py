"""DAPO of a Qwen2.5-32B AFM with LoRA on one TPU v5p-8 host (4 chips): the 32B recipe
(configs/dapo_qwen2_5_32b.py, the reference's RL settings) training rank-16 adapters on every
projection, the base frozen in bf16 (16 GB a chip with 4-way tensor parallelism), instead of
float32 weights and two AdamW moments over 64 chips.

Rollouts decode the LoRA model itself (the frozen base and the adapters, which add under 1% to
a decode step's bytes), tensor-parallel over the 4 chips like the full recipe's host; a 32B KV
cache of 16k slots takes 4.3 GB a row, so the host decodes 32 rows at a time.
The update trains one 16k-token row at a time over the 4 chips. RL updates apply no LoRA
dropout (`coa_jax.rl.update.dapo_step`).
"""

import ml_collections

from configs import common, dapo_qwen2_5_32b


def get_config() -> ml_collections.ConfigDict:
  config = dapo_qwen2_5_32b.get_config()
  config.model = common.model("qwen2_5_32b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="splash", attention_block=512,
                              lora_rank=16, lora_alpha=32.0, lora_dropout=0.0)
  config.model.checkpoint = "/ckpt/afm-sft-qwen2.5-32b"  # the SFT model (an HF folder)
  config.mesh = common.mesh(data=1, fsdp=1, tensor=4)
  config.topology = "v5p:2x2x1"  # one host
  config.batch_size = 32  # decode rows: 2 groups of 16
  # The reference's mini-batch of 32 prompt groups (512 rows), one row per micro-batch.
  config.rl.micro_batches = 512
  config.optimizer.learning_rate = 1e-5  # adapters take about 10x full fine-tuning's rate
  config.optimizer.weight_decay = 0.0
  config.checkpoint.directory = "gs://bucket/coa/dapo32b_lora/ckpt"
  config.workdir = "runs/dapo_qwen2_5_32b_lora"
  config.export_dir = "runs/dapo_qwen2_5_32b_lora/hf_export"
  return config
