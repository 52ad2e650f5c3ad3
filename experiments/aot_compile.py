"""Compile the train step ahead of time for a TPU or GPU topology (on this CPU) and report the
fit; for a DAPO config, also the rollout's programs as one host runs them (its share of rows).

  python experiments/aot_compile.py --model=qwen2_5_7b --topology=v5p:2x2x1 \
      [--config.batch_size=16 --config.seq_len=4096 --config.mesh.tensor=2 ...]
  python experiments/aot_compile.py --config=configs/sft_qwen2_5_7b.py   # an SFT config
  python experiments/aot_compile.py --config=configs/dapo_qwen2_5_32b.py  # update + rollout

Needs the `tpu` extra (libtpu) for TPU topologies and the `gpu-aot` extra for GPU ones
(h100:8, h200:2x8). --model and --topology are shorthands for --config.model.preset and
--config.topology. `experiments/pod_fit.py` runs every shipped config.
"""

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from coa_jax.perf import aot, pod_fit
from coa_jax.runtime import cli
from configs import aot_train

sys.argv[:] = cli.config_argv(sys.argv)  # e.g. --config.rl.async.staleness=2
_CONFIG = config_flags.DEFINE_config_file(
    "config", aot_train.__file__)
_MODEL = flags.DEFINE_string("model", None, "model preset (overrides config.model.preset)")
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU or GPU topology, e.g. v5p:2x2x1, h100:8")
_REPORT = flags.DEFINE_string("report_json", None, "also write the report here (JSON)")


def main(argv):
  del argv
  config = _CONFIG.value
  if _MODEL.value:
    config.model.preset = _MODEL.value
  if _TOPOLOGY.value:
    config.topology = _TOPOLOGY.value
  settings = pod_fit.run_settings(config)
  reports = pod_fit.config_reports(settings)
  for report in reports.values():
    print(report.format())
  path = _REPORT.value or getattr(settings, "report_json", "")
  if path:
    with open(path, "w") as f:
      json.dump({name: aot.report_json(r) for name, r in reports.items()}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
