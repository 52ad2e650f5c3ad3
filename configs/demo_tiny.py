"""The LM demo (make lm-demo): train the tiny model on synthetic sequences over all devices."""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = common.model("tiny")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.optimizer = common.optimizer(learning_rate=1e-2, warmup_steps=5, total_steps=100)
  config.steps = 100
  config.batch_size = 16
  config.seq_len = 64
  config.seed = 0
  config.log_every = 20
  config.workdir = "runs/demo"
  return config
