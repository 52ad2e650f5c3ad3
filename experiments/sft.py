"""Observation-masked SFT.

  python experiments/sft.py [--config=configs/sft_tiny_cpu.py] [--config.train.steps=300 ...]
"""

from absl import app
from ml_collections import config_flags

from coa_jax.runtime import cli
from coa_jax.sft import job as sft
from configs import sft_tiny_cpu

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    sft_tiny_cpu.__file__,
    lock_config=True)


def main(argv):
  del argv
  cli.start(_CONFIG.value.get("xla_flags", ""))
  sft.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
