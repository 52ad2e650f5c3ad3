"""Asynchronous DAPO on 8 fake CPU devices, 4 decoding and 4 training: the staleness bound over
random arrival orders, staleness 0 against the synchronous step, weight pushes, the job."""

import dataclasses
import json
import random

import flax
import jax
import numpy as np
import pytest

from coa_jax.model import ConfigError
from coa_jax.perf import async_bench
from coa_jax.rl import dapo
from coa_jax.rl import job as rl_job
from coa_jax.rl.async_trainer import AsyncTrainer
from coa_jax.rl.settings import rl_settings
from coa_jax.rl.staleness import StalenessQueue
from coa_jax.runtime import sharding
from configs import common, dapo_tiny_cpu


def _config(tmp_path, **options):
  config = dapo_tiny_cpu.get_config()
  config.model.checkpoint = ""  # a fresh model: no SFT export needed
  config.max_tasks, config.eval_tasks = 16, ""
  config.mesh = common.mesh(data=1, fsdp=2, tensor=2)  # the 4 trainer devices
  config.batch_size, config.chunk = 8, 16
  config.rollout.update(group_size=2, max_prompt_tokens=192, max_response_tokens=48,
                        max_observation_tokens=32, max_turns=2)
  config.rl = common.rl(steps=3, batch_groups=2, prompts_per_round=2, max_rounds=2,
                        mini_batch_groups=2, overlong_cache=16, dynamic_sampling=False)
  config.rl["async"].update({"enabled": True, **options})
  config.optimizer = common.optimizer(learning_rate=1e-3, schedule="constant", weight_decay=0.0)
  config.checkpoint = common.checkpoint(str(tmp_path / "ckpt"), every=3, async_save=False)
  config.workdir, config.export_dir = str(tmp_path), ""
  return config


def _copy(tree):
  return jax.tree_util.tree_map(lambda x: x.copy(), tree)


# --- the staleness bound (host-side) ---------------------------------------------------------


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_no_group_older_than_the_bound_is_ever_used(staleness):
  """Random interleavings of starts, finishes in any order, give-backs, weight pickups and
  updates: every group trained on is within the bound, and the queue never runs ahead."""
  dropped = 0
  for seed in range(60):
    rng = random.Random(seed)
    batch = rng.randint(1, 4)
    queue = StalenessQueue(batch, staleness)
    worker_version, in_flight = 0, []
    for _ in range(20_000):
      if queue.version == 8:
        break
      action = rng.random()
      if action < 0.35:
        for _ in range(rng.randint(1, 3)):
          seq = queue.try_start(worker_version)
          if seq is not None:
            in_flight.append((seq, worker_version))
      elif action < 0.75 and in_flight:
        seq, version = in_flight.pop(rng.randrange(len(in_flight)))
        if rng.random() < 0.1:  # e.g. dropped by dynamic sampling
          queue.give_back()
        else:
          queue.put(seq, version, None)
      elif action < 0.85:
        worker_version = queue.version  # the worker picks up the newest weights
      else:
        try:
          taken, _ = queue.take(batch, timeout=0)
        except TimeoutError:
          continue
        assert all(queue.version - r.version <= staleness for r in taken)
        assert [r.seq for r in taken] == sorted(r.seq for r in taken)
        queue.advance()
      assert len(queue.ready) + len(in_flight) <= (staleness + 1) * batch
    assert queue.version == 8, f"seed {seed} stalled"
    dropped += queue.stale_dropped
  # Late finishers were discarded, not trained on; with staleness 0 none can be late.
  assert (dropped > 0) == (staleness > 0)


def test_with_staleness_0_the_worker_runs_one_batch_per_version():
  queue = StalenessQueue(batch_groups=2, staleness=0)
  assert [queue.try_start(0) for _ in range(3)] == [0, 1, None]
  queue.put(1, 0, "b")
  queue.put(0, 0, "a")
  taken, depth = queue.take(2)
  assert [r.group for r in taken] == ["a", "b"] and depth == 2  # in issue order
  assert queue.try_start(0) is None  # the old weights may not start the next batch
  queue.advance()
  assert queue.try_start(1) == 2


# --- the trainer on 4 + 4 devices ------------------------------------------------------------


@pytest.fixture(scope="module")
def staleness_0(tmp_path_factory):
  """(trainer, its initial state, the first batch its worker produced)."""
  tmp = tmp_path_factory.mktemp("async0")
  trainer = AsyncTrainer(rl_settings(_config(tmp, staleness=0)))
  initial = _copy(trainer.state)
  trainer._start_worker(version=0)
  taken, _ = trainer.worker.queue.take(2, timeout=300)
  trainer.worker.close(timeout=60)
  yield trainer, initial, [r.group for r in taken], taken
  trainer.close()


def test_rollout_and_trainer_devices_are_disjoint_halves(staleness_0):
  trainer = staleness_0[0]
  rollout = {d.id for d in trainer.host.devices.flat}
  training = {d.id for d in trainer.mesh.devices.flat}
  assert len(rollout) == len(training) == 4 and not rollout & training


