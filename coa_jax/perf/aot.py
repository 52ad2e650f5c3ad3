"""Ahead-of-time compilation of a training step (SFT, or a DAPO update when given a policy-loss
config) and of the rollout's decode step for a TPU topology, on any host (CPU too).

Needs libtpu (the `tpu` extra). The report combines three sources, each labelled:
- memory per device: the compiler's `memory_analysis()` of the real (scanned) step;
- model FLOPs: analytic (`coa_jax.flops`), the MFU convention;
- the compiler's FLOPs and estimated step time: XLA's cost analysis counts a loop body once
  (the layer scan, the micro-batch scan), so they come from two small compiles of one
  micro-batch's step with 1 and 2 unrolled layers, extrapolated linearly to the full depth and
  multiplied by the number of micro-batches.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax

from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.model import ModelConfig, Transformer
from coa_jax.perf import flops
from coa_jax.rl import update as rl_update
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.runtime import hardware, sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from coa_jax.train.batch import PolicyBatch, TokenBatch, abstract_batch


@dataclasses.dataclass
class AotReport:
  """What one ahead-of-time compile of the train step found (bytes and FLOPs per device)."""

  model: str
  topology: str
  device_kind: str
  num_devices: int
  mesh: dict[str, int]
  batch_size: int
  seq_len: int
  num_params: int
  compile_seconds: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  hbm_bytes: int
  model_flops: float  # analytic, whole step, all devices
  compiler_flops: float  # per device, extrapolated from 1- and 2-layer compiles
  compiler_seconds: float  # the compiler's estimated step time, extrapolated likewise
  peak_flops: float  # per device
  step: str = "train step (fwd + bwd + AdamW)"

  @property
  def peak_bytes(self) -> int:
    """Per-device bytes live at the peak: arguments + outputs not aliased to them + temps."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  @property
  def implied_mfu(self) -> float:
    """Analytic model FLOPs per device / (compiler's step time x peak FLOP/s)."""
    if self.compiler_seconds <= 0:
      return float("nan")
    return self.model_flops / self.num_devices / (self.compiler_seconds * self.peak_flops)

  def format(self) -> str:
    """Returns a human-readable multi-line report."""
    gib = lambda b: (f"{b / hardware.GIB:.2f} GiB" if b >= hardware.GIB / 10
                     else f"{b / (1 << 20):.2f} MiB")
    tokens = self.batch_size * self.seq_len
    lines = [
        f"model {self.model} ({self.num_params / 1e9:.2f}B params), {self.step}, "
        f"batch {self.batch_size} x {self.seq_len} = {tokens:,} tokens",
        f"topology {self.topology}: {self.num_devices} x {self.device_kind}, mesh {self.mesh}, "
        f"compiled in {self.compile_seconds:.1f}s",
        f"memory per device (compiler): arguments {gib(self.argument_bytes)}, outputs "
        f"{gib(self.output_bytes)} (aliased {gib(self.alias_bytes)}), temporaries "
        f"{gib(self.temp_bytes)} -> peak {gib(self.peak_bytes)} of {gib(self.hbm_bytes)} HBM: "
        f"{'FITS' if self.fits else 'DOES NOT FIT'}",
        f"model FLOPs per step (analytic, 6 x params x tokens + attention): "
        f"{self.model_flops:.3e} total, {self.model_flops / self.num_devices:.3e} per device",
        f"compiler's FLOPs per device (XLA cost analysis, extrapolated from 1/2-layer compiles): "
        f"{self.compiler_flops:.3e}",
        f"compiler's estimated step time: {self.compiler_seconds * 1e3:.1f} ms -> implied MFU "
        f"{self.implied_mfu:.1%} (peak {self.peak_flops / 1e12:.0f} TFLOP/s per device), "
        f"{tokens / max(self.compiler_seconds, 1e-12):,.0f} tokens/s",
    ]
    return "\n".join(lines)


def topology_devices(topology: str) -> list[Any]:
  """Returns the (abstract) devices of a TPU topology such as 'v5p:2x2x1'."""
  from jax.experimental import topologies

  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except Exception as e:  # libtpu missing, a name it rejects, or its lock held
    if "lockfile" in str(e):
      raise ValueError(f"cannot describe TPU topology {topology!r}: another process on this "
                       f"machine has loaded libtpu. With no TPU attached, set "
                       f"ALLOW_MULTIPLE_LIBTPU_LOAD=1 to compile beside it: {e}") from None
    raise ValueError(f"cannot describe TPU topology {topology!r} (is the `tpu` extra, i.e. "
                     f"libtpu, installed?): {e}") from None


