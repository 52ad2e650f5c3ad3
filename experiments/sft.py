"""Observation-masked SFT.

  python experiments/sft.py [--config=configs/sft_tiny_cpu.py] [--config.train.steps=300 ...]
"""

from coa_jax.runtime import cli
from coa_jax.sft import job as sft
from configs import sft_tiny_cpu

if __name__ == "__main__":
  cli.run_job(sft.run, sft_tiny_cpu.__file__)
