"""Per-kernel table of a benchmark's step: the share of the step each op or fusion takes.

  python experiments/profile_step.py --target=train_tiny            # trace a run here
  python experiments/profile_step.py --target=train_1p5b --topology=h100:1   # ahead of time
  python experiments/profile_step.py --target=sft_7b                # its config's v5p:2x2x2

Targets: train_1p5b (the 1.5B GPU bench's train step, batch 2 x 2048), decode_b16 (its decode
chunk at batch 16), sft_7b (configs/sft_qwen2_5_7b.py's train step), train_tiny and
decode_tiny (the CPU bench's tiny model). A decode chunk starts with its rows' caches filled to
--filled slots (default: the bench's first round, its prompt) and reads the window of cache
slots that its rows can fill (`Sampler.window_for`). Without --topology the step runs on this machine's
devices under jax.profiler.trace and the table holds each op's measured time (on a GPU or TPU
from the device's ops, on a CPU from XLA:CPU's per-op events); with it the step is compiled
ahead of time for that TPU topology or GPU and the table holds each op's FLOPs, bytes and
roofline time from the optimized HLO (loop bodies counted once per trip). Writes
<output_dir>/<target>_<where>.md and .json.
"""

import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from coa_jax.model import Transformer, build_config, compiling_for
from coa_jax.perf import aot, flops, op_profile, pod_fit
from coa_jax.rollout.sampler import Sampler, SamplingConfig, bucket, window_for
from coa_jax.runtime import hardware, sharding
from coa_jax.runtime.settings import build
from coa_jax.sft.settings import sft_settings
from coa_jax.train import optimizer
from coa_jax.train.optimizer import OptimizerSettings
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from configs import bench_model, bench_model_gpu, sft_qwen2_5_7b

_TARGET = flags.DEFINE_enum("target", "train_tiny", ["train_1p5b", "decode_b16", "sft_7b",
                                                     "train_tiny", "decode_tiny"],
                            "which step to profile")
_TOPOLOGY = flags.DEFINE_string("topology", None, "compile ahead of time for this TPU topology "
                                "or GPU (v5p:2x2x2, h100:1); default: trace a run here (sft_7b: "
                                "its config's topology)")
_STEPS = flags.DEFINE_integer("steps", 3, "traced steps (decode: chunks)")
_TOP = flags.DEFINE_integer("top", 20, "rows before the rest is summed")
_OUTPUT = flags.DEFINE_string("output_dir", "runs/profiles", "where the tables go")
_FILLED = flags.DEFINE_integer("filled", -1, "decode: the rows' filled cache slots at the "
                               "chunk's start (-1: the bench's prompt, less its pending token)")
_CACHE = flags.DEFINE_integer("cache_size", 0, "decode: KV cache slots (0: the bucket that fits "
                              "the bench's prompt, rounds and observations)")
_SUFFIX = flags.DEFINE_string("suffix", "", "appended to the tables' file names")
_SET = flags.DEFINE_list("set", [], "model config overrides, e.g. remat=minimal,scan_unroll=28")
_MICRO = flags.DEFINE_integer("micro_batches", 0, "train: micro-batches (0: the target's own)")
_XLA_FLAGS = flags.DEFINE_string("xla_flags", "", "ahead of time: compile with this XLA flag "
                                 "set (coa_jax/runtime/xla_flags.py: tpu, gpu)")


def with_overrides(spec: dict) -> dict:
  """Returns a target's spec with the --set model overrides and --micro_batches applied."""
  def value(text: str):
    return int(text) if text.lstrip("-").isdigit() else text
  overrides = dict(item.split("=", 1) for item in _SET.value)
  spec = dict(spec, model=spec["model"].replace(**{k: value(v) for k, v in overrides.items()}))
  if _MICRO.value:
    spec["micro"] = _MICRO.value
  return spec


