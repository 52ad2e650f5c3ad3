"""Observation-masked SFT: data -> packed batches -> jitted sharded steps -> checkpoints -> HF.

`run(config)` is the whole job behind `experiments/sft.py`; see configs/sft_tiny_cpu.py for
every field, which `sft_settings` checks once, at the top. It resumes from the newest
checkpoint in `checkpoint.directory` (train state and data position), stops cleanly on SIGTERM
after a final save, and stops with a clear error on a non-finite loss, leaving the last good
checkpoint as it was. Its checkpoints keep the
tokenizer's tag mapping, and its HF export is a folder transformers loads whole (weights,
tokenizer with the tags, chat template, generation defaults: `data.hf_tokenizer`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from coa_jax.data import DropCounter, hf_tokenizer, load_tokenizer, packing
from coa_jax.model import ConfigError, ModelConfig, Transformer
from coa_jax.runtime import distributed, sharding
from coa_jax.runtime.distributed import say
from coa_jax.sft.settings import SFTSettings, sft_settings
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from coa_jax.train.loop import LoopConfig, run_loop


def _data(settings: SFTSettings) -> tuple[Any, list, DropCounter]:
  """Returns (tokenizer, trajectories, their drop counter), the drops within the settings'
  bound."""
  tokenizer = load_tokenizer(settings.tokenizer, settings.model.checkpoint, settings.tools)
  data, counter = settings.data, DropCounter()
  trajectories = packing.load_source(data.path, counter, tokenizer.tool_tags)
  say(f"data {data.path}: {counter.summary()}")
  counter.check(data.max_drop_fraction)
  if data.upsample_by:
    trajectories = packing.upsample(trajectories, data.upsample_by, data.upsample)
    say(f"data upsampled by {data.upsample_by} {data.upsample}: {len(trajectories)} examples "
        f"an epoch")
  return tokenizer, trajectories, counter


class SFTJob:
  """The SFT job for `run_loop`: packed batches in, one jitted sharded step each."""

  def __init__(self, state: state_lib.TrainState, batches: packing.ShardedBatches,
               step_fn: Any, mesh: Any):
    self.state, self.batches, self.step_fn, self.mesh = state, batches, step_fn, mesh

  def step(self, step: int) -> dict[str, float]:
    # Shards pack into different numbers of batches: the run ends when any process's data
    # are exhausted, on every process at once (one alone would leave the others in the step),
    # and a process whose data fail (an unreadable shard) ends every process with its error.
    drawn = {}

    def draw() -> bool:
      drawn["batch"] = next(self.batches, None)
      return drawn["batch"] is not None

    if not all(distributed.agreed_all(draw, f"reading the batch of step {step}")):
      raise StopIteration
    self.state, metrics = step_lib.run_step(self.step_fn, self.state,
                                            sharding.shard_batch(drawn["batch"], self.mesh))
    return metrics

  def checkpoint_state(self) -> Any:
    return self.state.checkpointed()

  def data_state(self, step: int) -> dict[str, Any]:
    return {k: v for part in distributed.gather_json(self.batches.get_state())
            for k, v in part.items()}  # every process's shards

  def restore(self, state: state_lib.TrainState, data_state: dict[str, Any]) -> None:
    self.state = state.replace(frozen=self.state.frozen)
    self.batches.set_state(data_state)


@functools.lru_cache(maxsize=4)
def _train_step(model_config: ModelConfig, settings: optimizer.OptimizerSettings, mesh: Mesh,
                micro_batches: int, z_loss: float) -> Callable:
  """Returns the jitted train step, one per model, optimizer, mesh and step options in this
  process: SFT runs alike in one process (a resumed run, an experiment's seeds, its prefix of
  the main job's SFT) trace and compile it once."""
  schedule, tx = optimizer.schedule_and_optimizer(settings)
  return step_lib.jit_train_step(Transformer(model_config), tx, mesh,
                                 micro_batches=micro_batches, z_loss=z_loss, schedule=schedule)


def run(config: Any) -> dict[str, Any]:
  """Trains per `config` (a ConfigDict, checked by `sft_settings`, or SFTSettings); returns a
  summary (losses, steps, paths)."""
  settings = sft_settings(config)
  tokenizer, trajectories, counter = distributed.agreed(lambda: _data(settings),
                                                        "loading the SFT data")

  mesh = sharding.make_mesh(settings.mesh)
  batch_size, seq_len, train = settings.batch_size, settings.seq_len, settings.train
  if batch_size % jax.process_count():
    raise ConfigError(f"batch_size={batch_size} does not split over {jax.process_count()} "
                      f"processes")
  sharding.check_batch_fits_mesh(batch_size, train.micro_batches, mesh)
  _, tx = optimizer.schedule_and_optimizer(settings.optimizer)
  rng = jax.random.key(settings.seed)
  model_config, state = state_lib.load_state(settings.model, tokenizer, mesh, tx, rng)
  model = Transformer(model_config)
  say(f"model {settings.model.checkpoint or settings.model.preset}: "
      f"{model_config.num_params():,} params, vocab {model_config.vocab_size}; "
      f"mesh {dict(mesh.shape)}; batch {batch_size} x {seq_len}")

  pipeline = packing.PipelineConfig(
      seq_len=seq_len, batch_size=batch_size // jax.process_count(), seed=settings.seed,
      num_epochs=settings.data.num_epochs, overlong=settings.data.overlong)
  batches = packing.ShardedBatches(trajectories, tokenizer, pipeline, counter,
                                   settings.data.shards, jax.process_index(),
                                   jax.process_count())
  step_fn = _train_step(model_config, settings.optimizer, mesh, train.micro_batches,
                        train.z_loss)
  job = SFTJob(state, batches, step_fn, mesh)
  loop = LoopConfig(steps=train.steps, workdir=settings.workdir, checkpoint=settings.checkpoint,
                    log_every=train.log_every, stop_after=train.stop_after,
                    nonfinite_skips=train.nonfinite_skips, export_dir=settings.export_dir,
                    export_dtype=settings.export_dtype, base_checkpoint=settings.model.checkpoint,
                    units_per_step=batch_size * seq_len,
                    plot_keys=("loss", "grad_norm", "lr"), plot_file="loss.png",
                    title="SFT (observation-masked)", tokenizer=tokenizer,
                    export_files=hf_tokenizer.export_files(tokenizer, settings.sampling))
  result = run_loop(job, loop, state_lib.abstract_state(model, tx, mesh).checkpointed(),
                    model_config)
  summary = dict(result.summary(), drops=dict(counter.dropped), state=job.state)
  if result.rows:
    summary.update(first_loss=result.rows[0]["loss"], final_loss=result.rows[-1]["loss"])
    say(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} over steps "
        f"{result.resumed_from + 1}-{result.steps} in {result.train_seconds:.1f}s; plot "
        f"{result.plot}")
  return summary
