"""Two pipelines' DAPO stages from the same SFT models, side by side: per seed, the largest gap
between their per-step metrics, whether their exports are the same bytes, and their held-out
pass@1 (overall and by task family).

  python experiments/compare_dapo_runs.py --a=runs/p10_f --b=runs/p10_f_agent --seeds=7,1,5 \
      --out=docs/results/dapo_through_endpoint/results.json

(docs/serving.md: the main job's DAPO stage through the trainer's endpoint, `--a` the built-in
loop's run and `--b` the same stage with `--config.dapo.rl.agent=coa_jax.serving.agent:coa_loop`.)
"""

import hashlib
import json
import os
import statistics
import sys

from absl import app, flags

_A = flags.DEFINE_string("a", None, "one pipeline's output_dir", required=True)
_B = flags.DEFINE_string("b", None, "the other's", required=True)
_SEEDS = flags.DEFINE_list("seeds", None, "the seeds both ran", required=True)
_OUT = flags.DEFINE_string("out", "", "a JSON file for the comparison")
STEP_KEYS = ("reward", "accuracy", "response_len", "entropy", "pg_loss", "grad_norm",
             "logp_diff_max")


def _md5(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "md5").hexdigest()


def run_figures(folder: str, seed: str) -> dict:
  """Returns one run's per-step metrics, export md5 and held-out evaluation."""
  seed_dir = os.path.join(folder, f"seed-{seed}")
  with open(os.path.join(seed_dir, "dapo", "metrics.jsonl")) as f:
    steps = [json.loads(line) for line in f if line.strip()]
  with open(os.path.join(seed_dir, "eval_dapo", "metrics.json")) as f:
    evaluation = json.load(f)
  return {"steps": steps, "export_md5": _md5(os.path.join(seed_dir, "dapo", "hf_export",
                                                          "model.safetensors")),
          "pass@1": evaluation["pass@1"],
          "pass@1_by_family": evaluation.get("pass@1_by_family", {})}


def main(argv):
  del argv
  rows = {}
  for seed in _SEEDS.value:
    a, b = run_figures(_A.value, seed), run_figures(_B.value, seed)
    gaps = [abs(x[k] - y[k]) for x, y in zip(a["steps"], b["steps"]) for k in STEP_KEYS
            if k in x and k in y]
    rows[seed] = {"steps": [len(a["steps"]), len(b["steps"])],
                  "largest_step_metric_gap": max(gaps),
                  "same_export": a["export_md5"] == b["export_md5"],
                  "export_md5": [a["export_md5"], b["export_md5"]],
                  "pass@1": [a["pass@1"], b["pass@1"]],
                  "pass@1_by_family": [a["pass@1_by_family"], b["pass@1_by_family"]]}
    print(f"seed {seed}: {len(gaps)} step metrics, largest gap {max(gaps):.3g}; exports "
          f"{'the same bytes' if rows[seed]['same_export'] else 'differ'}; held-out pass@1 "
          f"{a['pass@1']:.3f} ({_A.value}) vs {b['pass@1']:.3f} ({_B.value})")
  for i, name in enumerate((_A.value, _B.value)):
    values = [row["pass@1"][i] for row in rows.values()]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    print(f"{name}: pass@1 {statistics.fmean(values):.3f} +- {sd:.3f}")
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"a": _A.value, "b": _B.value, "seeds": rows,
                 "command": " ".join(["python", *sys.argv])}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
