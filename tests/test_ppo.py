"""PPO (rl.advantage = "gae"): the critic beside the actor, end to end on 8 devices, exact resume,
the critic's export, one device against eight, and the two updates kept apart."""

import dataclasses
import json
import os

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from coa_jax.model import ConfigError, Transformer, build_config
from coa_jax.rl import critic as critic_lib
from coa_jax.rl import job as rl_job
from coa_jax.rl import update
from coa_jax.rl.batch import rollout_batch
from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.rollout import RolloutRecord
from coa_jax.rl.settings import RLConfig, rl_settings
from coa_jax.runtime import sharding
from coa_jax.runtime.settings import build
from coa_jax.train import optimizer
from coa_jax.train.optimizer import OptimizerSettings
from coa_jax.train import state as state_lib
from configs import common
from test_dapo_job import _config as dapo_job_config

CRITIC_METRICS = ("value_loss", "value_clip_frac", "value_pred_mean", "explained_variance",
                  "return_mean", "advantage_mean", "advantage_std", "critic_grad_norm")


def _config(tmp_path, name, critic=None, **rl):
  """The DAPO job test's config (a fresh tiny model on 8 devices) as PPO, 3 steps."""
  config = dapo_job_config(tmp_path, name, **{**dict(steps=3, eval_every=3, advantage="gae"),
                                              **rl})
  # Step 1 pre-trains the critic (on Monte-Carlo returns: explained variance 1 is never
  # reached, so pretrain_steps ends it), step 2 is its warm-up, step 3 trains both. The
  # critic's learning rate decays over its own 3 updates (the actor's is constant).
  if critic is None:
    critic = dict(warmup=2, pretrain_steps=1, pretrain_explained_variance=1.0, lambda_critic=0.5,
                  schedule="cosine")
  config.rl.critic.update(critic)
  config.export_dir = str(tmp_path / name / "hf_export")
  return config


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("ppo")
  return tmp, rl_job.run(_config(tmp, "whole"))


def _rows(path):
  return [json.loads(line) for line in open(path)]


def test_job_pretrains_and_warms_up_the_critic_then_trains_both(uninterrupted):
  tmp, summary = uninterrupted
  rows = _rows(tmp / "whole" / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3]
  for row in rows:
    for key in CRITIC_METRICS:
      # Explained variance is undefined (NaN) for a batch whose returns are all equal.
      assert np.isfinite(row[key]) or key == "explained_variance" and np.isnan(row[key]), key
    assert not row["explained_variance"] > 1
  assert [r["pretraining"] for r in rows] == [1, 0, 0]
  assert [r["actor_trained"] for r in rows] == [0, 0, 1]
  # Cosine from 10x the actor's 1e-3 to a tenth of it over the critic's 3 updates, one a step.
  np.testing.assert_allclose([r["critic_lr"] for r in rows], [1e-2, 7.75e-3, 3.25e-3],
                             rtol=1e-6)
  assert rows[2]["lr"] == np.float32(1e-3)  # the actor's first update, at its own schedule
  assert "pg_loss" not in rows[1] and "pg_loss" in rows[2]
  assert rows[0]["value_pred_mean"] == 0.0  # a fresh critic's value head is zero
  assert rows[1]["value_pred_mean"] != 0.0
  assert rows[2]["advantage_std"] > 0  # before whitening
  assert (tmp / "whole" / "dapo.png").stat().st_size > 0


