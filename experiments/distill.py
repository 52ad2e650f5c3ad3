"""Distillation: build the embedded world, run the teacher system on it, filter, write SFT data.

  python experiments/distill.py [--config=configs/distill_tiny.py] [--config.world.seed=1 ...]

Writes world/ (corpus, train and held-out tasks, tools spec), traces.jsonl (every multi-agent
trace), trajectories.jsonl (what SFT reads) and distill_report.json to config.output_dir, and
prints each filter stage's counts and retention.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax import distill  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../configs/distill_tiny.py"),
    lock_config=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distill.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
