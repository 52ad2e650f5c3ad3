"""Train-step throughput and MFU: coa-jax vs HF transformers (PyTorch) in the same run, on the
device JAX runs on (PyTorch on the same kind: the GPU when JAX has one).

  python experiments/bench_model.py [--config.batch_size=8 --config.seq_len=512 ...]
  python experiments/bench_model.py --config=configs/bench_model_gpu.py   # on a GPU

MFU is analytic model FLOPs per second over the device's peak: an accelerator's published
dense bf16 figure, or on a CPU its measured float32 matmul rate (the faster of JAX's and
PyTorch's 2048^3 matmul). Writes a JSON file of the figures.
"""

import json
import os

import jax
from absl import app, flags
from ml_collections import config_flags

from coa_jax.model import build_config
from coa_jax.perf import bench, flops
from coa_jax.runtime.settings import build
from coa_jax.train.optimizer import OptimizerSettings
from configs import bench_model

_CONFIG = config_flags.DEFINE_config_file(
    "config", bench_model.__file__)
_MODELS = flags.DEFINE_list("models", [], "the config's models to run (default: all); on a GPU "
                            "run one per process: JAX keeps the memory it allocated")
_OUTPUT = flags.DEFINE_string("output", "", "figures (JSON); default: the config's, with the "
                              "models' names")


def main(argv):
  del argv
  bench.share_gpu_with_torch()
  config = _CONFIG.value
  import torch

  if config.torch_threads:
    torch.set_num_threads(config.torch_threads)
  peak, source = bench.peak_flops()
  device = jax.devices()[0]
  print(f"device {device.device_kind} (PyTorch on {bench.torch_device()}); peak "
        f"{peak / 1e12:.3g} TFLOP/s ({source}); torch threads {torch.get_num_threads()}")
  b, t = config.batch_size, config.seq_len
  opt = build(OptimizerSettings, config.optimizer, "optimizer")
  rows, progress = [], bench.progress()
  for name, spec in config.models.items():
    if _MODELS.value and name not in _MODELS.value:
      continue
    model_config = build_config(spec)
    steps = config.steps[name]
    # PyTorch first: it returns its GPU memory when done, JAX keeps what it allocated. Each
    # side's fastest of `rounds` alternating runs: on a CPU either side's step was at times up to
    # 25% slower in one run than in the others of the same process (why is not known).
    theirs, ours = [], []
    for _ in range(config.get("rounds", 1)):
      theirs.append(bench.torch_train_step_seconds(model_config, opt, b, t,
                                                   config.warmup_steps, steps))
      progress(f"{name}: PyTorch {b * t / theirs[-1]:,.0f} tok/s; coa-jax next")
      ours.append(bench.jax_train_step_seconds(model_config, opt, b, t, config.warmup_steps,
                                               steps))
      progress(f"{name}: coa-jax {b * t / ours[-1]:,.0f} tok/s")
    rates = [", ".join(f"{b * t / s:,.0f}" for s in runs) for runs in (theirs, ours)]
    rounds = f" (rounds: PyTorch {rates[0]}; coa-jax {rates[1]})" if len(ours) > 1 else ""
    theirs, ours = min(theirs), min(ours)
    step_flops = flops.train_flops(model_config, b, t)
    row = dict(model=name, params=model_config.num_params(), batch=b, seq_len=t,
               dtype=model_config.dtype, attention=model_config.attention_impl,
               jax_tokens_per_s=b * t / ours, torch_tokens_per_s=b * t / theirs,
               ratio=theirs / ours, jax_mfu=step_flops / ours / peak,
               torch_mfu=step_flops / theirs / peak)
    print(f"{name:>12} {row['params'] / 1e6:7.1f}M params  coa-jax "
          f"{row['jax_tokens_per_s']:9,.0f} tok/s (MFU {row['jax_mfu']:.1%})  HF/PyTorch "
          f"{row['torch_tokens_per_s']:9,.0f} tok/s (MFU {row['torch_mfu']:.1%})  ratio "
          f"{row['ratio']:.2f}x{rounds}", flush=True)
    if config.get("attention"):  # where the step's time goes: one layer's attention alone
      jax_s, torch_s = bench.attention_seconds(model_config, b, t, config.warmup_steps, steps)
      row.update(jax_attention_ms=jax_s * 1e3, torch_attention_ms=torch_s * 1e3)
      print(f"{'':>12} one layer's attention, forward and backward: coa-jax {jax_s * 1e3:.2f} "
            f"ms, PyTorch SDPA {torch_s * 1e3:.2f} ms, ratio {torch_s / jax_s:.2f}x", flush=True)
    rows.append(row)
  output = _OUTPUT.value
  if not output:  # the config's, one file per choice of models: runs one at a time don't overwrite
    stem, ext = os.path.splitext(config.output)
    output = f"{stem}_{'_'.join(_MODELS.value)}{ext}" if _MODELS.value else config.output
  os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
  with open(output, "w") as f:
    json.dump(dict(device=device.device_kind, peak_flops=peak, peak_source=source, rows=rows),
              f, indent=2)
  print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)
