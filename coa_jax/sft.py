"""Observation-masked SFT: data -> packed batches -> jitted sharded steps -> checkpoints -> HF.

`run(config)` is the whole job behind `experiments/sft.py`; see configs/sft_tiny_cpu.py for
every field. It resumes from the newest checkpoint in `checkpoint.directory` (train state and
data position), stops cleanly on SIGTERM after a final save, and stops with a clear error on
a non-finite loss, leaving the last good checkpoint as it was.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np

from coa_jax import data_pipeline, distributed, hf_checkpoint, sharding, tokenizer as tokenizer_lib
from coa_jax.checkpointing import Checkpointer, PreemptionFlag
from coa_jax.importers import DropCounter
from coa_jax.metrics import MetricsLog, say
from coa_jax.model import ConfigError, ModelConfig, Transformer, build_config
from coa_jax.train import optimizer, state as state_lib, step as step_lib


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient became NaN/inf; the last good checkpoint is left as it was."""


def load_tokenizer(config: Any) -> tokenizer_lib.CoATokenizer:
  """Returns the tokenizer named by config.tokenizer ('default' or a local HF folder)."""
  if config.tokenizer.path == "default":
    return tokenizer_lib.default_tokenizer(config.tokenizer.template)
  return tokenizer_lib.from_hf_folder(config.tokenizer.path, config.tokenizer.template)


def load_model(config: Any, tokenizer, mesh) -> tuple[ModelConfig, Any]:
  """Returns (model config, params) from the HF folder config.model.checkpoint, or (model
  config, None) for a fresh model built from config.model; the vocabulary covers the
  tokenizer's."""
  sharding.check_attention(config.model.get("attention_impl", "xla"), mesh)
  if config.model.get("checkpoint"):
    overrides = {k: v for k, v in config.model.items() if k not in ("preset", "checkpoint")}
    return hf_checkpoint.load_checkpoint(config.model.checkpoint, mesh,
                                         vocab_size=tokenizer.vocab_size, **overrides)
  model_config = build_config(config.model)
  if model_config.vocab_size < tokenizer.vocab_size:
    model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
  sharding.check_model_fits_mesh(model_config, mesh)
  return model_config, None


def _model_and_params(config: Any, tokenizer, mesh, tx, rng):
  """Returns (model config, TrainState): from an HF checkpoint folder or a fresh init."""
  model_config, params = load_model(config, tokenizer, mesh)
  model = Transformer(model_config)
  if params is not None:
    return model_config, state_lib.state_from_params(params, tx, model, mesh, rng)
  return model_config, state_lib.init_state(model, tx, mesh, rng)


def run(config: Any) -> dict[str, Any]:
  """Trains per `config`; returns a summary (losses, steps, paths)."""
  tokenizer = load_tokenizer(config)
  counter = DropCounter()
  trajectories = data_pipeline.load_source(config.data.path, counter)
  say(f"data {config.data.path}: {counter.summary()}")
  counter.check(config.data.max_drop_fraction)

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

  pipeline = data_pipeline.PipelineConfig(
      seq_len=config.seq_len, batch_size=config.batch_size // jax.process_count(),
      seed=config.seed, num_epochs=config.data.num_epochs, overlong=config.data.overlong)
  batches = data_pipeline.ShardedBatches(trajectories, tokenizer, pipeline, counter,
                                         config.data.get("shards", 0), jax.process_index(),
                                         jax.process_count())
  checkpointer = Checkpointer(config.checkpoint.directory, config.checkpoint.max_to_keep,
                              config.checkpoint.async_save)
  restored = checkpointer.restore_latest(state_lib.abstract_state(model, tx, mesh))
  if restored is not None:
    state, data_state = restored
    batches.set_state(data_state)
    say(f"resumed from step {int(state.step)} in {checkpointer.directory}")

  step_fn = step_lib.jit_train_step(model, tx, mesh, micro_batches=config.train.micro_batches,
                                    z_loss=config.train.z_loss, schedule=schedule)
  os.makedirs(config.workdir, exist_ok=True)
  log = MetricsLog(os.path.join(config.workdir, "metrics.jsonl"), config.train.steps,
                   config.train.log_every, append=restored is not None)
  start_step = int(state.step)
  stopped_by_signal = False
  t0 = time.perf_counter()
  last_step = config.train.steps
  if config.train.get("stop_after"):  # end this invocation early (a time-limited job)
    last_step = min(last_step, start_step + config.train.stop_after)
  with PreemptionFlag() as preempted:
    for step in range(start_step + 1, last_step + 1):
      try:
        batch = next(batches)
      except StopIteration:
        say(f"data exhausted after {config.data.num_epochs} epoch(s) at step {step - 1}")
        break
      state, metrics = step_fn(state, sharding.shard_batch(batch, mesh))
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      if not metrics.pop("is_finite"):
        checkpointer.close()
        raise NonFiniteLossError(
            f"non-finite loss or gradient at step {step} ({metrics}); the update was not "
            f"applied and the last good checkpoint in {checkpointer.directory} is intact")
      log.log(step, metrics, units=config.batch_size * config.seq_len)
      if step % config.checkpoint.every == 0 or step == last_step or preempted.requested:
        data_state = {k: v for part in distributed.gather_json(batches.get_state())
                      for k, v in part.items()}  # every process's shards
        checkpointer.save(step, state, data_state, force=preempted.requested)
      if preempted.requested:
        stopped_by_signal = True
        break
  checkpointer.close()
  train_seconds = time.perf_counter() - t0
  summary = dict(steps=int(state.step), resumed_from=start_step,
                 stopped_by_signal=stopped_by_signal, train_seconds=round(train_seconds, 2),
                 metrics=log.path, drops=dict(counter.dropped))
  if log.rows:
    summary.update(first_loss=log.rows[0]["loss"], final_loss=log.rows[-1]["loss"])
    summary["plot"] = log.plot(os.path.join(config.workdir, "loss.png"),
                               ("loss", "grad_norm", "lr"), title="SFT (observation-masked)")
    say(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} over steps "
        f"{start_step + 1}-{int(state.step)} in {train_seconds:.1f}s; plot {summary['plot']}")
  if config.export_dir and int(state.step) == config.train.steps:
    hf_checkpoint.save_checkpoint(config.export_dir, model_config, state.params,
                                  dtype=config.export_dtype)
    summary["export_dir"] = config.export_dir
    say(f"exported HF checkpoint to {config.export_dir}")
  summary["state"] = state
  return summary
