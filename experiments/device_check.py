"""Every GPU figure in one call on a lent GPU: decode against HF `generate` and the HBM
roofline, the 1.5B train steps against HF transformers and PEFT, serving at 16, 64 and 128
concurrent sessions, the 7B LoRA preset's step and memory, and the per-kernel profiles traced on
the GPU, in one table against the targets
(docs/benchmarks.md#the-prepared-gpu-check-make-device-check).

Here, once: the packages the device machine lacks (ml_collections, grain and two of grain's),
as wheels at the lock's versions in .whl/ (git ignores it):

  make device-check ARGS=--fetch_wheels

There (one H100 or H200, its own python3 with JAX, PyTorch, transformers and peft; no
network), through the device tool, about 9 minutes, then the rest on the same warm machine
(a 15-minute lease: about 30 s to start, 570 s, then what is left less 30 s):

  run(command="python3 experiments/device_check.py --output_dir=$OUT", carry=[".whl"],
      timeout_s=570)
  run(command="python3 experiments/device_check.py --output_dir=$OUT --budget_s=240 "
      "--only=<the steps the first call skipped>", carry=[".whl"], timeout_s=270)

On this CPU, the same orchestration on tiny shapes (runs/device_check/):

  make device-check ARGS=--smoke

Each step runs in a process of its own (JAX keeps the GPU memory it allocated, which the next
step's PyTorch side needs), with the repository root and the installed wheels on PYTHONPATH
and a compilation cache of its own, under its own time limit: its share, or what is left of
--budget_s. A step that no longer fits, fails or runs out of time is a row saying so,
with its log's tail. The steps, in order of value (--only picks some):
  env                 the imports and the devices each framework sees
  ceilings            experiments/gpu_ceilings.py: copy bandwidth, bf16 matmul rate and the
                      1.5B's decode GEMMs (weights in separate or stacked arrays), in JAX
  decode_b16          experiments/bench_rollout.py at batch 16: tokens/s, of the HBM roofline,
                      against HF generate
  profile_decode_b16  experiments/profile_step.py, traced here: its per-kernel table
  decode_b16_graphs   decode_b16's coa-jax side with the decode loop as CUDA graphs (XLA's
                      command buffers for while loops and conditionals too)
  train_1p5b          experiments/bench_model.py: the 1.5B train step's MFU against HF
                      transformers
  decode_b128         decode_b16's bench at batch 128
  sft_7b_lora         experiments/device_fit.py: the 7B LoRA preset's step, MFU and memory
  train_1p5b_lora     train_1p5b's bench on its LoRA step, against PEFT
  serve_1p5b          experiments/bench_serve.py: 16, 64 and 128 concurrent sessions of the
                      official openai client against the roofline, HF generate and the
                      offline sampler
  profile_train_1p5b  the train step's per-kernel table
Writes at most 7 files into --output_dir, none in a sub-folder (the device tool brings back 8
of 16 MiB): device_check.json (every step's status and figures), device_check.md (the
table), device_check.log (every step's output) and the two profiles' tables (.md and .json).
"""

import dataclasses
import datetime
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported by every step but not installed on the device machine: carried there as wheels.
DEVICE_WHEELS = ("ml_collections", "grain", "array_record", "portpicker")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
            "orbax-checkpoint", "torch", "transformers", "peft", "numpy", *DEVICE_WHEELS)
OUTPUT_FILES = 8  # what the device tool brings back from $OUT: 8 files of 16 MiB at most
LOG_BYTES = 15 << 20

_OUTPUT = flags.DEFINE_string("output_dir", "runs/device_check", "where the files go ($OUT)")
_BUDGET = flags.DEFINE_float("budget_s", 540, "seconds for all the steps together")
_SMOKE = flags.DEFINE_bool("smoke", False, "the same steps on this CPU at tiny shapes")
_ONLY = flags.DEFINE_list("only", [], "run these steps only (default: all, in order of value)")
_WHEELS = flags.DEFINE_string("wheels", ".whl", "wheels to install where a package is missing")
_FETCH = flags.DEFINE_bool("fetch_wheels", False, "download the wheels into --wheels and stop")
_WHEEL_PYTHON = flags.DEFINE_string("wheel_python", "3.12", "the device's Python version")

