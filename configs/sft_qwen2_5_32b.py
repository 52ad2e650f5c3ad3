"""Observation-masked SFT of Qwen2.5-32B-Instruct on CoA trajectories (TPU pod scale): the 7B
recipe (configs/sft_qwen2_5_7b.py) on a larger slice, with FSDP over 64 chips and 4-way tensor
parallelism so that a 16k-token row's activations split over more chips."""

import ml_collections

from configs import common, sft_qwen2_5_7b


def get_config() -> ml_collections.ConfigDict:
  config = sft_qwen2_5_7b.get_config()
  config.model = common.model("qwen2_5_32b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="splash", attention_block=512)
  config.model.checkpoint = "/ckpt/Qwen2.5-32B-Instruct"
  config.tokenizer = common.tokenizer("/ckpt/Qwen2.5-32B-Instruct", "chatml")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=4)
  config.topology = "v5p:4x4x4"
  config.batch_size = 64  # 4 micro-batches of 16 rows
  config.optimizer.learning_rate = 1e-5
  config.checkpoint.directory = "gs://bucket/coa/sft32b/ckpt"
  config.workdir = "runs/sft_qwen2_5_32b"
  config.export_dir = "runs/sft_qwen2_5_32b/hf_export"
  return config