def test_resumed_run_equals_the_uninterrupted_one(uninterrupted, tmp_path):
  _, whole = uninterrupted
  config = _config(tmp_path, "split")
  config.rl.stop_after = 2
  built = critic_lib._programs.cache_info()
  first = rl_job.run(config)
  assert first["steps"] == 2
  second = rl_job.run(config)  # resumes from step 2's checkpoint (actor and critic), runs 3
  assert second["resumed_from"] == 2 and second["steps"] == 3
  # The two runs alike share the critic's jitted programs: built once at most, then reused.
  now = critic_lib._programs.cache_info()
  assert now.misses - built.misses <= 1 and now.hits > built.hits
  rows, whole_rows = _rows(tmp_path / "split" / "metrics.jsonl"), _rows(whole["metrics"])
  assert [a["step"] for a in rows] == [b["step"] for b in whole_rows] == [1, 2, 3]
  for a, b in zip(rows, whole_rows):
    for key in ("reward", "value_loss", "explained_variance", "advantage_std"):
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # bit for bit (NaN == NaN)
  for params in (lambda s: s["state"].params, lambda s: s["critic_state"].params):
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(params(second)),
                           jax.device_get(params(whole)))


def test_critic_export_loads_in_transformers_with_the_same_values(uninterrupted):
  _, summary = uninterrupted
  folder = summary["critic_export_dir"]
  hf = transformers.AutoModelForTokenClassification.from_pretrained(folder).eval()
  critic = summary["critic_state"].params
  config = json.load(open(f"{folder}/config.json"))
  model = Transformer(build_config(dict(preset="tiny", hidden_size=128, intermediate_size=256,
                                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                        vocab_size=config["vocab_size"])), head="value")
  ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 12))
  ours = np.asarray(model.apply({"params": jax.device_get(critic)}, jnp.asarray(ids)))
  with torch.no_grad():
    theirs = hf(torch.as_tensor(ids)).logits[..., 0].numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
  assert np.abs(ours).max() > 0  # the trained head is not the zero it started as
  # The policy's tokenizer beside it, without generation defaults: a value model generates none.
  assert sorted(os.listdir(folder)) == ["coa_tags.json", "config.json", "model.safetensors",
                                        "tokenizer.json", "tokenizer_config.json"]


def test_lora_ppo_critic_trains_its_adapters_and_head_on_the_actors_base(tmp_path):
  """PPO with LoRA: the critic holds the actor's frozen base weights (the same arrays, no
  copy), trains its own adapters and value head, and exports merged, with its values equal in
  transformers."""
  # Every step trains both; the critic's adapters get a gradient once its head is not zero.
  config = _config(tmp_path, "lora", critic=dict(), steps=2)
  config.model.update(lora_rank=4, lora_alpha=8.0)
  summary = rl_job.run(config)
  rows = _rows(tmp_path / "lora" / "metrics.jsonl")
  assert [r["actor_trained"] for r in rows] == [1, 1]
  assert all(np.isfinite(r["pg_loss"]) for r in rows)
  actor, critic = summary["state"], summary["critic_state"]
  body = {k: v for k, v in actor.frozen.items() if k != "lm_head"}
  assert critic.frozen.keys() == body.keys()
  assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(critic.frozen),
                                    jax.tree_util.tree_leaves(body)))
  assert set(critic.params) == {"layers", "value_head"}
  assert float(jnp.abs(critic.params["value_head"]).max()) > 0
  assert float(jnp.abs(critic.params["layers"]["mlp"]["up_proj"]["lora_b"]).max()) > 0
  folder = summary["critic_export_dir"]
  hf = transformers.AutoModelForTokenClassification.from_pretrained(folder).eval()
  model = Transformer(build_config(config.model.to_dict() | dict(checkpoint="",
                                                                 vocab_size=hf.config.vocab_size)),
                      head="value")
  ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 12))
  ours = np.asarray(model.apply({"params": jax.device_get(critic.model_params())},
                                jnp.asarray(ids)))
  with torch.no_grad():
    theirs = hf(torch.as_tensor(ids)).logits[..., 0].numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def _record(mask, finish="answer", task="t"):
  n = len(mask)
  return RolloutRecord(task, 0, list(range(n)), mask, [0.0] * n, 1, [0] * n, finish)


