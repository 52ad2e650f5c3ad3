"""What JAX itself reaches on this device, the ceilings the decode and train figures are read
against (docs/benchmarks.md#measured-on-one-h200-2026-11-30):

  python experiments/gpu_ceilings.py [--output=ceilings.json]   # on a GPU, about 30 s
  python experiments/gpu_ceilings.py --smoke                     # this CPU, small shapes

1. copy: a jitted elementwise op over a float32 array, bytes read and written over the time;
2. matmul: a square bf16 matrix product, FLOPs over the time;
3. decode GEMMs: the 1.5B model's MLP weights (28 layers of 1536 x 8960 and 8960 x 1536 in
   bf16, 1.54 GB) multiplied in a chain by M rows (16 and 128: the decode batch), all inside one
   program (20 passes in a loop, so no dispatch between kernels), weight bytes over the time;
   once with each layer's weights in arrays of their own (as the sampler decodes on GPUs) and
   once with them stacked and scanned over (as the model trains), every layer unrolled.
4. the 1.5B's MLP as the model runs it (gate and up GEMMs, silu, their product, down GEMM,
   residual; 2.31 GB of weights) at 16 and 128 rows, per-layer arrays: gate and up as two
   arrays, or merged into one GEMM of twice the width (fewer, larger kernels).
5. kernel latency: 512 dependent tiny GEMMs (16 x 128 by 128 x 128, each its own kernel) in a
   loop inside one program, microseconds per kernel: the floor under a decode step of a few
   hundred small kernels (about 520 a step for the 1.5B by the ahead-of-time profile).
Each figure is the median of 5 timed calls after one compiling call.
"""

import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags

_OUTPUT = flags.DEFINE_string("output", "", "the figures (JSON); default: printed only")
_SMOKE = flags.DEFINE_bool("smoke", False, "small shapes (a CPU)")

PASSES = 20


def _seconds(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[2]


def copy_bytes_per_s(n: int) -> float:
  x = jnp.ones((n,), jnp.float32)
  return 2 * x.nbytes / _seconds(jax.jit(lambda x: x * 1.0001), x)


def matmul_flops_per_s(n: int) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  return 2 * n ** 3 / _seconds(jax.jit(lambda a: a @ a), a)


def gemm_chain_bytes_per_s(rows: int, layers: int, d: int, f: int, stacked: bool) -> float:
  """Weight bytes read per second by `rows` x d activations through `layers` pairs of
  d x f and f x d bf16 weights, PASSES times in one program."""
  keys = jax.random.split(jax.random.key(1), 2 * layers)
  up = [jax.random.normal(k, (d, f), jnp.bfloat16) * d ** -0.5 for k in keys[:layers]]
  down = [jax.random.normal(k, (f, d), jnp.bfloat16) * f ** -0.5 for k in keys[layers:]]
  if stacked:
    up, down = jnp.stack(up), jnp.stack(down)
    one_pass = lambda h, up, down: jax.lax.scan(
        lambda h, w: ((h @ w[0]) @ w[1], None), h, (up, down), unroll=layers)[0]
  else:
    def one_pass(h, up, down):
      for u, v in zip(up, down):
        h = (h @ u) @ v
      return h
  h = jax.random.normal(jax.random.key(2), (rows, d), jnp.bfloat16)
  fn = jax.jit(lambda h, up, down: jax.lax.fori_loop(0, PASSES,
                                                       lambda _, h: one_pass(h, up, down), h))
  return PASSES * 2 * layers * d * f * 2 / _seconds(fn, h, up, down)


def mlp_bytes_per_s(rows: int, layers: int, d: int, f: int, merged: bool) -> float:
  """Weight bytes read per second by the MLP stack, PASSES times in one program."""
  keys = iter(jax.random.split(jax.random.key(3), 3 * layers))
  weight = lambda shape: jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.02
  gate_up = [weight((d, 2 * f)) if merged else (weight((d, f)), weight((d, f)))
             for _ in range(layers)]
  down = [weight((f, d)) for _ in range(layers)]

  def one_pass(h, gate_up, down):
    for w, v in zip(gate_up, down):
      g, u = jnp.split(h @ w, 2, axis=-1) if merged else (h @ w[0], h @ w[1])
      h = h + (jax.nn.silu(g) * u) @ v
    return h
  h = jax.random.normal(jax.random.key(2), (rows, d), jnp.bfloat16)
  fn = jax.jit(lambda h, gate_up, down: jax.lax.fori_loop(
      0, PASSES, lambda _, h: one_pass(h, gate_up, down), h))
  return PASSES * 3 * layers * d * f * 2 / _seconds(fn, h, gate_up, down)


def kernel_seconds(kernels: int = 512, width: int = 128) -> float:
  """Seconds per kernel of `kernels` dependent tiny GEMMs, PASSES times in one program."""
  ws = [jax.random.normal(jax.random.key(i), (width, width), jnp.bfloat16) / width ** 0.5
        for i in range(kernels)]

  def one_pass(h, ws):
    for w in ws:
      h = h @ w
    return h
  h = jax.random.normal(jax.random.key(0), (16, width), jnp.bfloat16)
  fn = jax.jit(lambda h, ws: jax.lax.fori_loop(0, PASSES, lambda _, h: one_pass(h, ws), h))
  return _seconds(fn, h, ws) / (PASSES * kernels)


def main(argv):
  del argv
  copy_n, matmul_n, (layers, d, f) = ((1 << 22, 1024, (4, 256, 1024)) if _SMOKE.value else
                                      (1 << 30, 8192, (28, 1536, 8960)))
  device = jax.devices()[0]
  figures = dict(device=device.device_kind, jax=jax.__version__,
                 copy_bytes_per_s=copy_bytes_per_s(copy_n),
                 matmul_flops_per_s=matmul_flops_per_s(matmul_n),
                 gemm_chain=dict(layers=layers, hidden=d, intermediate=f, rows={}))
  print(f"{device.device_kind}, JAX {jax.__version__}")
  print(f"copy (read + write, float32): {figures['copy_bytes_per_s'] / 1e12:.3g} TB/s")
  print(f"bf16 matmul {matmul_n}^3: {figures['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s")
  for rows in (16, 128):
    row = {}
    for layout in ("separate", "stacked"):
      row[layout] = gemm_chain_bytes_per_s(rows, layers, d, f, layout == "stacked")
      print(f"GEMM chain, {rows} rows, {layers} x ({d}x{f}, {f}x{d}) bf16, weights {layout}: "
            f"{row[layout] / 1e12:.3g} TB/s of weight reads", flush=True)
    figures["gemm_chain"]["rows"][str(rows)] = row
  figures["mlp"] = dict(layers=layers, hidden=d, intermediate=f, rows={})
  for rows in (16, 128):
    row = {}
    for layout in ("separate", "merged"):
      row[layout] = mlp_bytes_per_s(rows, layers, d, f, layout == "merged")
      print(f"MLP, {rows} rows, gate and up {layout}: {row[layout] / 1e12:.3g} TB/s of weight "
            "reads", flush=True)
    figures["mlp"]["rows"][str(rows)] = row
  figures["kernel_seconds"] = kernel_seconds(64 if _SMOKE.value else 512)
  print(f"dependent tiny GEMMs: {figures['kernel_seconds'] * 1e6:.2f} us per kernel", flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as fh:
      json.dump(figures, fh, indent=2)
    print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
