"""The jitted, sharded language-model training step (forward, backward, optimizer update)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from coa_jax import sharding
from coa_jax.losses import LossSums, token_cross_entropy_and_z
from coa_jax.train.state import TrainState, state_shardings

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")


def lm_loss(model: nn.Module, params: Any, batch: dict[str, jax.Array]):
  """Returns (token-mean loss, LossSums) of next-token prediction on `batch`."""
  sums, _ = _loss_sums(model, params, batch)
  return sums.mean(), sums


def _loss_sums(model: nn.Module, params: Any, batch: dict[str, jax.Array]):
  logits_BxTxV = model.apply({"params": params}, batch["input_ids"], batch["positions"],
                             batch["segment_ids"])
  return token_cross_entropy_and_z(logits_BxTxV, batch["targets"], batch["loss_mask"])


def _micro_batches(batch: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
  """Returns the batch as (count, B / count, ...): micro-batch m holds rows m, m+count, ...,
  so every micro-batch stays evenly split over the devices that hold the batch."""
  def split(x):
    if x.shape[0] % count:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {count} micro-batches")
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)

  return jax.tree_util.tree_map(split, batch)


def train_step(model: nn.Module, tx: optax.GradientTransformation, state: TrainState,
               batch: dict[str, jax.Array], *, micro_batches: int = 1, z_loss: float = 0.0,
               schedule: optax.Schedule | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """Returns the updated state and metrics of one optimizer step on `batch`.

  The loss is the sum over unmasked tokens of the whole batch divided by their count, so
  accumulating gradients over `micro_batches` (a scan) is token-exact. A non-finite loss or
  gradient leaves the state unchanged (params, optimizer state and step) and reports
  is_finite=False, so the caller can stop with the last good state intact.
  """
  def sums_and_grads(params, micro):
    def objective(p):
      ce, z_total = _loss_sums(model, p, micro)
      return ce.total + z_loss * z_total, (ce, z_total)
    (_, (ce, z_total)), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return ce, z_total, grads

  if micro_batches == 1:
    ce, z_total, grad_sums = sums_and_grads(state.params, batch)
  else:
    def accumulate(carry, micro):
      ce, z_total, grads = sums_and_grads(state.params, micro)
      acc_ce, acc_z, acc_grads = carry
      return (acc_ce + ce, acc_z + z_total,
              jax.tree_util.tree_map(jnp.add, acc_grads, grads)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    init = (LossSums(jnp.zeros(()), jnp.zeros(())), jnp.zeros(()), zeros)
    (ce, z_total, grad_sums), _ = jax.lax.scan(accumulate, init,
                                               _micro_batches(batch, micro_batches))
  count = jnp.maximum(ce.count, 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / count, grad_sums)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  loss = ce.mean()
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = state.replace(step=jnp.where(finite, state.step + 1, state.step),
                            params=keep(params, state.params),
                            opt_state=keep(opt_state, state.opt_state))
  positions = jnp.maximum(jnp.sum(batch["segment_ids"] > 0), 1)
  metrics = dict(loss=loss, z_loss=z_total / count, tokens=ce.count,
                 unmasked_fraction=ce.count / positions, grad_norm=grad_norm,
                 is_finite=finite)
  if schedule is not None:
    metrics["lr"] = schedule(state.step)
  return new_state, metrics


def jit_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                   donate: bool = True, **step_options: Any) -> Callable:
  """Returns `train_step` jitted with explicit state/batch shardings on `mesh`.

  The result is called as step(state, batch) and also offers `.lower(state, batch)` for
  ahead-of-time compilation; the state argument is donated unless donate=False.
  `step_options` (micro_batches, z_loss, schedule) are passed to `train_step`.
  """
  state_sh = state_shardings(model, tx, mesh)
  batch_sh = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS}
  jitted = jax.jit(lambda s, b: train_step(model, tx, s, b, **step_options),
                   in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, sharding.replicated(mesh)),
                   donate_argnums=(0,) if donate else ())
  return sharding.bind_mesh(jitted, mesh)


def next_token_batch(tokens_BxT1: np.ndarray) -> dict[str, np.ndarray]:
  """Returns an unpacked training batch from (B, T+1) token rows: inputs, shifted targets."""
  tokens = np.asarray(tokens_BxT1, np.int32)
  inputs = np.ascontiguousarray(tokens[:, :-1])
  positions = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)
  return dict(input_ids=inputs, targets=np.ascontiguousarray(tokens[:, 1:]),
              loss_mask=np.ones_like(inputs), positions=np.ascontiguousarray(positions),
              segment_ids=np.ones_like(inputs))
