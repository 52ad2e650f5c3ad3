"""The paper's experiments in miniature, each a sweep of pipeline-config overrides times seeds
(`runner`), of one kind: "rl" (held-out learning curves of an RL stage, `rl_curves`), "sft"
(the trajectory-quality ablation, `filters`), "scaling" (test-time scaling, `scaling_curves`)
"lora" (LoRA against full fine-tuning at a fixed budget, `lora_sft`) or "recipe" (the whole
recipe on a cell's config, e.g. another model size, `recipe`).
The named experiments are configs/experiments.py's; `make experiment NAME=...` runs one."""

from coa_jax.experiments import filters, lora_sft, recipe, rl_curves, scaling_curves
from coa_jax.experiments.runner import Experiment, publish, run, with_overrides

KINDS = {"rl": rl_curves, "sft": filters, "scaling": scaling_curves, "lora": lora_sft,
         "recipe": recipe}