def test_outcomes_put_truncated_samples_terminal_or_bootstrapped():
  records = [_record([0, 1, 1]), _record([0, 1, 1, 0, 0], finish="length"),
             _record([0, 1, 1], finish="length")]
  scores, penalty = [1.0, -1.5, -0.25], [0.0, -0.5, -0.25]
  rewards, boot = critic_lib.outcomes(records, scores, penalty, "terminal")
  np.testing.assert_array_equal(rewards, scores)
  assert not boot.any()
  rewards, boot = critic_lib.outcomes(records, scores, penalty, "bootstrap")
  np.testing.assert_array_equal(rewards, [1.0, -0.5, -0.25])  # only the length penalty left
  np.testing.assert_array_equal(boot, [False, True, True])


def _value_model():
  """A tiny value model with a random (not zero) head, and its params."""
  model = Transformer(build_config(dict(preset="tiny", hidden_size=32, intermediate_size=64,
                                        num_layers=1, num_heads=4, num_kv_heads=4,
                                        vocab_size=64)), head="value")
  params = flax.core.unfreeze(nn.unbox(model.init(jax.random.key(0),
                                                  jnp.zeros((1, 4), jnp.int32))["params"]))
  params["value_head"] = jax.random.normal(jax.random.key(1), params["value_head"].shape)
  return model, params


def test_a_bootstrapped_return_continues_from_the_value_after_the_last_token():
  """The value after a truncated sample is the value model's at the end of its whole sequence
  (its last token an input too), not the value of the state that token was sampled in."""
  model, params = _value_model()
  ids = [5, 9, 2, 40, 41, 42, 7, 8, 3]  # prompt, 3 sampled tokens, an observation cut short
  records = [_record([0, 0, 0, 1, 1, 1, 0, 0, 0], finish="length"),
             _record([0, 0, 0, 1, 1], finish="answer")]
  records[0] = dataclasses.replace(records[0], ids=ids)
  batch = rollout_batch(records, np.zeros(2), [0, 1], seq_len=12,
                        outcomes=(np.array([-0.25, 1.0]), np.array([True, False])))
  config = critic_lib.CriticConfig(truncation="bootstrap")  # gamma = lambda = 1

  @jax.jit
  def programs(params, batch, whole):  # GAE's; the row's own values; the whole sequence's
    values, _, returns, _ = critic_lib.estimate(model, config, params, batch, jnp.float32(1.0))
    return (values, returns, critic_lib.values(model, params, batch),
            model.apply({"params": params}, whole))

  values, returns, plain, whole = jax.device_get(programs(params, batch, jnp.asarray([ids])))
  after = whole[0, -1]  # after the last token, which is an input here
  np.testing.assert_allclose(returns[0, 2:5], -0.25 + after, rtol=1e-5)
  np.testing.assert_allclose(returns[1, 2:4], 1.0, rtol=1e-6)  # terminal
  # The row's own values are those of a pass without the appended token.
  np.testing.assert_allclose(values[0, :8], plain[0, :8], rtol=1e-6)
  assert abs(after - values[0, 7]) > 1e-3  # the value before the last token is another


def test_a_bootstrapped_sample_needs_room_for_the_value_after_it():
  record = _record([0, 1, 1, 1, 1], finish="length")
  with pytest.raises(ValueError, match="no position for the value after its last token"):
    rollout_batch([record], [0.0], [0], seq_len=4, outcomes=([0.0], [True]))
  rollout_batch([record], [0.0], [0], seq_len=4, outcomes=([0.0], [False]))  # terminal: fits


def test_a_sample_ending_on_an_observation_is_an_error():
  with pytest.raises(ValueError, match="ends on an observation"):
    critic_lib.outcomes([_record([0, 1, 1, 0], finish="max_turns")], [1.0], [0.0], "terminal")


def test_bad_critic_settings_fail_clearly():
  with pytest.raises(ConfigError, match="truncation"):
    critic_lib.CriticConfig(truncation="drop")
  with pytest.raises(ConfigError, match="lambda_actor"):
    critic_lib.CriticConfig(lambda_actor=1.5)


