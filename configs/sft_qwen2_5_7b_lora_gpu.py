"""LoRA SFT of Qwen2.5-7B-Instruct on one GPU (e.g. one H100 80 GB): rank-16 adapters on every
projection, the base frozen in bf16 (15 GB), 16k-token rows one at a time."""

import ml_collections

from configs import common, sft_qwen2_5_7b_gpu


def get_config() -> ml_collections.ConfigDict:
  config = sft_qwen2_5_7b_gpu.get_config()
  config.model = common.model("qwen2_5_7b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="cudnn", lora_rank=16,
                              lora_alpha=32.0, lora_dropout=0.05)
  config.model.checkpoint = "/ckpt/Qwen2.5-7B-Instruct"
  config.mesh = common.mesh(data=1, fsdp=1, tensor=1)
  config.topology = "h100:1"
  config.batch_size = 8  # 8 micro-batches of one 16k-token row
  config.train.micro_batches = 8
  config.optimizer.learning_rate = 2e-4
  config.checkpoint.directory = "runs/sft_qwen2_5_7b_lora_gpu/checkpoints"
  config.workdir = "runs/sft_qwen2_5_7b_lora_gpu"
  config.export_dir = "runs/sft_qwen2_5_7b_lora_gpu/hf_export"
  return config
