"""Compile the train step ahead of time for a TPU topology (on this CPU) and report the fit; for
a DAPO config, also the rollout's decode chunk as one host runs it (its share of the rows).

  python experiments/aot_compile.py --model=qwen2_5_7b --topology=v5p:2x2x1 \
      [--config.batch_size=16 --config.seq_len=4096 --config.mesh.tensor=2 ...]
  python experiments/aot_compile.py --config=configs/sft_qwen2_5_7b.py   # an SFT config
  python experiments/aot_compile.py --config=configs/dapo_qwen2_5_32b.py  # update + decode

Needs the `tpu` extra (libtpu). --model and --topology are shorthands for
--config.model.preset and --config.topology.
"""

import dataclasses
import json

from absl import app, flags
from ml_collections import config_flags

from coa_jax.model import build_config
from coa_jax.perf import aot
from coa_jax.rl import dapo
from coa_jax.rollout.sampler import bucket
from coa_jax.rollout.tool_loop import RolloutConfig
from coa_jax.runtime import sharding
from configs import aot_train

_CONFIG = config_flags.DEFINE_config_file(
    "config", aot_train.__file__)
_MODEL = flags.DEFINE_string("model", None, "model preset (overrides config.model.preset)")
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:2x2x1")
_REPORT = flags.DEFINE_string("report_json", None, "also write the report here (JSON)")


def main(argv):
  del argv
  config = _CONFIG.value
  if _MODEL.value:
    config.model.preset = _MODEL.value
  if _TOPOLOGY.value:
    config.topology = _TOPOLOGY.value
  micro_batches = config.train.micro_batches if "train" in config else 1
  batch_size, seq_len, loss_config = config.get("batch_size"), config.get("seq_len"), None
  if "rl" in config:  # a DAPO config: one mini-batch of whole prompt groups
    batch_size = config.rl.mini_batch_groups * config.rollout.group_size
    seq_len = config.rollout.max_prompt_tokens + config.rollout.max_response_tokens
    micro_batches, loss_config = config.rl.micro_batches, dapo.loss_config(config.rl)
  model = build_config(config.model)
  report = aot.aot_report(config.model.preset, model, config.optimizer, config.topology,
                          sharding.MeshConfig(**config.mesh), batch_size, seq_len, micro_batches,
                          loss_config)
  print(report.format())
  out = {"train": dict(dataclasses.asdict(report), peak_bytes=report.peak_bytes,
                       fits=report.fits, implied_mfu=report.implied_mfu,
                       roofline_seconds=report.roofline.seconds,
                       projected_mfu=report.projected_mfu)}
  if "rl" in config:
    hosts = len({d.process_index for d in aot.topology_devices(config.topology)})
    rollout, rows = RolloutConfig(**config.rollout), config.batch_size // hosts
    decode = aot.decode_report(
        config.model.preset, model, config.topology, config.mesh.tensor, rows,
        rollout.cache_size, config.chunk,
        prefill=(bucket(rows // rollout.group_size, 1), bucket(rollout.max_prompt_tokens)),
        extend=(bucket(rows, 1), rollout.observation_bucket))
    print(decode.format())
    out["decode"] = dict(dataclasses.asdict(decode), peak_bytes=decode.peak_bytes,
                         fits=decode.fits, step_seconds=decode.step_seconds)
  path = _REPORT.value or config.get("report_json")
  if path:
    with open(path, "w") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  app.run(main)
