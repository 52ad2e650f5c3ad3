"""Ahead-of-time compilation of a training step (SFT, or a DAPO update when given a policy-loss
config; PPO's actor and critic updates) and of the rollout's programs for a TPU topology or
NVIDIA GPUs, on any host (CPU too).

Needs libtpu (the `tpu` extra) for TPUs; XLA:GPU's plugin and cuDNN (the `gpu-aot` extra) for
GPUs, described to the compiler by `gpu_targets/` (XLA:GPU gives no cost analysis there, so
GPU reports have no compiler estimate). The report combines four sources, each labelled:
- memory per device: the compiler's `memory_analysis()` of the real (scanned) step;
- model FLOPs: analytic (`perf.flops`), the MFU convention;
- the roofline: executed FLOPs and HBM bytes per device, analytic (`perf.roofline`), against
  the chip's published peaks;
- PPO: each update's peak adds the other model's train state, which stays in memory beside it
  (`resident_bytes`);
- the compiler's FLOPs and estimated step time: XLA's cost analysis counts a loop body once
  (the layer scan, the micro-batch scan, the decode loop), so they come from two small
  compiles of one micro-batch's step (one decode step) with 1 and 2 unrolled layers,
  extrapolated linearly to the full depth and multiplied by the number of micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.model import ModelConfig, Transformer, compiling_for
from coa_jax.perf import flops, roofline
from coa_jax.rl import critic as critic_lib
from coa_jax.rl import update as rl_update
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.runtime import hardware, sharding, xla_flags
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from coa_jax.train.optimizer import OptimizerSettings
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
  roofline: roofline.Roofline  # per device, with the chip's peaks
  step: str = "train step (fwd + bwd + AdamW)"
  resident_bytes: int = 0  # per device, held beside the step (PPO: the other model's state)
  # Of compiler_seconds: the splash attention kernels at the chip's peak FLOP/s. XLA costs a
  # Pallas (Mosaic) kernel only by the estimate the kernel declares, and splash declares none.
  kernel_seconds: float = 0.0

  @property
  def peak_bytes(self) -> int:
    """Per-device bytes live at the peak: arguments + outputs not aliased to them + temps, and
    what stays resident beside the step."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes +
            self.resident_bytes)

  @property
  def fits(self) -> bool:
    return self.peak_bytes <= self.hbm_bytes

  @property
  def peak_flops(self) -> float:
    """The device's dense bf16 peak FLOP/s."""
    return self.roofline.peak_flops

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
        f"{gib(self.temp_bytes)}, resident beside it {gib(self.resident_bytes)} -> peak "
        f"{gib(self.peak_bytes)} of {gib(self.hbm_bytes)} HBM: "
        f"{'FITS' if self.fits else 'DOES NOT FIT'}",
        f"model FLOPs per step (analytic: 6 x trained, 4 x frozen params x tokens + attention): "
        f"{self.model_flops:.3e} total, {self.model_flops / self.num_devices:.3e} per device",
        f"roofline per device: {self.roofline.flops:.3e} FLOPs executed, "
        f"{self.roofline.hbm_bytes:.3e} HBM bytes -> {self.roofline.seconds * 1e3:.1f} ms "
        f"({self.roofline.bound}-bound) -> projected MFU {self.projected_mfu:.1%}",
    ]
    if math.isnan(self.compiler_seconds):
      lines.append(f"compiler's estimate: none (XLA:GPU has no cost analysis without a device); "
                   f"peak {self.peak_flops / 1e12:.0f} TFLOP/s per device")
    else:
      lines += [
          f"compiler's FLOPs per device (XLA cost analysis, extrapolated from 1/2-layer "
          f"compiles): {self.compiler_flops:.3e}",
          f"compiler's estimated step time: {self.compiler_seconds * 1e3:.1f} ms"
          + (f" (of which the splash attention kernels at peak FLOP/s, which XLA cannot cost: "
             f"{self.kernel_seconds * 1e3:.1f} ms)" if self.kernel_seconds else "") +
          f" -> implied MFU "
          f"{self.implied_mfu:.1%} (peak {self.peak_flops / 1e12:.0f} TFLOP/s per device), "
          f"{tokens / self.compiler_seconds:,.0f} tokens/s"]
    return "\n".join(lines)


