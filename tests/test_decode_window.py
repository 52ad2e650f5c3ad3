"""A decode chunk reads only the cache slots its rows can fill (its window), and decodes exactly
as it does over the whole cache."""

import re

import jax
import numpy as np
import pytest

from coa_jax.model.transformer import Transformer
from coa_jax.perf import aot
from coa_jax.rollout.sampler import Sampler, SamplingConfig, window_for
from coa_jax.runtime import sharding

from test_sampler import CONFIG, mesh1, params  # noqa: F401 (its fixtures)

SLOTS, CHUNK = 1024, 16


def sampler(mesh, cache_heads_first=None):
  return Sampler(CONFIG, mesh, batch_size=4, cache_size=SLOTS, chunk=CHUNK, stop_ids=(),
                 sampling=SamplingConfig(temperature=1.0), cache_heads_first=cache_heads_first)


def episode(s, params, window=None):
  """Rows joining mid-run, finishing, resuming and refilled, new weights mid-sample; returns
  (each chunk's window, tokens, log-probs and counts; the final state)."""
  ids = lambda n, seed: np.random.default_rng(seed).integers(0, CONFIG.vocab_size, n).tolist()
  swapped = jax.tree.map(lambda x: x * 1.05, params)  # a partial rollout's newer weights
  chunks = []

  def decode(state, p, key):
    used = s.decode_window(state) if window is None else window
    state, chunk = s.decode_chunk(p, state, jax.random.key(key), window=window)
    chunks.append((used, *map(np.asarray, (chunk.tokens_BxK, chunk.logprobs_BxK,
                                           chunk.counts_B))))
    return state

  # rows 0, 1: 99 tokens cached, they stop at 139 (budget 140)
  state = s.prefill_groups(params, s.init_state(), [([0, 1], ids(100, 0))], [140])
  state = decode(state, params, 0)
  state = s.prefill_groups(params, state, [([2, 3], ids(20, 1))], [400])  # rows 2, 3 join
  state = decode(state, params, 1)
  state = decode(state, swapped, 2)  # rows 0, 1 finish with the new weights
  state = decode(state, swapped, 3)  # rows 2, 3 alone: rows 0, 1 lie past the window
  # row 1 resumes: 139 + 32 padded ids - 1 -> 512 (4x steps); the whole cache's reads it all
  state = s.extend_rows(swapped, state, {1: ids(20, 2), 2: ids(5, 3)}, window=window)
  state = decode(state, swapped, 4)
  state = s.prefill_groups(swapped, state, [([0], ids(30, 4))], [300])  # row 0 refilled
  state = decode(state, swapped, 5)
  return chunks, state


@pytest.mark.parametrize("cache_heads_first", [False, True])
def test_the_window_decodes_and_extends_as_the_whole_cache_and_compiles_once_per_bucket(
    mesh1, params, cache_heads_first):
  s = sampler(mesh1, cache_heads_first)
  windowed, state = episode(s, params)
  before = s.compilations()
  whole, whole_state = episode(s, params, window=SLOTS)
  assert s.compilations() == before + 2  # the whole cache's decode and extend; prefill as before
  # The bucket of the longest active row's length + CHUNK - 1: 99 + 15, 115 + 15, 131 + 15,
  # rows 2, 3 at 51 + 15 (rows 0, 1 at 139 past it, not active), row 1 resumed at 159 + 15,
  # rows 2, 3 at 89 + 15.
  assert [w for w, *_ in windowed] == [128, 256, 256, 128, 256, 128]
  assert [w for w, *_ in whole] == [SLOTS] * 6
  for (_, tokens, logprobs, counts), (_, *full) in zip(windowed, whole):
    np.testing.assert_array_equal(tokens, full[0])
    np.testing.assert_allclose(logprobs, full[1], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(counts, full[2])
  assert [c[3].tolist() for c in windowed][:3] == [[16, 16, 0, 0], [16, 16, 16, 16],
                                                   [8, 8, 16, 16]]
  lengths = np.asarray(state.cache.lengths_B)
  np.testing.assert_array_equal(lengths, whole_state.cache.lengths_B)
  for a, b in ((state.cache.k, whole_state.cache.k), (state.cache.v, whole_state.cache.v)):
    a, b = np.asarray(a), np.asarray(b)
    if cache_heads_first:
      a, b = a.swapaxes(2, 3), b.swapaxes(2, 3)
    for row, n in enumerate(lengths):  # every filled slot
      np.testing.assert_allclose(a[:, row, :n], b[:, row, :n], rtol=0, atol=1e-6)
  again, _ = episode(s, params)
  assert s.compilations() == before + 2 and all(
      (x[1] == y[1]).all() for x, y in zip(again, windowed))


def test_the_window_is_the_bucket_of_the_last_slot_a_chunk_reads(mesh1):
  s = sampler(mesh1)
  # A row of n tokens reads slots up to n + CHUNK - 2 in its chunk's last step.
  assert [s.window_for(n) for n in (0, 113, 114, 241, 242, 497, 498, 1009, 1010, 4000)] == [
      128, 128, 256, 256, 512, 512, 1024, 1024, 1024, 1024]
  # An extend's window (32 padded tokens) grows in steps of 4, to the cache size.
  assert [window_for(n, 32, SLOTS, growth=4) for n in (97, 98, 481, 482, 5000)] == [
      128, 512, 512, 1024, 1024]


def test_the_decode_chunk_reads_its_window_in_place_and_updates_the_cache_in_place(mesh1,
                                                                                   params):
  """No copy of a layer's cache window or of the cache in the compiled chunk (kv heads first,
  the accelerators' layout; slots first, XLA:CPU transposes each layer's window for its dots),
  and the donated cache is the output's (aliased: written in place)."""
  s = sampler(mesh1, cache_heads_first=True)
  key = jax.eval_shape(lambda: jax.random.key(0))
  compiled = s.decode_chunk.lower(params, s.abstract_state(), key, window=128).compile()
  text = compiled.as_text()
  layer_window = 4 * CONFIG.num_kv_heads * 128 * CONFIG.head_dim * 4  # rows x ... x f32
  assert aot._cache_copies(compiled, 128, layer_window) == 0
  assert aot._cache_copies(compiled, SLOTS, layer_window) == 0
  assert re.search(r"f32\[4,2,128,16\]", text)  # the window is read
  params_in = len(jax.tree.leaves(params))  # then the state: cache k, v first
  alias = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
  assert f"{{0}}: ({params_in}, {{}}" in alias and f"{{1}}: ({params_in + 1}, {{}}" in alias


def test_a_sharded_window_decodes_as_one_device(mesh1, params):
  """Rows over data (4), kv heads over tensor (2): the window cuts only the slots."""
  mesh8 = sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=1, tensor=2))
  sharded = jax.device_put(params, sharding.param_shardings(Transformer(CONFIG), mesh8))
  one, _ = episode(sampler(mesh1, cache_heads_first=True), params)
  eight, state = episode(sampler(mesh8, cache_heads_first=True), sharded)
  assert [c[0] for c in eight] == [c[0] for c in one]
  for a, b in zip(eight, one):
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_allclose(a[2], b[2], rtol=0, atol=1e-5)
  assert state.cache.k.addressable_shards[0].data.shape == (2, 1, 1, SLOTS, 16)
