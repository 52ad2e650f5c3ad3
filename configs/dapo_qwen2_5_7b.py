"""DAPO of a Qwen2.5-7B AFM (after CoA SFT): the reference's RL settings of
configs/dapo_qwen2_5_32b.py on a v5p-16 slice (4 hosts of 4 chips), 2-way tensor parallelism."""

import ml_collections

from configs import common, dapo_qwen2_5_32b


def get_config() -> ml_collections.ConfigDict:
  config = dapo_qwen2_5_32b.get_config()
  config.model = common.model("qwen2_5_7b", dtype="bfloat16", param_dtype="float32",
                              remat="full", attention_impl="splash", attention_block=512)
  config.model.checkpoint = "/ckpt/afm-sft-qwen2.5-7b"
  config.tokenizer = common.tokenizer("/ckpt/afm-sft-qwen2.5-7b", "chatml")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=2)
  config.topology = "v5p:2x2x4"
  config.batch_size = 256  # decode rows: 64 per host
  config.rl.update(batch_groups=256, prompts_per_round=256, mini_batch_groups=16,
                   micro_batches=8)
  config.checkpoint.directory = "gs://bucket/coa/dapo7b/ckpt"
  config.workdir = "runs/dapo_qwen2_5_7b"
  config.export_dir = "runs/dapo_qwen2_5_7b/hf_export"
  return config
