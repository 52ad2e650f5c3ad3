"""Why a seed fails: the copy probes and the sampled numbers of a finished pipeline run, per
task family (coa_jax.evaluation.diagnosis).

  python experiments/diagnose.py [--config=configs/pipeline_tiny_cpu.py] --seeds=0,1,7
      [--config.output_dir=runs/pipeline_tiny] [--noprobes]

Writes config.output_dir/diagnosis.json and prints one line per seed, model and family.
"""

import json
import os

from absl import app, flags, logging
from ml_collections import config_flags

from coa_jax import pipeline
from coa_jax.evaluation import diagnosis
from configs import pipeline_tiny_cpu

_CONFIG = config_flags.DEFINE_config_file("config", pipeline_tiny_cpu.__file__)
_SEEDS = flags.DEFINE_list("seeds", ["0"], "the finished seeds to diagnose")
_PROBES = flags.DEFINE_bool("probes", True, "run the copy probes (they load each model); "
                            "--noprobes reads the samples alone")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  seeds = [int(s) for s in _SEEDS.value]
  result = diagnosis.diagnose(pipeline.Stages(config, pipeline_tiny_cpu.stage_configs).of, seeds,
                              _PROBES.value)
  if not any(result.values()):
    raise SystemExit(f"{config.output_dir} holds no evaluation samples of seeds {seeds}: "
                     f"run the pipeline there first")
  for seed, models in result.items():
    for name, parts in models.items():
      origins = parts["origins"]
      print(f"seed {seed} {name:4} {origins['numbers']} numbers from nowhere of 4 digits or more: "
            f"{origins['near_seen']:.3f} within two edits of a number seen, "
            f"{origins['in_training']:.3f} in the training trajectories (by chance "
            f"{origins['in_training_by_chance']:.3f})")
      for family, probe in parts.get("probe", {}).items():
        invented = parts["invented"].get(family, {})
        print(f"seed {seed} {name:4} {family:10} copy {probe['copy_exact']:.3f} "
              f"call {probe['call_exact']:.3f} question {probe['question_exact']:.3f} "
              f"(sampled {probe['question_sampled']:.3f}, unsure "
              f"{probe['question_unsure']:.3f}) invented "
              f"{invented.get('invented', float('nan')):.3f} " + " ".join(
                  f"{k[9:]}={v:.3f}" for k, v in invented.items() if k.startswith("first_in")))
      if "question_by_distance" in parts:
        print(f"seed {seed} {name:4} question copies by tokens into the response: " + ", ".join(
            f"{edge} {v['exact']:.3f} ({v['copies']})"
            for edge, v in parts["question_by_distance"].items()))
  path = os.path.join(config.output_dir, "diagnosis.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
