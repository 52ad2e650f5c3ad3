"""DAPO pieces on the host and the jitted update: advantages, overlong shaping, dynamic
sampling, rollout batches, and an update that micro-batching and sharding leave unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.model import Transformer, get_preset
from coa_jax.rl import update
from coa_jax.rl.advantages import ADVANTAGE_ESTIMATORS, group_advantages, overlong_penalty
from coa_jax.rl.batch import rollout_batch
from coa_jax.rl.dynamic_sampling import DynamicSamplingError, ScoredGroup, fill_batch
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.tool_loop import RolloutRecord
from coa_jax.runtime import sharding
from coa_jax.train import state as state_lib
from coa_jax.train.step import run_step


def test_group_advantages_use_bessel_corrected_std():
  adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [1.0, -1.0, -1.0, -1.0]]), eps=0.0)
  std = np.sqrt(1 / 3)  # ddof=1 of (1, 0, 0, 1): sum of squares 1 over 3
  np.testing.assert_allclose(adv[0], [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
  np.testing.assert_allclose(adv[1], [1.5, -0.5, -0.5, -0.5] / np.sqrt(1.0), rtol=1e-12)


def test_group_advantages_of_equal_rewards_and_single_samples_are_zero():
  np.testing.assert_array_equal(group_advantages(np.array([[1.0, 1.0, 1.0]])), [[0, 0, 0]])
  np.testing.assert_array_equal(group_advantages(np.array([[1.0], [-1.0]])), [[0], [0]])


def test_negative_advantages_are_scaled_by_their_weight():
  rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
  full = group_advantages(rewards)
  np.testing.assert_allclose(group_advantages(rewards, negative_weight=0.25),
                             np.where(full < 0, 0.25 * full, full))
  np.testing.assert_array_equal(group_advantages(rewards, negative_weight=0.0),
                                np.maximum(full, 0.0))
  with pytest.raises(ValueError, match="negative_weight=2"):
    group_advantages(rewards, negative_weight=2)


def test_mean_only_advantages_are_centered_rewards():
  np.testing.assert_allclose(group_advantages(np.array([[1.0, 0.0, 0.0, 0.0]]), "mean"),
                             [[0.75, -0.25, -0.25, -0.25]])


@pytest.fixture
def median_estimator():
  """Registers "test-median" (R - the group's median) for one test, then removes it."""

  @ADVANTAGE_ESTIMATORS.register("test-median")
  def median(rewards_GxN, eps):
    del eps
    return rewards_GxN - np.median(rewards_GxN, axis=1, keepdims=True)

  yield "test-median"
  ADVANTAGE_ESTIMATORS.unregister("test-median")


def test_a_registered_advantage_estimator_is_used_by_name(median_estimator):
  adv = group_advantages(np.array([[3.0, 0.0, 1.0]]), median_estimator, negative_weight=0.5)
  np.testing.assert_allclose(adv, [[2.0, -0.5, 0.0]])  # then negatives are scaled as usual


def test_an_unknown_advantage_estimator_lists_the_registered_names():
  with pytest.raises(ValueError,
                     match=r"normalize='max': expected one of \('std', 'mean', 'gae'\)"):
    group_advantages(np.array([[1.0, 0.0]]), "max")


def test_gae_has_no_group_form():
  with pytest.raises(ValueError, match="token-level and computed by the critic"):
    group_advantages(np.array([[1.0, 0.0]]), "gae")


@pytest.mark.parametrize("length,expected", [(0, 0.0), (60, 0.0), (70, -0.5), (79, -0.95),
                                             (80, -1.0), (500, -1.0)])
def test_overlong_penalty_is_linear_over_the_cache(length, expected):
  assert overlong_penalty(length, max_len=80, cache_len=20) == pytest.approx(expected)


def _group(task, correct):
  return ScoredGroup(task, [], [1.0 if c else -1.0 for c in correct], list(correct))


def test_dynamic_sampling_keeps_mixed_groups_over_rounds():
  rounds = iter([[_group("a", [1, 1]), _group("b", [0, 1])],
                 [_group("c", [0, 0]), _group("d", [1, 0])],
                 [_group("e", [0, 1]), _group("f", [1, 0])]])
  kept, stats = fill_batch(lambda: next(rounds), batch_groups=3, max_rounds=5)
  assert [g.task_id for g in kept] == ["b", "d", "e"]
  assert (stats.rounds, stats.groups, stats.kept, stats.surplus) == (3, 6, 3, 1)
  assert (stats.all_correct, stats.all_wrong) == (1, 1)
  assert (stats.solved, stats.unsolved) == (["a"], ["c"])


def test_dynamic_sampling_cap_raises():
  with pytest.raises(DynamicSamplingError, match="after 2 generation rounds"):
    fill_batch(lambda: [_group("a", [1, 1]), _group("b", [0, 0])], batch_groups=1,
               max_rounds=2)


def test_dynamic_sampling_off_keeps_uniform_groups():
  kept, stats = fill_batch(lambda: [_group("a", [1, 1]), _group("b", [0, 0])], batch_groups=2,
                           max_rounds=1, drop_uniform=False)
  assert [g.task_id for g in kept] == ["a", "b"] and stats.all_correct == 1


def _record(ids, mask, logprobs, prompt_len=2):
  return RolloutRecord("t", 0, list(ids), list(mask), list(logprobs), prompt_len,
                       [0] * len(ids))


def test_rollout_batch_shifts_ids_masks_and_logprobs():
  record = _record([5, 6, 7, 8, 9], [0, 0, 1, 0, 1], [0, 0, -0.5, 0, -0.25])
  batch = rollout_batch([record, record], [1.5, -1.5], [0, 0], seq_len=6,
                        drop_mask=[False, True])
  np.testing.assert_array_equal(batch.input_ids[0], [5, 6, 7, 8, 0, 0])
  np.testing.assert_array_equal(batch.targets[0], [6, 7, 8, 9, 0, 0])
  np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 0, 1, 0, 0], [0] * 6])
  np.testing.assert_array_equal(batch.sampler_logp[0], [0, -0.5, 0, -0.25, 0, 0])
  np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(batch.advantages[1, :4], [-1.5] * 4)


