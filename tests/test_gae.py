"""Masked GAE, whitening and the clipped value loss against an independent NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.losses import gae as gae_lib
from coa_jax.losses.dapo import aggregation_weights
from coa_jax.losses.value import value_loss


def _numpy_gae(rewards, values, mask, gamma, lams, next_values):
  """Textbook GAE over each row's trainable tokens taken alone (a Python loop), scattered back;
  next_values[b]: the value after row b's last action."""
  advantages, returns = np.zeros_like(values), np.zeros_like(values)
  for b in range(values.shape[0]):
    where = np.flatnonzero(mask[b])
    if not len(where):
      continue
    r, v = rewards[b, where], values[b, where]
    next_value, running = next_values[b], 0.0
    out = np.zeros(len(where))
    for k in reversed(range(len(where))):
      running = r[k] + gamma * next_value - v[k] + gamma * lams[b] * running
      out[k], next_value = running, v[k]
    advantages[b, where] = out
    returns[b, where] = out + v
  return advantages, returns


def _rows(seed=0):
  """Rows of sampled spans with observation spans between them, and padding after."""
  rng = np.random.default_rng(seed)
  b, t = 5, 24
  mask = np.zeros((b, t), np.int32)
  for row in range(b):
    end, pos, sampled = rng.integers(12, t + 1), rng.integers(1, 4), True
    while pos < end:
      span = int(rng.integers(1, 5))
      mask[row, pos:min(pos + span, end)] = sampled
      pos, sampled = pos + span, not sampled
  mask[3] = 0  # a row without trainable tokens (an overlong-filtered sample)
  values = rng.normal(0.0, 1.0, (b, t)).astype(np.float32)
  outcome = rng.choice([-1.0, 1.0], b).astype(np.float32)
  return mask, values, outcome


TERMINAL = np.zeros(5, np.float32)  # every row's value after its last action: 0
BOOTSTRAPPED = np.array([0.7, -0.4, 0.0, 0.0, 1.3], np.float32)  # rows 0, 1 and 4 bootstrapped


def _gae(rewards, values, mask, gamma, lam, next_values):
  adv, ret = jax.jit(gae_lib.gae, static_argnums=(3,))(
      jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, jnp.asarray(lam),
      jnp.asarray(next_values))
  return np.asarray(adv), np.asarray(ret)


def test_outcome_reward_sits_on_the_last_trainable_token():
  mask = np.array([[0, 1, 1, 0, 0, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0], [0] * 8])
  rewards = np.asarray(gae_lib.outcome_rewards(jnp.array([2.0, -1.0, 5.0]), jnp.asarray(mask)))
  expected = np.zeros((3, 8))
  expected[0, 5], expected[1, 3] = 2.0, -1.0  # the row without tokens gets none
  np.testing.assert_array_equal(rewards, expected)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_equals_gae_on_the_trainable_tokens_alone(gamma, lam):
  mask, values, outcome = _rows()
  rewards = np.asarray(gae_lib.outcome_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  rewards = rewards + np.random.default_rng(1).normal(0, 0.1, rewards.shape) * mask  # dense too
  lams = np.full(5, lam, np.float32)
  adv, ret = _gae(rewards, values, mask, gamma, lams, TERMINAL)
  want_adv, want_ret = _numpy_gae(rewards, values, mask, gamma, lams, TERMINAL)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)


