"""When does SFT learn to copy? The pipeline's SFT stage, probed every N steps, per seed.

  python experiments/copy_curve.py [--config=configs/pipeline_tiny_cpu.py] [--seeds=3]
      [--every=200] [--config.sft.weight_decay=0.1]

Reuses (or runs) the pipeline's distillation, trains each seed's SFT model in segments of
`every` steps and runs the held-out copy probe (coa_jax.copy_probe) after each; writes
config.output_dir/copy_curve/copy_curve.json and copy_curve.png. Use it to compare recipes
before paying for whole pipeline runs.
"""

from absl import app, flags
from ml_collections import config_flags

from coa_jax import pipeline
from coa_jax.runtime import cli
from configs import pipeline_tiny_cpu

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    pipeline_tiny_cpu.__file__)
_SEEDS = flags.DEFINE_integer("seeds", 1, "seeds config.seed, config.seed + 1, ...")
_EVERY = flags.DEFINE_integer("every", 200, "SFT steps between copy probes")


def main(argv):
  del argv
  cli.start()  # joins a multi-host run (COA_JAX_DISTRIBUTED), quiets absl's INFO lines
  pipeline.copy_curve(_CONFIG.value, pipeline_tiny_cpu.stage_configs, seeds=_SEEDS.value,
                     every=_EVERY.value)


if __name__ == "__main__":
  app.run(main)