# NVIDIA GPUs that ahead-of-time compiles can target without one: XLA:GPU's target description
# of each (gpu_targets/, hardware facts), by the name a topology starts with.
GPU_TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}


def topology_devices(topology: str) -> list[Any]:
  """Returns the (abstract) devices of a TPU topology such as 'v5p:2x2x1', or of NVIDIA GPUs
  as 'h100:8' (one node of 8) or 'h100:2x8' (2 nodes of 8: a process each)."""
  from jax.experimental import topologies

  kind, _, shape = topology.partition(":")
  if kind in GPU_TARGETS:
    return _gpu_devices(kind, shape)
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except Exception as e:  # libtpu missing, a name it rejects, or its lock held
    if "lockfile" in str(e):
      raise ValueError(f"cannot describe TPU topology {topology!r}: another process on this "
                       f"machine has loaded libtpu. With no TPU attached, set "
                       f"ALLOW_MULTIPLE_LIBTPU_LOAD=1 to compile beside it: {e}") from None
    raise ValueError(f"cannot describe TPU topology {topology!r} (is the `tpu` extra, i.e. "
                     f"libtpu, installed?): {e}") from None


def _gpu_devices(kind: str, shape: str) -> list[Any]:
  from jax.experimental import topologies

  dims = shape.split("x")
  if not 1 <= len(dims) <= 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
    raise ValueError(f"GPU topology {kind}:{shape} is not of the form '{kind}:GPUS' or "
                     f"'{kind}:NODESxGPUS'")
  nodes, gpus = (1, dims[0]) if len(dims) == 1 else dims
  target = (resources.files("coa_jax.perf") / "gpu_targets" / GPU_TARGETS[kind]).read_text()
  try:
    return list(topologies.get_topology_desc(platform="cuda", target_config=target,
                                             topology=f"1x{nodes}x{gpus}").devices)
  except Exception as e:  # no XLA:GPU plugin, or it did not register (a CUDA check failed)
    raise ValueError(f"cannot describe GPU topology {kind}:{shape}: {e}. Ahead-of-time GPU "
                     f"compiles need the `gpu-aot` extra (`make pod-fit` installs it) and, on a "
                     f"machine without a GPU, JAX_PLATFORMS=cpu") from None


