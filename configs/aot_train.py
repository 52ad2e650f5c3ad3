"""Ahead-of-time compile of the train step for a TPU topology (experiments/aot_compile.py)."""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = common.model("qwen2_5_7b", dtype="bfloat16", param_dtype="float32",
                              remat="full")
  config.topology = "v5p:2x2x1"
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.optimizer = common.optimizer()
  config.batch_size = 16
  config.seq_len = 4096
  config.report_json = ""  # also write the report here when set
  return config
