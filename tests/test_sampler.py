"""KV-cache decoding equals full forward passes; sampling matches its definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.model import build_config
from coa_jax.model.transformer import Transformer
from coa_jax.rollout.sampler import (RowSampling, Sampler, SamplingConfig, bucket, sample_rows,
                                     sample_tokens)
from coa_jax.runtime import sharding
from coa_jax.runtime.sharding import init_params, param_shardings

CONFIG = build_config({"preset": "tiny", "tie_embeddings": False})
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def mesh1():
  return sharding.make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def params(mesh1):
  return init_params(Transformer(CONFIG), mesh1, jax.random.key(0))


@pytest.fixture(scope="module")
def full_logits(params):
  """Logits of a full forward pass without a cache, one sequence at a time."""
  apply = jax.jit(lambda ids: Transformer(CONFIG).apply({"params": params}, ids))
  return lambda seq: np.asarray(apply(jnp.asarray([seq]))[0])


def sampler(mesh, sampling=GREEDY, batch_size=4, chunk=6, stop_ids=(), cache_heads_first=None,
            extend_tokens=2048, rows_alone_from=64):
  return Sampler(CONFIG, mesh, batch_size=batch_size, cache_size=64, chunk=chunk,
                 stop_ids=stop_ids, sampling=sampling, cache_heads_first=cache_heads_first,
                 extend_tokens=extend_tokens, rows_alone_from=rows_alone_from)


def run_episode(s, params, key=0):
  """Prefills two groups of two rows, decodes, extends rows 0 and 2, decodes again.

  Returns each row's full token sequence and the (position, logprob) of its sampled tokens.
  """
  state = s.init_state()
  state = s.prefill_groups(params, state, [([0, 1], PROMPTS[0]), ([2, 3], PROMPTS[1])],
                           [40, 40])
  seqs = [list(PROMPTS[0]), list(PROMPTS[0]), list(PROMPTS[1]), list(PROMPTS[1])]
  sampled = [[] for _ in seqs]

  def take(chunk):
    tokens, logprobs, counts = map(np.asarray, (chunk.tokens_BxK, chunk.logprobs_BxK,
                                                chunk.counts_B))
    for row in range(4):
      for t, lp in zip(tokens[row, :counts[row]], logprobs[row, :counts[row]]):
        sampled[row].append((len(seqs[row]), float(lp)))
        seqs[row].append(int(t))

  state, chunk = s.decode_chunk(params, state, jax.random.key(key))
  take(chunk)
  appends = {0: [100, 101, 102], 2: [200]}
  state = s.extend_rows(params, state, appends)
  for row, ids in appends.items():
    seqs[row].extend(ids)
  state, chunk = s.decode_chunk(params, state, jax.random.key(key + 1))
  take(chunk)
  return seqs, sampled, state


# Both cache layouts; and the extend fed one token per call (2 rows, 2 (row, token) pairs).
@pytest.mark.parametrize("cache_heads_first, extend_tokens", [(True, 2048), (False, 2048),
                                                              (False, 2)])
def test_greedy_cached_decoding_equals_full_forward_argmax_across_an_extend(
    mesh1, params, full_logits, cache_heads_first, extend_tokens):
  seqs, sampled, _ = run_episode(sampler(mesh1, cache_heads_first=cache_heads_first,
                                         extend_tokens=extend_tokens), params)
  for row, seq in enumerate(seqs):
    assert len(sampled[row]) == 12  # rows 1 and 3: 6 tokens, the extend, 6 more
    for position, _ in sampled[row]:
      assert seq[position] == int(np.argmax(full_logits(seq[:position])[-1])), (row, position)
  assert len(set(seqs[0][5:11])) > 1  # the model does not just repeat one token


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)])
def test_recorded_logprobs_equal_teacher_forced_log_softmax(mesh1, params, full_logits,
                                                            sampling):
  seqs, sampled, _ = run_episode(sampler(mesh1, sampling), params)
  for row, seq in enumerate(seqs):
    logp = jax.nn.log_softmax(full_logits(seq)[:-1], axis=-1)
    for position, recorded in sampled[row]:
      np.testing.assert_allclose(recorded, logp[position - 1, seq[position]], atol=1e-4)


def test_rows_freeze_on_stop_tokens_and_at_their_budget(mesh1, params):
  seqs, _, _ = run_episode(sampler(mesh1), params)
  stop = seqs[1][7]  # the third token that row 1 samples greedily
  s = sampler(mesh1, chunk=10, stop_ids=[stop])
  state = s.init_state()
  state = s.prefill_groups(params, state, [([0, 1], PROMPTS[0])], [40])
  state = s.prefill_groups(params, state, [([2, 3], PROMPTS[1])], [len(PROMPTS[1]) + 4])
  state, chunk = s.decode_chunk(params, state, jax.random.key(0))
  counts = np.asarray(chunk.counts_B)
  assert counts[1] == 3 and np.asarray(chunk.tokens_BxK)[1, 2] == stop
  assert counts[2] == counts[3] == 4  # prompt 9 + 4 sampled = budget 13
  assert not np.asarray(state.active_B)[[1, 2, 3]].any()



def test_an_extend_padded_past_the_last_slot_fills_the_cache_exactly(mesh1, params, full_logits):
  # prompt 5 + 2 sampled + 3 appended + 1 sampled = 11 slots; the extend writes 8 slots from
  # slot 6 (the pending token, the first 2 appended and 5 of padding), 3 past the end.
  s = Sampler(CONFIG, mesh1, batch_size=2, cache_size=11, chunk=2, stop_ids=(), sampling=GREEDY)
  state = s.prefill_groups(params, s.init_state(), [([0, 1], PROMPTS[0])], [11])
  state, first = s.decode_chunk(params, state, jax.random.key(0))
  appended = [100, 101, 102]
  state = s.extend_rows(params, state, {0: appended})
  state, second = s.decode_chunk(params, state, jax.random.key(1))
  seq = PROMPTS[0] + np.asarray(first.tokens_BxK)[0].tolist() + appended
  assert np.asarray(second.counts_B)[0] == 1 and not np.asarray(state.active_B)[0]
  assert np.asarray(second.tokens_BxK)[0, 0] == int(np.argmax(full_logits(seq)[-1]))


def test_group_rows_share_one_prefill_and_diverge_when_sampling(mesh1, params):
  s = sampler(mesh1, SamplingConfig(temperature=1.0), chunk=8)
  state = s.prefill_groups(params, s.init_state(), [([0, 1, 2, 3], PROMPTS[0])], [40])
  state, chunk = s.decode_chunk(params, state, jax.random.key(3))
  rows = {tuple(r) for r in np.asarray(chunk.tokens_BxK)}
  assert len(rows) > 1
  again = s.prefill_groups(params, s.init_state(), [([0, 1, 2, 3], PROMPTS[0])], [40])
  _, same = s.decode_chunk(params, again, jax.random.key(3))
  np.testing.assert_array_equal(same.tokens_BxK, chunk.tokens_BxK)  # same key, same tokens


def test_a_rows_samples_depend_on_its_seed_not_its_slot_batch_or_chunks(mesh1, params):
  """The same (key, seed, prompt) draws the same tokens in another slot, beside another
  prompt, in a larger batch and with another chunk size."""

  def tokens(batch_size, chunk, groups, seeds, row):
    s = sampler(mesh1, SamplingConfig(temperature=1.0), batch_size=batch_size, chunk=chunk)
    state = s.prefill_groups(params, s.init_state(), groups, [30] * len(groups), seeds)
    out = []
    while np.asarray(state.active_B)[row]:
      state, chunk_out = s.decode_chunk(params, state, jax.random.key(5))
      out += np.asarray(chunk_out.tokens_BxK)[row, :int(chunk_out.counts_B[row])].tolist()
    return out

  alone = tokens(4, 6, [([0, 1], PROMPTS[0])], [[11, 12]], row=1)
  moved = tokens(8, 4, [([0, 1], PROMPTS[1]), ([6, 7], PROMPTS[0])], [[3, 4], [11, 12]], row=7)
  assert len(alone) == 25 and moved == alone
  assert tokens(4, 6, [([0, 1], PROMPTS[0])], [[11, 13]], row=1) != alone


def test_top_k_1_is_greedy():
  logits = jax.random.normal(jax.random.key(0), (16, 50))
  keys = jax.random.split(jax.random.key(1), 16)
  greedy, _ = sample_tokens(logits, keys, GREEDY)
  top1, _ = sample_tokens(logits, keys, SamplingConfig(temperature=0.7, top_k=1))
  np.testing.assert_array_equal(greedy, top1)


def frequencies(logits, sampling, n=40_000):
  tokens, _ = sample_tokens(jnp.broadcast_to(logits, (n, len(logits))),
                            jax.random.split(jax.random.key(7), n), sampling)
  return np.bincount(np.asarray(tokens), minlength=len(logits)) / n


def test_top_p_keeps_the_smallest_set_reaching_p():
  logits = jnp.log(jnp.array([0.05, 0.5, 0.15, 0.3]))
  freq = frequencies(logits, SamplingConfig(temperature=1.0, top_p=0.7))
  np.testing.assert_allclose(freq, [0, 0.5 / 0.8, 0, 0.3 / 0.8], atol=0.01)


def numpy_filtered_logp(logits_V, sampling):
  """The log-probs of the distribution sampled from, written from the definitions: softmax of
  logits / temperature over the top_k largest, then over the fewest most likely of those whose
  probability reaches top_p, renormalised (-inf off the kept set)."""
  z = logits_V.astype(np.float64) / sampling.temperature
  keep = np.ones(len(z), bool)
  if sampling.top_k:
    keep &= z >= np.sort(z)[-sampling.top_k]
  if sampling.top_p < 1.0:
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]  # mass of the likelier tokens
    keep[order[before >= sampling.top_p]] = False
  return np.where(keep, z - np.log(np.sum(np.exp(z[keep]))), -np.inf)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7, top_k=4),
                                      SamplingConfig(temperature=1.3, top_p=0.6),
                                      SamplingConfig(temperature=0.9, top_k=5, top_p=0.7),
                                      SamplingConfig(temperature=0.8)])
def test_recorded_logprobs_are_of_the_truncated_renormalised_distribution(sampling):
  logits = np.asarray(jax.random.normal(jax.random.key(2), (64, 12))) * 2.0
  tokens, logprobs = sample_tokens(jnp.asarray(logits), jax.random.split(jax.random.key(3), 64),
                                   sampling)
  expected = [numpy_filtered_logp(row, sampling)[t] for row, t in zip(logits, np.asarray(tokens))]
  np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-5)


ROWS = [GREEDY, SamplingConfig(temperature=0.7, top_k=4), SamplingConfig(temperature=1.3, top_p=0.6),
        SamplingConfig(temperature=0.9, top_k=5, top_p=0.7), SamplingConfig(temperature=0.8),
        SamplingConfig(temperature=0.5, top_k=100)]


def test_each_row_samples_with_its_own_settings_as_the_static_settings_do():
  """A batch whose rows bring their own settings (a server's requests) draws, row by row, the
  same token and log-prob, bit for bit, as `sample_tokens` with that row's settings for the
  whole batch; top_k past the vocabulary keeps every token."""
  logits = jax.random.normal(jax.random.key(4), (len(ROWS), 12)) * 2.0
  keys = jax.random.split(jax.random.key(5), len(ROWS))
  tokens, logprobs, logp = sample_rows(logits, keys, RowSampling.of(ROWS))
  for row, settings in enumerate(ROWS):
    alone = SamplingConfig(settings.temperature, min(settings.top_k, 12), settings.top_p)
    token, logprob = sample_tokens(logits, keys, alone)
    assert int(tokens[row]) == int(token[row]) and float(logprobs[row]) == float(logprob[row])
    expected = (jax.nn.log_softmax(logits[row]) if settings.temperature == 0 else
                numpy_filtered_logp(np.asarray(logits[row]), alone))
    np.testing.assert_allclose(logp[row], expected, rtol=1e-5, atol=1e-5)


def test_a_row_settings_sampler_returns_the_top_logprobs_of_the_distribution_drawn_from(
    mesh1, params, full_logits):
  s = Sampler(CONFIG, mesh1, batch_size=4, cache_size=64, chunk=6, stop_ids=(), sampling=None,
              top_logprobs=3)
  settings = [GREEDY, SamplingConfig(temperature=1.0), GREEDY, SamplingConfig(temperature=0.5)]
  state = s.prefill_groups(params, s.init_state(), [([0, 1], PROMPTS[0]), ([2, 3], PROMPTS[1])],
                           [40, 40])
  state, chunk = s.decode_chunk(params, state, jax.random.key(0),
                                row_sampling=RowSampling.of(settings))
  chunk = jax.tree.map(np.asarray, chunk)
  for row, prompt in enumerate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]):
    seq = prompt + chunk.tokens_BxK[row].tolist()
    temperature = settings[row].temperature or 1.0
    logp = jax.nn.log_softmax(full_logits(seq)[len(prompt) - 1:-1] / temperature, axis=-1)
    expected_ids = np.argsort(-np.asarray(logp), axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(chunk.top_ids_BxKxN[row], expected_ids)
    np.testing.assert_allclose(chunk.top_logprobs_BxKxN[row],
                               np.take_along_axis(np.asarray(logp), expected_ids, -1), atol=1e-4)
    if settings[row] is GREEDY:
      np.testing.assert_array_equal(chunk.tokens_BxK[row], expected_ids[:, 0])


def test_row_settings_come_exactly_with_a_sampler_built_for_them(mesh1, params):
  static = sampler(mesh1)
  state = static.prefill_groups(params, static.init_state(), [([0], PROMPTS[0])], [40])
  with pytest.raises(ValueError, match="row_sampling"):
    static.decode_chunk(params, state, jax.random.key(0), row_sampling=RowSampling.of([GREEDY] * 4))
  rows = Sampler(CONFIG, mesh1, batch_size=4, cache_size=64, chunk=6, stop_ids=(), sampling=None)
  with pytest.raises(ValueError, match="row_sampling"):
    rows.decode_chunk(params, rows.init_state(), jax.random.key(0))
  with pytest.raises(ValueError, match="top_logprobs"):
    Sampler(CONFIG, mesh1, batch_size=4, cache_size=64, chunk=6, stop_ids=(), top_logprobs=2)


def test_only_top_k_or_top_p_truncate_the_sampled_distribution():
  assert SamplingConfig(top_k=5).truncates and SamplingConfig(top_p=0.9).truncates
  assert not SamplingConfig(temperature=0.6).truncates and not GREEDY.truncates


def test_temperature_scales_the_logits():
  logits = jnp.log(jnp.array([0.1, 0.2, 0.7]))
  expected = np.asarray(jax.nn.softmax(logits / 2.0))
  np.testing.assert_allclose(frequencies(logits, SamplingConfig(temperature=2.0)), expected,
                             atol=0.01)


def test_buckets_are_powers_of_two():
  assert [bucket(n) for n in (1, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]
  assert bucket(3, 1) == 4 and bucket(1, 1) == 1


def test_no_recompilation_after_warm_up(mesh1, params):
  s = sampler(mesh1)
  run_episode(s, params)
  warm = s.compilations()
  state = s.prefill_groups(params, s.init_state(), [([0, 1], [1] * 10), ([2, 3], [4] * 15)],
                           [40, 40])  # other prompt lengths, in the same bucket of 16
  for i in range(4):
    state, _ = s.decode_chunk(params, state, jax.random.key(i))
    state = s.extend_rows(params, state, {1: [7, 8], 3: [9] * (1 + i)})
  assert s.compilations() == warm


def test_extends_of_up_to_8_rows_share_one_program(mesh1, params):
  s = sampler(mesh1, batch_size=16)
  state = s.prefill_groups(params, s.init_state(), [(list(range(8)), [1] * 10)], [40])
  for rows in ([3], [0, 5], [1, 2, 4, 6, 7]):
    state = s.extend_rows(params, state, {row: [7, 8] for row in rows})
  assert s._jits[1]._cache_size() == 1


@pytest.mark.parametrize("cache_heads_first", [False, True])
def test_sharded_decoding_gives_the_same_tokens_as_one_device(mesh1, params, cache_heads_first):
  mesh8 = sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=1, tensor=2))
  sharded = jax.device_put(params, param_shardings(Transformer(CONFIG), mesh8))
  one, _, _ = run_episode(sampler(mesh1), params)
  eight, _, state = run_episode(sampler(mesh8, cache_heads_first=cache_heads_first), sharded)
  assert one == eight
  # Rows over data (4 of them), kv heads over tensor (2).
  assert state.cache.heads_first == cache_heads_first
  shard = (2, 1, 1, 64, 16) if cache_heads_first else (2, 1, 64, 1, 16)
  assert state.cache.k.addressable_shards[0].data.shape == shard


@pytest.mark.parametrize("devices, cache_heads_first", [(1, False), (1, True), (8, True)])
def test_decoding_only_the_active_rows_equals_decoding_the_whole_batch(mesh1, params, devices,
                                                                      cache_heads_first):
  """6 of 16 rows active (rows decoded alone from a batch of 16 here, 64 by default): the
  sampler decodes a batch of 8 (the bucket, at most half of 16) and writes it back; every row
  samples, records and caches what the whole batch gives it, across an extend and a second
  chunk. On 8 devices the rows split over data (4) and kv heads over tensor (2)."""
  mesh = mesh1 if devices == 1 else sharding.make_mesh(sharding.MeshConfig(data=4, tensor=2))
  weights = jax.device_put(params, param_shardings(Transformer(CONFIG), mesh))
  s = sampler(mesh, SamplingConfig(temperature=1.0), batch_size=16, chunk=5,
              cache_heads_first=cache_heads_first, rows_alone_from=16)

  def episode(active_rows: bool):
    state = s.prefill_groups(weights, s.init_state(), [([0, 1], PROMPTS[0]), ([6, 7], PROMPTS[1]),
                                                       ([12, 13], PROMPTS[0][:3])], [40] * 3)
    chunks = []
    for i, appends in enumerate([{1: [100, 101], 12: [102]}, {}]):
      rows = np.flatnonzero(np.asarray(state.active_B)) if active_rows else None
      state, chunk = s.decode_chunk(weights, state, jax.random.key(i), rows=rows)
      chunks.append(jax.tree.map(np.asarray, chunk))
      if appends:
        state = s.extend_rows(weights, state, appends)
    return chunks, jax.tree.map(np.asarray, state)

  state = s.prefill_groups(weights, s.init_state(), [([0, 1, 2, 3, 4, 5], PROMPTS[0])], [40])
  assert s._compact_rows(state, [0, 1, 2, 3, 4, 5]).tolist() == [0, 1, 2, 3, 4, 5, 16, 16]
  assert s._compact_rows(state, list(range(9))) is None  # a bucket of 16: the whole batch
  small = sampler(mesh, batch_size=16, cache_heads_first=cache_heads_first)  # 16 < 64
  assert small._compact_rows(state, [0, 1]) is None
  (whole, whole_state), (alone, alone_state) = episode(False), episode(True)
  rows = [0, 1, 6, 7, 12, 13]
  for a, b in zip(whole, alone):
    np.testing.assert_array_equal(a.counts_B, b.counts_B)
    assert a.counts_B[rows].min() > 0 and not b.counts_B[[2, 3, 4, 5, 8, 15]].any()
    np.testing.assert_array_equal(a.tokens_BxK, b.tokens_BxK)
    np.testing.assert_allclose(a.logprobs_BxK, b.logprobs_BxK, atol=1e-6)
  for name in ("pending_B", "active_B", "budget_B", "seed_B"):
    np.testing.assert_array_equal(getattr(whole_state, name), getattr(alone_state, name))
  np.testing.assert_array_equal(whole_state.cache.lengths_B, alone_state.cache.lengths_B)
  for row in rows:  # the filled slots; an inactive row of the whole batch also wrote one more
    filled = (slice(None), row) + (slice(None),) * cache_heads_first + (
        slice(int(whole_state.cache.lengths_B[row])),)
    np.testing.assert_allclose(whole_state.cache.k[filled], alone_state.cache.k[filled],
                               atol=1e-6)
    np.testing.assert_allclose(whole_state.cache.v[filled], alone_state.cache.v[filled],
                               atol=1e-6)


def test_rows_decoded_alone_keep_the_slot_their_last_step_writes_past_the_window(mesh1, params):
  """A row at length 124 reads a window of 128 slots in a chunk of 5 and writes slots 124-128;
  the next chunk must see slot 128, which lies past the window the first one read."""
  s = Sampler(CONFIG, mesh1, batch_size=16, cache_size=256, chunk=5, stop_ids=(),
              sampling=SamplingConfig(temperature=1.0), rows_alone_from=16)
  prompt = [(7 * i) % 50 + 5 for i in range(125)]  # 124 slots in the cache, 1 pending

  def chunks(active_rows: bool):
    state = s.prefill_groups(params, s.init_state(), [([0, 1], prompt)], [200])
    assert s.decode_window(state) == 128
    out = []
    for i in range(2):
      rows = np.flatnonzero(np.asarray(state.active_B)) if active_rows else None
      state, chunk = s.decode_chunk(params, state, jax.random.key(i), rows=rows)
      out.append(jax.tree.map(np.asarray, chunk))
    return out

  for whole, alone in zip(chunks(False), chunks(True)):
    np.testing.assert_array_equal(whole.tokens_BxK, alone.tokens_BxK)
    np.testing.assert_allclose(whole.logprobs_BxK, alone.logprobs_BxK, atol=1e-6)


def test_the_cache_puts_kv_heads_first_on_cpu_only_without_query_groups(mesh1):
  assert not sampler(mesh1).cache_heads_first  # the tiny preset: 2 query heads per kv head
  ungrouped = build_config({"preset": "tiny", "num_kv_heads": 4})
  assert Sampler(ungrouped, mesh1, batch_size=4, cache_size=64, chunk=6,
                 stop_ids=()).cache_heads_first


def test_sampling_params_in_the_compute_dtype_sample_exactly_as_the_master_weights(mesh1):
  config = CONFIG.replace(dtype="bfloat16", param_dtype="float32")
  master = init_params(Transformer(config), mesh1, jax.random.key(0))
  s = Sampler(config, mesh1, batch_size=4, cache_size=64, chunk=6, stop_ids=(),
              sampling=SamplingConfig(temperature=1.0))
  cast = s.sampling_params(master)
  assert {x.dtype for x in jax.tree_util.tree_leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
  # the same tokens with the same log-probs
  jax.tree_util.tree_map(np.testing.assert_array_equal, run_episode(s, cast),
                         run_episode(s, master))


def test_per_layer_weights_sample_exactly_as_the_stacked_ones(mesh1, params):
  """`layer_arrays` (the GPU default): the weights split into one array per layer, the decode
  chunk applying the layers one by one, prefill and extend scanning them."""
  split_sampler = Sampler(CONFIG, mesh1, batch_size=4, cache_size=64, chunk=6, stop_ids=(),
                          sampling=SamplingConfig(temperature=1.0), layer_arrays=True)
  split = split_sampler.sampling_params(params)
  assert "layers" not in split and split["layers_1"]["mlp"]["up_proj"]["kernel"].shape == (
      params["layers"]["mlp"]["up_proj"]["kernel"].shape[1:])
  np.testing.assert_array_equal(split["layers_1"]["attn"]["q_proj"]["kernel"],
                                params["layers"]["attn"]["q_proj"]["kernel"][1])
  stacked = sampler(mesh1, SamplingConfig(temperature=1.0))
  assert not stacked.layer_arrays and stacked.sampling_params(params) is not split
  # the same tokens with the same float32 log-probs, and the same cache
  jax.tree_util.tree_map(np.testing.assert_array_equal, run_episode(split_sampler, split),
                         run_episode(stacked, params))
