"""Evaluate a checkpoint (with tools) or the teacher system on a task file.

  python experiments/evaluate.py [--config=configs/evaluate_tiny.py] [--config.k=8]
  python experiments/evaluate.py --config.system=teacher

Prints pass@1, avg@k, pass@k, maj@k, tokens and tool calls per task and the format-error rate;
writes metrics.json and samples.jsonl to config.output_dir.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax import distributed, evaluate  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../configs/evaluate_tiny.py"))


def main(argv):
  del argv
  distributed.initialize_from_env()
  logging.set_verbosity(logging.WARNING)
  evaluate.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
