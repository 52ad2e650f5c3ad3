"""The critic's clipped value loss, as token-exact sums over a global mini-batch.

Per token (mask 1), with V the critic's prediction, V_old the rollout-time value and R the
return: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), PPO's value clipping
with range c (`cliprange_value`; 0 turns it off). The loss is the sum of weight x loss, with
the weights of `coa_jax.losses.dapo.aggregation_weights` (token-mean: one over the mini-batch's
trainable tokens), so micro-batching and sharding leave it and its gradient unchanged.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class ValueLossSums:
  """The weighted loss and token sums of the critic's metrics (add them over micro-batches)."""

  loss: jax.Array
  tokens: jax.Array
  clipped: jax.Array  # tokens where the clipped term is the larger (its gradient is cut)
  value: jax.Array  # the predicted values
  error: jax.Array  # (V - R)^2

  def __add__(self, other: "ValueLossSums") -> "ValueLossSums":
    return jax.tree_util.tree_map(jnp.add, self, other)

  def metrics(self) -> dict[str, jax.Array]:
    """Returns the loss and the metrics as means over trainable tokens."""
    count = jnp.maximum(self.tokens, 1.0)
    return dict(value_loss=self.loss, value_clip_frac=self.clipped / count,
                value_pred_mean=self.value / count, value_mse=self.error / count)


def value_loss(values_BxT: jax.Array, old_values_BxT: jax.Array, returns_BxT: jax.Array,
               mask_BxT: jax.Array, weights_BxT: jax.Array,
               cliprange_value: float) -> ValueLossSums:
  """Returns the clipped value loss (weighted by `weights_BxT`) and metric sums over tokens
  with mask 1."""
  mask = mask_BxT > 0
  values = values_BxT.astype(jnp.float32)
  returns = returns_BxT.astype(jnp.float32)
  unclipped = jnp.square(values - returns)
  per_token, clipped = unclipped, jnp.zeros_like(unclipped, bool)
  if cliprange_value:
    near = jnp.clip(values, old_values_BxT - cliprange_value, old_values_BxT + cliprange_value)
    clipped_loss = jnp.square(near - returns)
    per_token = jnp.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
  masked_sum = lambda x: jnp.sum(jnp.where(mask, x, 0.0))
  return ValueLossSums(loss=0.5 * masked_sum(per_token * weights_BxT), tokens=masked_sum(1.0),
                       clipped=masked_sum(clipped), value=masked_sum(values),
                       error=masked_sum(unclipped))