def target_spec(name: str) -> dict:
  """Returns a target's model config, shapes, mesh and how to read it."""
  gpu, cpu = bench_model_gpu.get_config(), bench_model.get_config()
  if name == "sft_7b":
    c = sft_settings(sft_qwen2_5_7b.get_config())
    return dict(kind="train", model=pod_fit.with_tag_rows(c.model.fresh_config()),
                opt=c.optimizer, mesh=c.mesh, batch=c.batch_size, seq=c.seq_len,
                micro=c.train.micro_batches, topology=c.topology)
  config = gpu if name.endswith(("1p5b", "b16")) else cpu
  spec = config.models["qwen2_5_1_5b" if config is gpu else "tiny"]
  if name.startswith("train"):
    return dict(kind="train", model=build_config(spec),
                opt=build(OptimizerSettings, cpu.optimizer, "optimizer"),
                mesh=sharding.MeshConfig(1, 1, 1), batch=config.batch_size,
                seq=config.seq_len, micro=1, topology=None)
  work = dict(config.decode)  # the bench's decode: cache for its prompt, rounds, observations
  length = work["prompt_len"] + work["rounds"] * work["new_tokens"] + (
      work["rounds"] - 1) * work["observation_len"]
  filled = work["prompt_len"] - 1 if _FILLED.value < 0 else _FILLED.value
  return dict(kind="decode", model=build_config(dict(spec, attention_impl="xla")), rows=16,
              cache=_CACHE.value or bucket(length + 1), chunk=work["new_tokens"],
              prompt=filled + 1, topology=None)


def header_lines(spec: dict, where: str) -> list[str]:
  """Returns the table's description: model, shapes, where it ran or was compiled."""
  model = spec["model"]
  shape = (f"train step (fwd + bwd + AdamW), batch {spec['batch']} x {spec['seq']}, "
           f"{spec['micro']} micro-batch(es), remat {model.remat}" if spec["kind"] == "train"
           else f"decode chunk of {spec['chunk']} tokens at batch {spec['rows']}, KV cache "
                f"{spec['cache']} slots, every row filled to {spec['prompt'] - 1} slots at the "
                f"chunk's start: the chunk reads the window of {decode_window(spec)} slots")
  return [f"model: {model.num_params() / 1e9:.2f}B params ({model.num_layers} layers x "
          f"{model.hidden_size}), {model.dtype} compute, attention {model.attention_impl}",
          f"step: {shape}", f"where: {where}"]


def analytic_line(spec: dict, devices: int) -> str:
  """Returns the analytic model FLOPs per device of the step, for comparison with the table's."""
  model = spec["model"]
  if spec["kind"] == "train":
    total = flops.train_flops(model, spec["batch"], spec["seq"])
    remat = " (x 4/3 with full remat's recomputed forward)" if model.remat == "full" else ""
    return (f"analytic model FLOPs per device (6 x params x tokens + attention): "
            f"{total / devices:.3e}{remat}")
  return (f"analytic matmul FLOPs per device of the chunk (2 x params x rows x tokens, "
          f"attention excluded): {2 * model.num_params() * spec['rows'] * spec['chunk'] / devices:.3e}")


def decode_sampler(spec: dict, mesh, sampling: SamplingConfig, stop_ids=()) -> Sampler:
  """Returns the sampler of a decode target."""
  return Sampler(spec["model"], mesh, batch_size=spec["rows"], cache_size=spec["cache"],
                 chunk=spec["chunk"], stop_ids=stop_ids, sampling=sampling)


def decode_window(spec: dict) -> int:
  """Returns the cache slots a decode target's chunk reads (`Sampler.window_for`)."""
  return window_for(spec["prompt"] - 1, spec["chunk"], spec["cache"])