def test_the_critics_learning_rate_follows_its_own_schedule():
  actor = OptimizerSettings(learning_rate=1e-3, schedule="constant", warmup_steps=5)
  rl = common.rl(steps=4, batch_groups=8, mini_batch_groups=2, ppo_epochs=2)
  rl.critic.update(learning_rate=1.0, schedule="cosine", warmup_steps=4, final_lr_fraction=0.0)
  config = build(RLConfig, rl, "rl").critic_settings()
  assert config.total_steps == 4 * 4 * 2  # every critic update: steps x mini-batches x epochs
  schedule = optimizer.learning_rate_schedule(critic_lib.optimizer_settings(actor, config))
  np.testing.assert_allclose([schedule(s) for s in (0, 2, 4, 18, 32)], [0, 0.5, 1, 0.5, 0],
                             atol=1e-6)


def test_the_critics_default_learning_rate_is_constant_whatever_the_actors_schedule():
  actor = OptimizerSettings(learning_rate=1e-3, schedule="cosine", warmup_steps=5,
                            total_steps=100)
  config = build(RLConfig, common.rl(steps=4), "rl").critic_settings()
  schedule = optimizer.learning_rate_schedule(critic_lib.optimizer_settings(actor, config))
  np.testing.assert_allclose([schedule(s) for s in (0, 5, 100)], [1e-2] * 3, rtol=1e-6)


def test_bad_critic_schedules_name_the_critics_settings():
  actor = OptimizerSettings()
  with pytest.raises(ConfigError, match="rl.critic.schedule='linear'"):
    critic_lib.CriticConfig(schedule="linear")
  with pytest.raises(ConfigError, match="rl.critic.total_steps=3 must exceed warmup_steps=4"):
    critic_lib.optimizer_settings(actor, critic_lib.CriticConfig(
        schedule="cosine", warmup_steps=4, total_steps=3))


def test_gae_with_group_advantage_settings_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="negative_weight"):
    rl_settings(_config(tmp_path, "bad", negative_weight=0.0))


def test_a_critic_schedule_that_cannot_be_built_is_refused_with_the_settings(tmp_path):
  """... before any model loads (a pipeline checks it before its first stage)."""
  with pytest.raises(ConfigError, match=r"rl\.critic\.decay_steps=0"):
    rl_settings(_config(tmp_path, "bad", critic=dict(schedule="wsd")))


# --- the programs on one device and on eight --------------------------------------------------


def _programs(mesh, seed=0):
  """Returns (actor state, critic, actor update, a PPO mini-batch on `mesh`)."""
  model_config = build_config(dict(preset="tiny", hidden_size=32, intermediate_size=64,
                                   num_layers=2, num_heads=4, num_kv_heads=4, vocab_size=64))
  model = Transformer(model_config)
  # Adam's eps of 1e-3 keeps its first step a smooth function of the gradient: with 1e-8, a
  # weight whose gradient is near 0 moves by lr * g / |g|, a sign that reduction order can flip.
  opt = OptimizerSettings(learning_rate=1e-2, schedule="constant", weight_decay=0.0, eps=1e-3)
  tx = optimizer.make_optimizer(opt)
  actor = state_lib.init_state(model, tx, mesh, jax.random.key(seed))
  critic = critic_lib.Critic(critic_lib.CriticConfig(cliprange_value=0.2), model_config,
                             actor.params, mesh, opt, micro_batches=2, seed=seed)
  rng = np.random.default_rng(seed)
  records = []
  for i in range(8):
    mask = [0] * 3 + [1] * int(rng.integers(2, 6)) + [0] * 3 + [1] * int(rng.integers(1, 5))
    records.append(RolloutRecord(f"t{i // 2}", i % 2, rng.integers(0, 64, len(mask)).tolist(),
                                 mask, [0.0] * len(mask), 3, [0] * len(mask), "answer"))
  rewards = rng.choice([-1.0, 1.0], 8)
  batch = rollout_batch(records, np.zeros(8), np.arange(8) // 2, 16,
                        outcomes=(rewards, np.zeros(8, bool)))
  step = update.jit_dapo_step(model, tx, mesh, loss_config=PolicyLossConfig(), micro_batches=2)
  logprobs = update.jit_policy_logprobs(model, mesh, sharding.param_shardings(model, mesh))
  batch = sharding.shard_batch(batch, mesh)
  batch = batch.replace(old_logp=logprobs(actor.params, batch)[0])
  return actor, critic, step, batch


