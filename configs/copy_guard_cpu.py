"""The CI guard against the collapse of issue 19: a tiny model must learn, by SFT alone, to copy
the number that the code tool printed into its suggested answer (tests/test_copy_guard.py).

The pipeline's recipe shrunk to the one skill: arithmetic tasks only, all solved with the code
tool, a one-line system prompt and a 64-wide model. The held-out answers are 4-digit results
that the model never saw and cannot compute: a model that does not copy from the observation
scores 0 on the copy probe. Rows of 128 tokens end each 150-token trajectory inside its
double-check step; every copied answer lies within the row.

  python experiments/copy_curve.py --config=configs/copy_guard_cpu.py   (about 4 minutes)
"""

import ml_collections

from configs import common, pipeline_tiny_cpu


def get_config() -> ml_collections.ConfigDict:
  config = pipeline_tiny_cpu.get_config()
  config.output_dir = "runs/copy_guard"
  config.system_prompt = "Solve with tools."
  config.world.update(families=(("arithmetic", 1.0),), train_tasks=2000, heldout_tasks=60)
  config.teacher.mental_math_rate = 0.0  # every answer is the number the code printed
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.model.update(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2)
  # Copying forms abruptly at a step that float rounding moves: over seeds 0-2 it had formed by
  # step 1500 of 3000 (probe 0.90, 0.85, 0.73), while a 2000-step schedule left seed 2 at 0.000.
  # The run lasts twice the latest formation seen, so the guard's 0.5 bar holds with a margin.
  config.sft.update(steps=3000, seq_len=128, batch_size=8, learning_rate=1e-3, warmup_steps=20,
                    schedule="cosine", weight_decay=0.1)
  return config