def compile_train_step(config: ModelConfig, optimizer_config: Any, devices: list[Any],
                       mesh_config: sharding.MeshConfig, batch_size: int, seq_len: int,
                       micro_batches: int = 1, loss_config: PolicyLossConfig | None = None):
  """Returns (compiled step, mesh, compile seconds) for `devices` without running it: the SFT
  train step, or the DAPO update step when `loss_config` is given."""
  mesh = sharding.make_mesh(mesh_config, devices=devices)
  sharding.check_model_fits_mesh(config, mesh)
  sharding.check_batch_fits_mesh(batch_size, micro_batches, mesh)
  model, tx = Transformer(config), optimizer.make_optimizer(optimizer_config)
  state = state_lib.abstract_state(model, tx, mesh)
  batch = abstract_batch(TokenBatch if loss_config is None else PolicyBatch, batch_size, seq_len,
                         sharding.batch_sharding(mesh))
  start = time.perf_counter()
  if loss_config is None:
    step = step_lib.jit_train_step(model, tx, mesh, micro_batches=micro_batches)
  else:
    step = rl_update.jit_dapo_step(model, tx, mesh, loss_config=loss_config,
                                   micro_batches=micro_batches)
  compiled = step.lower(state, batch).compile()
  return compiled, mesh, time.perf_counter() - start


def _cost(compiled) -> tuple[float, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost.get("flops", 0.0)), float(cost.get("optimal_seconds", 0.0))


def aot_report(name: str, config: ModelConfig, optimizer_config: Any, topology: str,
               mesh_config: sharding.MeshConfig, batch_size: int, seq_len: int,
               micro_batches: int = 1, loss_config: PolicyLossConfig | None = None) -> AotReport:
  """Compiles the train step of `config` (the DAPO update with `loss_config`) for `topology`
  and returns what the compiler found."""
  devices = topology_devices(topology)
  compiled, mesh, seconds = compile_train_step(config, optimizer_config, devices, mesh_config,
                                               batch_size, seq_len, micro_batches, loss_config)
  memory = compiled.memory_analysis()
  # Cost analysis counts a loop body once: layers are unrolled in these small compiles and
  # micro-batch accumulation is costed as one micro-batch times their number.
  per_layer_costs = []
  for layers in (1, 2):
    small = config.replace(num_layers=layers, scan_unroll=layers)
    flops_, seconds_ = _cost(compile_train_step(small, optimizer_config, devices, mesh_config,
                                                batch_size // micro_batches, seq_len,
                                                loss_config=loss_config)[0])
    per_layer_costs.append((flops_ * micro_batches, seconds_ * micro_batches))
  (f1, t1), (f2, t2) = per_layer_costs
  extra = config.num_layers - 1
  devices_per_chip = len(devices) / hardware.chips_in_topology(topology)
  chip = hardware.chip_for(devices[0].device_kind)
  return AotReport(
      model=name, topology=topology, device_kind=devices[0].device_kind,
      num_devices=len(devices), mesh=dict(mesh.shape), batch_size=batch_size, seq_len=seq_len,
      num_params=config.num_params(), compile_seconds=seconds,
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
      hbm_bytes=int(chip.hbm_bytes / devices_per_chip),
      model_flops=flops.train_flops(config, batch_size, seq_len),
      compiler_flops=f1 + extra * (f2 - f1), compiler_seconds=t1 + extra * (t2 - t1),
      peak_flops=chip.peak_bf16_flops / devices_per_chip,
      step="DAPO update step (fwd + bwd + AdamW)" if loss_config else AotReport.step)


