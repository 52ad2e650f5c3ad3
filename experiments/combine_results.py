"""Pipeline runs of disjoint seeds over the same distillation, as one results file: every seed's
rows, mean +- sd, the per-seed table (coa_jax.pipeline.combine); writes the results file, a
Markdown page of both tables and the plot beside it.

  python experiments/combine_results.py --out=docs/results/pipeline_10_seeds/before.json \
      --runs=docs/results/pipeline_5_seeds/after_07e6fff.json,runs/p10_before/results.json
"""

import json
import os

from absl import app, flags

from coa_jax import pipeline
from coa_jax.runtime.cache import write_json

_RUNS = flags.DEFINE_list("runs", None, "results.json files of disjoint seeds", required=True)
_OUT = flags.DEFINE_string("out", None, "the combined results.json", required=True)
_K = flags.DEFINE_integer("k", 3, "samples per task of the runs' evaluations")


def main(argv):
  del argv
  runs = []
  for path in _RUNS.value:
    with open(path) as f:
      runs.append(json.load(f))
  results = pipeline.combine(runs, _K.value)
  results["sources"] = list(_RUNS.value)
  stem = os.path.splitext(_OUT.value)[0]
  os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
  results["plot"] = pipeline.plot(results["summary"], _K.value, len(results["seeds"]),
                                  f"{stem}.png")
  write_json(_OUT.value, results)
  with open(f"{stem}.md", "w") as f:
    f.write(f"{results['table']}\n\n{results['per_seed_table']}\n")
  print(f"{results['table']}\n\n{results['per_seed_table']}\n\nwrote {_OUT.value}, "
        f"{stem}.md and {stem}.png")


if __name__ == "__main__":
  app.run(main)
