"""The job scaffold: resume, preemption save, progress, metrics, checkpoints and HF export.

A training job (SFT, DAPO) is a `Job` (its state, a step function that draws its own batches,
and what a checkpoint keeps beside the state) and a `LoopConfig`; `run_loop` does the rest:

- resumes from the newest checkpoint in `checkpoint.directory` (train state and job data);
- runs steps until `steps`, or `stop_after` more of them (a time-limited invocation), or the
  job's data run out (which ends the run: its last state is saved and exported);
- prints a progress line every `log_every` steps with its rate and ETA, and writes every
  step's metrics to workdir/metrics.jsonl and TensorBoard events (`train.writers`);
- saves a checkpoint every `checkpoint.every` steps, at the last step, and on SIGTERM (then
  stops cleanly, at a step every process agrees on);
- a step whose update was not finite changed nothing (`train.step.run_step`); the run skips up
  to `nonfinite_skips` such steps (counted in the metrics as nonfinite_skipped, kept across
  resumes), and at the next one saves the state it holds (the last good one) and stops with
  NonFiniteLossError;
- a step whose batch, or one of whose mini-batches, had no trainable token (metrics["empty"] >
  0, e.g. every row dropped by RL's overlong filter) changed nothing by that update either; it
  is a no-op, not a fault: it is said and its metrics row shows it, but it is not counted
  toward `nonfinite_skips` and never stops the run;
- plots the metrics (PNG) and, once all `steps` are done or the data ran out, exports an HF
  checkpoint with the job's `export_files` beside the weights (the tokenizer, its chat
  template, the generation defaults and the tag mapping), and beside a LoRA run's adapters;
- keeps the model's tag mapping (`tokenizer.tag_map()`) in every checkpoint's data, and at
  restore checks it against the run's tokenizer: a tag whose id moved is an error naming it.

Every decision that leads to a collective (save, stop, restore) is the same on every process:
the step counts are, the non-finite flag comes out of one global program, and preemption and
restore agree through `runtime.checkpointing`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Protocol, Sequence

import jax

from coa_jax.model import ConfigError, ModelConfig, lora
from coa_jax.runtime import distributed, hf_checkpoint, paths
from coa_jax.runtime.checkpointing import Checkpointer, PreemptionFlag
from coa_jax.runtime.distributed import say
from coa_jax.train import writers
from coa_jax.train.state import TrainState
from coa_jax.train.step import NonFiniteLossError


class Job(Protocol):
  """What `run_loop` drives: the train state (whose params are exported), one step, and what a
  checkpoint keeps."""

  state: TrainState

  def checkpoint_state(self) -> Any:
    """Returns the arrays a checkpoint holds (the train state, or a tree of train states)."""

  def step(self, step: int) -> dict[str, float]:
    """Runs step `step` (1-based) and returns its metrics (metrics["nonfinite"] > 0: an update
    was not finite, metrics["empty"] > 0: one had no trainable token; neither was applied,
    `run_step`); raises StopIteration when the data are exhausted."""

  def data_state(self, step: int) -> dict[str, Any]:
    """Returns what a checkpoint keeps beside the train state (may be a collective)."""

  def restore(self, state: Any, data_state: dict[str, Any]) -> None:
    """Takes a restored checkpoint (`checkpoint_state`'s arrays and `data_state`)."""


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """A training job's loop settings: steps, gradient accumulation (`micro_batches`), the z-loss
  coefficient, how often to log; stop_after=N ends one invocation after N steps (0: never);
  nonfinite_skips: steps whose update was not finite that the run skips before it stops."""

  steps: int
  micro_batches: int = 1
  z_loss: float = 0.0
  log_every: int = 10
  stop_after: int = 0
  nonfinite_skips: int = 0

  def __post_init__(self):
    if self.steps < 1 or self.micro_batches < 1 or self.log_every < 1:
      raise ConfigError(f"steps={self.steps}, micro_batches={self.micro_batches}, log_every="
                        f"{self.log_every}: expected >= 1")
    if self.stop_after < 0 or self.nonfinite_skips < 0 or self.z_loss < 0:
      raise ConfigError("stop_after, nonfinite_skips and z_loss must be >= 0")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The loop's settings; `checkpoint` holds `configs.common.checkpoint`'s fields (None: no
  checkpoints, no resume)."""

  steps: int
  workdir: str
  checkpoint: Any
  log_every: int = 10
  stop_after: int = 0  # end this invocation after this many steps (0: run to `steps`)
  nonfinite_skips: int = 0  # non-finite steps skipped before the run stops
  export_dir: str = ""
  export_dtype: str = "bfloat16"
  base_checkpoint: str = ""  # a LoRA run's base HF folder, named in its adapter export
  unit: str = "tokens"  # what `units_per_step` counts, for the rate
  units_per_step: float = 0.0
  shown: Sequence[str] = ()  # the metrics in progress lines (all when empty)
  plot_keys: Sequence[str] = ("loss",)
  plot_file: str = "metrics.png"  # in workdir
  title: str = ""
  tokenizer: Any = None  # the model's CoATokenizer: its tag mapping is saved and checked
  export_files: Any = None  # {file name: text} written beside the exported weights


@dataclasses.dataclass
class LoopResult:
  """What a run did: steps (the last one completed), the metrics of this invocation's steps,
  and the paths it wrote."""

  steps: int
  resumed_from: int
  stopped_by_signal: bool
  train_seconds: float
  rows: list[dict[str, float]]
  metrics: str
  plot: str | None = None
  export_dir: str | None = None

  def summary(self) -> dict[str, Any]:
    """Returns what a job's summary reports of the run (the paths it wrote, when it did)."""
    out = dict(steps=self.steps, resumed_from=self.resumed_from,
               stopped_by_signal=self.stopped_by_signal, train_seconds=self.train_seconds,
               metrics=self.metrics)
    out.update({k: v for k, v in (("plot", self.plot), ("export_dir", self.export_dir)) if v})
    return out


class _Progress:
  """Prints `step i/n  metrics  rate  ETA` every `every` steps (and at the last one)."""

  def __init__(self, total: int, every: int, unit: str, shown: Sequence[str]):
    self.total, self.every, self.unit, self.shown = total, max(every, 1), unit, tuple(shown)
    self.start = self.last = time.perf_counter()
    self.first: int | None = None
    self.units = 0.0

  def update(self, step: int, metrics: dict[str, float], units: float) -> None:
    now = time.perf_counter()
    self.first = step if self.first is None else self.first
    self.units += units
    if step % self.every and step != self.total:
      return
    rate = self.units / max(now - self.last, 1e-9)
    eta = (now - self.start) / (step - self.first + 1) * (self.total - step)
    shown = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                      if not self.shown or k in self.shown)
    say(f"step {step}/{self.total}  {shown}  {rate:,.0f} {self.unit}/s  ETA {eta:.0f}s")
    self.last, self.units = now, 0.0


