"""Every seed of pipeline runs side by side: held-out pass@1, overall and per task family, after
SFT and after DAPO (coa_jax.pipeline.plot_spread).

  python experiments/seed_spread.py --out=spread.png \
      --runs=before=docs/results/pipeline_10_seeds/before.json,after=runs/pipeline_tiny/results.json

Each run is a pipeline's results.json; the dashed lines are the targets after DAPO: every seed
at pass@1 >= 0.85 and every task family >= 0.75.
"""

import json

from absl import app, flags

from coa_jax import pipeline

_RUNS = flags.DEFINE_list("runs", None, "label=results.json, ...", required=True)
_OUT = flags.DEFINE_string("out", "spread.png", "the plot's path")
FLOORS = {"pass@1": 0.85, "arithmetic": 0.75, "lookup": 0.75, "mixed": 0.75}


def main(argv):
  del argv
  runs = {}
  for item in _RUNS.value:
    label, _, path = item.partition("=")
    with open(path) as f:
      runs[label] = json.load(f)
  print(pipeline.plot_spread(runs, _OUT.value, FLOORS))


if __name__ == "__main__":
  app.run(main)