def compile_target(spec: dict, devices: list):
  """Returns the compiled step of a target for `devices` (ahead of time when abstract): a
  decode chunk as the sampler runs it, its weights in the compute dtype (on GPUs one array per
  layer), reading its window of the cache."""
  if spec["kind"] == "train":
    # Without windowed einsums on TPU (`xla_flags.COUNTED_MATMULS`): their loops have no trip
    # count in the HLO, so the table could not count their matmuls.
    return aot.compile_train_step(spec["model"], spec["opt"], devices, spec["mesh"],
                                  spec["batch"], spec["seq"], spec["micro"],
                                  flags=_XLA_FLAGS.value, for_cost=True)[0]
  mesh = sharding.decode_mesh(devices[:1], 1)
  # As the rollout programs' ahead-of-time compiles (`aot.decode_report`): sampling at
  # temperature 1, one stop token.
  sampler = decode_sampler(spec, mesh, SamplingConfig(temperature=1.0), stop_ids=(0,))
  config = spec["model"]
  params = sampler.layer_params(state_lib.abstract_placed_params(
      Transformer(config.replace(param_dtype=config.dtype)), mesh))
  key = jax.eval_shape(lambda: jax.random.key(0))
  return sampler.decode_chunk.lower(params, sampler.abstract_state(), key,
                                    window=decode_window(spec)).compile()


def profile_ahead_of_time(spec: dict, topology: str) -> tuple[list[str], list, dict]:
  """Compiles a target for `topology` and returns (header, table rows, extra JSON)."""
  devices = aot.topology_devices(topology)
  if spec["kind"] == "train" and spec["mesh"] == sharding.MeshConfig(1, 1, 1):
    devices = devices[:1]
  start = time.perf_counter()
  with compiling_for(devices[0].platform):
    compiled = compile_target(spec, devices)
  seconds = time.perf_counter() - start
  chip = hardware.chip_for(devices[0].device_kind)
  per_chip = len(devices) / hardware.chips_in_topology(topology) if ":" in topology else 1
  # The decode loop can stop early (every row done): its HLO has no trip count; a full chunk.
  ops, notes = op_profile.hlo_ops(compiled.as_text(), chip.peak_bf16_flops / per_chip,
                                  chip.hbm_bytes_per_s / per_chip, spec.get("chunk", 1))
  program_devices = len(devices) if spec["kind"] == "train" else 1
  xla = aot._cost(compiled)[0]
  header = header_lines(spec, f"compiled ahead of time for {topology} ({devices[0].device_kind}"
                        f", {program_devices} device(s)) on this CPU in {seconds:.0f} s, "
                        f"JAX {jax.__version__}, XLA flags {_XLA_FLAGS.value or 'default'}, "
                        f"{spec['model'].scan_unroll} layer(s) per scan step; figures per "
                        f"device")
  header += [
      f"table's totals: {sum(o.flops for o in ops):.3e} matmul FLOPs, {sum(o.bytes for o in ops):.3e}"
      f" bytes, {sum(o.seconds for o in ops) * 1e3:.2f} ms at {chip.name}'s peaks "
      f"({chip.peak_bf16_flops / per_chip / 1e12:.0f} TFLOP/s, "
      f"{chip.hbm_bytes_per_s / per_chip / 1e9:.0f} GB/s), ops one after another",
      analytic_line(spec, program_devices),
      "XLA's cost analysis (counts each loop body once): " +
      ("none (XLA:GPU gives none without a device)" if np.isnan(xla) else f"{xla:.3e} FLOPs"),
      "time = max(FLOPs / peak, bytes / HBM bandwidth) per op; share = of the summed times"]
  header += [f"note: {n}" for n in notes]
  rows = op_profile.kernel_table(op_profile.group_ops(ops), _TOP.value)
  return header, rows, dict(topology=topology, device_kind=devices[0].device_kind,
                            compile_seconds=seconds, xla_flops=xla, notes=notes)


def run_target(spec: dict):
  """Returns (a function running one step here and returning its seconds, the step's
  compiled HLO text)."""
  devices = jax.devices()
  if spec["kind"] == "train":
    mesh = sharding.make_mesh(spec["mesh"], devices=devices[:max(1, spec["mesh"].fsdp)])
    model, tx = Transformer(spec["model"]), optimizer.make_optimizer(spec["opt"])
    state = [state_lib.init_state(model, tx, mesh, jax.random.key(0))]
    tokens = np.random.default_rng(0).integers(0, spec["model"].vocab_size,
                                               (spec["batch"], spec["seq"] + 1))
    batch = sharding.shard_batch(step_lib.next_token_batch(tokens), mesh)
    step = step_lib.jit_train_step(model, tx, mesh, micro_batches=spec["micro"])
    text = step.lower(state[0], batch).compile().as_text()

    def run():
      start = time.perf_counter()
      state[0], metrics = step(state[0], batch)
      metrics["loss"].block_until_ready()
      return time.perf_counter() - start
    return run, text
  return _decode_runner(spec, devices)