# The env step: whether every step's imports work, and the devices JAX and PyTorch see.
_ENV_CHECK = """
import json, sys
import jax
import ml_collections, grain, peft, torch, transformers
from coa_jax.perf import bench
gpu = torch.cuda.is_available()
info = dict(jax_devices=[f"{d.platform}: {d.device_kind}" for d in jax.devices()],
            jax_runtime=jax.devices()[0].client.platform_version,  # CUDA's version on a GPU
            torch_device=bench.torch_device(),
            torch_gpu=torch.cuda.get_device_name(0) if gpu else None,
            torch_cuda=torch.version.cuda if gpu else None,
            torch_cudnn=torch.backends.cudnn.version() if gpu else None)
print(info)
with open(sys.argv[1], "w") as f:
  json.dump(info, f)
"""


@dataclasses.dataclass(frozen=True)
class Target:
  """The issue's bar for a row: each figure given here must be at least this."""
  of_roofline: float | None = None
  ratio: float | None = None
  mfu: float | None = None

  def text(self) -> str:
    """Returns the target in words ("-" for none)."""
    parts = [f">= {self.of_roofline:.0%} of the HBM roofline" if self.of_roofline else "",
             f">= {self.ratio:g}x the peer" if self.ratio else "",
             f">= {self.mfu:.0%} MFU" if self.mfu else ""]
    return ", ".join(p for p in parts if p) or "-"

  def met(self, values: dict) -> str:
    """Returns "yes", "no", "n/a" (a figure it needs is missing) or "-" (no target)."""
    bars = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
    if not bars:
      return "-"
    if any(values.get(k) is None for k in bars):
      return "n/a"
    return "yes" if all(values[k] >= v for k, v in bars.items()) else "no"


@dataclasses.dataclass(frozen=True)
class Step:
  """One command of the check and how its figures become a row."""
  name: str
  what: str
  kind: str  # how its JSON reads: env, decode, train, serve, preset or profile
  argv: tuple[str, ...]  # after the Python interpreter
  output: str  # the JSON the command writes
  share_s: float  # its time limit, when the budget has that much left
  min_s: float  # below this much budget left it is skipped
  target: Target = Target()
  peer: str = ""
  env: tuple[tuple[str, str], ...] = ()
  keep: tuple[str, ...] = ()  # its files copied into the output folder


# The order of value. On the H200 lent 2026-11-30 the 1.5B decode at batch 16 took 224 s (76 s
# of them the weights' init, before sharding.initializer rolled the layer loop) and timed out
# at the 170 s share it had, as did the steps after it: a 15-minute lease takes what fits of
# this list in a first call (--budget_s 540), then the rest in a second (--only).
ORDER = ("env", "ceilings", "decode_b16", "profile_decode_b16", "decode_b16_graphs",
         "train_1p5b", "decode_b128", "sft_7b_lora", "train_1p5b_lora", "serve_1p5b",
         "profile_train_1p5b")
# XLA's default command buffer types, and loops and conditionals ("+": added to the defaults).
GRAPHS_FLAGS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"


