"""How a decode step draws its tokens: the sampling settings (static for a batch, or row by
row), the draw from explicit keys, and each row's keys.

Log-probabilities are those of the distribution each token was drawn from: softmax(logits /
temperature) restricted to the tokens that top-k and top-p keep and renormalised, i.e.
log_softmax(logits / temperature) minus the log of the kept tokens' total probability (which is
1 with neither on). Greedy decoding records log_softmax(logits). The update's own log-probs are
of the tempered policy without truncation (`coa_jax.rl.update.policy_logprobs`; docs/dapo.md).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn: temperature 0 is greedy; top_k 0 and top_p 1.0 switch those off."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @property
  def truncates(self) -> bool:
    """Returns whether top-k or top-p cut the tempered policy before tokens are drawn."""
    return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)

  def __post_init__(self):
    if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"invalid sampling settings {self}: need temperature >= 0, top_k >= 0, "
                       f"0 < top_p <= 1")


@flax.struct.dataclass
class RowSampling:
  """Sampling settings row by row (a serving engine's requests each bring their own): the
  fields of `SamplingConfig` as (B,) arrays. A sampler built with `sampling=None` takes them
  with every decode chunk; a row samples as the static `SamplingConfig` of its values would."""

  temperature_B: jax.Array  # float32; 0: greedy
  top_k_B: jax.Array  # int32; 0: off
  top_p_B: jax.Array  # float32; 1.0: off

  @classmethod
  def of(cls, rows: Sequence[SamplingConfig]) -> RowSampling:
    """Returns the rows' settings as host arrays (row b samples as rows[b])."""
    return cls(np.asarray([r.temperature for r in rows], np.float32),
               np.asarray([r.top_k for r in rows], np.int32),
               np.asarray([r.top_p for r in rows], np.float32))


def sample_tokens(logits_BxV: jax.Array, keys_B: jax.Array,
                  sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """Returns (token_B, logprob_B) drawn from `logits_BxV` under `sampling`, row b with keys_B[b]:
  logprob_B under the distribution drawn from (see the module docstring)."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  if sampling.temperature == 0:
    token_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  else:
    scaled_BxV = logits_BxV / sampling.temperature
    kept_BxV = scaled_BxV
    if sampling.top_k:
      kth_Bx1 = jax.lax.top_k(scaled_BxV, sampling.top_k)[0][:, -1:]
      kept_BxV = jnp.where(scaled_BxV < kth_Bx1, -jnp.inf, kept_BxV)
    if sampling.top_p < 1.0:
      # Keep the smallest set of most likely tokens whose probability reaches top_p.
      sorted_BxV = jnp.sort(kept_BxV, axis=-1)[:, ::-1]
      probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
      before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
      cutoff_Bx1 = jnp.min(jnp.where(before_BxV < sampling.top_p, sorted_BxV, jnp.inf), axis=-1,
                           keepdims=True)
      kept_BxV = jnp.where(kept_BxV < cutoff_Bx1, -jnp.inf, kept_BxV)
    token_B = jax.vmap(jax.random.categorical)(keys_B, kept_BxV).astype(jnp.int32)
    # The distribution the token was drawn from: the kept tokens' renormalised softmax.
    logp_BxV = jax.nn.log_softmax(kept_BxV, axis=-1)
  logprob_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B, logprob_B


def sample_rows(logits_BxV: jax.Array, keys_B: jax.Array,
                rows: RowSampling) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`sample_tokens` with each row's own settings; returns (token_B, logprob_B, logp_BxV), the
  last the log-probs of the distribution each row drew from (-inf where truncated). The same
  operations as `sample_tokens`, so a row samples what the static settings of its values do."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  greedy_B = rows.temperature_B == 0
  scaled_BxV = logits_BxV / jnp.where(greedy_B, 1.0, rows.temperature_B)[:, None]
  # One descending sort serves both cuts: top-k's threshold is its k-th value, and top-p's
  # cumulative mass is taken over the sorted values that top-k kept.
  sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
  kth_B = jnp.clip(rows.top_k_B - 1, 0, logits_BxV.shape[-1] - 1)
  kth_Bx1 = jnp.take_along_axis(sorted_BxV, kth_B[:, None], axis=-1)
  kth_Bx1 = jnp.where(rows.top_k_B[:, None] > 0, kth_Bx1, -jnp.inf)
  kept_BxV = jnp.where(scaled_BxV < kth_Bx1, -jnp.inf, scaled_BxV)
  sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)
  probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
  before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  top_p_Bx1 = rows.top_p_B[:, None]
  cutoff_Bx1 = jnp.min(jnp.where(before_BxV < top_p_Bx1, sorted_BxV, jnp.inf), axis=-1,
                       keepdims=True)
  cutoff_Bx1 = jnp.where(top_p_Bx1 < 1.0, cutoff_Bx1, -jnp.inf)
  kept_BxV = jnp.where(kept_BxV < cutoff_Bx1, -jnp.inf, kept_BxV)
  drawn_B = jax.vmap(jax.random.categorical)(keys_B, kept_BxV).astype(jnp.int32)
  token_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), drawn_B)
  logp_BxV = jnp.where(greedy_B[:, None], jax.nn.log_softmax(logits_BxV, axis=-1),
                       jax.nn.log_softmax(kept_BxV, axis=-1))
  logprob_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B, logprob_B, logp_BxV


def token_keys(key: jax.Array, seed_B: jax.Array, position_B: jax.Array) -> jax.Array:
  """Returns the (B,) keys rows draw their tokens at cache positions position_B with."""
  return jax.vmap(lambda seed, t: jax.random.fold_in(jax.random.fold_in(key, seed), t))(
      seed_B, position_B)
