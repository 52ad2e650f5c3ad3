"""Observation-masked SFT: data -> packed batches -> jitted sharded steps -> checkpoints -> HF.

`run(config)` is the whole job behind `experiments/sft.py`; see configs/sft_tiny_cpu.py for
every field. It resumes from the newest checkpoint in `checkpoint.directory` (train state and
data position), stops cleanly on SIGTERM after a final save, and stops with a clear error on
a non-finite loss, leaving the last good checkpoint as it was. Its checkpoints keep the
tokenizer's tag mapping, and its HF export is a folder transformers loads whole (weights,
tokenizer with the tags, chat template, generation defaults: `data.hf_tokenizer`).
"""

from __future__ import annotations

from typing import Any

import jax

from coa_jax.data import DropCounter, hf_tokenizer, load_tokenizer, packing
from coa_jax.model import ConfigError, Transformer
from coa_jax.runtime import distributed, sharding
from coa_jax.runtime.distributed import say
from coa_jax.runtime.hf_checkpoint import load_model
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from coa_jax.train.loop import LoopConfig, run_loop


def _data(config: Any) -> tuple[Any, list, DropCounter]:
  """Returns (tokenizer, trajectories, their drop counter), the drops within the config's
  bound."""
  tokenizer = load_tokenizer(config)
  counter = DropCounter()
  trajectories = packing.load_source(config.data.path, counter, tokenizer.tool_tags)
  say(f"data {config.data.path}: {counter.summary()}")
  counter.check(config.data.max_drop_fraction)
  if config.data.get("upsample_by"):
    trajectories = packing.upsample(trajectories, config.data.upsample_by,
                                    dict(config.data.upsample))
    say(f"data upsampled by {config.data.upsample_by} {dict(config.data.upsample)}: "
        f"{len(trajectories)} examples an epoch")
  return tokenizer, trajectories, counter


def _model_and_params(config: Any, tokenizer, mesh, tx, rng):
  """Returns (model config, TrainState): from an HF checkpoint folder or a fresh init."""
  model_config, params = distributed.agreed(lambda: load_model(config, tokenizer, mesh),
                                           "loading the model")
  model = Transformer(model_config)
  if params is not None:
    return model_config, state_lib.state_from_params(params, tx, model, mesh, rng)
  return model_config, state_lib.init_state(model, tx, mesh, rng)


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


def run(config: Any) -> dict[str, Any]:
  """Trains per `config`; returns a summary (losses, steps, paths)."""
  tokenizer, trajectories, counter = distributed.agreed(lambda: _data(config),
                                                        "loading the SFT data")

  mesh = sharding.make_mesh(sharding.MeshConfig(**config.mesh))
  if config.batch_size % jax.process_count():
    raise ConfigError(f"batch_size={config.batch_size} does not split over "
                      f"{jax.process_count()} processes")
  sharding.check_batch_fits_mesh(config.batch_size, config.train.micro_batches, mesh)
  schedule = optimizer.learning_rate_schedule(config.optimizer)
  tx = optimizer.make_optimizer(config.optimizer)
  rng = jax.random.key(config.seed)
  model_config, state = _model_and_params(config, tokenizer, mesh, tx, rng)
  model = Transformer(model_config)
  say(f"model {config.model.get('checkpoint') or config.model.preset}: "
      f"{model_config.num_params():,} params, vocab {model_config.vocab_size}; "
      f"mesh {dict(mesh.shape)}; batch {config.batch_size} x {config.seq_len}")

  pipeline = packing.PipelineConfig(
      seq_len=config.seq_len, batch_size=config.batch_size // jax.process_count(),
      seed=config.seed, num_epochs=config.data.num_epochs, overlong=config.data.overlong)
  batches = packing.ShardedBatches(trajectories, tokenizer, pipeline, counter,
                                   config.data.get("shards", 0), jax.process_index(),
                                   jax.process_count())
  step_fn = step_lib.jit_train_step(model, tx, mesh, micro_batches=config.train.micro_batches,
                                    z_loss=config.train.z_loss, schedule=schedule)
  job = SFTJob(state, batches, step_fn, mesh)
  loop = LoopConfig(steps=config.train.steps, workdir=config.workdir,
                    checkpoint=config.checkpoint, log_every=config.train.log_every,
                    stop_after=config.train.stop_after,
                    nonfinite_skips=config.train.nonfinite_skips, export_dir=config.export_dir,
                    export_dtype=config.export_dtype,
                    base_checkpoint=config.model.get("checkpoint", ""),
                    units_per_step=config.batch_size * config.seq_len,
                    plot_keys=("loss", "grad_norm", "lr"), plot_file="loss.png",
                    title="SFT (observation-masked)", tokenizer=tokenizer,
                    export_files=hf_tokenizer.export_files(tokenizer, config.get("sampling")))
  result = run_loop(job, loop, state_lib.abstract_state(model, tx, mesh).checkpointed(),
                    model_config)
  summary = dict(result.summary(), drops=dict(counter.dropped), state=job.state)
  if result.rows:
    summary.update(first_loss=result.rows[0]["loss"], final_loss=result.rows[-1]["loss"])
    say(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} over steps "
        f"{result.resumed_from + 1}-{result.steps} in {result.train_seconds:.1f}s; plot "
        f"{result.plot}")
  return summary
