"""The smallest end-to-end job: train the tiny model over all devices, export it, reload it.

Data are synthetic counting sequences (each row counts from a random start with a random
stride, modulo the vocabulary), which a tiny transformer learns in a few dozen steps, so the
loss curve shows the whole training path working: sharded init, jitted forward/backward/AdamW
steps, metrics, then HF export and a reload that must reproduce the logits.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from coa_jax.model import ConfigError, ModelSettings, Transformer
from coa_jax.runtime import distributed, hf_checkpoint, sharding
from coa_jax.runtime.distributed import say
from coa_jax.runtime.settings import build
from coa_jax.train import optimizer
from coa_jax.train.optimizer import OptimizerSettings
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib
from coa_jax.train.loop import LoopConfig, run_loop


def counting_sequences(rng: np.random.Generator, rows: int, length: int,
                       vocab: int) -> np.ndarray:
  """Returns (rows, length) int32 rows start + stride * t (mod vocab), stride in 1..7."""
  start = rng.integers(0, vocab, (rows, 1))
  stride = rng.integers(1, 8, (rows, 1))
  return ((start + stride * np.arange(length)) % vocab).astype(np.int32)


class _CountingJob:
  """The demo's job for `run_loop`: fresh counting sequences every step, no checkpoints."""

  def __init__(self, state, step_fn, mesh, rows: int, seq_len: int, vocab: int,
               rng: np.random.Generator):
    self.state, self.step_fn, self.mesh, self.rng = state, step_fn, mesh, rng
    self.shape = (rows, seq_len + 1, vocab)

  def step(self, step: int) -> dict[str, float]:
    rows = counting_sequences(self.rng, *self.shape)
    batch = sharding.shard_batch(step_lib.next_token_batch(rows), self.mesh)
    self.state, metrics = step_lib.run_step(self.step_fn, self.state, batch)
    return metrics

  def checkpoint_state(self) -> Any:
    return self.state

  def data_state(self, step: int) -> dict[str, Any]:
    return {}

  def restore(self, state, data_state) -> None:
    raise NotImplementedError("the demo keeps no checkpoints")


@dataclasses.dataclass(frozen=True)
class DemoSettings:
  """The demo's settings (configs/demo_tiny.py): a fresh model, trained `steps` steps on
  `batch_size` rows of `seq_len` tokens over the mesh; metrics, plot and export in `workdir`."""

  model: ModelSettings
  optimizer: OptimizerSettings
  steps: int
  batch_size: int
  seq_len: int
  workdir: str
  mesh: sharding.MeshConfig = sharding.MeshConfig()
  seed: int = 0
  log_every: int = 20

  def __post_init__(self):
    if min(self.steps, self.batch_size, self.seq_len, self.log_every) < 1:
      raise ConfigError(f"steps={self.steps}, batch_size={self.batch_size}, seq_len="
                        f"{self.seq_len}, log_every={self.log_every}: expected >= 1")


def demo_settings(config: Any, where: str = "demo") -> DemoSettings:
  """Returns the demo config's settings; raises ConfigError naming a bad key."""
  return build(DemoSettings, config, where)


def run(config: Any) -> dict[str, Any]:
  """Trains per `config` (a ConfigDict, checked by `demo_settings`, or DemoSettings); returns a
  summary of what it did."""
  settings = demo_settings(config)
  model_config = settings.model.fresh_config()
  mesh = sharding.make_mesh(settings.mesh)
  sharding.check_model_fits_mesh(model_config, mesh)
  model, tx = Transformer(model_config), optimizer.make_optimizer(settings.optimizer)
  local_rows = settings.batch_size // jax.process_count()
  say(f"devices: {jax.device_count()} x {jax.devices()[0].platform} "
      f"({jax.process_count()} process(es)); mesh {dict(mesh.shape)}")
  say(f"model: {settings.model.preset}, {model_config.num_params():,} parameters, "
      f"dtype {model_config.dtype}, params {model_config.param_dtype}")

  state = state_lib.init_state(model, tx, mesh, jax.random.key(settings.seed))
  job = _CountingJob(state, step_lib.jit_train_step(model, tx, mesh), mesh, local_rows,
                     settings.seq_len, model_config.vocab_size,
                     np.random.default_rng([settings.seed, jax.process_index()]))
  loop = LoopConfig(steps=settings.steps, workdir=settings.workdir, checkpoint=None,
                    log_every=settings.log_every,
                    units_per_step=settings.batch_size * settings.seq_len,
                    plot_keys=("loss", "grad_norm"), plot_file="loss.png",
                    title=f"{settings.model.preset} on synthetic counting sequences")
  result = run_loop(job, loop, None, model_config)
  state = job.state

  export_dir = os.path.join(settings.workdir, "hf_export")
  hf_checkpoint.save_checkpoint(export_dir, model_config, state.params, dtype="float32")
  _, reloaded = distributed.agreed(  # a host that cannot read process 0's export stops them all
      lambda: hf_checkpoint.load_checkpoint(export_dir, mesh, dtype=model_config.dtype,
                                            param_dtype=model_config.param_dtype),
      f"reloading {export_dir}")
  probe = counting_sequences(np.random.default_rng(1), 2 * mesh.size, 16, model_config.vocab_size)
  apply = jax.jit(model.apply)
  with sharding.activate(mesh):
    before = np.asarray(apply({"params": state.params}, probe))
    after = np.asarray(apply({"params": reloaded}, probe))
  summary = dict(first_loss=result.rows[0]["loss"], final_loss=result.rows[-1]["loss"],
                 steps=settings.steps, train_seconds=result.train_seconds,
                 export_dir=export_dir,
                 reload_max_abs_logit_diff=float(np.abs(before - after).max()),
                 metrics=result.metrics, plot=result.plot)
  say(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in {settings.steps} steps "
      f"({result.train_seconds:.1f}s incl. compile); metrics {result.metrics}; plot "
      f"{result.plot}")
  say(f"exported HF checkpoint to {export_dir}; reloaded logits differ by at most "
      f"{summary['reload_max_abs_logit_diff']:.2e}")
  return summary