def compile_train_step(config: ModelConfig, optimizer_settings: OptimizerSettings,
                       devices: list[Any], mesh_config: sharding.MeshConfig, batch_size: int,
                       seq_len: int,
                       micro_batches: int = 1, loss_config: PolicyLossConfig | None = None,
                       critic: critic_lib.CriticConfig | None = None, flags: str = "",
                       for_cost: bool = False):
  """Returns (compiled step, mesh, compile seconds, other state's bytes per device) for
  `devices` without running it: the SFT train step; the DAPO update step when `loss_config` is
  given; with `critic` too, PPO's actor update, or its critic's update when `loss_config` is
  None. The last figure is, for PPO, the train state of the model the step does not update.
  `flags` names the XLA flag set the job runs with (`runtime.xla_flags`); `for_cost` compiles
  for XLA:TPU's cost analysis (`xla_flags.COUNTED_MATMULS`)."""
  mesh = sharding.make_mesh(mesh_config, devices=devices)
  sharding.check_model_fits_mesh(config, mesh)
  sharding.check_batch_fits_mesh(batch_size, micro_batches, mesh)
  actor, tx = Transformer(config), optimizer.make_optimizer(optimizer_settings)
  with compiling_for(devices[0].platform):
    states = {"actor": state_lib.abstract_state(actor, tx, mesh)}
    if critic is not None:
      value_model = Transformer(config, head="value")
      critic_tx = optimizer.make_optimizer(
          critic_lib.optimizer_settings(optimizer_settings, critic))
      states["critic"] = state_lib.abstract_state(value_model, critic_tx, mesh)
    batch = abstract_batch(TokenBatch if loss_config is None and critic is None else PolicyBatch,
                           batch_size, seq_len, sharding.batch_sharding(mesh),
                           ppo=critic is not None)
    start = time.perf_counter()
    updated = "actor"
    if critic is not None and loss_config is None:
      updated = "critic"
      step = step_lib.jit_state_step(
          lambda s, b: critic_lib.critic_step(value_model, critic_tx, s, b,
                                              cliprange_value=critic.cliprange_value,
                                              micro_batches=micro_batches),
          value_model, critic_tx, mesh)
    elif loss_config is None:
      step = step_lib.jit_train_step(actor, tx, mesh, micro_batches=micro_batches)
    else:
      step = rl_update.jit_dapo_step(actor, tx, mesh, loss_config=loss_config,
                                     micro_batches=micro_batches)
    options = xla_flags.compiler_options(flags)
    if for_cost and devices[0].platform == "tpu":
      options.update(xla_flags.COUNTED_MATMULS)
    compiled = step.lower(states[updated], batch).compile(compiler_options=options)
  # A LoRA critic's frozen base is the actor's body (the same arrays): resident beside the
  # updated state are the other's own arrays and whatever of the actor's base it lacks.
  frozen = {name: _bytes_per_device(s.frozen) for name, s in states.items()}
  other = sum(_bytes_per_device(s.checkpointed()) for name, s in states.items()
              if name != updated) + max(frozen.values()) - frozen[updated]
  return compiled, mesh, time.perf_counter() - start, other


