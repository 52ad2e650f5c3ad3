"""The paper's experiments in miniature, each a sweep of pipeline-config overrides times seeds
(`runner`), of one kind: "rl" (held-out learning curves of an RL stage, `rl_curves`), "sft"
(the trajectory-quality ablation, `filters`) or "scaling" (test-time scaling, `scaling_curves`).
The named experiments are configs/experiments.py's; `make experiment NAME=...` runs one."""

from coa_jax.experiments import filters, rl_curves, scaling_curves
from coa_jax.experiments.runner import Experiment, publish, run, with_overrides

KINDS = {"rl": rl_curves, "sft": filters, "scaling": scaling_curves}
