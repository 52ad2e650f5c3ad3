"""The whole recipe end to end: world -> distil -> SFT -> evaluate -> DAPO -> evaluate.

  python experiments/pipeline.py [--config=configs/pipeline_tiny_cpu.py] [--quick] [--seeds=3]

Writes every stage's outputs under config.output_dir and, at the end, results.json and
results.png: the teacher system, the AFM after SFT and after DAPO on held-out tasks. The config
file's module gives `quick` and `stage_configs` (configs/pipeline_sql_cpu.py: the recipe on a
user's own tool).
"""

import importlib.util
import os
import sys
from typing import Any

import jax
from absl import app, flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from coa_jax import pipeline
from coa_jax.runtime import cli
from coa_jax.runtime.distributed import say
from configs import pipeline_tiny_cpu

sys.argv[:] = cli.config_argv(sys.argv)  # e.g. --config.rl.async.staleness=2
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    pipeline_tiny_cpu.__file__)
_QUICK = flags.DEFINE_bool("quick", False, "a few-minute smoke test of every stage")
_SEEDS = flags.DEFINE_integer("seeds", 1, "train and evaluate this many seeds (config.seed, "
                              "config.seed + 1, ...) on the same distilled data; results.json "
                              "and results.png report mean +- sd")


def _recipe() -> object:
  """Returns the config file's module (its `quick` and `stage_configs`)."""
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":")[0]
  spec = importlib.util.spec_from_file_location("pipeline_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def quick_note(config: Any) -> str:
  """The lines a --quick run prints under its table: why its model rows are near 0, and where
  its outputs are."""
  sft, dapo = config.sft.steps, config.dapo.rl.steps
  return (f"--quick is a smoke test of every stage ({sft} SFT step{'s' * (sft != 1)}, {dapo} "
          f"DAPO step{'s' * (dapo != 1)}, a toy-sized world): its model rows near 0 are "
          f"expected; run without --quick for results.\n"
          f"outputs: {config.output_dir} (--quick adds _quick to config.output_dir)")


def main(argv):
  del argv
  cli.start()
  config = _CONFIG.value
  recipe = _recipe()
  if _QUICK.value:  # the command line's settings win over the smoke test's, but its folder
    config = recipe.quick(config)
    for path, value in config_flags.get_override_values(flags.FLAGS["config"]).items():
      if path != "output_dir":  # quick() named it after the command line's
        config_path.set_value(path, config, value)
    say(f"--quick: a smoke test of every stage, written to {config.output_dir} (--quick adds "
        f"_quick to config.output_dir; `make view RUN={config.output_dir}` shows it)")
  # Both evaluations of a seed, and every seed, compile the same programs: a persistent cache
  # beside the outputs compiles each once (the loaded program is the compiled one, bit for bit);
  # or the one JAX_COMPILATION_CACHE_DIR names (the test suite's, shared by its runs).
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", os.path.join(config.output_dir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  pipeline.run(config, recipe.stage_configs, seeds=_SEEDS.value)
  if _QUICK.value:
    say(quick_note(config))


if __name__ == "__main__":
  app.run(main)
