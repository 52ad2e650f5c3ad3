"""DAPO and PPO side by side from the main job's SFT models: held-out learning curves.

  python experiments/rl_curves.py [--seeds=3] [--every=4] [--algorithms=dapo,ppo]
                                  [--config=configs/pipeline_tiny_cpu.py] [--output=...]

Needs the main job's SFT exports and evaluations (`make pipeline ARGS="--seeds 3"`). Writes
results.json, results.md and results.png to --output (default <output_dir>/rl_curves); a
re-run reuses every segment and evaluation on disk (coa_jax/rl_curves.py, docs/ppo.md).
"""

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from coa_jax import rl_curves
from coa_jax.runtime import cli
from configs import pipeline_tiny_cpu

sys.argv[:] = cli.config_argv(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", pipeline_tiny_cpu.__file__)
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds config.seed, config.seed + 1, ...")
_EVERY = flags.DEFINE_integer("every", 4, "updates between held-out evaluations")
_ALGORITHMS = flags.DEFINE_list("algorithms", list(rl_curves.ALGORITHMS), "stages to compare")
_OUTPUT = flags.DEFINE_string("output", "", "where to write (default <output_dir>/rl_curves)")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  # The main job's cache: its evaluations compiled the same programs.
  jax.config.update("jax_compilation_cache_dir", os.path.join(config.output_dir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  rl_curves.run(config, pipeline_tiny_cpu.stage_configs, seeds=_SEEDS.value, every=_EVERY.value,
                output_dir=_OUTPUT.value, algorithms=tuple(_ALGORITHMS.value))


if __name__ == "__main__":
  app.run(main)
