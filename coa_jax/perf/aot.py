"""Ahead-of-time compilation of a training step (SFT, or a DAPO update when given a policy-loss
config) and of the rollout's decode step for a TPU topology, on any host (CPU too).

Needs libtpu (the `tpu` extra). The report combines four sources, each labelled:
- memory per device: the compiler's `memory_analysis()` of the real (scanned) step;
- model FLOPs: analytic (`perf.flops`), the MFU convention;
- the roofline: executed FLOPs and HBM bytes per device, analytic (`perf.roofline`), against
  the chip's published peaks;
- the compiler's FLOPs and estimated step time: XLA's cost analysis counts a loop body once
  (the layer scan, the micro-batch scan, the decode loop), so they come from two small
  compiles of one micro-batch's step (one decode step) with 1 and 2 unrolled layers,
  extrapolated linearly to the full depth and multiplied by the number of micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.model import ModelConfig, Transformer
from coa_jax.perf import flops, roofline
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
  roofline: roofline.Roofline
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

  @property
  def projected_mfu(self) -> float:
    """Model FLOPs per device over what the chip could do in the roofline time."""
    return self.roofline.mfu(self.model_flops / self.num_devices)

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
        f"roofline per device: {self.roofline.flops:.3e} FLOPs executed, "
        f"{self.roofline.hbm_bytes:.3e} HBM bytes -> {self.roofline.seconds * 1e3:.1f} ms "
        f"({self.roofline.bound}-bound) -> projected MFU {self.projected_mfu:.1%}",
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
  """Returns the compiler's (FLOPs, estimated seconds); seconds are NaN where it has none
  (it answers -1 for some small programs)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  seconds = float(cost.get("optimal_seconds", -1.0))
  return float(cost.get("flops", 0.0)), seconds if seconds > 0 else float("nan")


def _to_depth(one: float, two: float, layers: int) -> float:
  """Extrapolates a cost of 1- and 2-layer compiles linearly to `layers` layers."""
  return one + (layers - 1) * (two - one)


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
  devices_per_chip = len(devices) / hardware.chips_in_topology(topology)
  chip = hardware.chip_for(devices[0].device_kind)
  peak_flops = chip.peak_bf16_flops / devices_per_chip
  return AotReport(
      model=name, topology=topology, device_kind=devices[0].device_kind,
      num_devices=len(devices), mesh=dict(mesh.shape), batch_size=batch_size, seq_len=seq_len,
      num_params=config.num_params(), compile_seconds=seconds,
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
      hbm_bytes=int(chip.hbm_bytes / devices_per_chip),
      model_flops=flops.train_flops(config, batch_size, seq_len),
      compiler_flops=_to_depth(f1, f2, config.num_layers),
      compiler_seconds=_to_depth(t1, t2, config.num_layers),
      peak_flops=peak_flops,
      roofline=roofline.train_roofline(config, batch_size, seq_len, dict(mesh.shape),
                                       micro_batches, peak_flops,
                                       chip.hbm_bytes_per_s / devices_per_chip),
      step="DAPO update step (fwd + bwd + AdamW)" if loss_config else AotReport.step)


@dataclasses.dataclass
class DecodeReport:
  """What ahead-of-time compiles of one host's rollout programs found (bytes per device): the
  decode chunk, and prefill and extend at their largest buckets."""

  model: str
  topology: str
  device_kind: str
  host_devices: int
  mesh: dict[str, int]
  rows: int  # decode rows on one host
  cache_size: int
  chunk: int
  prefill: tuple[int, int]  # (prompts, tokens) of the largest prefill call
  extend: tuple[int, int]  # (rows, tokens) of the largest extend call
  compile_seconds: float
  argument_bytes: int  # of the decode chunk: weights, cache and row state
  temp_bytes: dict[str, int]  # temporaries of each program
  cache_copies: int  # copies of at least one layer's K or V cache in the three programs
  hbm_bytes: int
  param_bytes: int  # per device
  cache_bytes: int  # per device
  step_flops: float  # analytic, one token for every row, all host devices, full cache
  roofline: roofline.Roofline  # one decode step, at a full cache
  compiler_seconds: float  # the compiler's estimate of one decode step (1/2-layer compiles)

  @property
  def peak_bytes(self) -> int:
    """Arguments plus the largest program's temporaries (outputs alias the donated state)."""
    return self.argument_bytes + max(self.temp_bytes.values())

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  @property
  def step_seconds(self) -> float:
    """Projected time of one token for every row: the roofline."""
    return self.roofline.seconds

  def format(self) -> str:
    gib = lambda b: f"{b / hardware.GIB:.2f} GiB"
    temps = ", ".join(f"{name} {gib(b)}" for name, b in self.temp_bytes.items())
    return "\n".join([
        f"model {self.model}, rollout on one host: {self.rows} rows, KV cache "
        f"{self.cache_size} tokens; decode chunk of {self.chunk} steps, prefill of "
        f"{self.prefill[0]} x {self.prefill[1]} tokens, extend of {self.extend[0]} x "
        f"{self.extend[1]} tokens",
        f"topology {self.topology}: {self.host_devices} x {self.device_kind} per host, mesh "
        f"{self.mesh}, compiled in {self.compile_seconds:.1f}s",
        f"memory per device (compiler): arguments {gib(self.argument_bytes)} (params "
        f"{gib(self.param_bytes)}, KV cache {gib(self.cache_bytes)}), temporaries {temps} "
        f"-> peak {gib(self.peak_bytes)} of {gib(self.hbm_bytes)} HBM: "
        f"{'FITS' if self.fits else 'DOES NOT FIT'}; copies of a layer's KV cache: "
        f"{self.cache_copies}",
        f"roofline of a decode step at a full cache, per device: {self.roofline.flops:.3e} "
        f"FLOPs, {self.roofline.hbm_bytes:.3e} HBM bytes -> {self.step_seconds * 1e3:.1f} ms "
        f"({self.roofline.bound}-bound), {self.rows / self.step_seconds:,.0f} tokens/s per host",
        f"compiler's estimated decode step (extrapolated from 1/2-layer compiles): "
        f"{self.compiler_seconds * 1e3:.1f} ms, {self.rows / self.compiler_seconds:,.0f} "
        f"tokens/s per host"])