def test_staleness_0_updates_are_the_synchronous_step(staleness_0, tmp_path):
  trainer, initial, groups, taken = staleness_0
  assert all(r.version == 0 for r in taken)
  assert {v for g in groups for record in g.records for v in record.versions} == {0}
  for group in groups:  # an untrained model fails every task: give the samples advantages
    group.scores = [1.0, -1.0]

  def update(job, proximal_version):
    job.state = _copy(initial) if job is trainer else job.state
    metrics = job._train_on(groups, 1, proximal_version)
    return metrics, jax.tree_util.tree_map(np.asarray, job.state.params)

  async_metrics, async_params = update(trainer, proximal_version=0)
  assert async_metrics["stale"] == 0 and async_metrics["behaviour_weight"] == 1
  # The synchronous objective on the same mesh: bit for bit (fresh tokens weigh exactly 1).
  sync_metrics, sync_params = update(trainer, proximal_version=None)
  jax.tree_util.tree_map(np.testing.assert_array_equal, async_params, sync_params)
  assert async_metrics == sync_metrics
  # The synchronous job on all 8 devices: the same update to float tolerance (its sums reduce
  # over 8 devices in another order).
  config = _config(tmp_path, enabled=False)
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)
  sync = dapo.Trainer(rl_settings(config))
  sync.state = sync.state.replace(params=jax.device_put(
      jax.tree_util.tree_map(np.asarray, initial.params),
      jax.tree_util.tree_map(lambda x: x.sharding, sync.state.params)))
  eight_metrics, eight_params = update(sync, proximal_version=None)
  sync.close()
  for key in ("pg_loss", "grad_norm", "entropy", "tokens"):
    np.testing.assert_allclose(eight_metrics[key], sync_metrics[key], rtol=1e-5, atol=1e-7,
                               err_msg=key)
  moved = jax.tree_util.tree_map(lambda a, b: np.abs(a - b).max(), sync_params,
                                 jax.tree_util.tree_map(np.asarray, initial.params))
  gap = jax.tree_util.tree_map(lambda a, b: np.abs(a - b).max(), sync_params, eight_params)
  assert max(jax.tree_util.tree_leaves(gap)) < 1e-2 * max(jax.tree_util.tree_leaves(moved))


def test_a_weight_push_copies_to_the_rollout_devices_and_leaves_the_trainer_state(staleness_0):
  trainer = staleness_0[0]
  before = jax.tree_util.tree_map(np.asarray, trainer.state)
  pushed = trainer._push()
  rollout = {d.id for d in trainer.host.devices.flat}
  for leaf, param in zip(jax.tree_util.tree_leaves(pushed),
                         jax.tree_util.tree_leaves(trainer.state.params)):
    assert {d.id for d in leaf.devices()} == rollout
    assert leaf.dtype == trainer.model_config.compute_dtype
    np.testing.assert_array_equal(leaf, np.asarray(param).astype(leaf.dtype))
    leaf.delete()  # the trainer's arrays are other buffers
  after = jax.tree_util.tree_map(np.asarray, trainer.state)
  jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)


def test_lora_pushes_the_base_once_then_adapters_and_rows(tmp_path, monkeypatch):
  """With LoRA the worker decodes the LoRA model itself: the first push copies the frozen base
  and the trained leaves (adapters, token rows), in the compute dtype, to the rollout devices;
  each update's push copies only the trained leaves, beside the very base buffers of the first.
  Each batch's sampled log-probs equal the teacher-forced ones of the weights it was drawn with,
  and the updates train the adapters and rows."""
  config = _config(tmp_path, staleness=0)
  config.model.update(lora_rank=4, lora_alpha=8.0, lora_trained_token_ids=(3, 7))
  trainer = AsyncTrainer(rl_settings(config))
  moves = []  # the paths of every leaf pushed to the rollout devices
  to_host_mesh = sharding.to_host_mesh
  monkeypatch.setattr(sharding, "to_host_mesh", lambda tree, *args: (
      moves.extend(flax.traverse_util.flatten_dict(tree)), to_host_mesh(tree, *args))[1])
  score = trainer.score  # an untrained model fails every task: give the samples advantages
  trainer.score = lambda records: dataclasses.replace(score(records), scores=[1.0, -1.0])
  try:
    key = iter(jax.random.split(jax.random.key(1), 64))
    trained = jax.tree_util.tree_map(  # B = 0 would leave the base's outputs: make B count
        lambda x: x + 0.05 * jax.random.normal(next(key), x.shape, x.dtype), trainer.state.params)
    trainer.state = trainer.state.replace(params=trained)
    expected = flax.traverse_util.flatten_dict(jax.device_get(trainer.state.model_params()))
    trained_paths = flax.traverse_util.flatten_dict(trained).keys()
    assert {"lora_b", "embedding_rows"} <= {path[-1] for path in trained_paths}  # (tied head)
    before = jax.device_get(trained)  # the update donates the state
    trainer._start_worker(version=0)
    first = flax.traverse_util.flatten_dict(trainer.worker.box.latest()[1])
    rollout = {d.id for d in trainer.host.devices.flat}
    assert first.keys() == expected.keys() and sorted(moves) == sorted(expected)
    for path, leaf in first.items():
      assert {d.id for d in leaf.devices()} == rollout
      assert leaf.dtype == trainer.model_config.compute_dtype
      np.testing.assert_array_equal(leaf, expected[path].astype(leaf.dtype))
    pointers = lambda leaf: [s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards]
    base = {path: (leaf, pointers(leaf)) for path, leaf in first.items()
            if path not in trained_paths}
    diffs = [trainer.update_once(step)["logp_diff_max"] for step in (1, 2)]
    trainer.worker.close(timeout=60)
    assert max(diffs) < 1e-3  # batch 2 was sampled with the weights of update 1's push
    version, latest = trainer.worker.box.latest()
    latest = flax.traverse_util.flatten_dict(latest)
    assert version == 2 and latest.keys() == expected.keys()
    for path, (leaf, pointer) in base.items():  # the very buffers of the first push
      assert latest[path] is leaf and pointers(leaf) == pointer and moves.count(path) == 1
    now = flax.traverse_util.flatten_dict(jax.device_get(trainer.state.params))
    for path in trained_paths:  # copied at each of the 3 pushes: the trainer's latest
      assert moves.count(path) == 3
      np.testing.assert_array_equal(latest[path], now[path].astype(latest[path].dtype))
    moved = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                                   trainer.state.params, before)
    assert min(jax.tree_util.tree_leaves(moved)) > 0
  finally:
    trainer.close()


