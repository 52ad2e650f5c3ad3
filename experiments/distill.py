"""Distillation: build the embedded world, run the teacher system on it, filter, write SFT data.

  python experiments/distill.py [--config=configs/distill_tiny.py] [--config.world.seed=1 ...]

Writes world/ (corpus, train and held-out tasks, tools spec), traces.jsonl (every multi-agent
trace), trajectories.jsonl (what SFT reads) and distill_report.json to config.output_dir, and
prints each filter stage's counts and retention.
"""

from coa_jax.distill import job as distill
from coa_jax.runtime import cli
from configs import distill_tiny

if __name__ == "__main__":
  cli.run_job(distill.run, distill_tiny.__file__)
