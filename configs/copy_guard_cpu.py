"""The CI guard against the collapse of issue 19: a tiny model must learn, by SFT alone, to copy
the number that the code tool printed into its suggested answer (tests/test_copy_guard.py).

The pipeline's recipe shrunk to the one skill: arithmetic tasks only, all solved with the code
tool, a one-line system prompt and a 64-wide model. The held-out answers are 4-digit results
that the model never saw and cannot compute: a model that does not copy from the observation
scores 0 on the copy probe. Rows of 128 tokens end each 150-token trajectory inside its
double-check step; every copied answer lies within the row.

  python experiments/copy_curve.py --config=configs/copy_guard_cpu.py   (about a minute)
"""

import ml_collections

from configs import common, pipeline_tiny_cpu


def get_config() -> ml_collections.ConfigDict:
  config = pipeline_tiny_cpu.get_config()
  config.output_dir = "runs/copy_guard"
  config.system_prompt = "Solve with tools."
  # 1,000 tasks distil in 4 s on the code sandbox's persistent workers (23 s with a sandboxed
  # process started per call).
  config.world.update(families=(("arithmetic", 1.0),), train_tasks=1000, heldout_tasks=60)
  config.teacher.mental_math_rate = 0.0  # every answer is the number the code printed
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.model.update(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=2,
                      head_dim=16, attention_block=128)
  # Copying forms abruptly at a step that float rounding moves. Rows of 16 (60 ms a step here)
  # formed it by step 1,000 where rows of 8 needed 1,500. At twice the rate (2e-3) every seed
  # forms it by step 750: over seeds 0-2 the probe stood at 0.033, 0.617, 0.067 at step 600,
  # 0.800, 0.733, 0.833 at 750 and 0.933, 0.750, 0.900 at 900. At 1e-3 the schedule needed
  # 1,500 steps (seed 2 at 0.083 by step 1,000, 0.883 at 1,500); with a cosine, 0.367.
  config.sft.update(steps=900, seq_len=128, batch_size=16, learning_rate=2e-3, warmup_steps=20,
                    schedule="wsd", decay_steps=300, final_lr_fraction=0.1,
                    weight_decay=0.1, upsample_by="")  # one family: nothing to upsample
  return config