@dataclasses.dataclass
class DecodeReport:
  """What an ahead-of-time compile of one host's rollout decode chunk found (per device)."""

  model: str
  topology: str
  device_kind: str
  host_devices: int
  mesh: dict[str, int]
  rows: int  # decode rows on one host
  cache_size: int
  chunk: int
  compile_seconds: float
  argument_bytes: int
  temp_bytes: int
  hbm_bytes: int
  param_bytes: int  # per device
  cache_bytes: int  # per device
  step_flops: float  # analytic, one token for every row, all host devices, full cache
  peak_flops: float  # per device
  hbm_bytes_per_s: float  # per device

  @property
  def peak_bytes(self) -> int:
    return self.argument_bytes + self.temp_bytes

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  @property
  def step_seconds(self) -> float:
    """Projected time of one token for every row: HBM-bound (weights and the full KV cache
    read once) unless the FLOPs take longer."""
    return max((self.param_bytes + self.cache_bytes) / self.hbm_bytes_per_s,
               self.step_flops / self.host_devices / self.peak_flops)

  def format(self) -> str:
    gib = lambda b: f"{b / hardware.GIB:.2f} GiB"
    return "\n".join([
        f"model {self.model}, rollout decode chunk ({self.chunk} steps, KV cache "
        f"{self.cache_size} tokens) on one host: {self.rows} rows",
        f"topology {self.topology}: {self.host_devices} x {self.device_kind} per host, mesh "
        f"{self.mesh}, compiled in {self.compile_seconds:.1f}s",
        f"memory per device (compiler): arguments {gib(self.argument_bytes)} (params "
        f"{gib(self.param_bytes)}, KV cache {gib(self.cache_bytes)}), temporaries "
        f"{gib(self.temp_bytes)} -> peak {gib(self.peak_bytes)} of {gib(self.hbm_bytes)} HBM: "
        f"{'FITS' if self.fits else 'DOES NOT FIT'}",
        f"projected decode step at a full cache (HBM-bound model): "
        f"{self.step_seconds * 1e3:.1f} ms -> {self.rows / self.step_seconds:,.0f} tokens/s "
        f"per host"])


def decode_report(name: str, config: ModelConfig, topology: str, tensor: int, rows: int,
                  cache_size: int, chunk: int) -> DecodeReport:
  """Compiles the rollout's decode chunk as one host of `topology` runs it (its devices, the
  `tensor` axis within the host, `rows` rows) and returns what the compiler found. When the
  compiler refuses the program for lack of HBM, the report carries the temporaries it asked
  for and does not fit."""
  devices = topology_devices(topology)
  local = [d for d in devices if d.process_index == devices[0].process_index]
  if len(local) % tensor:
    raise ValueError(f"tensor={tensor} does not divide a host's {len(local)} devices")
  mesh = sharding.make_mesh((1, len(local) // tensor, tensor), devices=local)
  sampler = Sampler(config, mesh, batch_size=rows, cache_size=cache_size, chunk=chunk,
                    stop_ids=(0,), sampling=SamplingConfig(temperature=1.0))
  # The sampler holds its weights in the compute dtype (Sampler.sampling_params).
  params = state_lib.abstract_placed_params(Transformer(config.replace(param_dtype=config.dtype)),
                                            mesh)
  state = sampler.abstract_state()
  key = jax.eval_shape(lambda: jax.random.key(0))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
  start = time.perf_counter()
  try:
    memory = sampler.decode_chunk.lower(params, state, key).compile().memory_analysis()
    arguments, temporaries = memory.argument_size_in_bytes, memory.temp_size_in_bytes
  except jax.errors.JaxRuntimeError as e:  # the compiler refuses a program that cannot fit
    needed = re.search(r"HLO temporaries \(([\d.]+)G\)", str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not needed:
      raise
    arguments = (nbytes(params) + nbytes(state)) // len(local)
    temporaries = int(float(needed.group(1)) * hardware.GIB)
  seconds = time.perf_counter() - start
  chip = hardware.chip_for(local[0].device_kind)
  per_chip = len(devices) / hardware.chips_in_topology(topology)
  return DecodeReport(
      model=name, topology=topology, device_kind=local[0].device_kind,
      host_devices=len(local), mesh=dict(mesh.shape), rows=rows, cache_size=cache_size,
      chunk=chunk, compile_seconds=seconds, argument_bytes=arguments, temp_bytes=temporaries,
      hbm_bytes=int(chip.hbm_bytes / per_chip),
      param_bytes=nbytes(params) // len(local),
      cache_bytes=nbytes((state.cache.k, state.cache.v)) // len(local),
      step_flops=flops.decode_flops(config, rows, cache_size),
      peak_flops=chip.peak_bf16_flops / per_chip,
      hbm_bytes_per_s=chip.hbm_bytes_per_s / per_chip)
