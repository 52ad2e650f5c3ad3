"""Jitted, sharded DAPO computations: teacher-forced log-probs and the policy update step."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from coa_jax.losses import token_entropy, token_logprobs
from coa_jax.losses.dapo import PolicyLossConfig, aggregation_weights, policy_loss
from coa_jax.runtime import sharding
from coa_jax.train.batch import PolicyBatch
from coa_jax.train.state import TrainState
from coa_jax.train.step import jit_state_step, summed_update, unrolled_layers


def policy_logprobs(model: nn.Module, params: Any, batch: PolicyBatch,
                    temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Returns (log p(target), entropy of the next-token distribution), each (B, T) float32, of
  the policy at the sampling `temperature` (softmax(logits / temperature)), which is the
  policy the rollouts sampled from."""
  logits_BxTxV = model.apply({"params": params}, batch.input_ids, batch.positions,
                             batch.segment_ids).astype(jnp.float32) / temperature
  logp_BxT, log_z_BxT = token_logprobs(logits_BxTxV, batch.targets)
  return logp_BxT, token_entropy(logits_BxTxV, log_z_BxT)


def dapo_step(model: nn.Module, tx: optax.GradientTransformation, state: TrainState,
              batch: PolicyBatch, *, loss_config: PolicyLossConfig,
              micro_batches: int = 1, temperature: float = 1.0,
              schedule: optax.Schedule | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """Returns the state after one optimizer step on the mini-batch `batch`, and its metrics.

  The aggregation weights come from the whole mini-batch's masks before it is split into
  `micro_batches`, so the loss and its gradient do not depend on the split or the sharding.
  `batch.old_logp` must hold the rollout policy's teacher-forced log-probs and `batch.ref_logp`
  (only when loss_config.kl_coef > 0) the reference policy's. A non-finite loss or gradient,
  or a mini-batch without a trainable token, leaves the state unchanged (is_finite, applied).
  A LoRA state trains its adapters without dropout: at the first update the ratio's numerator
  is the very function old_logp was computed with.
  """
  weights_BxT = aggregation_weights(batch.loss_mask, batch.group, loss_config.aggregation,
                                    loss_config.norm_tokens)

  def objective(params, micro):
    micro, weights = micro
    logp, entropy = policy_logprobs(model, state.model_params(params), micro, temperature)
    sums = policy_loss(logp, micro.old_logp, micro.advantages, micro.loss_mask, weights,
                       loss_config, micro.ref_logp, entropy, micro.sampler_logp, micro.stale_mask)
    return sums.loss, sums

  new_state, sums, metrics = summed_update(objective, tx, state, (batch, weights_BxT),
                                           micro_batches, schedule,
                                           unrolled_layers(model))
  return new_state, {**sums.metrics(), **metrics}


def jit_dapo_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                  donate: bool = True, **step_options: Any) -> Callable:
  """Returns `dapo_step` jitted by `jit_state_step` (called as step(state, batch), with
  `.lower`); `step_options` go to `dapo_step`."""
  return jit_state_step(lambda s, b: dapo_step(model, tx, s, b, **step_options), model, tx,
                        mesh, donate)


def jit_policy_logprobs(model: nn.Module, mesh: Mesh, params_shardings: Any,
                       temperature: float = 1.0) -> Callable:
  """Returns `policy_logprobs` jitted on `mesh`: called as fn(params, batch) -> (logp,
  entropy), both sharded like the batch."""
  jitted = jax.jit(lambda p, b: policy_logprobs(model, p, b, temperature),
                   in_shardings=(params_shardings, sharding.batch_sharding(mesh)),
                   out_shardings=sharding.batch_sharding(mesh))
  return sharding.bind_mesh(jitted, mesh)
