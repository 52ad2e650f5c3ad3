"""Generalized advantage estimation over token sequences that hold observation tokens.

A row's trainable tokens (mask 1, the policy's own samples) are its actions; observation,
prompt and padding tokens (mask 0) are not. GAE runs over the actions alone: a reverse scan
over the row carries the next action's value and the running advantage across every masked
token unchanged, so the values and rewards the model gives masked tokens change nothing, and
the advantages equal GAE on the sequence of the row's trainable tokens taken by themselves.

    delta_k = r_k + gamma * V_{k+1} - V_k,   A_k = delta_k + gamma * lambda * A_{k+1}

over the row's actions k, where V_k is the value of the state action k is taken in (the prefix
before its token) and V_{n+1}, after the last action, is 0 for a terminal row and, for a
bootstrapped one (a truncated sample, whose outcome is unknown), the value of the state after
the row's last token, which the caller gives (`coa_jax.rl.critic`: one more position of the
value model's forward pass, the whole sequence). A row of packed samples (an agent session's
calls that do not extend each other, `segment_ids` 1, 2, ...) holds one episode per segment:
each gets the row's outcome on its last action and is terminal after it. Returns are A + V. Advantages are whitened over trainable tokens only (`masked_moments` gives
the sums, so a batch split into mini-batches, devices or hosts whitens with its global
statistics).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def last_token_index(mask_BxT: jax.Array) -> jax.Array:
  """Returns each row's index of its last token with mask 1 (T - 1 for a row without one:
  callers weigh what they read there by the mask)."""
  seq = mask_BxT.shape[1]
  return seq - 1 - jnp.argmax(mask_BxT[:, ::-1] > 0, axis=1)


def outcome_rewards(rewards_B: jax.Array, mask_BxT: jax.Array,
                    segment_ids_BxT: jax.Array | None = None) -> jax.Array:
  """Returns (B, T) token rewards holding each row's reward on its last trainable token, or with
  `segment_ids_BxT` (packed samples: 1, 2, ... along the row, 0 on padding) on the last
  trainable token of each of its segments (each an episode with the row's reward)."""
  mask = mask_BxT > 0
  if segment_ids_BxT is None:
    last_BxT = jnp.arange(mask_BxT.shape[1])[None, :] == last_token_index(mask_BxT)[:, None]
  else:
    def back(next_segment, x):  # the segment of the nearest trainable token to the right
      segment, trainable = x
      return jnp.where(trainable, segment, next_segment), trainable & (segment != next_segment)

    rows = mask.shape[0]
    _, last_TxB = jax.lax.scan(back, jnp.full((rows,), -1, segment_ids_BxT.dtype),
                               (segment_ids_BxT.T, mask.T), reverse=True)
    last_BxT = last_TxB.T
  return jnp.where(last_BxT & mask, rewards_B[:, None].astype(jnp.float32), 0.0)


def adaptive_lambda(mask_BxT: jax.Array, alpha: float,
                    segment_ids_BxT: jax.Array | None = None) -> jax.Array:
  """Returns VAPO's length-adaptive lambda, 1 - 1 / (alpha * l) clipped to [0, 1], with l the
  row's trainable tokens (one lambda per row), or with `segment_ids_BxT` its segment's (one per
  token)."""
  trainable = (mask_BxT > 0).astype(jnp.float32)
  if segment_ids_BxT is None:
    length = jnp.sum(trainable, axis=1)
  else:  # each token's segment's count: the counts scattered by segment id, gathered back
    counts = jax.vmap(lambda ids, t: jnp.zeros(ids.shape[0] + 1).at[ids].add(t))(
        segment_ids_BxT, trainable)
    length = jnp.take_along_axis(counts, segment_ids_BxT, axis=1)
  return jnp.clip(1.0 - 1.0 / (alpha * jnp.maximum(length, 1.0)), 0.0, 1.0)


def gae(rewards_BxT: jax.Array, values_BxT: jax.Array, mask_BxT: jax.Array, gamma: float,
        lam: float | jax.Array, next_value_B: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Returns (advantages, returns), each (B, T) float32 and 0 on masked tokens.

  `lam` is a scalar, one lambda per row or one per token; `next_value_B` is each row's value
  after its last action (0: terminal; None: every row terminal). Rewards and values on masked
  tokens are ignored. With `segment_ids_BxT` (packed samples) each segment is an episode of its
  own: terminal after its last action, except the row's last, which `next_value_B` continues.
  """
  mask = mask_BxT > 0
  values = values_BxT.astype(jnp.float32)
  rows, seq = values.shape
  lam = jnp.asarray(lam, jnp.float32)
  lam_BxT = jnp.broadcast_to(lam[:, None] if lam.ndim == 1 else lam, (rows, seq))
  if next_value_B is None:
    next_value_B = jnp.zeros((rows,), jnp.float32)
  next_value_B = jnp.asarray(next_value_B, jnp.float32)
  if segment_ids_BxT is None:  # one segment: no boundary is ever crossed
    segment_ids_BxT = jnp.ones((rows, seq), jnp.int32)

  def back(carry, x):
    next_value, running, next_segment = carry
    reward, value, trainable, lam_B, segment = x
    ends = (segment != next_segment) & (segment > 0) & (next_segment > 0)  # a segment's end
    next_value, running = jnp.where(ends, 0.0, next_value), jnp.where(ends, 0.0, running)
    advantage = reward + gamma * next_value - value + gamma * lam_B * running
    carry = (jnp.where(trainable, value, next_value), jnp.where(trainable, advantage, running),
             segment)
    return carry, jnp.where(trainable, advantage, 0.0)

  xs = (rewards_BxT.astype(jnp.float32).T, values.T, mask.T, lam_BxT.T, segment_ids_BxT.T)
  init = (next_value_B, jnp.zeros((rows,)), jnp.zeros((rows,), segment_ids_BxT.dtype))
  _, advantages_TxB = jax.lax.scan(back, init, xs, reverse=True)
  advantages = advantages_TxB.T
  return advantages, jnp.where(mask, advantages + values, 0.0)


def masked_moments(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Returns [count, sum, sum of squares] of x over the tokens with mask 1 (add these over
  mini-batches for the statistics of their union)."""
  mask = (mask_BxT > 0).astype(jnp.float32)
  x = jnp.where(mask > 0, x_BxT.astype(jnp.float32), 0.0)
  return jnp.stack([mask.sum(), x.sum(), (x * x).sum()])


def mean_std(moments: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns (mean, Bessel-corrected std) from `masked_moments` sums (0, 0 without tokens)."""
  count, total, squares = moments[0], moments[1], moments[2]
  mean = total / jnp.maximum(count, 1.0)
  var = (squares - count * mean * mean) / jnp.maximum(count - 1.0, 1.0)
  return mean, jnp.sqrt(jnp.maximum(var, 0.0))


def whiten(x_BxT: jax.Array, mask_BxT: jax.Array, moments: jax.Array,
           eps: float = 1e-8) -> jax.Array:
  """Returns (x - mean) / (std + eps) on tokens with mask 1 and 0 elsewhere, with the mean and
  std of `moments` (the `masked_moments` of the whole batch)."""
  mean, std = mean_std(moments)
  return jnp.where(mask_BxT > 0, (x_BxT - mean) / (std + eps), 0.0)