def _cache_copies(compiled, slots: int, nbytes: int) -> int:
  """Returns how many copy instructions of the optimized HLO produce an array of >= `nbytes`
  bytes with a dimension of `slots` (a layer's K or V cache, or more of it; the weights' layout
  copies at a loop's entry have no such dimension)."""
  count = 0
  for match in re.finditer(r"= \(?[a-z]+(\d*)\[([\d,]*)\][^\n]*? copy(?:-start)?\(",
                           compiled.as_text()):
    bits, dims = match.groups()  # bf16[2,4]: 16 bits; pred: 8
    shape = [int(d) for d in dims.split(",") if d]
    count += slots in shape and math.prod(shape) * int(bits or 8) // 8 >= nbytes
  return count


def decode_report(name: str, config: ModelConfig, topology: str, tensor: int, rows: int,
                  cache_size: int, chunk: int, prefill: tuple[int, int],
                  extend: tuple[int, int]) -> DecodeReport:
  """Compiles the rollout's programs as one host of `topology` runs them (its devices on the
  decode mesh with `tensor`, `rows` rows): the decode chunk, prefill of (prompts, tokens) and
  extend of (rows, tokens), and returns what the compiler found."""
  devices = topology_devices(topology)
  local = [d for d in devices if d.process_index == devices[0].process_index]
  mesh = sharding.decode_mesh(local, tensor)

  def compile_(model_config, program):
    sampler = Sampler(model_config, mesh, batch_size=rows, cache_size=cache_size, chunk=chunk,
                      stop_ids=(0,), sampling=SamplingConfig(temperature=1.0))
    # The sampler holds its weights in the compute dtype (Sampler.sampling_params).
    params = state_lib.abstract_placed_params(
        Transformer(model_config.replace(param_dtype=model_config.dtype)), mesh)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    (p, t), (r, e) = prefill, extend
    args = {"decode": (sampler.decode_chunk, jax.eval_shape(lambda: jax.random.key(0))),
            "prefill": (sampler.prefill, ints(p, rows // p), ints(p, t), ints(p), ints(p),
                        ints(p, rows // p)),
            "extend": (sampler.extend, ints(r), ints(r, e), ints(r))}[program]
    try:
      compiled = args[0].lower(params, sampler.abstract_state(), *args[1:]).compile()
    except jax.errors.JaxRuntimeError as e:  # the compiler refuses a program that cannot fit
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise ValueError(f"the rollout's {program} program does not fit one device's HBM: "
                       f"{str(e).splitlines()[0]}") from None
    return compiled, sampler, params

  start = time.perf_counter()
  compiled = {program: compile_(config, program) for program in ("decode", "prefill", "extend")}
  seconds = time.perf_counter() - start
  _, sampler, params = compiled["decode"]
  state = sampler.abstract_state()
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
  cache_bytes = nbytes((state.cache.k, state.cache.v)) // len(local)
  layer_kv = cache_bytes // (2 * config.num_layers)
  costs = [_cost(compile_(config.replace(num_layers=n, scan_unroll=n), "decode")[0])[1]
           for n in (1, 2)]
  chip = hardware.chip_for(local[0].device_kind)
  per_chip = len(devices) / hardware.chips_in_topology(topology)
  return DecodeReport(
      model=name, topology=topology, device_kind=local[0].device_kind,
      host_devices=len(local), mesh=dict(mesh.shape), rows=rows, cache_size=cache_size,
      chunk=chunk, prefill=prefill, extend=extend, compile_seconds=seconds,
      argument_bytes=compiled["decode"][0].memory_analysis().argument_size_in_bytes,
      temp_bytes={program: c.memory_analysis().temp_size_in_bytes
                  for program, (c, *_) in compiled.items()},
      cache_copies=sum(_cache_copies(c, cache_size, layer_kv) for c, *_ in compiled.values()),
      hbm_bytes=int(chip.hbm_bytes / per_chip), param_bytes=nbytes(params) // len(local),
      cache_bytes=cache_bytes, step_flops=flops.decode_flops(config, rows, cache_size),
      roofline=roofline.decode_roofline(config, rows, cache_size, dict(mesh.shape),
                                        chip.peak_bf16_flops / per_chip,
                                        chip.hbm_bytes_per_s / per_chip,
                                        state.cache.k.dtype.itemsize),
      compiler_seconds=_to_depth(*costs, config.num_layers))