def _ppo_step(mesh):
  actor, critic, step, batch = _programs(mesh)
  critic.state = critic.update(critic.state, critic.prepare([batch], False)[0][0])[0]
  (batch,), stats = critic.prepare([batch], False)  # values of the updated critic
  actor, actor_metrics = step(actor, batch)
  critic_metrics = critic.train(batch)
  return jax.device_get((actor.params, critic.state.params)), stats, actor_metrics, critic_metrics


def test_ppo_on_eight_devices_equals_one_device():
  one = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  eight = sharding.make_mesh((2, 2, 2))
  params1, stats1, actor1, critic1 = _ppo_step(one)
  params8, stats8, actor8, critic8 = _ppo_step(eight)
  for a, b in ((stats1, stats8), (critic1, critic8), (actor1, actor8)):
    for key in a:
      np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), rtol=2e-4, atol=1e-6,
                                 err_msg=key)
  assert float(actor1["grad_norm"]) > 0 and critic1["critic_grad_norm"] > 0
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5),
                         params1, params8)


def test_each_update_reaches_only_its_own_parameters(single_device_mesh):
  actor, critic, step, batch = _programs(single_device_mesh)
  critic.state = critic.update(critic.state, critic.prepare([batch], False)[0][0])[0]
  model = Transformer(critic.model.config)
  config = critic.config

  def actor_loss(actor_params, critic_params):  # advantages from the critic, as a step does
    _, advantages, _, _ = critic_lib.estimate(critic.model, config, critic_params, batch,
                                              jnp.float32(1.0))
    logp, _ = update.policy_logprobs(model, actor_params, batch)
    return jnp.sum(advantages * logp * batch.loss_mask)

  def critic_loss(actor_params, critic_params):
    del actor_params  # the value model is its own copy, not a view of the actor
    values = critic_lib.values(critic.model, critic_params, batch)
    return jnp.sum(jnp.square(values - batch.rewards[:, None]) * batch.loss_mask)

  for loss, own, other in ((actor_loss, 0, 1), (critic_loss, 1, 0)):
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(actor.params, critic.state.params)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree_util.tree_leaves(grads[other]))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(grads[own]))


def test_the_critic_owns_its_buffers(single_device_mesh):
  actor, critic, step, batch = _programs(single_device_mesh)
  before = jax.device_get(critic.state.params)
  jax.tree_util.tree_map(lambda x: x.delete(), actor)  # as a donating actor update does
  after = jax.device_get(critic.state.params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)
  assert float(jnp.abs(critic.state.params["value_head"]).max()) == 0.0


def test_asynchronous_ppo_trains_the_critic_on_the_trainer_devices(tmp_path):
  config = _config(tmp_path, "async", critic=dict(), steps=2)
  config.mesh = common.mesh(data=1, fsdp=2, tensor=2)  # the 4 trainer devices
  config.batch_size, config.export_dir = 8, ""
  config.rl["async"].update({"enabled": True, "staleness": 1})
  summary = rl_job.run(config)
  rows = _rows(tmp_path / "async" / "metrics.jsonl")
  assert [r["actor_trained"] for r in rows] == [1, 1]
  for row in rows:
    assert row["staleness_0"] + row["staleness_1"] == 2
    for key in ("pg_loss", *CRITIC_METRICS):
      assert np.isfinite(row[key]) or key == "explained_variance" and np.isnan(row[key]), key
  actor_devices = {d for leaf in jax.tree_util.tree_leaves(summary["state"].params)
                   for d in leaf.devices()}
  for leaf in jax.tree_util.tree_leaves(summary["critic_state"]):
    assert leaf.devices() == actor_devices  # the trainer's half, not the rollout devices
  assert len(actor_devices) == 4
