"""Evaluate a checkpoint (with tools) or the teacher system on a task file.

  python experiments/evaluate.py [--config=configs/evaluate_tiny.py] [--config.k=8]
  python experiments/evaluate.py --config.system=teacher

Prints pass@1, avg@k, pass@k, maj@k, tokens and tool calls per task and the format-error rate;
writes metrics.json and samples.jsonl to config.output_dir.
"""



from absl import app, logging
from ml_collections import config_flags

from coa_jax.evaluation import job as evaluate
from coa_jax.runtime import distributed
from configs import evaluate_tiny

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    evaluate_tiny.__file__)


def main(argv):
  del argv
  distributed.initialize_from_env()
  logging.set_verbosity(logging.WARNING)
  evaluate.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