def _decode_runner(spec: dict, devices: list):
  """Returns (prefill a fresh prompt, then time one full decode chunk; its HLO text)."""
  mesh = sharding.decode_mesh(devices[:1], 1)
  sampler = decode_sampler(spec, mesh, SamplingConfig(temperature=0.0))
  params = sampler.sampling_params(sharding.init_params(Transformer(spec["model"]), mesh,
                                                        jax.random.key(0)))
  prompts = np.random.default_rng(0).integers(0, spec["model"].vocab_size,
                                              (spec["rows"], spec["prompt"]))
  groups = [([row], list(p)) for row, p in enumerate(prompts)]
  budgets = [spec["cache"] - 1] * spec["rows"]
  key = jax.random.key(0)
  window = decode_window(spec)
  text = sampler.decode_chunk.lower(params, sampler.abstract_state(), key,
                                    window=window).compile().as_text()

  def run():  # a fresh prompt each time (its prefill is another module), then one full chunk
    state = sampler.prefill_groups(params, sampler.init_state(), groups, budgets)
    jax.block_until_ready(state)
    start = time.perf_counter()
    _, chunk = sampler.decode_chunk(params, state, key, window=window)
    chunk.tokens_BxK.block_until_ready()
    return time.perf_counter() - start
  return run, text


def profile_run(spec: dict, steps: int) -> tuple[list[str], list, dict]:
  """Runs a target here, traces `steps` steps and returns (header, table rows, extra JSON)."""
  run, text = run_target(spec)
  run()  # compiled and warm before the trace
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      wall = sum(run() for _ in range(steps)) / steps
    module = text.split(",")[0].split()[-1]
    measured, plane = op_profile.trace_ops(op_profile.xplane_path(log_dir), module)
  ops = op_profile.join_hlo(measured, text, steps)
  device = jax.devices()[0]
  summed = sum(o.seconds for o in ops)
  header = header_lines(spec, f"run on {device.device_kind} ({device.platform}), JAX "
                        f"{jax.__version__}, {steps} steps traced with jax.profiler")
  header += [
      f"wall time per step {wall * 1e3:.2f} ms (under the profiler); the ops' summed time "
      f"{summed * 1e3:.2f} ms ({summed / wall:.0%} of it: on a CPU ops of one step run on "
      f"several threads at once, on a device the gaps are idle time)",
      f"ops from the trace's {plane!r} plane, module {module}; time per step = the op's "
      f"summed time / {steps}, less the ops nested in it (a loop's body); share = of the "
      f"summed op time", "FLOPs and bytes per step: the same op of the compiled HLO"]
  rows = op_profile.kernel_table(op_profile.group_ops(ops), _TOP.value)
  return header, rows, dict(device_kind=device.device_kind, plane=plane, module=module,
                            wall_seconds=wall, op_seconds=summed, steps=steps)


def main(argv):
  del argv
  spec = with_overrides(target_spec(_TARGET.value))
  topology = _TOPOLOGY.value or spec["topology"]
  if topology:
    header, rows, extra = profile_ahead_of_time(spec, topology)
    where, measured = topology.replace(":", "_"), False
  else:
    header, rows, extra = profile_run(spec, _STEPS.value)
    where, measured = jax.devices()[0].platform, True
  stem = os.path.join(_OUTPUT.value, f"{_TARGET.value}_{where}{_SUFFIX.value}")
  title = f"{_TARGET.value}: per-op profile ({'measured' if measured else 'compiler estimate'})"
  op_profile.write_tables(stem, title, header, rows, measured, extra)
  print(open(stem + ".md").read())
  print(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
  app.run(main)
