"""An SFT config's train step run on the devices of this machine, beside what the compiler
predicts for it: the check that a pod-fit row holds on real hardware.

  python experiments/device_fit.py --config=configs/sft_qwen2_5_7b_lora_gpu.py [--steps=3]

Random weights and full random rows (no checkpoint, no data): the step's shapes, memory and
speed are the config's. On a GPU set XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. .95) as for a real
run. Writes the figures as JSON (--output, default runs/device_fit/<config>.json).
"""

import json
import os

from absl import app, flags
from ml_collections import config_flags

from coa_jax.perf import bench
from coa_jax.runtime import hardware, xla_flags
from coa_jax.sft.settings import sft_settings

_CONFIG = config_flags.DEFINE_config_file("config", None, "an SFT config file")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps after one warm-up step")
_OUTPUT = flags.DEFINE_string("output", "", "the JSON file (default runs/device_fit/<config>.json)")


def main(argv):
  del argv
  settings = sft_settings(_CONFIG.value)
  xla_flags.apply(settings.xla_flags)
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.splitext(os.path.basename(path))[0]
  result = dict(config=name, topology=settings.topology,
                **bench.measure_config_step(settings, _STEPS.value))
  gib = lambda b: "n/a" if b is None else f"{b / hardware.GIB:.1f} GiB"
  print(f"{name} on {result['devices']} x {result['device']} (mesh {result['mesh']}): "
        f"compiled in {result['compile_seconds']:.0f} s; memory per device: compiler "
        f"{gib(result['compiler_peak_bytes'])}, measured peak {gib(result['measured_peak_bytes'])}"
        f" (after init {gib(result['measured_peak_after_init'])}, of "
        f"{gib(result['device_bytes_limit'])}); {result['step_seconds']:.2f} s a step, "
        f"{result['tokens_per_s']:,.0f} tokens/s"
        + ("" if result["mfu"] is None else f", MFU {result['mfu']:.1%}")
        + f"; losses {[round(l, 3) for l in result['losses']]}")
  output = _OUTPUT.value or os.path.join("runs", "device_fit", f"{name}.json")
  os.makedirs(os.path.dirname(output), exist_ok=True)
  with open(output, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {output}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