def run_loop(job: Job, config: LoopConfig, abstract_state: TrainState | None,
             model_config: ModelConfig) -> LoopResult:
  """Runs `job` per `config` (see the module docstring); `abstract_state` is the shapes and
  shardings of the job's `checkpoint_state()`, which a restore reads into."""
  ckpt = config.checkpoint
  checkpointer = ckpt and Checkpointer(ckpt.directory, ckpt.max_to_keep, ckpt.async_save,
                                      ckpt.start_over_if_all_damaged)
  start, skipped = 0, 0
  restored = checkpointer and checkpointer.restore_latest(abstract_state)
  if restored is not None:
    start, state, data_state = restored
    loop_state = data_state.pop("loop", {})
    skipped = loop_state.get("nonfinite_skipped", 0)

    def take() -> None:
      if config.tokenizer is not None and loop_state.get("tags") is not None:
        config.tokenizer.check_tag_map(loop_state["tags"],
                                       f"checkpoint step {start} in {checkpointer.directory}")
      job.restore(state, data_state)

    # The data position may not fit this host (a shard it lacks): every host hears of it.
    distributed.agreed(take, "restoring the job's data")
    say(f"resumed from step {start} in {checkpointer.directory}")
  last = min(config.steps, start + config.stop_after) if config.stop_after else config.steps
  active = jax.process_index() == 0

  def open_writer() -> writers.MetricWriter:
    paths.to_epath(config.workdir).mkdir(parents=True, exist_ok=True)
    return writers.MetricWriter(config.workdir, append=restored is not None, active=active)

  # Process 0 writes the metrics: a failure to open them ends every host; one to write a step's
  # row is kept (the others go on stepping beside it) and ends every host at the next save.
  writer = distributed.agreed(open_writer, f"opening the metric files in {config.workdir}")
  writes = distributed.FirstError()
  progress = _Progress(config.steps, config.log_every, config.unit, config.shown)
  rows: list[dict[str, float]] = []
  completed, stopped_by_signal, exhausted, saved = start, False, False, start
  t0 = previous = time.perf_counter()

  def save(step: int, force: bool = False) -> None:
    loop_state = {"nonfinite_skipped": skipped}
    if config.tokenizer is not None:
      loop_state["tags"] = config.tokenizer.tag_map()
    data_state = {**job.data_state(step), "loop": loop_state}
    checkpointer.save(step, job.checkpoint_state(), data_state, force=force)

  try:
    with PreemptionFlag() as preemption:
      for step in range(start + 1, last + 1):
        try:
          metrics = job.step(step)
        except StopIteration:
          say(f"data exhausted at step {step - 1}")
          exhausted = True
          if checkpointer and saved != completed:  # the run ends here: keep its last state
            save(completed)
          break
        if metrics.get("nonfinite", 0.0) > 0:
          skipped += 1
          if skipped > config.nonfinite_skips:
            if checkpointer:
              save(step, force=True)
            where = (f"; saved the state it holds (the last good one) as step {step} in "
                     f"{checkpointer.directory}, which resumes after this batch"
                     if checkpointer else "")
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {step} ({metrics}); the update was not "
                f"applied, and {skipped} such steps exceed nonfinite_skips="
                f"{config.nonfinite_skips}{where}. Lower the learning rate, check the data, "
                f"or allow more skips")
          say(f"step {step}: non-finite loss or gradient, update skipped ({skipped} of "
              f"{config.nonfinite_skips} allowed)")
        if metrics.get("empty", 0.0) > 0:
          say(f"step {step}: no trainable token in its batch or one of its mini-batches; that "
              f"update changed nothing (a no-op, not counted toward nonfinite_skips)")
        now = time.perf_counter()
        row = {**metrics, "nonfinite_skipped": skipped, "time": round(now - t0, 4)}
        if config.units_per_step:
          row[f"{config.unit}_per_s"] = round(config.units_per_step / max(now - previous, 1e-9),
                                             2)
        previous = now
        rows.append(row)
        writes.run(writer.write_scalars, step, row)
        progress.update(step, metrics, config.units_per_step)
        stopping = preemption.reached(step)
        if checkpointer and (step % ckpt.every == 0 or step == last or stopping):
          writes.raise_together(f"writing the metrics of step {step}")
          save(step, force=stopping)
          saved = step
        completed = step
        if stopping:
          stopped_by_signal = True
          break
    writes.run(writer.close)  # process 0's last flush or upload: agreed with its writes
    writes.raise_together("writing the metrics")
  finally:
    writer.close()  # after an error (closed above otherwise)
    if checkpointer:
      checkpointer.close()
  result = LoopResult(steps=completed, resumed_from=start, stopped_by_signal=stopped_by_signal,
                      train_seconds=round(time.perf_counter() - t0, 2), rows=rows,
                      metrics=os.path.join(config.workdir, "metrics.jsonl"))
  if config.export_dir and (completed == config.steps or exhausted):
    params = job.state.model_params()
    if model_config.lora_rank:  # the adapters alone (PEFT), then merged into the base weights
      hf_checkpoint.save_adapters(os.path.join(config.export_dir, "adapter"), model_config,
                                  job.state.params, config.base_checkpoint,
                                  files=config.export_files)
      params, model_config = lora.merge(params, model_config), model_config.replace(lora_rank=0)
    hf_checkpoint.save_checkpoint(config.export_dir, model_config, params,
                                  dtype=config.export_dtype, files=config.export_files)
    result.export_dir = config.export_dir
    say(f"exported HF checkpoint to {config.export_dir}")
  if rows:  # after the export's gathers, which a plot failing on process 0 alone would hang
    result.plot = distributed.agreed(lambda: active and plot_metrics(
        result.metrics, os.path.join(config.workdir, config.plot_file), config.plot_keys,
        config.title) or None, "plotting the metrics")
  return result


def plot_metrics(path: str, png_path: str, keys: Sequence[str], title: str = "") -> str | None:
  """Writes a PNG of `keys` against step from the JSONL metrics at `path` (every invocation of a
  resumed job); returns its path, or None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    say("matplotlib is not installed (pip install 'coa-jax[plots]'): no plot written")
    return None
  with paths.to_epath(path).open() as f:
    rows = [json.loads(line) for line in f if line.strip()]
  fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
  for ax, key in zip(axes[0], keys):
    ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  with paths.to_epath(png_path).open("wb") as f:  # a local file or a URL (gs://...)
    fig.savefig(f, format="png", dpi=100)
  plt.close(fig)
  return png_path
