"""Rollouts of a checkpoint on a task file, or an interactive session.

  python experiments/rollout.py [--config=configs/rollout_tiny_cpu.py] [--config.max_tasks=64]
  python experiments/rollout.py --interactive
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax import distributed, rollout_job  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../configs/rollout_tiny_cpu.py"))
_INTERACTIVE = flags.DEFINE_bool("interactive", False,
                                 "type questions and watch the agent's steps stream out")


def main(argv):
  del argv
  distributed.initialize_from_env()
  logging.set_verbosity(logging.WARNING)
  if _INTERACTIVE.value:
    rollout_job.interactive(_CONFIG.value)
  else:
    rollout_job.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
