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
from coa_jax.losses import token_cross_entropy
from coa_jax.train.state import TrainState, state_shardings

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")


def lm_loss(model: nn.Module, params: Any, batch: dict[str, jax.Array]):
  """Returns (token-mean loss, LossSums) of next-token prediction on `batch`."""
  logits_BxTxV = model.apply({"params": params}, batch["input_ids"], batch["positions"],
                             batch["segment_ids"])
  sums = token_cross_entropy(logits_BxTxV, batch["targets"], batch["loss_mask"])
  return sums.mean(), sums


def train_step(model: nn.Module, tx: optax.GradientTransformation, state: TrainState,
               batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
  """Returns the updated state and metrics (loss, tokens, grad_norm, is_finite)."""
  (loss, sums), grads = jax.value_and_grad(
      lambda p: lm_loss(model, p, batch), has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  metrics = dict(loss=loss, tokens=sums.count, grad_norm=grad_norm,
                 is_finite=jnp.isfinite(loss) & jnp.isfinite(grad_norm))
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def jit_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                   donate: bool = True) -> Callable:
  """Returns `train_step` jitted with explicit state/batch shardings on `mesh`.

  The result is called as step(state, batch) and also offers `.lower(state, batch)` for
  ahead-of-time compilation; the state argument is donated unless donate=False.
  """
  state_sh = state_shardings(model, tx, mesh)
  batch_sh = {k: sharding.batch_sharding(mesh) for k in BATCH_KEYS}
  jitted = jax.jit(lambda s, b: train_step(model, tx, s, b),
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