def _cost(compiled) -> tuple[float, float]:
  """Returns the compiler's (FLOPs, estimated seconds); NaN where it has none (XLA:GPU gives
  no cost analysis to a compile without a device; XLA:TPU answers -1 seconds for some small
  programs)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  cost = cost or {}
  seconds = float(cost.get("optimal_seconds", -1.0))
  return float(cost.get("flops", "nan")), seconds if seconds > 0 else float("nan")


def _to_depth(one: float, two: float, layers: int) -> float:
  """Extrapolates a cost of 1- and 2-layer compiles linearly to `layers` layers."""
  return one + (layers - 1) * (two - one)


def aot_report(name: str, config: ModelConfig, optimizer_settings: OptimizerSettings,
               topology: str, mesh_config: sharding.MeshConfig, batch_size: int, seq_len: int,
               micro_batches: int = 1, loss_config: PolicyLossConfig | None = None,
               critic: critic_lib.CriticConfig | None = None, flags: str = "") -> AotReport:
  """Compiles the train step of `config` (the DAPO update with `loss_config`; PPO's actor or
  critic update with `critic`, see `compile_train_step`; with XLA flag set `flags`) for
  `topology` and returns what the compiler found."""
  devices = topology_devices(topology)
  compiled, mesh, seconds, resident = compile_train_step(
      config, optimizer_settings, devices, mesh_config, batch_size, seq_len, micro_batches,
      loss_config, critic, flags)
  head = "value" if critic is not None and loss_config is None else "lm"
  memory = compiled.memory_analysis()
  # Cost analysis counts a loop body once: layers are unrolled in these small compiles and
  # micro-batch accumulation is costed as one micro-batch times their number.
  per_layer_costs = []
  for layers in (1, 2):
    small = config.replace(num_layers=layers, scan_unroll=layers)
    flops_, seconds_ = _cost(compile_train_step(small, optimizer_settings, devices, mesh_config,
                                                batch_size // micro_batches, seq_len,
                                                loss_config=loss_config, critic=critic,
                                                flags=flags, for_cost=True)[0])
    per_layer_costs.append((flops_ * micro_batches, seconds_ * micro_batches))
  (f1, t1), (f2, t2) = per_layer_costs
  devices_per_chip = len(devices) / hardware.chips_in_topology(topology)
  chip = hardware.chip_for(devices[0].device_kind)
  peak_flops = chip.peak_bf16_flops / devices_per_chip
  kernels = (roofline.attention_kernel_seconds(config, batch_size, seq_len, len(devices),
                                               peak_flops)
             if config.attention_impl == "splash" else 0.0)
  return AotReport(
      model=name, topology=topology, device_kind=devices[0].device_kind,
      num_devices=len(devices), mesh=dict(mesh.shape), batch_size=batch_size, seq_len=seq_len,
      num_params=config.num_params(), compile_seconds=seconds,
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
      hbm_bytes=int(chip.hbm_bytes / devices_per_chip),
      model_flops=flops.train_flops(config, batch_size, seq_len, head),
      compiler_flops=_to_depth(f1, f2, config.num_layers),
      compiler_seconds=_to_depth(t1, t2, config.num_layers) + kernels, kernel_seconds=kernels,
      roofline=roofline.train_roofline(config, batch_size, seq_len, dict(mesh.shape),
                                       micro_batches, peak_flops,
                                       chip.hbm_bytes_per_s / devices_per_chip, head),
      step=_step_name(loss_config, critic), resident_bytes=resident)


def _step_name(loss_config: PolicyLossConfig | None,
               critic: critic_lib.CriticConfig | None) -> str:
  if critic is not None:
    return ("PPO actor update step (fwd + bwd + AdamW; the critic's state resident)"
            if loss_config else
            "PPO critic update step (value fwd + bwd + AdamW; the actor's state resident)")
  return "DAPO update step (fwd + bwd + AdamW)" if loss_config else AotReport.step


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
  roofline: roofline.Roofline  # one decode step, at a full cache
  compiler_seconds: float  # the compiler's estimate of one decode step (1/2-layer compiles)
  resident_bytes: int = 0  # per device: train states beside the rollout (synchronous RL)

  @property
  def peak_bytes(self) -> int:
    """Arguments plus the largest program's temporaries (outputs alias the donated state), and
    what stays resident beside the rollout."""
    return self.argument_bytes + max(self.temp_bytes.values()) + self.resident_bytes

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
        f"{gib(self.param_bytes)}, KV cache {gib(self.cache_bytes)}), temporaries {temps}, "
        f"train state resident beside it {gib(self.resident_bytes)} -> peak "
        f"{gib(self.peak_bytes)} of {gib(self.hbm_bytes)} HBM: "
        f"{'FITS' if self.fits else 'DOES NOT FIT'}; copies of a layer's KV cache: "
        f"{self.cache_copies}",
        f"roofline of a decode step at a full cache, per device: {self.roofline.flops:.3e} "
        f"FLOPs, {self.roofline.hbm_bytes:.3e} HBM bytes -> {self.step_seconds * 1e3:.1f} ms "
        f"({self.roofline.bound}-bound), {self.rows / self.step_seconds:,.0f} tokens/s per host",
        "compiler's estimated decode step: none (XLA:GPU has no cost analysis without a "
        "device)" if math.isnan(self.compiler_seconds) else
        f"compiler's estimated decode step (extrapolated from 1/2-layer compiles): "
        f"{self.compiler_seconds * 1e3:.1f} ms, {self.rows / self.compiler_seconds:,.0f} "
        f"tokens/s per host"])


def _bytes_per_device(tree: Any) -> int:
  """Returns the bytes one device holds of a tree of sharded ShapeDtypeStructs."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree_util.tree_leaves(tree))


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


