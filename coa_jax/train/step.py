"""The jitted, sharded language-model training step (forward, backward, optimizer update)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from coa_jax.losses import token_cross_entropy_and_z
from coa_jax.runtime import sharding
from coa_jax.train.batch import TokenBatch
from coa_jax.train.state import TrainState, state_shardings


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient was NaN/inf more often than the run allows; it stopped with the last
  good state saved."""


def lm_loss(model: nn.Module, params: Any, batch: TokenBatch):
  """Returns (token-mean loss, LossSums) of next-token prediction on `batch`."""
  sums, _ = _loss_sums(model, params, batch)
  return sums.mean(), sums


def _loss_sums(model: nn.Module, params: Any, batch: TokenBatch, rngs: Any = None):
  logits_BxTxV = model.apply({"params": params}, batch.input_ids, batch.positions,
                             batch.segment_ids, rngs=rngs)
  return token_cross_entropy_and_z(logits_BxTxV, batch.targets, batch.loss_mask)


def split_micro_batches(batch: Any, count: int) -> Any:
  """Returns the batch as (count, B / count, ...): micro-batch m holds rows m, m+count, ...,
  so every micro-batch stays evenly split over the devices that hold the batch."""
  def split(x):
    if x.shape[0] % count:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {count} micro-batches")
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)

  return jax.tree_util.tree_map(split, batch)


def summed_grads(objective: Callable[[Any, Any], tuple[jax.Array, Any]], params: Any,
                 batch: Any, micro_batches: int = 1, unroll: bool = False):
  """Returns (aux, grads) of `objective(params, micro) -> (value, aux)` summed over the
  micro-batches of `batch` (a scan): exact when value and aux are sums over tokens. With
  `unroll` (a model whose layers are unrolled: `unrolled_layers`) the scan is unrolled too, so
  no loop is left and XLA casts the weights once for every micro-batch and drops the add to
  zeros (docs/benchmarks.md: the 1.5B step in 2 micro-batches on H100, ahead of time)."""
  grad_fn = jax.grad(objective, has_aux=True)
  if micro_batches == 1:
    grads, aux = grad_fn(params, batch)
    return aux, grads

  def accumulate(carry, micro):
    return jax.tree_util.tree_map(jnp.add, carry, grad_fn(params, micro)), None

  micro = split_micro_batches(batch, micro_batches)
  first = jax.tree_util.tree_map(lambda x: x[0], micro)
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                 jax.eval_shape(grad_fn, params, first))
  (grads, aux), _ = jax.lax.scan(accumulate, zeros, micro, unroll=unroll)
  return aux, grads


def unrolled_layers(model: nn.Module) -> bool:
  """Returns whether the model's config unrolls its layers (`scan_unroll`, no layer loop): then
  its micro-batches are unrolled too (`summed_grads`). (A multi-device CPU program also unrolls
  its layers, `layer_unroll`, but to avoid a deadlock: its micro-batch loop is kept.)"""
  return model.config.scan_unroll >= model.config.num_layers