def test_values_and_rewards_on_observation_tokens_change_nothing():
  mask, values, outcome = _rows()
  rewards = np.asarray(gae_lib.outcome_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  lams = np.full(5, 0.95, np.float32)
  noise = np.random.default_rng(2).normal(0, 10.0, values.shape).astype(np.float32)
  masked = mask == 0
  adv, ret = _gae(rewards, values, mask, 0.99, lams, BOOTSTRAPPED)
  adv2, ret2 = _gae(rewards + noise * masked, values + noise * masked, mask, 0.99, lams,
                    BOOTSTRAPPED)
  np.testing.assert_array_equal(adv, adv2)
  np.testing.assert_array_equal(ret, ret2)


def test_gamma_and_lambda_one_give_outcome_minus_value():
  mask, values, outcome = _rows()
  rewards = np.asarray(gae_lib.outcome_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  adv, ret = _gae(rewards, values, mask, 1.0, np.ones(5, np.float32), TERMINAL)
  np.testing.assert_allclose(adv, np.where(mask, outcome[:, None] - values, 0.0), atol=1e-5)
  np.testing.assert_allclose(ret, np.where(mask, outcome[:, None], 0.0), atol=1e-5)


def test_bootstrapped_rows_continue_from_the_value_after_their_last_action():
  mask, values, outcome = _rows()
  rewards = np.asarray(gae_lib.outcome_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  lams = np.full(5, 0.9, np.float32)
  for next_values in (TERMINAL, BOOTSTRAPPED):
    adv, ret = _gae(rewards, values, mask, 0.99, lams, next_values)
    want_adv, want_ret = _numpy_gae(rewards, values, mask, 0.99, lams, next_values)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
  # With gamma = lambda = 1 every return of a row is its reward plus the value after it.
  adv, ret = _gae(rewards, values, mask, 1.0, np.ones(5, np.float32), BOOTSTRAPPED)
  for b in (0, 1, 4):
    np.testing.assert_allclose(ret[b, np.flatnonzero(mask[b])], outcome[b] + BOOTSTRAPPED[b],
                               atol=1e-5)


def test_length_adaptive_lambda():
  mask, values, outcome = _rows()
  alpha = 0.2  # rows of 3-12 trainable tokens: lambda from 0 (clipped) to about 0.6
  lengths = mask.sum(axis=1)
  expected = np.clip(1 - 1 / (alpha * np.maximum(lengths, 1)), 0.0, 1.0)
  lams = np.asarray(gae_lib.adaptive_lambda(jnp.asarray(mask), alpha))
  np.testing.assert_allclose(lams, expected, rtol=1e-6)
  assert lams[3] == 0.0 and 0 < lams.max() < 1  # short rows clip at 0
  rewards = np.asarray(gae_lib.outcome_rewards(jnp.asarray(outcome), jnp.asarray(mask)))
  adv, _ = _gae(rewards, values, mask, 1.0, lams, TERMINAL)
  want, _ = _numpy_gae(rewards, values, mask, 1.0, expected, TERMINAL)
  np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)


def test_whitening_uses_trainable_tokens_only_and_splits_exactly():
  mask, values, _ = _rows()
  x = values * 3.0 + 1.0
  picked = x[mask > 0]
  expected = np.where(mask > 0, (x - picked.mean()) / (picked.std(ddof=1) + 1e-8), 0.0)
  whole = gae_lib.masked_moments(jnp.asarray(x), jnp.asarray(mask))
  halves = (gae_lib.masked_moments(jnp.asarray(x[:2]), jnp.asarray(mask[:2])) +
            gae_lib.masked_moments(jnp.asarray(x[2:]), jnp.asarray(mask[2:])))
  np.testing.assert_allclose(halves, whole, rtol=1e-6)
  got = np.asarray(gae_lib.whiten(jnp.asarray(x), jnp.asarray(mask), halves))
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _numpy_value_loss(v, old, ret, mask, clip):
  clipped_v = np.clip(v, old - clip, old + clip)
  per_token = np.maximum((v - ret) ** 2, (clipped_v - ret) ** 2)
  grad = np.where((v - ret) ** 2 >= (clipped_v - ret) ** 2, v - ret, 0.0)  # 0.5 * d/dv
  weights = mask / mask.sum()
  return 0.5 * np.sum(per_token * weights), grad * weights, np.sum(
      ((clipped_v - ret) ** 2 > (v - ret) ** 2) * mask) / mask.sum()


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_clipped_value_loss_and_gradient_match_numpy(clip):
  rng = np.random.default_rng(3)
  mask, old, _ = _rows()
  v = old + rng.normal(0.0, 0.8, old.shape).astype(np.float32)
  ret = rng.normal(0.0, 1.0, old.shape).astype(np.float32)
  weights = aggregation_weights(jnp.asarray(mask), jnp.zeros(5, jnp.int32), "token-mean")
  loss_fn = lambda v_: value_loss(v_, jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask),
                                  weights, clip)
  sums = loss_fn(jnp.asarray(v))
  grad = np.asarray(jax.grad(lambda v_: loss_fn(v_).loss)(jnp.asarray(v)))
  want_loss, want_grad, want_frac = _numpy_value_loss(v, old, ret, mask,
                                                      clip if clip else np.inf)
  np.testing.assert_allclose(float(sums.loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
  metrics = sums.metrics()
  np.testing.assert_allclose(float(metrics["value_clip_frac"]), want_frac, rtol=1e-6)
  assert (want_frac > 0) == bool(clip)
  np.testing.assert_allclose(float(metrics["value_pred_mean"]), v[mask > 0].mean(), rtol=1e-5)


def _packed(mask, values, outcome, cuts):
  """Row 0 cut into segments at `cuts` (each an episode with the row's outcome): the packed row,
  its segment ids, and the separate rows it packs (each at the start of its own row)."""
  t = mask.shape[1]
  n = int(np.flatnonzero(mask[0]).max()) + 2  # the row's tokens, padding after
  bounds = [0, *cuts, n]
  segment_ids = np.zeros((1, t), np.int32)
  rows = np.zeros((len(cuts) + 1, t), np.int32), np.zeros((len(cuts) + 1, t), np.float32)
  for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
    segment_ids[0, a:b] = s + 1
    rows[0][s, :b - a], rows[1][s, :b - a] = mask[0, a:b], values[0, a:b]
  packed_mask = np.where(np.arange(t) < n, mask[0], 0)[None]
  return packed_mask, values[:1], segment_ids, rows, np.full(len(cuts) + 1, outcome[0])


@pytest.mark.parametrize("adaptive", [False, True])
def test_each_packed_segment_is_an_episode_of_its_own(adaptive):
  """A row of packed samples (an agent session's calls, one sample each) gets, segment by
  segment, the advantages and returns of the samples as separate rows; its last segment
  continues from the row's bootstrap value, the others end terminal."""
  mask, values, outcome = _rows(seed=4)
  mask[0, :] = 0
  mask[0, [1, 2, 5, 6, 7, 11, 12, 15, 16, 17]] = 1  # trainable spans in three segments
  packed_mask, packed_values, segment_ids, (rows_mask, rows_values), outcomes = _packed(
      mask, values, outcome, cuts=[4, 9])
  seg = jnp.asarray(segment_ids)
  rewards = gae_lib.outcome_rewards(jnp.asarray(outcome[:1]), jnp.asarray(packed_mask), seg)
  assert list(np.flatnonzero(np.asarray(rewards)[0])) == [2, 7, 17]  # each segment's last
  alpha = 0.5
  lam = (gae_lib.adaptive_lambda(jnp.asarray(packed_mask), alpha, seg) if adaptive
         else jnp.full((1,), 0.9))
  lams = (gae_lib.adaptive_lambda(jnp.asarray(rows_mask), alpha) if adaptive
          else jnp.full((3,), 0.9))
  if adaptive:  # segments of 2, 3 and 5 trainable tokens
    np.testing.assert_allclose(np.asarray(lam)[0, [1, 5, 11]], np.asarray(lams), rtol=1e-6)
  bootstrap = 0.6
  adv, ret = gae_lib.gae(rewards, jnp.asarray(packed_values), jnp.asarray(packed_mask), 0.99,
                         lam, jnp.full((1,), bootstrap), seg)
  want_adv, want_ret = _numpy_gae(np.asarray(gae_lib.outcome_rewards(
      jnp.asarray(outcomes), jnp.asarray(rows_mask))), rows_values, rows_mask, 0.99,
      np.asarray(lams), np.array([0.0, 0.0, bootstrap], np.float32))
  for s, start in enumerate([0, 4, 9]):
    where = np.flatnonzero(rows_mask[s])
    np.testing.assert_allclose(np.asarray(adv)[0, start + where], want_adv[s, where], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret)[0, start + where], want_ret[s, where], rtol=1e-5,
                               atol=1e-5)