@pytest.mark.parametrize("options,message", [
    (dict(staleness=-1), "staleness"),
    (dict(rollout_devices=8), "rollout devices per host"),
])
def test_bad_async_settings_are_named(tmp_path, options, message):
  with pytest.raises(ConfigError, match=message):
    AsyncTrainer(rl_settings(_config(tmp_path, **options)))


def test_the_job_overlaps_rollouts_and_updates_and_reports_them(tmp_path):
  """The worker's first fill starts 4 groups with version 0 (the budget of staleness 1, and 8
  sampler rows of 2): 2 make the first batch, the other 2 are trained one update later (stale)
  or dropped, never on time. Tokens of a stale group, and only those, are importance-weighted:
  each sampled with (or over a cache of) version 0 while the trainer holds version 1 (their
  weight is 1 only if the update left the params as they were)."""
  config = _config(tmp_path, staleness=1)
  config.eval_tasks, config.eval_max_tasks = config.tasks, 2  # evaluated beside the worker
  summary = rl_job.run(config)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert summary["steps"] == 3 and [r["step"] for r in rows] == [1, 2, 3]
  assert (rows[0]["staleness_0"], rows[0]["stale"], rows[0]["behaviour_weight"]) == (2, 0, 1)
  assert sum(r["staleness_1"] + r["stale_dropped"] for r in rows[1:]) >= 2  # ran ahead
  for row in rows:
    assert row["staleness_0"] + row["staleness_1"] == 2  # every group within the bound
    assert row["staleness_mean"] == row["staleness_1"] / 2
    assert (row["stale"] > 0) == (row["staleness_1"] > 0)
    assert row["stale"] > 0 or row["behaviour_weight"] == 1.0  # fresh tokens weigh exactly 1
    assert 0 < row["trainer_busy"] < 1 and row["trainer_tokens_per_s"] > 0
    assert np.isfinite(row["pg_loss"])
  assert rows[0]["sampler_tokens_per_s"] > 0  # (a later interval may find the queue full)
  assert "eval_accuracy" in rows[-1] and "eval_accuracy" not in rows[0]
  assert (tmp_path / "dapo.png").stat().st_size > 0
  assert summary["overlap_plot"] == str(tmp_path / "async.png")
  assert (tmp_path / "async.png").stat().st_size > 0


def test_the_benchmark_times_updates_after_the_first_and_compares_with_sync():
  def rows(times, busy):
    return [{"time": t, "sampler_busy": busy, "trainer_busy": 1 - busy} for t in times]

  sync = {s: async_bench.run_figures(rows([30.0, 38.0, 46.0], 0.5), {"pass@1": 0.8 + s / 100})
          for s in (0, 1)}
  k1 = {s: async_bench.run_figures(rows([20.0, 24.0 + s, 28.0 + 2 * s], 0.9),
                                   {"pass@1": 0.8}) for s in (0, 1)}
  assert sync[0]["wall_per_update_s"] == 8.0  # the first update's compilations are left out
  table = async_bench.compare({"sync": sync, "k=1": k1})
  assert table["k=1"]["speedup"]["values"] == [2.0, 8.0 / 5.0]
  assert table["sync"]["pass@1"]["mean"] == pytest.approx(0.805)
  text = async_bench.markdown(table)
  assert "| k=1 | 4.50 +- 0.71 | 1.80x +- 0.28 |" in text
