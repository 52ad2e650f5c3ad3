"""Agentic RL with DAPO: rollouts with tools, rewards, dynamic sampling, clipped updates.

  python experiments/dapo.py [--config=configs/dapo_tiny_cpu.py] [--config.rl.eps_high=0.3 ...]

Writes metrics.jsonl and dapo.png (reward, accuracy, response length, entropy, clip
fractions) to config.workdir, checkpoints to config.checkpoint.directory (a re-run resumes),
and the final policy as an HF checkpoint to config.export_dir.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax import distributed  # noqa: E402
from coa_jax.rl import dapo  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../configs/dapo_tiny_cpu.py"),
    lock_config=True)


def main(argv):
  del argv
  distributed.initialize_from_env()
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  dapo.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
