"""The DAPO policy loss and its aggregations against an independent NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.losses.dapo import AGGREGATIONS, PolicyLossConfig, aggregation_weights, policy_loss

CONFIG = PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0)


def _inputs():
  rng = np.random.default_rng(0)
  b, t = 6, 7
  old = rng.normal(-2.0, 0.5, (b, t))
  logp = old + rng.normal(0.0, 0.4, (b, t))
  logp[0, :3] = old[0, :3] + 1.6  # ratio ~5 > dual clip 3 where A < 0
  mask = (rng.random((b, t)) < 0.7).astype(np.float32)
  mask[3] = 0.0  # a fully masked row
  adv = np.array([-1.5, 0.8, -0.3, 1.0, 0.0, 2.0])
  groups = np.array([0, 0, 1, 1, 2, 2])
  return logp, old, adv, mask, groups


def _numpy_loss_and_grad(logp, old, adv, mask, groups, aggregation, cfg, norm=0):
  """The loss per token and d loss / d logp, written from the definitions."""
  a = np.broadcast_to(adv[:, None], logp.shape)
  r = np.exp(logp - old)
  clipped_r = np.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high)
  surrogate = np.maximum(-a * r, -a * clipped_r)
  grad = np.where(-a * r >= -a * clipped_r, -a * r, 0.0)  # the clipped branch is constant
  capped = (a < 0) & (surrogate > -a * cfg.dual_clip)
  loss = np.where(capped, -a * cfg.dual_clip, surrogate)
  grad = np.where(capped, 0.0, grad)
  b, t = logp.shape
  weights = np.zeros((b, t))
  if aggregation == "token-mean":
    weights = mask / mask.sum()
  elif aggregation in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
    live = [i for i in range(b) if mask[i].sum() > 0]
    for i in live:
      length = mask[i].sum() if aggregation == "seq-mean-token-mean" else (norm or t)
      weights[i] = mask[i] / length / len(live)
  else:
    live = [g for g in set(groups) if mask[groups == g].sum() > 0]
    for i in range(b):
      if groups[i] in live:
        weights[i] = mask[i] / mask[groups == groups[i]].sum() / len(live)
  return float(np.sum(loss * weights)), grad * weights


@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_loss_and_gradient_match_numpy(aggregation):
  logp, old, adv, mask, groups = _inputs()
  cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, aggregation=aggregation,
                         norm_tokens=10 if aggregation == "seq-mean-token-sum-norm" else 0)
  expected_loss, expected_grad = _numpy_loss_and_grad(logp, old, adv, mask, groups,
                                                      aggregation, cfg, cfg.norm_tokens)
  weights = aggregation_weights(jnp.asarray(mask), jnp.asarray(groups), aggregation,
                                cfg.norm_tokens)
  adv_bxt = jnp.broadcast_to(jnp.asarray(adv, jnp.float32)[:, None], logp.shape)

  def loss(lp):
    return policy_loss(lp, jnp.asarray(old, jnp.float32), adv_bxt, jnp.asarray(mask), weights,
                       cfg).loss

  value, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
  np.testing.assert_allclose(value, expected_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_clip_fractions_count_by_hand():
  ratios = np.array([[1.5, 0.5, 20.0, 1.0, 1.5]])
  adv = jnp.array([[1.0, -1.0, -1.0, 1.0, 1.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token would clip, but is masked
  sums = policy_loss(jnp.log(ratios), jnp.zeros((1, 5)), adv, mask,
                     aggregation_weights(mask, jnp.zeros(1, jnp.int32), "token-mean"),
                     PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=10.0))
  metrics = sums.metrics()
  assert float(metrics["clip_high"]) == 0.25  # A > 0, ratio 1.5 > 1.28
  assert float(metrics["clip_low"]) == 0.25  # A < 0, ratio 0.5 < 0.8
  assert float(metrics["dual_clip"]) == 0.25  # A < 0, ratio 20 > c = 10
  assert float(sums.tokens) == 4
  np.testing.assert_allclose(metrics["ratio"], (1.5 + 0.5 + 20.0 + 1.0) / 4, rtol=1e-6)
  # The dual clip caps the third token's loss at -A c = 10; the others: -1.28, 0.8, -1.
  np.testing.assert_allclose(sums.loss, (-1.28 + 0.8 + 10.0 - 1.0) / 4, rtol=1e-6)


def test_reference_kl_and_entropy_terms_are_added_per_token():
  mask = jnp.ones((1, 2))
  weights = aggregation_weights(mask, jnp.zeros(1, jnp.int32), "token-mean")
  logp, ref = jnp.log(jnp.array([[0.5, 0.25]])), jnp.log(jnp.array([[0.25, 0.25]]))
  entropy = jnp.array([[1.0, 2.0]])
  cfg = PolicyLossConfig(kl_coef=0.5, entropy_coef=0.1)
  base = policy_loss(logp, logp, jnp.ones((1, 2)), mask, weights, PolicyLossConfig())
  sums = policy_loss(logp, logp, jnp.ones((1, 2)), mask, weights, cfg, ref, entropy)
  k3 = np.array([0.5 - np.log(0.5) - 1.0, 0.0])  # exp(ref - logp) - (ref - logp) - 1
  np.testing.assert_allclose(sums.loss - base.loss, np.mean(0.5 * k3 - 0.1 * np.array([1, 2])),
                             rtol=1e-5)
  np.testing.assert_allclose(sums.metrics()["ref_kl"], k3.mean(), rtol=1e-5)


def _kl_metric(tokens, old, new, sampler=None, cap=2.0):
  """Returns approx_kl over one row of sampled token ids, under distributions old and new (and
  the behaviour policy `sampler`, whose tokens are then all stale)."""
  mask = jnp.ones((1, len(tokens)))
  logp_of = lambda p: jnp.log(jnp.asarray(p, jnp.float32)[np.asarray(tokens)])[None]
  weights = aggregation_weights(mask, jnp.zeros(1, jnp.int32), "token-mean")
  stale = None if sampler is None else mask
  sums = policy_loss(logp_of(new), logp_of(old), jnp.ones_like(mask), mask, weights,
                     PolicyLossConfig(behaviour_weight_cap=cap),
                     sampler_logp_BxT=None if sampler is None else logp_of(sampler),
                     stale_BxT=stale)
  return float(sums.metrics()["approx_kl"])


OLD, NEW = np.array([0.5, 0.25, 0.25]), np.array([0.2, 0.3, 0.5])
KL_OLD_NEW = float(np.sum(OLD * np.log(OLD / NEW)))  # closed form, 0.2350...


def test_approx_kl_is_kl_old_to_new_on_tokens_drawn_from_old():
  # Tokens in proportion to old (1/2, 1/4, 1/4): the sample mean of k3 is its expectation.
  assert abs(_kl_metric([0, 0, 1, 2], OLD, NEW) - KL_OLD_NEW) < 1e-6
  reverse = float(np.sum(NEW * np.log(NEW / OLD)))  # KL(new || old), 0.2218...: not reported
  assert abs(reverse - KL_OLD_NEW) > 0.01


def test_approx_kl_weights_stale_tokens_back_to_the_old_policy():
  # Tokens in proportion to a behaviour policy (1/4, 1/4, 1/2), weighted by old / behaviour.
  behaviour = np.array([0.25, 0.25, 0.5])
  assert abs(_kl_metric([0, 1, 2, 2], OLD, NEW, behaviour, cap=4.0) - KL_OLD_NEW) < 1e-6


def _decoupled(stale, sampler, cfg=CONFIG):
  """Returns (loss, d loss / d logp) of the decoupled objective on _inputs()."""
  logp, old, adv, mask, groups = _inputs()
  weights = aggregation_weights(jnp.asarray(mask), jnp.asarray(groups), "token-mean")
  a = jnp.broadcast_to(jnp.asarray(adv, jnp.float32)[:, None], logp.shape)

  def loss(lp):
    return policy_loss(lp, jnp.asarray(old, jnp.float32), a, jnp.asarray(mask), weights, cfg,
                       sampler_logp_BxT=None if sampler is None else jnp.asarray(sampler),
                       stale_BxT=None if stale is None else jnp.asarray(stale)).loss

  return jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))


def test_stale_tokens_are_weighted_by_the_truncated_behaviour_ratio():
  logp, old, adv, mask, groups = _inputs()
  rng = np.random.default_rng(1)
  sampler = old + rng.normal(0.0, 0.8, old.shape)  # the behaviour policy's log-probs
  stale = (rng.random(old.shape) < 0.5).astype(np.float32)
  cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, behaviour_weight_cap=1.5)
  per_token_loss, per_token_grad = _numpy_loss_and_grad(logp, old, adv, mask, groups,
                                                        "token-mean", cfg)
  w = np.where(stale > 0, np.minimum(np.exp(old - sampler), 1.5), 1.0)
  loss, grad = _decoupled(stale, sampler, cfg)
  np.testing.assert_allclose(grad, per_token_grad * w, rtol=1e-5, atol=1e-7)
  _, unweighted = _decoupled(None, None, cfg)
  np.testing.assert_allclose(grad, np.asarray(unweighted) * w, rtol=1e-5, atol=1e-7)
  assert np.any((stale > 0) & (np.exp(old - sampler) > 1.5))  # the cap was exercised


def test_without_stale_tokens_the_loss_is_the_synchronous_one_bit_for_bit():
  logp, old, *_ = _inputs()
  sampler = old + 0.3  # the sampler's numerics differ: not off-policyness
  loss, grad = _decoupled(np.zeros_like(old, np.float32), sampler)
  sync_loss, sync_grad = _decoupled(None, None)
  assert float(loss) == float(sync_loss)
  np.testing.assert_array_equal(grad, sync_grad)


@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_sums_of_halves_equal_the_whole(aggregation):
  """Weights from the whole mini-batch make any split (micro-batches, devices) exact."""
  logp, old, adv, mask, groups = _inputs()
  weights = aggregation_weights(jnp.asarray(mask), jnp.asarray(groups), aggregation)
  adv_bxt = jnp.broadcast_to(jnp.asarray(adv, jnp.float32)[:, None], logp.shape)
  parts = [policy_loss(jnp.asarray(logp[s]), jnp.asarray(old[s]), adv_bxt[s],
                       jnp.asarray(mask[s]), weights[s], CONFIG)
           for s in (slice(0, 3), slice(3, 6))]
  whole = policy_loss(jnp.asarray(logp), jnp.asarray(old), adv_bxt, jnp.asarray(mask), weights,
                      CONFIG)
  total = parts[0] + parts[1]
  np.testing.assert_allclose(total.loss, whole.loss, rtol=1e-6)
  np.testing.assert_allclose(total.metrics()["clip_high"], whole.metrics()["clip_high"])


@pytest.mark.parametrize("overrides,message", [
    (dict(aggregation="mean"), "aggregation='mean'"),
    (dict(eps_low=1.0), "eps_low"),
    (dict(dual_clip=1.1), "dual_clip=1.1"),
    (dict(behaviour_weight_cap=0.5), "behaviour_weight_cap=0.5"),
])
def test_bad_loss_settings_are_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    PolicyLossConfig(**overrides)


@pytest.fixture
def scaled_mask_aggregation():
  """Registers "test-scaled-mask" (weights = mask x norm_tokens) for one test, then removes it."""

  @AGGREGATIONS.register("test-scaled-mask")
  def scaled_mask(mask_BxT, group_B, norm_tokens):
    del group_B
    return mask_BxT * norm_tokens

  yield "test-scaled-mask"
  AGGREGATIONS.unregister("test-scaled-mask")


def test_an_aggregation_is_a_valid_setting_exactly_while_registered():
  AGGREGATIONS.register("test-while-registered")(lambda mask_BxT, group_B, norm_tokens: mask_BxT)
  PolicyLossConfig(aggregation="test-while-registered")  # accepted
  AGGREGATIONS.unregister("test-while-registered")
  with pytest.raises(ValueError, match="aggregation='test-while-registered'"):
    PolicyLossConfig(aggregation="test-while-registered")


# Row 2 has no trainable token, and it is group 1's only row: it counts in no denominator.
EMPTY_ROW_MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("aggregation, expected", [
    ("token-mean", [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0], [0, 0, 0]]),
    ("seq-mean-token-mean", [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0], [0, 0, 0]]),
    ("seq-mean-token-sum-norm", [[1 / 6, 1 / 6, 0], [1 / 6, 0, 0], [0, 0, 0]]),  # T=3, 2 rows
    ("group-token-mean", [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0], [0, 0, 0]]),
])
def test_empty_rows_and_groups_count_in_no_denominator(aggregation, expected):
  weights = aggregation_weights(jnp.array(EMPTY_ROW_MASK), jnp.array([0, 0, 1]), aggregation)
  np.testing.assert_allclose(weights, expected, rtol=1e-6)


def test_aggregation_weights_use_a_registered_aggregation(scaled_mask_aggregation):
  mask = jnp.array([[1, 0, 1], [0, 1, 1]])
  weights = aggregation_weights(mask, jnp.zeros(2, jnp.int32), scaled_mask_aggregation, 3)
  assert weights.dtype == jnp.float32  # the mask arrives as float32
  np.testing.assert_array_equal(weights, [[3, 0, 3], [0, 3, 3]])


def test_an_unknown_aggregation_lists_the_registered_names():
  with pytest.raises(ValueError, match="aggregation='mean'") as error:
    aggregation_weights(jnp.ones((1, 2)), jnp.zeros(1, jnp.int32), "mean")
  for name in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
               "group-token-mean"):
    assert repr(name) in str(error.value)


def test_an_aggregation_name_is_registered_once():
  with pytest.raises(ValueError, match="aggregation 'token-mean' is already registered"):
    AGGREGATIONS.register("token-mean")(lambda mask_BxT, group_B, norm_tokens: mask_BxT)
