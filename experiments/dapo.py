"""Agentic RL with DAPO: rollouts with tools, rewards, dynamic sampling, clipped updates.

  python experiments/dapo.py [--config=configs/dapo_tiny_cpu.py] [--config.rl.eps_high=0.3 ...]

Writes metrics.jsonl and dapo.png (reward, accuracy, response length, entropy, clip
fractions), rollouts.jsonl and trajectories.html (the last step's samples) to config.workdir,
checkpoints to config.checkpoint.directory (a re-run resumes), and the final policy as an HF
checkpoint to config.export_dir.
"""

import sys

import jax
from absl import app
from ml_collections import config_flags

from coa_jax.evaluation import viewer
from coa_jax.rl import job as rl_job
from coa_jax.runtime import cli
from configs import dapo_tiny_cpu

sys.argv[:] = cli.config_argv(sys.argv)  # e.g. --config.rl.async.staleness=2
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    dapo_tiny_cpu.__file__,
    lock_config=True)


def main(argv):
  del argv
  cli.start(_CONFIG.value.get("xla_flags", ""))
  rl_job.run(_CONFIG.value)
  if jax.process_index() == 0:  # the last step's samples as a page (a failure is only printed)
    viewer.logged(viewer.write_page, _CONFIG.value.workdir)


if __name__ == "__main__":
  app.run(main)
