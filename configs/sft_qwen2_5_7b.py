"""Observation-masked SFT of Qwen2.5-7B-Instruct on CoA trajectories (TPU/GPU pod scale).

Hyper-parameters in the range of the reference release: lr 2e-5 with warm-up and cosine
decay, 3 epochs, 16k-token packed rows, bf16 compute with f32 master weights, remat keeping
q, k, v and attention's output, splash attention in 512 x 512 tiles, TPU collective flags,
FSDP over every chip (the choices and their ahead-of-time figures: docs/tpu.md).
`experiments/aot_compile.py --config=configs/sft_qwen2_5_7b.py` compiles its train step for
`topology`.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = common.model("qwen2_5_7b", dtype="bfloat16", param_dtype="float32",
                              remat="qkv_context", attention_impl="splash",
                              attention_block=512)
  config.model.checkpoint = "/ckpt/Qwen2.5-7B-Instruct"  # a local HF folder
  config.tokenizer = common.tokenizer("/ckpt/Qwen2.5-7B-Instruct", "chatml")
  config.data = common.data("/data/coa_sft.json", num_epochs=3, overlong="drop")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.topology = "v5p:2x2x2"
  config.xla_flags = "tpu"  # coa_jax/runtime/xla_flags.py
  config.batch_size = 32  # 4 micro-batches of 8 rows: one 16k-token row per chip each
  config.seq_len = 16384
  config.optimizer = common.optimizer(learning_rate=2e-5, warmup_steps=100, schedule="cosine",
                                      total_steps=3000, weight_decay=0.1)
  config.train = common.train(steps=3000, micro_batches=4)
  config.checkpoint = common.checkpoint("gs://bucket/coa/sft7b/ckpt")
  config.workdir = "runs/sft_qwen2_5_7b"
  config.export_dir = "runs/sft_qwen2_5_7b/hf_export"
  config.export_dtype = "bfloat16"
  return config
