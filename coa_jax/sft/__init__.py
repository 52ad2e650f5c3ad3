"""Observation-masked SFT: the job behind `experiments/sft.py` (`run(config)`)."""

from coa_jax.sft.job import run
