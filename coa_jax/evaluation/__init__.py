"""Evaluation: pass@k, majority vote, tokens, tool calls and format errors of a policy or the
teacher system on held-out tasks; the copy probe of an SFT model and the near-miss probe."""

from coa_jax.evaluation.copy_probe import copy_accuracy, copy_examples
from coa_jax.evaluation.job import (Sample, near_miss_chance, pass_at_1_by, pass_at_1_by_page,
                                    pass_at_k, probe_trajectories, run, summarize)
