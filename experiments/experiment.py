"""One of the paper's experiments in miniature, by name (configs/experiments.py).

  python experiments/experiment.py --name=rl-ceiling [--seeds=3] [--cells=a,b] [--publish]
                                   [--config=configs/pipeline_tiny_cpu.py] [--config.x=...]

Needs the main job's outputs (`make pipeline ARGS="--seeds 3"`): its distilled data, SFT and
DAPO models and their evaluations, which the experiments reuse. Writes results.json,
results.md and results.png under <output_dir>/experiments/<name>; every (cell, seed) and the
runs behind it are cached, so a re-run (or an interrupted one) does only what is missing.
--publish copies the three files to docs/results/<name> (docs/experiments.md).
"""

import dataclasses
import os
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from coa_jax import experiments
from coa_jax.runtime import cli
from configs import pipeline_tiny_cpu
from configs.experiments import EXPERIMENTS

sys.argv[:] = cli.config_argv(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", pipeline_tiny_cpu.__file__)
_NAME = flags.DEFINE_enum("name", None, sorted(EXPERIMENTS), "the experiment to run")
_SEEDS = flags.DEFINE_integer("seeds", 0, "seeds (default: the experiment's, 3)")
_CELLS = flags.DEFINE_list("cells", [], "run only these cells (default: every cell)")
_PUBLISH = flags.DEFINE_bool("publish", False, "copy the results files to docs/results/<name>")
flags.mark_flag_as_required("name")


def main(argv):
  del argv
  cli.start()  # joins a multi-host run (COA_JAX_DISTRIBUTED), quiets absl's INFO lines
  config = _CONFIG.value
  experiment = EXPERIMENTS[_NAME.value]
  if _SEEDS.value:
    experiment = dataclasses.replace(experiment, seeds=_SEEDS.value)
  if _CELLS.value:
    unknown = set(_CELLS.value) - set(experiment.cells)
    if unknown:
      raise app.UsageError(f"--cells {sorted(unknown)}: {experiment.name}'s cells are "
                           f"{list(experiment.cells)}")
    experiment = dataclasses.replace(
        experiment, cells={n: c for n, c in experiment.cells.items() if n in _CELLS.value})
  # The main job's cache: its evaluations and training steps compiled the same programs.
  jax.config.update("jax_compilation_cache_dir", os.path.join(config.output_dir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  experiments.run(experiment, config, pipeline_tiny_cpu.stage_configs,
                           experiments.KINDS)
  if _PUBLISH.value:
    source = os.path.join(config.output_dir, "experiments", experiment.name)
    for path in experiments.publish(source, os.path.join("docs", "results", experiment.name)):
      print(f"published {path}")


if __name__ == "__main__":
  app.run(main)
