"""Token log-probabilities (the one implementation), and masked cross-entropy from them as a
(sum, count) pair."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LossSums:
  """A loss as the sum over counted tokens and their count; mean = total / count."""

  total: jax.Array
  count: jax.Array

  def __add__(self, other: "LossSums") -> "LossSums":
    """Returns the pair of sums over both sets of tokens (micro-batches, devices)."""
    return LossSums(self.total + other.total, self.count + other.count)

  def mean(self) -> jax.Array:
    """Returns total / count, or 0 when no token is counted."""
    return self.total / jnp.maximum(self.count, 1)


def token_cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                        mask_BxT: jax.Array) -> LossSums:
  """Returns the summed -log p(target) over tokens where mask is nonzero, and their count."""
  return token_cross_entropy_and_z(logits_BxTxV, targets_BxT, mask_BxT)[0]


def token_logprobs(logits_BxTxV: jax.Array,
                   targets_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns (log p(target), log Z), each (B, T) float32, of softmax(logits) in float32: the
  log-probability of each target token and the softmax normalizer."""
  logits = logits_BxTxV.astype(jnp.float32)
  log_z_BxT = jax.nn.logsumexp(logits, axis=-1)
  target_logit_BxT = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
  return target_logit_BxT - log_z_BxT, log_z_BxT


def token_entropy(logits_BxTxV: jax.Array, log_z_BxT: jax.Array) -> jax.Array:
  """Returns the (B, T) entropy of softmax(logits), given its normalizer log Z."""
  probs_BxTxV = jnp.exp(logits_BxTxV - log_z_BxT[..., None])
  return log_z_BxT - jnp.sum(probs_BxTxV * logits_BxTxV, axis=-1)


def token_cross_entropy_and_z(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                              mask_BxT: jax.Array) -> tuple[LossSums, jax.Array]:
  """Returns the masked cross-entropy sums and the masked sum of log(Z)^2 (the z-loss term,
  which keeps the softmax normalizer near 1 when weighted into the loss)."""
  logp_BxT, log_z_BxT = token_logprobs(logits_BxTxV, targets_BxT)
  mask = mask_BxT.astype(jnp.float32)
  sums = LossSums(total=jnp.sum(-logp_BxT * mask), count=jnp.sum(mask))
  return sums, jnp.sum(jnp.square(log_z_BxT) * mask)
