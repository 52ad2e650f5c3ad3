"""The DAPO clipped policy-gradient loss, as token-exact sums over a global mini-batch.

Per token (mask 1): ratio = exp(clamp(logp - old_logp)); the PPO surrogate
max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)) with decoupled clip ratios
("clip-higher"); for negative advantages a dual clip caps it at -A c. Optional terms: a k3
KL to a reference policy and an entropy bonus (both off by default, as in the reference).

Off-policy tokens use the decoupled objective: old_logp is the proximal policy (the trainer's
weights when the batch is formed), which the ratio is clipped against, and a token whose
sampling distribution was not the proximal policy's (stale mask 1: an older policy sampled it
or wrote the KV cache it was sampled over, or top-k / top-p truncated it; `coa_jax.rl.batch`)
has its surrogate weighted by the behaviour importance weight min(p_proximal / p_sampler, cap),
p_sampler the probability it was drawn with, a constant to the gradient. Every other token gets
weight exactly 1, so with no stale token the loss and its gradient are the synchronous ones
bit for bit: the sampler's and the teacher-forced log-probs of one policy differ only by
rounding, which is not off-policyness.

How per-token losses combine is the aggregation, expressed as a weight per token that
`aggregation_weights` computes from the masks of the whole (global) mini-batch before it is
split into micro-batches or over devices. The loss is then the plain sum of weight x loss, so
micro-batching and sharding leave it, and its gradient, exactly unchanged:

- `token-mean` (the default, and the reference's): every unmasked token of the mini-batch
  counts once: w = 1 / (unmasked tokens);
- `seq-mean-token-mean` (original GRPO): the mean over sequences of each sequence's token mean;
- `seq-mean-token-sum-norm` (Dr.GRPO): each sequence's token sum over a constant length,
  averaged over sequences;
- `group-token-mean` (the DAPO paper's formula read literally): a token mean within each
  prompt's group of samples, averaged over groups.

Sequences (or groups) without any unmasked token (e.g. overlong-filtered) count in no mean, so
that a filter removes samples without rescaling the update of the others (verl's current
`agg_loss` divides the seq-mean modes by every row instead; docs/dapo.md, "Empty rows").

The config's `aggregation` names a function in the `AGGREGATIONS` registry. A new mode is a
function and a name: `@AGGREGATIONS.register("name")` on a function
`(mask_BxT float32, group_B, norm_tokens) -> weights_BxT` whose weights are 0 wherever the mask
is; `PolicyLossConfig(aggregation="name")` then accepts it and `aggregation_weights` uses it.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from coa_jax.losses.registry import Registry

# (mask_BxT float32, group_B, norm_tokens) -> weights_BxT, by the config's `aggregation` name.
AGGREGATIONS = Registry("aggregation")
register_aggregation = AGGREGATIONS.register


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
  """The clipped objective's settings (the reference's values by default)."""

  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 10.0  # cap -A * c for A < 0; 0 turns the dual clip off
  aggregation: str = "token-mean"
  norm_tokens: int = 0  # seq-mean-token-sum-norm's constant length; 0: the padded row length
  log_ratio_clamp: float = 20.0  # |logp - old_logp| is clamped before exp
  kl_coef: float = 0.0  # k3 KL to the reference policy
  entropy_coef: float = 0.0  # entropy bonus
  behaviour_weight_cap: float = 2.0  # truncates the importance weight of stale tokens

  def __post_init__(self):
    AGGREGATIONS.get(self.aggregation)  # an unknown name raises, listing the registered ones
    if not 0 <= self.eps_low < 1 or self.eps_high < 0:
      raise ValueError(f"clip ratios must satisfy 0 <= eps_low < 1 and eps_high >= 0, got "
                       f"eps_low={self.eps_low}, eps_high={self.eps_high}")
    if self.dual_clip and self.dual_clip <= 1 + self.eps_high:
      raise ValueError(f"dual_clip={self.dual_clip} must exceed 1 + eps_high (or be 0: off)")
    if self.norm_tokens < 0 or self.log_ratio_clamp <= 0:
      raise ValueError(f"norm_tokens must be >= 0 and log_ratio_clamp > 0, got "
                       f"{self.norm_tokens}, {self.log_ratio_clamp}")
    if self.behaviour_weight_cap < 1:
      raise ValueError(f"behaviour_weight_cap={self.behaviour_weight_cap} must be >= 1 (fresh "
                       f"tokens have weight 1)")
    if self.kl_coef < 0 or self.entropy_coef < 0:
      raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, "
                       f"{self.entropy_coef}")


@flax.struct.dataclass
class PolicyLossSums:
  """The weighted loss (already normalized by its aggregation) and token sums of metrics.

  Adding two of these (micro-batches, devices) gives the pair of the union of their tokens;
  `metrics()` divides each metric sum by the unmasked token count.
  """

  loss: jax.Array
  tokens: jax.Array
  clip_high: jax.Array  # A > 0 and ratio > 1 + eps_high (the gradient is cut)
  clip_low: jax.Array  # A < 0 and ratio < 1 - eps_low
  dual_clip: jax.Array  # A < 0 and ratio > c
  # KL(old || new), old the proximal policy (the ratio's denominator): the k3 estimate
  # (r - 1) - log r, r = new / old, at tokens drawn from old. A stale token, drawn from
  # another distribution, counts with its behaviour weight (importance sampling).
  approx_kl: jax.Array
  ratio: jax.Array
  entropy: jax.Array
  ref_kl: jax.Array
  stale: jax.Array  # tokens sampled by an older policy than the proximal one
  behaviour_weight: jax.Array  # the importance weight (1 on fresh tokens)
  truncated: jax.Array  # stale tokens whose weight the cap cut

  def __add__(self, other: "PolicyLossSums") -> "PolicyLossSums":
    return jax.tree_util.tree_map(jnp.add, self, other)

  def metrics(self) -> dict[str, jax.Array]:
    """Returns the loss and every metric as a mean over unmasked tokens."""
    count = jnp.maximum(self.tokens, 1.0)
    means = {name: getattr(self, name) / count for name in
             ("clip_high", "clip_low", "dual_clip", "approx_kl", "ratio", "entropy", "ref_kl",
              "stale", "behaviour_weight", "truncated")}
    return dict(pg_loss=self.loss, tokens=self.tokens, **means)


def aggregation_weights(mask_BxT: jax.Array, group_B: jax.Array, aggregation: str,
                        norm_tokens: int = 0) -> jax.Array:
  """Returns the (B, T) weights whose sum with per-token losses is the aggregated loss.

  `mask_BxT` and `group_B` (each row's prompt-group id, in [0, B)) must cover the whole
  mini-batch; the weights are 0 wherever the mask is 0. `aggregation` names a function in
  `AGGREGATIONS` (an unknown name raises ValueError listing the registered ones).
  """
  return AGGREGATIONS.get(aggregation)(mask_BxT.astype(jnp.float32), group_B, norm_tokens)


def _rows_with_tokens(row_tokens_B: jax.Array) -> jax.Array:
  """Returns the number of rows with an unmasked token, at least 1."""
  return jnp.maximum(jnp.sum(row_tokens_B > 0), 1)


@AGGREGATIONS.register("token-mean")
def token_mean(mask_BxT: jax.Array, group_B: jax.Array, norm_tokens: int) -> jax.Array:
  """Returns 1 / (unmasked tokens of the mini-batch) at every unmasked token."""
  del group_B, norm_tokens
  return mask_BxT / jnp.maximum(mask_BxT.sum(), 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(mask_BxT: jax.Array, group_B: jax.Array, norm_tokens: int) -> jax.Array:
  """Returns the weights of the mean over sequences of each sequence's token mean."""
  del group_B, norm_tokens
  row_tokens_B = mask_BxT.sum(axis=1)
  return mask_BxT / jnp.maximum(row_tokens_B, 1.0)[:, None] / _rows_with_tokens(row_tokens_B)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(mask_BxT: jax.Array, group_B: jax.Array, norm_tokens: int) -> jax.Array:
  """Returns the weights of the mean over sequences of each sequence's token sum over a
  constant length: `norm_tokens`, or the padded row length when 0."""
  del group_B
  rows_with_tokens = _rows_with_tokens(mask_BxT.sum(axis=1))
  length = norm_tokens or mask_BxT.shape[1]
  return mask_BxT / (length * rows_with_tokens)


@AGGREGATIONS.register("group-token-mean")
def group_token_mean(mask_BxT: jax.Array, group_B: jax.Array, norm_tokens: int) -> jax.Array:
  """Returns the weights of the mean over prompt groups of each group's token mean."""
  del norm_tokens
  row_tokens_B = mask_BxT.sum(axis=1)
  batch = mask_BxT.shape[0]
  group_tokens_G = jax.ops.segment_sum(row_tokens_B, group_B, num_segments=batch)
  groups_with_tokens = jnp.maximum(jnp.sum(group_tokens_G > 0), 1)
  return mask_BxT / jnp.maximum(group_tokens_G[group_B], 1.0)[:, None] / groups_with_tokens


def behaviour_weights(old_logp_BxT: jax.Array, sampler_logp_BxT: jax.Array,
                      stale_BxT: jax.Array, config: PolicyLossConfig) -> jax.Array:
  """Returns min(p_proximal / p_sampler, cap) on stale tokens and exactly 1 elsewhere."""
  log_w = jnp.clip(old_logp_BxT - sampler_logp_BxT, -config.log_ratio_clamp,
                   config.log_ratio_clamp)
  return jnp.where(stale_BxT > 0, jnp.minimum(jnp.exp(log_w), config.behaviour_weight_cap), 1.0)


def policy_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_BxT: jax.Array,
                mask_BxT: jax.Array, weights_BxT: jax.Array, config: PolicyLossConfig,
                ref_logp_BxT: jax.Array | None = None,
                entropy_BxT: jax.Array | None = None,
                sampler_logp_BxT: jax.Array | None = None,
                stale_BxT: jax.Array | None = None) -> PolicyLossSums:
  """Returns the weighted clipped-surrogate loss and metric sums over unmasked tokens; with
  `stale_BxT` (and `sampler_logp_BxT`), the decoupled objective's behaviour weights."""
  mask = mask_BxT.astype(jnp.float32)
  adv = advantages_BxT.astype(jnp.float32)
  log_ratio = jnp.clip(logp_BxT - old_logp_BxT, -config.log_ratio_clamp, config.log_ratio_clamp)
  ratio = jnp.exp(log_ratio)
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  per_token = jnp.maximum(unclipped, clipped)
  dual = jnp.zeros_like(mask)
  if config.dual_clip:
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, -adv * config.dual_clip), per_token)
    dual = ((adv < 0) & (ratio > config.dual_clip)).astype(jnp.float32)
  stale = jnp.zeros_like(mask) if stale_BxT is None else stale_BxT.astype(jnp.float32)
  behaviour = jnp.ones_like(mask)
  if stale_BxT is not None:
    behaviour = behaviour_weights(old_logp_BxT, sampler_logp_BxT, stale, config)
    per_token = per_token * jax.lax.stop_gradient(behaviour)
  ref_kl = jnp.zeros_like(mask)
  if ref_logp_BxT is not None:
    ref_kl = _k3(ref_logp_BxT - logp_BxT)
    per_token = per_token + config.kl_coef * ref_kl
  entropy = jnp.zeros_like(mask) if entropy_BxT is None else entropy_BxT
  if entropy_BxT is not None and config.entropy_coef:
    per_token = per_token - config.entropy_coef * entropy_BxT
  masked_sum = lambda x: jnp.sum(jnp.where(mask > 0, x, 0.0))
  return PolicyLossSums(
      loss=masked_sum(per_token * weights_BxT),
      tokens=mask.sum(),
      clip_high=masked_sum((adv > 0) & (ratio > 1.0 + config.eps_high)),
      clip_low=masked_sum((adv < 0) & (ratio < 1.0 - config.eps_low)),
      dual_clip=masked_sum(dual),
      approx_kl=masked_sum(behaviour * _k3(log_ratio)),
      ratio=masked_sum(ratio),
      entropy=masked_sum(entropy),
      ref_kl=masked_sum(ref_kl),
      stale=masked_sum(stale),
      behaviour_weight=masked_sum(behaviour),
      truncated=masked_sum((stale > 0) & (behaviour >= config.behaviour_weight_cap)))


def _k3(log_q_over_p: jax.Array) -> jax.Array:
  """Returns the k3 estimator of KL(p || q) from log(q / p) at samples of p (>= 0)."""
  return jnp.exp(log_q_over_p) - log_q_over_p - 1.0
