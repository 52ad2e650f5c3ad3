"""The pod-fit table: every shipped TPU and GPU config compiled ahead of time for its slice on
this CPU, with the compiler's memory per chip, the roofline and the compiler's estimate.

  python experiments/pod_fit.py [--configs=sft_qwen2_5_7b,dapo_qwen2_5_32b] \
      [--output_dir=runs/pod_fit]

Writes pod_fit.json (every report's fields) and pod_fit.md (the table in docs/tpu.md). Needs
the `tpu` and `gpu-aot` extras (`make pod-fit` installs both).
"""

import importlib
import json
import os
import time

from absl import app, flags

from coa_jax.perf import aot, pod_fit

_CONFIGS = flags.DEFINE_list(
    "configs", ["sft_qwen2_5_7b", "sft_qwen2_5_32b", "dapo_qwen2_5_7b", "dapo_qwen2_5_32b",
                "sft_qwen2_5_7b_gpu", "dapo_qwen2_5_7b_gpu", "ppo_qwen2_5_7b",
                "ppo_qwen2_5_7b_gpu", "sft_qwen2_5_32b_lora", "sft_qwen2_5_32b_lora_gpu",
                "sft_qwen2_5_7b_lora_gpu", "dapo_qwen2_5_32b_lora", "dapo_qwen2_5_32b_lora_gpu"],
    "config modules under configs/")
_OUTPUT = flags.DEFINE_string("output_dir", "runs/pod_fit", "where the JSON and table go")


def main(argv):
  del argv
  os.makedirs(_OUTPUT.value, exist_ok=True)
  results, table = {}, [pod_fit.POD_FIT_HEADER]
  start = time.perf_counter()
  for i, name in enumerate(_CONFIGS.value):
    config = importlib.import_module(f"configs.{name}").get_config()
    print(f"[{i + 1}/{len(_CONFIGS.value)}] {name} on {config.topology} "
          f"({time.perf_counter() - start:.0f} s so far)", flush=True)
    reports = pod_fit.config_reports(pod_fit.run_settings(config))
    for report in reports.values():
      print(report.format(), flush=True)
    results[name] = {program: aot.report_json(r) for program, r in reports.items()}
    table += pod_fit.pod_fit_rows(name, reports)
    # Written after every config: a run cut short keeps the rows it has.
    with open(os.path.join(_OUTPUT.value, "pod_fit.json"), "w") as f:
      json.dump(results, f, indent=2)
    with open(os.path.join(_OUTPUT.value, "pod_fit.md"), "w") as f:
      f.write("\n".join(table) + "\n")
  print("\n".join(table))
  print(f"wrote {_OUTPUT.value}/pod_fit.json and pod_fit.md in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  app.run(main)