def plan(smoke: bool, scratch: str) -> list[Step]:
  """Returns the steps in order of value: on a GPU at the issue's shapes, or (smoke) the same
  scripts on this CPU at tiny shapes."""
  out = lambda name: os.path.join(scratch, f"{name}.json")
  if smoke:
    bench_config, model, lora = "configs/bench_model.py", "tiny", "qwen2_100m_lora"
    decode_flags = ["--config.decode.prompt_len=8", "--config.decode.new_tokens=8",
                    "--config.decode.rounds=2", "--config.decode.observation_len=4"]
    train_flags = ["--config.batch_size=2", "--config.seq_len=32", "--config.warmup_steps=1"]
    lora_flags = [f"--config.models.{lora}.{k}={v}" for k, v in dict(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
        vocab_size=1024, attention_block=32).items()]
    preset_flags = ["--steps=1", "--config.model.preset=tiny", "--config.batch_size=2",
                    "--config.seq_len=64", "--config.train.micro_batches=2",
                    "--config.model.attention_impl=xla"]
    profiles, profile_flags, where = ("decode_tiny", "train_tiny"), ["--steps=1"], "cpu"
  else:
    bench_config, model, lora = "configs/bench_model_gpu.py", "qwen2_5_1_5b", "qwen2_5_1_5b_lora"
    decode_flags, train_flags, lora_flags = [], [], []
    preset_flags = ["--steps=2"]
    profiles, profile_flags, where = ("decode_b16", "train_1p5b"), [], "gpu"
  steps = [Step("env", "environment: imports, devices", "env", ("-c", _ENV_CHECK, out("env")),
                out("env"), 90, 10)]
  steps.append(Step("ceilings", "what JAX reaches: copy, bf16 matmul, the 1.5B's decode GEMMs",
                    "ceilings", ("experiments/gpu_ceilings.py", f"--output={out('ceilings')}",
                                 *(["--smoke"] if smoke else [])), out("ceilings"), 90, 30))
  decode = lambda name, batch, *extra: (
      "experiments/bench_rollout.py", f"--config={bench_config}", f"--models={model}",
      f"--batches={batch}", "--skip_tools", "--skip_host_overhead", f"--output={out(name)}",
      *decode_flags, *extra)
  for batch, target in ((16, Target(of_roofline=0.6, ratio=3.0)), (128, Target(of_roofline=0.7))):
    steps.append(Step(
        f"decode_b{batch}", f"decode, batch {batch} ({model}, greedy, with extends)", "decode",
        decode(f"decode_b{batch}", batch), out(f"decode_b{batch}"), 230, 120, target,
        peer="HF generate"))
  # Whether the decode pays a fixed cost per kernel: its whole loop as CUDA graphs.
  steps.append(Step(
      "decode_b16_graphs", "decode_b16, coa-jax alone, with XLA's command buffers (CUDA "
      "graphs) for the decode loop too (while loops and conditionals)", "decode",
      decode("decode_b16_graphs", 16, "--skip_hf"), out("decode_b16_graphs"), 120, 60,
      Target(of_roofline=0.6), env=(("XLA_FLAGS", GRAPHS_FLAGS),)))
  for name, spec, extra, target, peer in (
      ("train_1p5b", model, train_flags, Target(mfu=0.45), "HF transformers"),
      ("train_1p5b_lora", lora, train_flags + lora_flags, Target(), "PEFT")):
    steps.append(Step(
        name, f"train step, {spec}", "train",
        ("experiments/bench_model.py", f"--config={bench_config}", f"--models={spec}",
         f"--output={out(name)}", *extra, *([f"--config.steps.{spec}=2"] if smoke else [])),
        out(name), 200, 120, target, peer=peer))
  serve = (["--preset=tiny", "--dtype=float32", "--sessions=2,4", "--max_tokens=8"] if smoke else
           [f"--preset={model}", "--dtype=bfloat16", "--sessions=16,64,128"])
  steps.append(Step(
      "serve_1p5b", f"serving: 16, 64 and 128 concurrent sessions of the openai client ({model})",
      "serve", ("experiments/bench_serve.py", *serve, "--peers", "--nosecond_turn",
                f"--out={out('serve_1p5b')}"), out("serve_1p5b"), 150, 60,
      peer="HF generate"))
  steps.append(Step(
      "sft_7b_lora", "7B LoRA SFT preset (sft_qwen2_5_7b_lora_gpu): step and memory", "preset",
      ("experiments/device_fit.py", "--config=configs/sft_qwen2_5_7b_lora_gpu.py",
       f"--output={out('sft_7b_lora')}", *preset_flags),
      out("sft_7b_lora"), 180, 90, Target(mfu=0.45),
      env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95"),)))
  for target, name in zip(profiles, ("profile_decode_b16", "profile_train_1p5b")):
    stem = os.path.join(scratch, "profiles", f"{target}_{where}")
    steps.append(Step(
        name, f"per-kernel profile, {target}, traced", "profile",
        ("experiments/profile_step.py", f"--target={target}",
         f"--output_dir={os.path.dirname(stem)}", *profile_flags),
        f"{stem}.json", 120, 60, keep=(f"{stem}.md", f"{stem}.json")))
  steps.sort(key=lambda s: ORDER.index(s.name))
  # A compilation cache per step: a program it compiles twice (ahead of time for its memory
  # or HLO, then to run) compiles once; none shared, so those figures come from fresh compiles.
  return [dataclasses.replace(s, env=s.env + (
      ("JAX_COMPILATION_CACHE_DIR", os.path.join(scratch, "xla_cache", s.name)),))
          for s in steps]


def run_step(step: Step, limit_s: float, log, env: dict) -> dict:
  """Runs a step's command in a process group of its own for at most `limit_s`, its output
  appended to `log`; returns its status (ok, failed, timeout), seconds, exit code, log tail
  and figures (its JSON)."""
  shown = [a if len(a) < 200 else "<script>" for a in step.argv]
  log.write(f"\n===== {step.name} (limit {limit_s:.0f} s): {' '.join(shown)}\n")
  log.flush()
  offset, start = log.tell(), time.monotonic()
  proc = subprocess.Popen([sys.executable, *step.argv], cwd=ROOT, env=step_variables(env, step),
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    rc = proc.wait(timeout=limit_s)
    status = "ok" if rc == 0 else "failed"
  except subprocess.TimeoutExpired:
    rc, status = None, "timeout"
  try:  # what it left running (compile workers) goes too: its GPU memory with it
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()
  seconds = time.monotonic() - start
  tail, figures = log_tail(log.name, offset), None
  if status == "ok":
    try:
      with open(step.output) as f:
        figures = json.load(f)
    except (OSError, ValueError) as e:
      status, tail = "failed", f"{tail}\n(exit 0 but no figures: {e})"
  return dict(name=step.name, status=status, seconds=seconds, limit_s=limit_s, rc=rc,
              tail=tail, figures=figures)


def step_variables(env: dict, step: Step) -> dict:
  """Returns `env` with the step's own variables: its XLA_FLAGS after the inherited ones (where
  both set a flag, the step's wins), the others in place of the inherited."""
  own = dict(step.env)
  merged = {**env, **own}
  if "XLA_FLAGS" in own and env.get("XLA_FLAGS"):
    merged["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {own['XLA_FLAGS']}"
  return merged


def log_tail(path: str, offset: int, lines: int = 25, width: int = 400) -> str:
  """Returns the last `lines` lines written to `path` after `offset`, each cut to `width`."""
  with open(path, "rb") as f:
    f.seek(offset)
    text = f.read().decode("utf-8", "replace")
  return "\n".join(line[:width] for line in text.rstrip().splitlines()[-lines:])


def run_steps(steps: list[Step], deadline: float, output_dir: str, env: dict, info: dict,
              run=run_step, clock=time.monotonic) -> list[dict]:
  """Runs the steps in order, each under min(its share, the time left before `deadline` on
  `clock`) and skipped when less than its minimum is left; rewrites the summary after each
  step (a call cut short still leaves the table so far). Returns each step's result."""
  results = []
  with open(os.path.join(output_dir, "device_check.log"), "w") as log:
    for step in steps:
      left = deadline - clock()
      if left <= 0 or left < step.min_s:
        result = dict(name=step.name, status="skipped: budget", seconds=0.0, limit_s=0.0,
                      rc=None, figures=None, tail=f"{max(left, 0):.0f} s of the budget left, "
                      f"the step needs at least {step.min_s:.0f} s")
      else:
        result = run(step, min(step.share_s, left), log, env)
      results.append(result)
      print(f"{step.name}: {result['status']} in {result['seconds']:.0f} s", flush=True)
      for path in step.keep if result["status"] == "ok" else ():
        shutil.copy(path, output_dir)
      write_summary(output_dir, info, steps, results)
  cap_file(os.path.join(output_dir, "device_check.log"), LOG_BYTES)
  return results


def row(step: Step, result: dict) -> dict:
  """Returns a step's row of the table: its figure, the peer's, their ratio, the target and
  whether it is met."""
  cells = dict(step=step.name, what=step.what, coa_jax="", peer="-", ratio="-",
               target=step.target.text(), met="-", status=result["status"],
               seconds=round(result["seconds"], 1))
  if result["status"] == "ok":
    try:
      values = _CELLS[step.kind](result["figures"], cells, step)
      cells["met"] = step.target.met(values)
    except (KeyError, IndexError, TypeError, ValueError) as e:
      cells.update(status="failed", coa_jax=f"figures unreadable: {e!r}")
  if cells["status"] != "ok":
    cells["coa_jax"] = cells["coa_jax"] or {
        "failed": f"failed (exit {result['rc']})", "timeout": f"timed out at "
        f"{result['limit_s']:.0f} s"}.get(result["status"], result["status"])
    cells["met"] = "not measured" if cells["target"] != "-" else "-"
  return cells


def _env_cells(figures: dict, cells: dict, step: Step) -> dict:
  torch_cuda = (f" (CUDA {figures['torch_cuda']}, cuDNN {figures['torch_cudnn']})"
                if figures.get("torch_cuda") else "")
  cells["coa_jax"] = (f"JAX: {', '.join(figures['jax_devices'])} "
                      f"({figures.get('jax_runtime', '?')}); PyTorch: "
                      f"{figures['torch_gpu'] or figures['torch_device']}{torch_cuda}")
  return {}


def _ceilings_cells(figures: dict, cells: dict, step: Step) -> dict:
  tb = lambda bytes_per_s: f"{bytes_per_s / 1e12:.3g} TB/s"
  chain = ", ".join(f"{rows} rows {tb(r['separate'])} ({tb(r['stacked'])} stacked)"
                    for rows, r in figures["gemm_chain"]["rows"].items())
  mlp = ", ".join(f"{rows} rows {tb(r['separate'])} ({tb(r['merged'])} gate and up merged)"
                  for rows, r in figures["mlp"]["rows"].items())
  cells["coa_jax"] = (f"copy {tb(figures['copy_bytes_per_s'])}, bf16 matmul "
                      f"{figures['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s; decode GEMMs' weight "
                      f"reads: {chain}; the MLP's: {mlp}; "
                      f"{figures['kernel_seconds'] * 1e6:.2f} us per tiny kernel")
  return {}


def _decode_cells(figures: dict, cells: dict, step: Step) -> dict:
  (r,) = figures["decode"]
  cells["coa_jax"] = (f"{r['ours_tokens_per_s']:,.0f} tok/s, {r['ours_of_roofline']:.1%} of the "
                      f"roofline ({r['bound']}-bound: {r['step_bytes'] / 1e9:.3g} GB a step at "
                      f"{figures['bandwidth_bytes_per_s'] / 1e12:.3g} TB/s)")
  if "hf_tokens_per_s" in r:  # (--skip_hf: coa-jax alone)
    cells.update(peer=f"{r['hf_tokens_per_s']:,.0f} tok/s {step.peer} ({r['hf_of_roofline']:.1%} "
                      f"of the roofline)", ratio=f"{r['ratio']:.2f}x")
  return dict(of_roofline=r["ours_of_roofline"], ratio=r.get("ratio"))


def _train_cells(figures: dict, cells: dict, step: Step) -> dict:
  (r,) = figures["rows"]
  cells.update(coa_jax=f"{r['jax_tokens_per_s']:,.0f} tok/s, MFU {r['jax_mfu']:.1%}",
               peer=f"{r['torch_tokens_per_s']:,.0f} tok/s {step.peer}, MFU {r['torch_mfu']:.1%}",
               ratio=f"{r['ratio']:.2f}x")
  return dict(mfu=r["jax_mfu"], ratio=r["ratio"])


def _serve_cells(figures: dict, cells: dict, step: Step) -> dict:
  rows = figures["rows"]
  cells.update(
      coa_jax="; ".join(f"{r['sessions']}: {r['served']['tokens_per_s']:,.0f} tok/s, "
                        f"{r['served_of_roofline']:.1%} of the roofline, "
                        f"{r['served_over_offline']:.2f}x the offline sampler" for r in rows),
      peer="; ".join(f"{r['sessions']}: {r['hf_tokens_per_s']:,.0f} tok/s" for r in rows),
      ratio="; ".join(f"{r['served_over_hf']:.2f}x" for r in rows))
  return {}


def _preset_cells(figures: dict, cells: dict, step: Step) -> dict:
  gib = lambda b: "n/a" if b is None else f"{b / (1 << 30):.2f} GiB"
  mfu = "n/a" if figures["mfu"] is None else f"{figures['mfu']:.1%}"
  cells["coa_jax"] = (f"{figures['tokens_per_s']:,.0f} tok/s, MFU {mfu}, "
                      f"{figures['step_seconds']:.2f} s a step; memory: peak "
                      f"{gib(figures['measured_peak_bytes'])} measured, "
                      f"{gib(figures['compiler_peak_bytes'])} by the compiler")
  return dict(mfu=figures["mfu"])


def _profile_cells(figures: dict, cells: dict, step: Step) -> dict:
  top = figures["rows"][0]
  cells["coa_jax"] = (f"{figures['wall_seconds'] * 1e3:.2f} ms a step under the profiler; top "
                      f"op `{top['name']}` ({top['kind']}) {top['share']:.0%}; table "
                      f"{os.path.basename(step.keep[0])}")
  return {}


_CELLS = dict(env=_env_cells, ceilings=_ceilings_cells, decode=_decode_cells,
              train=_train_cells, serve=_serve_cells, preset=_preset_cells,
              profile=_profile_cells)


def markdown(info: dict, rows: list[dict], results: list[dict]) -> str:
  """Returns device_check.md: where it ran, the table, and the log tails of the steps that
  did not finish."""
  lines = ["# The GPU figures: experiments/device_check.py", ""]
  lines += [f"- {k}: {v}" for k, v in info.items() if k not in ("versions", "smi")]
  lines += [f"- nvidia-smi: {info['smi']}",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()), ""]
  header = ("step", "what", "coa-jax", "peer", "ratio", "target", "met", "seconds")
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in rows:
    cells = (r["step"], r["what"], r["coa_jax"], r["peer"], r["ratio"], r["target"], r["met"],
             f"{r['seconds']:.0f}")
    lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
  for r, result in zip(rows, results):
    if r["status"] != "ok":
      lines += ["", f"## {r['step']}: {r['status']}", "", "```", result["tail"], "```"]
  return "\n".join(lines) + "\n"


def write_summary(output_dir: str, info: dict, steps: list[Step], results: list[dict]) -> None:
  """Writes device_check.json (where it ran, the rows, every step's result) and .md."""
  rows = [row(step, result) for step, result in zip(steps, results)]
  with open(os.path.join(output_dir, "device_check.json"), "w") as f:
    json.dump(dict(info=info, rows=rows, steps=results), f, indent=2)
  with open(os.path.join(output_dir, "device_check.md"), "w") as f:
    f.write(markdown(info, rows, results))


def cap_file(path: str, max_bytes: int) -> None:
  """Keeps a file within `max_bytes`: its first and last halves, with a line between."""
  size = os.path.getsize(path)
  if size <= max_bytes:
    return
  with open(path, "rb") as f:
    head = f.read(max_bytes // 2)
    f.seek(size - max_bytes // 2)
    tail = f.read()
  with open(path, "wb") as f:
    f.write(head + f"\n[... {size - len(head) - len(tail)} bytes cut ...]\n".encode() + tail)


def environment(smoke: bool, budget_s: float, wheels: str) -> dict:
  """Returns where the check runs, read without starting JAX (which would take the GPU):
  the time, Python, nvidia-smi's view of the GPU and the packages' versions."""
  smi = shutil.which("nvidia-smi")
  if smi:
    done = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.sm,"
                           "clocks.max.sm,temperature.gpu,power.draw", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    smi = (done.stdout or done.stderr).strip().replace("\n", "; ")
  versions = {}
  for name in VERSIONS:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  return dict(when=when, run=("smoke run on this CPU: tiny shapes, not the issue's figures"
                              if smoke else "the issue's shapes"),
              budget_s=budget_s, python=f"{platform.python_version()} ({sys.executable})",
              wheels=wheels, smi=smi or "not found", versions=versions)


def install_wheels(folder: str, site: str) -> str:
  """Installs the wheels in `folder` into `site` when a package of DEVICE_WHEELS is missing;
  returns what it did, in words."""
  missing = [m for m in DEVICE_WHEELS if importlib.util.find_spec(m) is None]
  if not missing:
    return "none needed"
  wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
  if not wheels:
    return (f"{', '.join(missing)} missing and no wheels in {folder}: run `make device-check "
            f"ARGS=--fetch_wheels` where pip reaches PyPI and carry {folder}")
  done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-compile", "--no-cache-dir", "--upgrade", "--target", site,
                         *wheels], capture_output=True, text=True)
  names = ", ".join(os.path.basename(w).split("-py3")[0].split("-cp3")[0] for w in wheels)
  return f"installed {names}" if done.returncode == 0 else f"pip failed: {done.stderr[-500:]}"


def fetch_wheels(folder: str, python_version: str) -> None:
  """Downloads DEVICE_WHEELS at the lock's versions for the device machine (x86-64 Linux,
  CPython `python_version`) into `folder`, and has git ignore it (a folder in the checkout)."""
  with open(os.path.join(ROOT, "requirements.lock")) as f:
    locked = dict(line.strip().split("==") for line in f if "==" in line)
  norm = lambda name: name.lower().replace("-", "_")
  locked = {norm(k): v for k, v in locked.items()}
  platforms = [f"--platform={p}_x86_64" for p in ("manylinux_2_28", "manylinux_2_27",
                                                   "manylinux_2_17", "manylinux2014",
                                                   "manylinux1")]
  subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  f"--python-version={python_version}", "--implementation=cp", *platforms,
                  "-d", folder, *[f"{m}=={locked[norm(m)]}" for m in DEVICE_WHEELS]], check=True)
  print(f"wheels in {folder}: {sorted(os.listdir(folder))}")
  relative = os.path.relpath(os.path.abspath(folder), ROOT)
  if relative.startswith(".."):
    return
  exclude = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
  exclude = os.path.join(ROOT, exclude)
  os.makedirs(os.path.dirname(exclude), exist_ok=True)
  with open(exclude, "a+") as f:
    f.seek(0)
    if f"/{relative}/" not in f.read().split():
      f.write(f"/{relative}/\n")
  print(f"git ignores /{relative}/ ({exclude}): carry it with the device tool's `carry`")


def step_environment(site: str) -> dict:
  """Returns the steps' environment: the repository root and `site` on PYTHONPATH, programs
  compiled in a second or more cached, unbuffered output, no network."""
  path = [ROOT, site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1", "HF_HUB_OFFLINE": "1",
          "TRANSFORMERS_OFFLINE": "1"}


def main(argv):
  del argv
  start = time.monotonic()
  wheels = os.path.join(ROOT, _WHEELS.value)
  if _FETCH.value:
    return fetch_wheels(wheels, _WHEEL_PYTHON.value)
  if not _SMOKE.value and not (shutil.which("nvidia-smi") or glob.glob("/dev/nvidia[0-9]*")):
    print("no NVIDIA GPU on this machine: run it on a lent GPU, or here with --smoke")
    return 2
  names = [s.name for s in plan(_SMOKE.value, "")]
  unknown = set(_ONLY.value) - set(names)
  if unknown:
    print(f"unknown steps {sorted(unknown)}: the steps are {names}")
    return 2
  os.makedirs(_OUTPUT.value, exist_ok=True)
  scratch = tempfile.mkdtemp(prefix="device_check_")
  site = os.path.join(scratch, "site")
  info = environment(_SMOKE.value, _BUDGET.value, install_wheels(wheels, site))
  steps = [s for s in plan(_SMOKE.value, scratch) if not _ONLY.value or s.name in _ONLY.value]
  results = run_steps(steps, start + _BUDGET.value, _OUTPUT.value, step_environment(site),
                      info)
  shutil.rmtree(scratch, ignore_errors=True)
  files = sorted(os.listdir(_OUTPUT.value))
  with open(os.path.join(_OUTPUT.value, "device_check.md")) as f:
    print(f.read())
  print(f"{len(files)} files in {_OUTPUT.value} (the device tool brings back {OUTPUT_FILES}): "
        f"{', '.join(files)}; {time.monotonic() - start:.0f} s of {_BUDGET.value:.0f}")
  return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
  app.run(main)