def test_rollout_batch_marks_tokens_sampled_over_an_older_cache_as_stale():
  # Prompt (version 0), tokens sampled by versions 0 and 1, an observation, one by version 2:
  # those of versions 1 and 2 attend to the prompt's KV cache, which version 0 wrote.
  record = RolloutRecord("t", 0, [5, 6, 7, 8, 9, 10], [0, 1, 1, 0, 1, 0],
                         [0, -0.1, -0.2, 0, -0.3, 0], 1, [0, 0, 1, 1, 2, 2])
  stale = lambda version: rollout_batch([record], [1.0], [0], seq_len=6,
                                        proximal_version=version).stale_mask[0]
  np.testing.assert_array_equal(stale(2), [1, 1, 0, 1, 0, 0])  # only sampled tokens
  np.testing.assert_array_equal(stale(1), [1, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(stale(0), [0] * 6)
  np.testing.assert_array_equal(stale(None), [0] * 6)  # synchronous: all on-policy


def test_a_packed_samples_calls_are_stale_by_their_own_cache_only():
  # Two calls of a session (not append-only): the first prefilled and sampled by version 0,
  # the second prefilled afresh and sampled by version 1.
  record = RolloutRecord("t", 0, [5, 6, 7, 8, 5, 6, 9, 10], [0, 0, 1, 1, 0, 0, 1, 1],
                         [0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4], 6, [0, 0, 0, 0, 1, 1, 1, 1])
  record.segments = [4, 4]
  batch = rollout_batch([record], [1.0], [0], seq_len=7, proximal_version=1)
  np.testing.assert_array_equal(batch.stale_mask[0], [0, 1, 1, 0, 0, 0, 0])


def test_rollout_batch_weights_every_sampled_token_of_a_truncated_sampler():
  record = RolloutRecord("t", 0, [5, 6, 7, 8, 9], [0, 0, 1, 0, 1], [0, 0, -0.5, 0, -0.25], 2,
                         [0] * 5)
  batch = rollout_batch([record], [1.0], [0], seq_len=6, truncated_sampling=True)
  np.testing.assert_array_equal(batch.stale_mask[0], [0, 1, 0, 1, 0, 0])


def test_rollout_batch_rejects_records_longer_than_the_update():
  with pytest.raises(ValueError, match="exceed the update's seq_len"):
    rollout_batch([_record(range(9), [0] * 9, [0] * 9)], [0.0], [0], seq_len=4)


def _random_batch(model_config, rows=8, length=16, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, model_config.vocab_size, (rows, length + 1))
  mask = (rng.random((rows, length + 1)) < 0.6).astype(int)
  mask[:, 0] = 0
  mask[2] = 0  # an overlong-filtered sample
  records = [_record(ids[r], mask[r], rng.normal(-3.0, 0.3, length + 1) * mask[r])
             for r in range(rows)]
  adv = rng.normal(size=rows)
  batch = rollout_batch(records, adv, np.arange(rows) // 2, seq_len=length)
  return batch.replace(old_logp=batch.sampler_logp)  # as if the sampler were the policy


@pytest.fixture(scope="module")
def tiny():
  model_config = get_preset("tiny")
  model = Transformer(model_config)
  return model_config, model, optax.sgd(1.0)  # new params = params - gradient


def _step(tiny, mesh, micro_batches):
  model_config, model, tx = tiny
  state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
  batch = _random_batch(model_config)
  step = update.jit_dapo_step(model, tx, mesh, loss_config=PolicyLossConfig(),
                              micro_batches=micro_batches)
  state, metrics = step(state, sharding.shard_batch(batch, mesh))
  return jax.device_get(state.params), jax.device_get(metrics)


def test_update_is_unchanged_by_micro_batching_and_sharding(tiny, single_device_mesh):
  reference, ref_metrics = _step(tiny, single_device_mesh, 1)
  assert ref_metrics["is_finite"]
  assert ref_metrics["tokens"] == _random_batch(tiny[0]).loss_mask.sum()  # 63
  # SGD at learning rate 1 moves the params by exactly the gradient: an update that was not
  # applied would leave every run below equal to the others too.
  model_config, model, tx = tiny
  init = jax.device_get(state_lib.init_state(model, tx, single_device_mesh,
                                             jax.random.key(0)).params)
  moved = np.sqrt(sum(np.sum((np.asarray(a) - b) ** 2) for a, b in zip(
      jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(init))))
  np.testing.assert_allclose(moved, ref_metrics["grad_norm"], rtol=1e-4)
  assert moved > 1e-2  # 0.051: far above the 1e-6 the runs are compared to
  mesh8 = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  for mesh, micro in [(single_device_mesh, 4), (mesh8, 2)]:
    params, metrics = _step(tiny, mesh, micro)
    np.testing.assert_allclose(metrics["pg_loss"], ref_metrics["pg_loss"], rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                           params, reference)


def test_dapo_steps_raise_a_verifiable_reward(tiny, single_device_mesh):
  """A bandit: the tiny model is rewarded when its first sampled token is in the lower half of
  the vocabulary (about half the samples at the start); DAPO steps must make that the rule."""
  model_config, model, _ = tiny
  mesh, tx = single_device_mesh, optax.adam(1e-2)
  groups, n, new = 4, 4, 2
  prompts = [[1, 5 + g, 9, 17 + g] for g in range(groups)]
  sampler = Sampler(model_config, mesh, batch_size=groups * n, cache_size=16, chunk=new,
                    stop_ids=(), sampling=SamplingConfig(temperature=1.0))
  state = state_lib.init_state(model, tx, mesh, jax.random.key(1))
  step = update.jit_dapo_step(model, tx, mesh, loss_config=PolicyLossConfig())
  logprobs = update.jit_policy_logprobs(model, mesh, sharding.param_shardings(model, mesh))
  rewards = []
  for i in range(30):
    decode = sampler.prefill_groups(state.params, sampler.init_state(),
                                    [(range(g * n, g * n + n), p) for g, p in enumerate(prompts)],
                                    [len(p) + new for p in prompts])
    _, chunk = sampler.decode_chunk(state.params, decode, jax.random.key(100 + i))
    tokens, logp = np.asarray(chunk.tokens_BxK), np.asarray(chunk.logprobs_BxK)
    records = [_record(prompts[r // n] + list(tokens[r]), [0] * 4 + [1] * new,
                       [0.0] * 4 + list(logp[r]), prompt_len=4) for r in range(groups * n)]
    correct = (tokens[:, 0] < model_config.vocab_size // 2).reshape(groups, n)
    rewards.append(correct.mean())
    batch = sharding.shard_batch(
        rollout_batch(records, group_advantages(np.where(correct, 1.0, -1.0)).reshape(-1),
                      np.arange(groups * n) // n, seq_len=4 + new - 1), mesh)
    batch = batch.replace(old_logp=logprobs(state.params, batch)[0])
    state, metrics = step(state, batch)
    assert metrics["is_finite"]
  assert np.mean(rewards[:5]) < 0.7 and np.mean(rewards[-5:]) > 0.9, rewards


def test_non_finite_update_is_flagged_and_not_applied(tiny, single_device_mesh):
  model_config, model, tx = tiny
  state = state_lib.init_state(model, tx, single_device_mesh, jax.random.key(0))
  batch = _random_batch(model_config)
  batch.advantages[0, :] = np.nan
  step = update.jit_dapo_step(model, tx, single_device_mesh, donate=False,
                              loss_config=PolicyLossConfig())
  new_state, metrics = step(state, sharding.shard_batch(batch, single_device_mesh))
  assert not metrics["is_finite"] and int(new_state.step) == 0
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(new_state.params),
                         jax.device_get(state.params))


def test_teacher_forced_logprobs_are_the_samplers_at_its_temperature(tiny, single_device_mesh):
  model_config, model, tx = tiny
  mesh, prompt, new = single_device_mesh, [1, 5, 9, 17], 6
  state = state_lib.init_state(model, tx, mesh, jax.random.key(2))
  sampler = Sampler(model_config, mesh, batch_size=2, cache_size=16, chunk=new, stop_ids=(),
                    sampling=SamplingConfig(temperature=0.6))
  decode = sampler.prefill_groups(state.params, sampler.init_state(), [(range(2), prompt)],
                                  [len(prompt) + new])
  _, chunk = sampler.decode_chunk(state.params, decode, jax.random.key(3))
  tokens, logp = np.asarray(chunk.tokens_BxK), np.asarray(chunk.logprobs_BxK)
  records = [_record(prompt + list(tokens[r]), [0] * len(prompt) + [1] * new,
                     [0.0] * len(prompt) + list(logp[r]), len(prompt)) for r in range(2)]
  batch = rollout_batch(records, [0.0, 0.0], [0, 0], seq_len=len(prompt) + new - 1)
  gaps = {}
  for temperature in (0.6, 1.0):
    fn = update.jit_policy_logprobs(model, mesh, sharding.param_shardings(model, mesh),
                                   temperature)
    got, _ = fn(state.params, sharding.shard_batch(batch, mesh))
    gaps[temperature] = np.abs(np.asarray(got) - batch.sampler_logp)[batch.loss_mask > 0].max()
  assert gaps[0.6] < 1e-5 and gaps[1.0] > 0.05  # 4.8e-7 and 0.17


def test_an_all_masked_mini_batch_applies_no_update(tiny, single_device_mesh):
  """Not even AdamW's momentum and weight decay, which zero gradients would still apply."""
  model_config, model, _ = tiny
  tx = optax.adamw(1e-2, weight_decay=0.1)
  step = update.jit_dapo_step(model, tx, single_device_mesh, donate=False,
                              loss_config=PolicyLossConfig())
  batch = sharding.shard_batch(_random_batch(model_config), single_device_mesh)
  moved, metrics = run_step(step, state_lib.init_state(model, tx, single_device_mesh,
                                                       jax.random.key(0)), batch)
  assert (metrics["nonfinite"], metrics["empty"], metrics["applied"]) == (0, 0, 1)
  assert int(moved.step) == 1
  masked = batch.replace(loss_mask=jnp.zeros_like(batch.loss_mask))
  after, metrics = run_step(step, moved, masked)
  # Flagged as empty (a no-op the loop goes on past), not as non-finite.
  assert (metrics["nonfinite"], metrics["empty"], metrics["applied"], metrics["tokens"]) == (
      0, 1, 0, 0)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(after),
                         jax.device_get(moved))