def apply_if_finite(tx: optax.GradientTransformation, state: TrainState, grads: Any,
                    loss: jax.Array, tokens: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
  """Returns (state after one optimizer update, metrics: grad_norm, is_finite, applied). The
  update is applied only when the loss and gradient are finite and the batch has a trainable
  token: otherwise params, optimizer state (moments, count) and step are left as they were, so
  an all-masked batch moves nothing (AdamW would still apply momentum and weight decay)."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  applied = finite & (tokens > 0)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(applied, n, o), new, old)
  new_state = state.replace(step=jnp.where(applied, state.step + 1, state.step),
                            params=keep(params, state.params),
                            opt_state=keep(opt_state, state.opt_state))
  return new_state, dict(grad_norm=grad_norm, is_finite=finite, applied=applied)


def summed_update(objective: Callable[[Any, Any], tuple[jax.Array, Any]],
                  tx: optax.GradientTransformation, state: TrainState, batch: Any,
                  micro_batches: int = 1, schedule: optax.Schedule | None = None,
                  unroll: bool = False) -> tuple[TrainState, Any, dict[str, jax.Array]]:
  """Returns (state, aux, metrics) after one optimizer step on the gradient of
  `objective(params, micro) -> (loss sum, aux)` summed over the micro-batches of `batch`
  (`summed_grads`, unrolled with `unroll`; aux.loss is the loss and aux.tokens the trainable
  tokens), applied only if finite and not empty (`apply_if_finite`); metrics hold grad_norm,
  is_finite, applied and, with a schedule, the step's lr."""
  aux, grads = summed_grads(objective, state.params, batch, micro_batches, unroll)
  new_state, metrics = apply_if_finite(tx, state, grads, aux.loss, aux.tokens)
  if schedule is not None:
    metrics["lr"] = schedule(state.step)
  return new_state, aux, metrics


def train_step(model: nn.Module, tx: optax.GradientTransformation, state: TrainState,
               batch: TokenBatch, *, micro_batches: int = 1, z_loss: float = 0.0,
               schedule: optax.Schedule | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """Returns the updated state and metrics of one optimizer step on `batch`.

  The loss is the sum over unmasked tokens of the whole batch divided by their count, so
  accumulating gradients over `micro_batches` (a scan) is token-exact. A non-finite loss or
  gradient, or a batch without a trainable token, leaves the state unchanged (is_finite,
  applied), so the caller can skip the batch or stop with the last good state.
  """
  def objective(params, micro_and_keys):
    micro, keys = micro_and_keys
    rngs = None if keys is None else {"dropout": jax.random.wrap_key_data(keys[0])}
    ce, z_total = _loss_sums(model, state.model_params(params), micro, rngs)
    return ce.total + z_loss * z_total, (ce, z_total)

  # LoRA dropout: a key per row, from the run's key and the step; a micro-batch draws its masks
  # from its first row's.
  keys = None
  if model.config.lora_rank and model.config.lora_dropout:
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    keys = jax.random.key_data(jax.random.split(step_key, batch.input_ids.shape[0]))
  (ce, z_total), grad_sums = summed_grads(objective, state.params, (batch, keys), micro_batches,
                                          unrolled_layers(model))
  count = jnp.maximum(ce.count, 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / count, grad_sums)
  loss = ce.mean()
  new_state, update = apply_if_finite(tx, state, grads, loss, ce.count)
  positions = jnp.maximum(jnp.sum(batch.segment_ids > 0), 1)
  metrics = dict(loss=loss, tokens=ce.count, unmasked_fraction=ce.count / positions, **update)
  if z_loss:  # the z term is reported only when it is part of the loss
    metrics["z_loss"] = z_total / count
  if schedule is not None:
    metrics["lr"] = schedule(state.step)
  return new_state, metrics


def run_step(step_fn: Callable, state: TrainState,
             batch: Any) -> tuple[TrainState, dict[str, float]]:
  """Returns (state, metrics as floats) of one jitted `step_fn(state, batch)` (whose metrics
  hold is_finite and applied, `apply_if_finite`) once every device has finished it.
  metrics["nonfinite"] is 1 when the loss or gradient was not finite, metrics["empty"] when it
  was finite but the batch had no trainable token: either way the update was not applied and
  the returned state is the one before it (the argument was donated, so the caller must keep
  the returned one either way). The flags come out of one program over the global batch, so
  every process sees the same values.

  Reading the metrics waits for one device only; waiting for the whole state keeps two steps
  from running at once. (The CPU hangs once blamed on overlapping steps came from collectives
  inside the scanned layer loop: `model.transformer.layer_unroll`.)
  """
  state, metrics = step_fn(state, batch)
  jax.block_until_ready(state)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  finite = metrics.pop("is_finite")
  metrics["nonfinite"] = 1.0 - finite
  metrics["empty"] = finite * (1.0 - metrics["applied"])
  return state, metrics


def jit_state_step(step: Callable, model: nn.Module, tx: optax.GradientTransformation,
                   mesh: Mesh, donate: bool = True) -> Callable:
  """Returns step(state, batch) -> (state, metrics) jitted on `mesh` with the train state's
  shardings, every batch leaf over the batch axes and replicated metrics; it also offers
  `.lower(state, batch)` for ahead-of-time compiles. The state is donated unless donate=False,
  except a LoRA state's frozen base: a separate argument, never donated, so that other
  programs can hold the same arrays (PPO's critic, the KL reference, the sampling weights)."""
  state_sh = state_shardings(model, tx, mesh)
  batch_sh, replicated = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  donated = (0,) if donate else ()
  if not model.config.lora_rank:
    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                     donate_argnums=donated)
    return sharding.bind_mesh(jitted, mesh)

  def frozen_apart(trained, frozen, batch):
    new, metrics = step(trained.replace(frozen=frozen), batch)
    return new.checkpointed(), metrics

  trained_sh = state_sh.checkpointed()
  bound = sharding.bind_mesh(jax.jit(
      frozen_apart, in_shardings=(trained_sh, state_sh.frozen, batch_sh),
      out_shardings=(trained_sh, replicated), donate_argnums=donated), mesh)

  def call(state, batch):
    new, metrics = bound(state.checkpointed(), state.frozen, batch)
    return new.replace(frozen=state.frozen), metrics

  call.lower = lambda state, batch: bound.lower(state.checkpointed(), state.frozen, batch)
  return call


def jit_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                   donate: bool = True, **step_options: Any) -> Callable:
  """Returns `train_step` jitted by `jit_state_step`; `step_options` (micro_batches, z_loss,
  schedule) are passed to `train_step`."""
  return jit_state_step(lambda s, b: train_step(model, tx, s, b, **step_options), model, tx,
                        mesh, donate)


def next_token_batch(tokens_BxT1: np.ndarray) -> TokenBatch:
  """Returns an unpacked training batch from (B, T+1) token rows: inputs, shifted targets."""
  tokens = np.asarray(tokens_BxT1, np.int32)
  inputs = np.ascontiguousarray(tokens[:, :-1])
  positions = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)
  return TokenBatch(input_ids=inputs, targets=np.ascontiguousarray(tokens[:, 1:]),
                    loss_mask=np.ones_like(inputs), positions=np.ascontiguousarray(positions),
                    segment_ids=np.ones_like(inputs))
