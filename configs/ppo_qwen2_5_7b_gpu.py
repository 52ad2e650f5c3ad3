"""PPO of a Qwen2.5-7B AFM with a learned critic on one node of 8 GPUs: configs/ppo_qwen2_5_7b.py's
settings on configs/dapo_qwen2_5_7b_gpu.py's node, mesh and sample budget (2,048 responses a
step in mini-batches of 256 rows). The critic's train state stays beside the actor's on the
same GPUs (`make pod-fit`): with DAPO's 16 micro-batches the actor's update needed 75.3 of an
H100's 79.6 GiB by the compiler, too little room for cuDNN's workspace, NCCL and the CUDA
context; 32 micro-batches (2 rows of 16k tokens per data x fsdp shard) halve the activations."""

import ml_collections

from configs import common, dapo_qwen2_5_7b_gpu


def get_config() -> ml_collections.ConfigDict:
  config = common.as_ppo(dapo_qwen2_5_7b_gpu.get_config())
  config.rl.micro_batches = 32
  config.checkpoint.directory = "runs/ppo_qwen2_5_7b_gpu/checkpoints"
  config.workdir = "runs/ppo_qwen2_5_7b_gpu"
  config.export_dir = "runs/ppo_qwen2_5_7b_gpu/hf_export"
  return config
