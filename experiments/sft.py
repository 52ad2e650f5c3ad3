"""Observation-masked SFT.

  python experiments/sft.py [--config=configs/sft_tiny_cpu.py] [--config.train.steps=300 ...]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax import distributed, sft  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../configs/sft_tiny_cpu.py"),
    lock_config=True)


def main(argv):
  del argv
  distributed.initialize_from_env()
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  sft.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
