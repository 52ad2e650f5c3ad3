"""The main job's fingerprint: md5s that a change meant to leave the main job as it is keeps.

  make fingerprint                       # writes runs/fingerprint/fingerprint.json
  make fingerprint ARGS=--out=/tmp/fp    # another folder (it starts from nothing)

Runs two jobs from scratch through `experiments/pipeline.py`: the quick main job (every stage
on a toy-sized world) and the main job's own world and settings cut to 12 SFT steps and 2 DAPO
steps (evaluations on 4 held-out tasks). Prints, and writes to `<out>/fingerprint.json`, the
md5 of each job's distilled trajectories and of its SFT and DAPO exports' weights. Two trees
whose fingerprints are equal train the same main job bit for bit on this machine; a change that
moves them moves the main job's results (docs/pipeline.md, "Reproducing it").
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

from absl import app, flags

_OUT = flags.DEFINE_string("out", "runs/fingerprint", "a folder of its own: emptied first")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = {
    "quick": ["--quick"],
    "small": ["--config.sft.steps=12", "--config.sft.warmup_steps=2", "--config.sft.decay_steps=4",
              "--config.dapo.rl.steps=2", "--config.eval.max_tasks=4"],
}
FILES = {"data": "distill/trajectories.jsonl", "sft": "seed-0/sft/hf_export/model.safetensors",
         "dapo": "seed-0/dapo/hf_export/model.safetensors"}


def md5(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "md5").hexdigest()


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  shutil.rmtree(out, ignore_errors=True)
  fingerprint = {}
  for name, args in JOBS.items():
    folder = os.path.join(out, name)
    subprocess.run([sys.executable, "experiments/pipeline.py", *args,
                    f"--config.output_dir={folder}"], cwd=ROOT, check=True)
    run = folder + "_quick" * ("--quick" in args)  # --quick writes to <output_dir>_quick
    fingerprint[name] = {what: md5(os.path.join(run, path)) for what, path in FILES.items()}
  with open(os.path.join(out, "fingerprint.json"), "w") as f:
    json.dump(fingerprint, f, indent=1)
  for name, sums in fingerprint.items():
    print(name, " ".join(f"{what} {digest[:8]}" for what, digest in sums.items()))
  print(f"wrote {os.path.join(out, 'fingerprint.json')}")


if __name__ == "__main__":
  app.run(main)
