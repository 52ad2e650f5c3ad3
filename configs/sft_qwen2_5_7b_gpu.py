"""Observation-masked SFT of Qwen2.5-7B-Instruct on one node of 8 GPUs (e.g. 8 x H100 80 GB):
the TPU recipe (configs/sft_qwen2_5_7b.py) with FSDP over the 8 GPUs and cuDNN's fused
attention. On several nodes, run the same config on every node with COA_JAX_DISTRIBUTED=auto
(SLURM: one task per node); the mesh then spans every GPU (docs/gpus.md)."""

import ml_collections

from configs import common, sft_qwen2_5_7b


def get_config() -> ml_collections.ConfigDict:
  config = sft_qwen2_5_7b.get_config()
  config.model = common.model("qwen2_5_7b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="cudnn")
  config.model.checkpoint = "/ckpt/Qwen2.5-7B-Instruct"
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)  # all GPUs of all nodes
  config.topology = "h100:8"  # one node of 8 H100s (experiments/aot_compile.py)
  config.xla_flags = "gpu"  # coa_jax/runtime/xla_flags.py
  config.checkpoint.directory = "runs/sft_qwen2_5_7b_gpu/checkpoints"
  config.workdir = "runs/sft_qwen2_5_7b_gpu"
  config.export_dir = "runs/sft_qwen2_5_7b_gpu/hf_export"
  return config
