"""Train-step throughput and MFU: coa-jax vs HF transformers (PyTorch) in the same run.

  python experiments/bench_model.py [--config.batch_size=8 --config.seq_len=512 ...]

MFU is analytic model FLOPs per second over this CPU's measured float32 matmul peak (the
faster of JAX's and PyTorch's 2048^3 matmul). Writes a JSON file of the figures.
"""

import json
import os

from absl import app
from ml_collections import config_flags

from coa_jax.model import build_config
from coa_jax.perf import bench, flops
from configs import bench_model

_CONFIG = config_flags.DEFINE_config_file(
    "config", bench_model.__file__)


def main(argv):
  del argv
  config = _CONFIG.value
  import torch

  if config.torch_threads:
    torch.set_num_threads(config.torch_threads)
  peaks = bench.matmul_peak_flops()
  peak = max(peaks.values())
  print(f"matmul peak (float32, 2048^3): JAX {peaks['jax'] / 1e9:.1f} GFLOP/s, "
        f"PyTorch {peaks['torch'] / 1e9:.1f} GFLOP/s; torch threads {torch.get_num_threads()}")
  b, t = config.batch_size, config.seq_len
  rows = []
  for name, spec in config.models.items():
    model_config = build_config(spec)
    steps = config.steps[name]
    ours = bench.jax_train_step_seconds(model_config, config.optimizer, b, t,
                                        config.warmup_steps, steps)
    theirs = bench.torch_train_step_seconds(model_config, config.optimizer, b, t,
                                            config.warmup_steps, steps)
    step_flops = flops.train_flops(model_config, b, t)
    row = dict(model=name, params=model_config.num_params(), batch=b, seq_len=t,
               jax_tokens_per_s=b * t / ours, torch_tokens_per_s=b * t / theirs,
               ratio=theirs / ours, jax_mfu=step_flops / ours / peak,
               torch_mfu=step_flops / theirs / peak)
    rows.append(row)
    print(f"{name:>11} {row['params'] / 1e6:7.1f}M params  coa-jax {row['jax_tokens_per_s']:9,.0f} "
          f"tok/s (MFU {row['jax_mfu']:.1%})  HF/PyTorch {row['torch_tokens_per_s']:9,.0f} tok/s "
          f"(MFU {row['torch_mfu']:.1%})  ratio {row['ratio']:.2f}x", flush=True)
  os.makedirs(os.path.dirname(config.output) or ".", exist_ok=True)
  with open(config.output, "w") as f:
    json.dump(dict(peak_flops=peaks, rows=rows), f, indent=2)
  print(f"wrote {config.output}")


if __name__ == "__main__":
  app.run(main)