def _compile_rollout_program(config: ModelConfig, mesh, rows: int, cache_size: int, chunk: int,
                             prefill: tuple[int, int], extend: tuple[int, int], program: str):
  """Returns (compiled program, its sampler, abstract sampling params) of one rollout program
  ("decode", "prefill" or "extend") on `mesh`."""
  sampler = Sampler(config, mesh, batch_size=rows, cache_size=cache_size, chunk=chunk,
                    stop_ids=(0,), sampling=SamplingConfig(temperature=1.0))
  # The sampler holds its weights in the compute dtype, on GPUs one array per layer
  # (Sampler.sampling_params).
  params = sampler.layer_params(state_lib.abstract_placed_params(
      Transformer(config.replace(param_dtype=config.dtype)), mesh))
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


def decode_report(name: str, config: ModelConfig, topology: str, tensor: int, rows: int,
                  cache_size: int, chunk: int, prefill: tuple[int, int],
                  extend: tuple[int, int], resident_bytes: int = 0) -> DecodeReport:
  """Compiles the rollout's programs as one host of `topology` runs them (its devices on the
  decode mesh with `tensor`, `rows` rows): the decode chunk, prefill of (prompts, tokens) and
  extend of (rows, tokens), and returns what the compiler found; `resident_bytes` per device
  stay beside it (the train states, when rollouts and updates share the devices)."""
  devices = topology_devices(topology)
  local = [d for d in devices if d.process_index == devices[0].process_index]
  mesh = sharding.decode_mesh(local, tensor)

  compile_ = functools.partial(_compile_rollout_program, mesh=mesh, rows=rows,
                               cache_size=cache_size, chunk=chunk, prefill=prefill,
                               extend=extend)

  with compiling_for(mesh.devices.flat[0].platform):
    start = time.perf_counter()
    compiled = {program: compile_(config, program=program)
                for program in ("decode", "prefill", "extend")}
    seconds = time.perf_counter() - start
    costs = [_cost(compile_(config.replace(num_layers=n, scan_unroll=n), program="decode")[0])[1]
             for n in (1, 2)]
  _, sampler, params = compiled["decode"]
  state = sampler.abstract_state()
  cache_bytes = _bytes_per_device((state.cache.k, state.cache.v))
  layer_kv = cache_bytes // (2 * config.num_layers)
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
      hbm_bytes=int(chip.hbm_bytes / per_chip), param_bytes=_bytes_per_device(params),
      cache_bytes=cache_bytes,
      roofline=roofline.decode_roofline(config, rows, cache_size, dict(mesh.shape),
                                        chip.peak_bf16_flops / per_chip,
                                        chip.hbm_bytes_per_s / per_chip,
                                        state.cache.k.dtype.itemsize),
      compiler_seconds=_to_depth(*costs, config.num_layers), resident_bytes=resident_bytes)


def train_state_bytes(config: ModelConfig, optimizer_settings: OptimizerSettings,
                      topology: str, mesh_config: sharding.MeshConfig,
                      critic: critic_lib.CriticConfig | None = None) -> int:
  """Returns the bytes per device of the actor's train state on `topology`'s mesh, and with
  `critic` the critic's beside it (a LoRA critic's frozen base is the actor's)."""
  devices = topology_devices(topology)
  mesh = sharding.make_mesh(mesh_config, devices=devices)
  with compiling_for(devices[0].platform):
    total = _bytes_per_device(state_lib.abstract_state(
        Transformer(config), optimizer.make_optimizer(optimizer_settings), mesh))
    if critic is not None:
      critic_tx = optimizer.make_optimizer(
          critic_lib.optimizer_settings(optimizer_settings, critic))
      total += _bytes_per_device(state_lib.abstract_state(
          Transformer(config, head="value"), critic_tx, mesh).checkpointed())
  return total


def report_json(report: AotReport | DecodeReport) -> dict[str, Any]:
  """Returns a report's fields and derived figures as JSON-ready values."""
  derived = ["peak_bytes", "fits"] + (["implied_mfu", "projected_mfu"]
                                      if isinstance(report, AotReport) else ["step_seconds"])
  out = dataclasses.asdict(report)
  out.update({name: getattr(report, name) for name in derived})
  out["roofline"].update(seconds=report.roofline.seconds, bound=report.roofline.bound)
  return out
