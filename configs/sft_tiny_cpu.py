"""Observation-masked SFT of a tiny model on the shipped CoA sample (about a minute on a CPU)."""


import ml_collections

from coa_jax.data import SAMPLE_PATH
from configs import common


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = common.model("tiny", hidden_size=128, intermediate_size=256, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16,
                              attention_impl="blockwise")
  config.model.checkpoint = ""  # a local HF folder to fine-tune instead of a fresh init
  config.tokenizer = common.tokenizer("default", "plain")
  config.data = common.data(SAMPLE_PATH, num_epochs=100)
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.topology = "v5e:2x2"  # for experiments/aot_compile.py
  config.batch_size = 8
  config.seq_len = 1024
  config.optimizer = common.optimizer(learning_rate=3e-3, warmup_steps=10, schedule="cosine",
                                      total_steps=120, weight_decay=0.0)
  config.train = common.train(steps=120)
  config.checkpoint = common.checkpoint("runs/sft_tiny/checkpoints", every=40, max_to_keep=2)
  config.workdir = "runs/sft_tiny"
  config.export_dir = "runs/sft_tiny/hf_export"
  config.export_dtype = "float32"
  return config
