"""The main job on a harder world: half of the numeric facts on the pages have a near-miss
figure beside them ("The population of the province of City 5230 is 48213."), before or after
the entity's own sentence at even odds. Everything else (the tasks, the entities, the teacher,
the filters, the model and every stage) is the main job's, on its 4-head recipe (`FOUR_HEADS`):
the world's tasks are the same, only their pages are harder to read. The scripted teacher reads the first figure of the form it
looks for and its check re-reads it the same way, so the near-miss figures show a failure mode
of its own (a real multi-agent system confuses look-alike facts too) rather than one chosen
for it; the knob is the world's (docs/experiments.md, "Test-time scaling").

  make pipeline ARGS="--config=configs/pipeline_distractors_cpu.py --seeds 3"
  make experiment NAME=scaling-distractors ARGS=--publish
"""

import ml_collections

from coa_jax.experiments import with_overrides
from configs import pipeline_tiny_cpu

# The main job's config -> this one (also the cells of the scaling-distractors experiment), on
# the recipe its results were measured with (`FOUR_HEADS`).
OVERRIDES = {"output_dir": "runs/pipeline_distractors", "world.distractors": 0.5,
             **pipeline_tiny_cpu.FOUR_HEADS}
stage_configs, quick = pipeline_tiny_cpu.stage_configs, pipeline_tiny_cpu.quick


def get_config() -> ml_collections.ConfigDict:
  return with_overrides(pipeline_tiny_cpu.get_config(), OVERRIDES)
