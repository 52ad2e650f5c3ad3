"""The CI guard against the collapse of issue 19: SFT must teach a tiny model to copy the value
a tool's observation holds into its answer (configs/copy_guard_cpu.py).

A held-out answer is a 4-digit number the code tool printed for operands the model never saw:
a model that cannot read observations, or never learned to, scores 0 on the copy probe. The
guard trains in a subprocess on one CPU device (the numerics of the documented command,
`python experiments/copy_curve.py --config=configs/copy_guard_cpu.py`), deterministically.
Seeds 0-2 end at 0.933, 0.750, 0.900; with the observations blanked out of the training inputs
the probe stayed at 0.000 at steps 500, 1,000 and 1,500 (of the guard's earlier 1,500-step
schedule at half the rate, which copying formed under by step 1,500).

It also guards the copies out of the question (the question-copy probe): the code writes the
question's three operands, and seed 0 writes 0.022 of them exactly at step 300, 0.922 at 600
and 1.000 at step 900 (copy probe 0.983 that run).
"""

import json
import os
import subprocess
import sys

from configs import copy_guard_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = copy_guard_cpu.get_config().sft.steps


def test_sft_learns_to_copy_values_out_of_observations(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one device
  cmd = [sys.executable, "experiments/copy_curve.py", "--config=configs/copy_guard_cpu.py",
         f"--config.output_dir={tmp_path}", f"--every={STEPS}"]
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  curve = json.load(open(tmp_path / "copy_curve" / "copy_curve.json"))["curves"]["0"]
  final = curve[-1]
  assert final["step"] == STEPS and final["copy_steps"] >= 50
  assert final["copy_exact"] >= 0.5, final  # a copy-blind model scores 0
  assert final["question_copies"] >= 150 and final["question_exact"] >= 0.8, final
