"""Distillation: build the embedded world, run the teacher system on it, filter, write SFT data.

  python experiments/distill.py [--config=configs/distill_tiny.py] [--config.world.seed=1 ...]

Writes world/ (corpus, train and held-out tasks, tools spec), traces.jsonl (every multi-agent
trace), trajectories.jsonl (what SFT reads) and distill_report.json to config.output_dir, and
prints each filter stage's counts and retention.
"""



from absl import app, logging
from ml_collections import config_flags

from coa_jax.distill import job as distill
from configs import distill_tiny

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    distill_tiny.__file__,
    lock_config=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distill.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
