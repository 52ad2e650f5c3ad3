"""Agentic RL with DAPO: rollouts with tools, rewards, dynamic sampling, clipped updates.

  python experiments/dapo.py [--config=configs/dapo_tiny_cpu.py] [--config.rl.eps_high=0.3 ...]

Writes metrics.jsonl and dapo.png (reward, accuracy, response length, entropy, clip
fractions), rollouts.jsonl and trajectories.html (the last step's samples) to config.workdir,
checkpoints to config.checkpoint.directory (a re-run resumes), and the final policy as an HF
checkpoint to config.export_dir.
"""

import jax

from coa_jax.evaluation import viewer
from coa_jax.rl import job as rl_job
from coa_jax.runtime import cli
from configs import dapo_tiny_cpu


def train(config):
  rl_job.run(config)
  if jax.process_index() == 0:  # the last step's samples as a page (a failure is only printed)
    viewer.logged(viewer.write_page, config.workdir)


if __name__ == "__main__":
  cli.run_job(train, dapo_tiny_cpu.__file__)
