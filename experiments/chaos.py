"""The chaos run: the quick main job SIGKILLed at seeded points in every stage, re-launched until
it completes, then compared with an uninterrupted quick run (docs/pipeline.md, "Chaos run").

  python experiments/chaos.py [--out=runs/chaos] [--seed=0]

Runs `experiments/pipeline.py --quick` into <out>/killed_quick (removed first), killing it at
each point of coa_jax.experiments.chaos.QUICK_POINTS, and (unless it holds a finished run) an
uninterrupted one into <out>/whole_quick; writes <out>/chaos_report.json: each kill's stage,
event, delay and exit status, and whether results.json and the SFT and DAPO exports are equal.
Exits 1 when not.
"""

import os
import shutil
import sys

from absl import app, flags

from coa_jax.experiments import chaos
from configs import pipeline_tiny_cpu

_OUT = flags.DEFINE_string("out", "runs/chaos", "the folder of both runs and the report")
_SEED = flags.DEFINE_integer("seed", 0, "draws the delay past each kill point's event")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pipeline(out: str, name: str) -> tuple[list[str], str]:
  """Returns the quick main job's command writing under out/name, and the folder it writes."""
  config = pipeline_tiny_cpu.get_config()
  config.output_dir = os.path.join(out, name)
  folder = pipeline_tiny_cpu.quick(config).output_dir
  return [sys.executable, os.path.join(ROOT, "experiments", "pipeline.py"), "--quick",
          f"--config.output_dir={os.path.join(out, name)}"], folder


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  command, folder = _pipeline(out, "killed")
  reference_command, reference = _pipeline(out, "whole")
  for earlier in (folder, os.path.join(out, "chaos_log.txt")):  # a chaos run starts from nothing
    if os.path.isdir(earlier):
      shutil.rmtree(earlier)
    elif os.path.exists(earlier):
      os.remove(earlier)
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  report = chaos.run(command, folder, reference_command, reference, chaos.QUICK_POINTS,
                     _SEED.value, chaos.EXPORTS, ROOT, env,
                     os.path.join(out, "chaos_report.json"), say=lambda s: print(s, flush=True))
  sys.exit(0 if report["comparison"]["equal"] else 1)


if __name__ == "__main__":
  app.run(main)
