"""Per-backend XLA compiler flags that a preset turns on (`config.xla_flags`: "tpu", "gpu", or ""
for XLA's defaults), as MaxText's and NVIDIA JAX-Toolbox's launch scripts set them:

- TPU: collectives run asynchronously, fused with the compute around them and overlapped with
  it (FSDP's all-gather of the next layer's weights and reduce-scatter of the last layer's
  gradients hide behind the current layer's matmuls).
- GPU: the latency-hiding scheduler, all-gathers and reduce-scatters pipelined through the
  layer loop, combined into fewer, larger collectives, and the loop double-buffered.

A job applies its set before JAX starts a backend (`apply`: libtpu reads LIBTPU_INIT_ARGS and
XLA:GPU reads XLA_FLAGS only then); an ahead-of-time compile passes the same flags as compiler
options (`compiler_options`), so the pod-fit rows are compiled as the jobs run.
"""

from __future__ import annotations

import os

# flag -> value, per backend.
FLAG_SETS: dict[str, dict[str, bool | int]] = {
    "tpu": {
        "xla_tpu_enable_async_collective_fusion": True,
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
        "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
        "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
        "xla_tpu_overlap_compute_collective_tc": True,
        "xla_enable_async_all_gather": True,
        "xla_enable_async_all_reduce": True,
        "xla_tpu_enable_data_parallel_all_reduce_opt": True,
        "xla_tpu_data_parallel_opt_different_sized_ops": True,
    },
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_all_gather_combine_threshold_bytes": 1 << 27,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 27,
        "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 27,
    },
}
_ENV = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}
# For XLA:TPU's cost analysis only: no windowed einsums. On slices of several hosts XLA:TPU
# turns FSDP's all-gather + matmul (and matmul + reduce-scatter) into a loop over the peers'
# shards with no trip count in the HLO, and its cost analysis counts that loop's body once:
# a Qwen2.5-7B layer's matmuls on v5p:2x2x2 counted at a quarter of their FLOPs (2,048-token
# rows). Without the loops every matmul is counted whole, the same math.
COUNTED_MATMULS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                   "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def compiler_options(name: str) -> dict[str, bool | int]:
  """Returns the flags of set `name` ("" for none) as compiler options."""
  if name and name not in FLAG_SETS:
    raise ValueError(f"xla_flags={name!r}: expected '' or one of {sorted(FLAG_SETS)}")
  return dict(FLAG_SETS.get(name, {}))


def apply(name: str) -> None:
  """Adds the flags of set `name` to the environment variable its backend reads at start (a
  flag already set there keeps its value). Call it before JAX starts a backend."""
  options = compiler_options(name)
  if not options:
    return
  import jax._src.xla_bridge as xla_bridge  # the one place JAX says whether a backend started

  if xla_bridge.backends_are_initialized():
    raise RuntimeError(f"xla_flags={name!r} must be applied before JAX starts a backend: call "
                       f"xla_flags.apply first in the job's main()")
  variable = _ENV[name]
  current = os.environ.get(variable, "")
  added = [f"--{flag}={str(value).lower()}" for flag, value in options.items()
           if f"--{flag}=" not in current]
  os.environ[variable] = " ".join([current, *added]).strip()
