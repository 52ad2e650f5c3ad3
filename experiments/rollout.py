"""Rollouts of a checkpoint on a task file, or an interactive session.

  python experiments/rollout.py [--config=configs/rollout_tiny_cpu.py] [--config.max_tasks=64]
  python experiments/rollout.py --interactive
"""



from absl import app, flags
from ml_collections import config_flags

from coa_jax.rollout import job as rollout_job
from coa_jax.runtime import cli
from configs import rollout_tiny_cpu

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    rollout_tiny_cpu.__file__)
_INTERACTIVE = flags.DEFINE_bool("interactive", False,
                                 "type questions and watch the agent's steps stream out")


def main(argv):
  del argv
  cli.start()
  if _INTERACTIVE.value:
    rollout_job.interactive(_CONFIG.value)
  else:
    rollout_job.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
