"""Device-side decoding with a KV cache: prefill, chunked decode and extend, as jitted steps.

A `DecodeState` holds B rows ("slots"). Row r has `cache.lengths_B[r]` tokens in its KV cache
(slots 0.. of the row, right-padded: prompts start at slot 0 and position 0) and one
`pending_B[r]` token not yet in the cache: the next decode step feeds it at position
`lengths_B[r]`. So

- `prefill` writes prompts minus their last token into the cache and makes the last one
  pending. A prompt is encoded once and its cache copied into every row of its group (the
  n samples of one prompt share one prefill).
- `decode_chunk` runs up to K steps on device (`lax.while_loop`): feed the pending tokens,
  sample the next ones (temperature, top-k, top-p, from an explicit key), record each sampled
  token's log-probability, and freeze a row the moment it samples a stop token or reaches
  its length budget.
- `extend` appends given tokens (an observation) to chosen rows in one parallel call and
  makes their last token pending.

Randomness is per row: the token a row samples at cache position t is drawn with the key
fold_in(fold_in(key, seed of the row), t) (`token_keys`). A row's samples therefore depend on the
key, its seed and its own tokens only, not on which slot it holds, what else is in the batch, how
the batch is split over devices and hosts, or where chunk boundaries fall. For one key, fold_in
is one-to-one in its 32-bit data (a block cipher), so rows with distinct seeds never share a
row key; their token keys coincide only as two random 64-bit keys would.

Shapes are static: B, the cache size S and K are fixed; the token and row counts of prefill
and extend are padded up to power-of-two buckets (rows past the real ones point at index B
and are dropped, as are padding tokens past slot S), so a rollout compiles each function once
per bucket it uses.

A decode chunk reads only the cache slots [0, W) that its rows can fill: its window W is a
power-of-two bucket (at least `MIN_WINDOW`, at most S) of the longest active row's length plus
K - 1, one past the last slot a row's K-th step attends to (`window_for`, `decode_window`: the
host fetches the rows' lengths). An extend reads the window of its rows' longest length plus
its padded token count (in 4x steps); a prefill's prompts start at slot 0 and read one (masked)
slot. Each program is compiled once per window; writes still go to the whole cache, in place
(or to the gathered rows, below, which are written back). A row that is not active may lie
past a chunk's window: it reads a cut cache, but what it samples is
discarded and the one slot it writes (its pending token's, at its length) is written again
when it resumes (extend). The slots past a window are masked to exact zeros either way; only
the order of the attention's float32 sums may differ, so a token can differ only where two
were within rounding of each other (tests/test_decode_window.py: the same tokens, log-probs
within 5e-7 of the whole cache's).

A batch empties as its samples finish or stop for a tool call, and a decode step costs the
same for every row, active or not. A caller that names the active rows (the rollout loop does)
has them decoded alone when their bucket is at most half the batch: the rows and the window's
slots are gathered into a smaller state, decoded, and written back (`_decode_rows`). Each row
attends to the same slots with the same weights as in the whole batch; only a matmul kernel
chosen for the smaller batch could round differently (on the CPU: the same tokens and log-probs
within 1e-6 in tests/test_sampler.py, and the main job's evaluation samples byte-identical with
and without, 1.57x faster; docs/benchmarks.md). The caller must name every active row: one left
out is not decoded, and stays active.

How a row draws its tokens, and the log-probabilities recorded: `coa_jax.rollout.sampling`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coa_jax.model.config import ModelConfig
from coa_jax.model.transformer import KVCache, Transformer, cache_axes, split_layers
from coa_jax.rollout.sampling import (RowSampling, SamplingConfig, sample_rows, sample_tokens,
                                      token_keys)
from coa_jax.runtime import sharding


@flax.struct.dataclass
class DecodeState:
  """The decoding state of B rows; see the module docstring for the invariants."""

  cache: KVCache
  pending_B: jax.Array  # int32: the next token to feed (not in the cache yet)
  active_B: jax.Array  # bool: still decoding
  budget_B: jax.Array  # int32: a row stops when lengths + 1 (its total tokens) reaches this
  seed_B: jax.Array  # int32: the row's sampling seed (see the module docstring)


@flax.struct.dataclass
class Chunk:
  """What one decode_chunk call sampled: K token slots per row, `counts_B` of them filled; with
  a sampler's `top_logprobs` N > 0, each step's N most likely tokens and their log-probs under
  the distribution drawn from (N = 0: empty arrays)."""

  tokens_BxK: jax.Array
  logprobs_BxK: jax.Array
  counts_B: jax.Array
  top_ids_BxKxN: jax.Array
  top_logprobs_BxKxN: jax.Array


# The smallest decode window: fewer programs to compile, at a read of at most this many slots.
MIN_WINDOW = 128


def bucket(n: int, smallest: int = 8) -> int:
  """Returns the power of two >= max(n, smallest) that pads a count of n."""
  return max(smallest, 1 << max(0, int(n) - 1).bit_length())


def window_for(longest: int, chunk: int, cache_size: int, growth: int = 2) -> int:
  """Returns the cache slots a decode chunk of `chunk` steps (or an extend of `chunk` padded
  tokens) reads when its longest row holds `longest` tokens: the smallest MIN_WINDOW x
  growth^i >= one past the last slot its last token attends to (longest + chunk - 2), at most
  the cache size."""
  window = MIN_WINDOW
  while window < min(longest + chunk - 1, cache_size):
    window *= growth
  return min(window, cache_size)


def _scatter_rows(cache: KVCache, rows_R: jax.Array, part: KVCache, slots: int) -> KVCache:
  """Returns `cache` with part's rows written over rows_R (slots [0, slots)); rows >= B drop."""
  heads = (slice(None),) * cache.heads_first
  put = lambda a, p: a.at[(slice(None), rows_R, *heads, slice(slots))].set(
      p[(slice(None), slice(None), *heads, slice(slots))].astype(a.dtype), mode="drop")
  return cache.replace(k=put(cache.k, part.k), v=put(cache.v, part.v),
                       lengths_B=cache.lengths_B.at[rows_R].set(part.lengths_B, mode="drop"))


class Sampler:
  """Jitted prefill / decode_chunk / extend for one model, batch size, cache size and chunk."""

  def __init__(self, model_config: ModelConfig, mesh: Mesh, batch_size: int, cache_size: int,
               chunk: int, stop_ids: Sequence[int], sampling: SamplingConfig = SamplingConfig(),
               cache_dtype: Any = None, cache_heads_first: bool | None = None,
               extend_tokens: int = 2048, layer_arrays: bool | None = None,
               rows_alone_from: int = 64, top_logprobs: int = 0):
    """With `sampling=None` every decode chunk takes the rows' own settings (`RowSampling`);
    `top_logprobs` N > 0 makes each chunk return every step's N most likely tokens too.

    `cache_heads_first` picks the KV cache's layout (see KVCache). By default kv heads come
    first, except on CPU devices for models with grouped query heads: there slots first
    decoded 1.1-1.2x faster (kv heads first was 1.1-1.5x faster in three models without).
    On TPU, slots first made the compiler copy each layer's cache into kv-heads-first order
    at every token (for the attention's batched dots).

    `extend_tokens` bounds the (row, token) pairs of one model call in `extend`: a long
    observation is fed in blocks, so the attention scores of one call stay small.

    `rows_alone_from` is the smallest batch whose active rows are decoded alone (`decode_chunk`'s
    `rows`). Below it a chunk of the whole batch costs about what one of fewer rows does, and
    each row bucket is one more program to compile: the main job's DAPO (32 rows) compiled 6
    of them (5 s) for no faster rollouts.

    On GPUs the decode chunk unrolls the layers: with the layer loop scanned, XLA:GPU copies
    each layer's slice of the stacked weights and of the KV cache before using it, at every
    token (in the 7B GPU preset's decode, 0.5 GiB of cache per layer and step: three times the
    cache's own traffic); unrolled, the cache slices are read in place. Prefill and extend keep
    the scan: unrolled, their attention scores stayed live across layers (extend: 34 GiB of
    temporaries against 2.5).

    With `layer_arrays` (default: on GPUs) the sampling weights hold each layer's weights in
    arrays of their own (`sampling_params` splits the stacked ones) and the decode chunk applies
    the layers one by one: unrolled over the stacked arrays, XLA:GPU still copied each layer's
    weights out of them at every token (the 1.5B bench's batch-16 decode on H100: 168 slice
    copies, 3.7 GB read and written per token, 44% of the estimated time). Prefill and extend
    scan the split weights, each layer's step switching to its weights (a copy of one layer's,
    as a scan over stacked weights slices them; stacked again, they would need a second copy
    of all weights in the program's temporaries)."""
    sharding.check_batch_fits_mesh(batch_size, 1, mesh)
    if top_logprobs and sampling is not None:
      raise ValueError("top_logprobs needs a sampler built with sampling=None (RowSampling)")
    platform = mesh.devices.flat[0].platform
    if cache_heads_first is None:
      cache_heads_first = platform != "cpu" or model_config.num_heads == model_config.num_kv_heads
    self.cache_heads_first = cache_heads_first
    self.config, self.mesh = model_config, mesh
    self.model = Transformer(model_config)
    self.decode_model = (Transformer(model_config.replace(scan_unroll=model_config.num_layers))
                         if platform == "gpu" else self.model)
    self.layer_arrays = platform == "gpu" if layer_arrays is None else layer_arrays
    self.layer_models = {"decode": Transformer(model_config, layer_arrays="each"),
                         "scan": Transformer(model_config, layer_arrays="scan")}
    self.batch_size, self.cache_size, self.chunk = batch_size, cache_size, chunk
    self.extend_tokens, self.rows_alone_from = extend_tokens, rows_alone_from
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.sampling, self.top_logprobs = sampling, top_logprobs
    self.cache_dtype = cache_dtype or model_config.compute_dtype
    self._jits = [jax.jit(self._prefill, donate_argnums=1),
                  jax.jit(self._extend, donate_argnums=1, static_argnames="window"),
                  jax.jit(self._decode_chunk, donate_argnums=1, static_argnames="window"),
                  jax.jit(self._decode_rows, donate_argnums=1, static_argnames="window"),
                  jax.jit(self._set_rows, donate_argnums=0)]
    self.prefill, self.extend, decode, decode_rows, self._set = (sharding.bind_mesh(f, mesh)
                                                                 for f in self._jits)
    self._row_ranks = mesh.shape["data"] * mesh.shape["fsdp"]

    def decode_chunk(params, state: DecodeState, key, window: int | None = None,
                     rows: Sequence[int] | None = None, row_sampling: RowSampling | None = None,
                     steps: int | None = None):
      """Returns (state, Chunk) of up to `chunk` steps reading the cache slots [0, window):
      by default `decode_window(state)` (which fetches the rows' lengths); a caller that knows
      them may pass `window_for` its longest active row. A caller that knows which rows are
      active may pass them as `rows`: when they fill at most half of the batch, only they
      are decoded (`_decode_rows`). `row_sampling`: the rows' settings, given exactly when the
      sampler was built with `sampling=None`. `steps`: fewer steps than `chunk` (the same
      program: a server's first tokens sooner)."""
      if (row_sampling is None) != (self.sampling is not None):
        raise ValueError("a sampler built with sampling=None takes row_sampling with every "
                         "decode chunk, and only such a sampler does")
      window = min(self.decode_window(state) if window is None else window, self.cache_size)
      steps = np.int32(self.chunk if steps is None else steps)
      if not 0 < steps <= self.chunk:
        raise ValueError(f"steps={steps}: expected 1..{self.chunk}")
      padded = self._compact_rows(state, rows)
      if padded is None:
        return decode(params, state, key, row_sampling, steps, window=window)
      return decode_rows(params, state, padded, key, row_sampling, steps, window=window)

    # Lowering (ahead of time, an abstract state): the whole cache unless given a window.
    decode_chunk.lower = lambda params, state, key, window=None, row_sampling=None: decode.lower(
        params, state, key, row_sampling, np.int32(self.chunk),
        window=min(window or self.cache_size, self.cache_size))
    self.decode_chunk = decode_chunk

  def sampling_params(self, params: Any) -> Any:
    """Returns `params` as this sampler decodes from them: `cast_params`, then `layer_params`."""
    return self.layer_params(self.cast_params(params))

  def cast_params(self, params: Any) -> Any:
    """Returns `params` in the compute dtype. The model casts every weight to it before use,
    so decoding gives the same tokens; but it reads half the bytes of float32 master weights
    and keeps no cast copies (in a 32B decode on v5p, 15 GiB of temporaries per chip)."""
    dtype = self.config.compute_dtype
    return jax.tree_util.tree_map(lambda p: p if p.dtype == dtype else p.astype(dtype), params)

  def layer_params(self, params: Any) -> Any:
    """Returns `params` (stacked, concrete or ShapeDtypeStructs) with each layer's weights in
    arrays of their own (`split_layers`) if this sampler decodes so (`layer_arrays`), else
    `params`; each array keeps its stacked parent's sharding less the layer axis."""
    if not self.layer_arrays or "layers" not in params:
      return params
    n = self.config.num_layers
    drop = lambda s: (NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))
                      if isinstance(s, NamedSharding) else s)
    leaves = jax.tree.leaves(params)
    if all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves):
      take = lambda a, i: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=drop(a.sharding))
      return split_layers(params, n, take)
    shardings = split_layers(jax.tree.map(lambda a: a.sharding, params), n,
                             lambda s, i: drop(s))
    # One module-level function, so that every later push hits jit's cache.
    return jax.jit(split_layers, static_argnums=1, out_shardings=shardings)(params, n)

  # --- state -----------------------------------------------------------------------------

  def state_shardings(self) -> DecodeState:
    """Returns the NamedShardings of a DecodeState: batch over data x fsdp, kv heads over tensor."""
    rules = sharding.AXIS_RULES
    spec = lambda names: NamedSharding(self.mesh, nn.logical_to_mesh_axes(names, rules))
    row = spec(("act_batch",))
    kv = spec(cache_axes(self.cache_heads_first))
    return DecodeState(KVCache(kv, kv, row, self.cache_heads_first), row, row, row, row)

  def abstract_state(self) -> DecodeState:
    """Returns the state's shapes, dtypes and shardings (ShapeDtypeStructs)."""
    b = self.batch_size
    cache = jax.eval_shape(lambda: self._empty_cache(b, self.cache_size))
    row, flag = jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.bool_)
    return jax.tree.map(lambda x, sharding: x.update(sharding=sharding),
                        DecodeState(cache, row, flag, row, row), self.state_shardings())

  def init_state(self) -> DecodeState:
    """Returns an empty state (every row inactive), created in place on the mesh (a fresh
    buffer per array: they are all donated)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding),
                        self.abstract_state())

  def _empty_cache(self, rows: int, slots: int) -> KVCache:
    """Returns a zero cache of `rows` rows and `slots` slots in this sampler's layout."""
    cfg = self.config
    middle = (cfg.num_kv_heads, slots) if self.cache_heads_first else (slots, cfg.num_kv_heads)
    shape = (cfg.num_layers, rows, *middle, cfg.head_dim)
    return KVCache(jnp.zeros(shape, self.cache_dtype), jnp.zeros(shape, self.cache_dtype),
                   jnp.zeros((rows,), jnp.int32), self.cache_heads_first)

  # --- jitted steps ----------------------------------------------------------------------

  def _run(self, params, cache: KVCache, tokens_BxT, positions_BxT, rows_B=None, model=None,
           window: int = 0):
    if "layers" not in params:  # split weights (`layer_params`)
      model = self.layer_models["decode" if model is self.decode_model else "scan"]
    return (model or self.model).apply({"params": params}, tokens_BxT, positions_BxT,
                                       cache=cache, cache_rows_B=rows_B, cache_window=window)

  def _prefill(self, params, state: DecodeState, rows_PxN, tokens_PxT, lengths_P, budgets_P,
               seeds_PxN):
    """Encodes P prompts once each and installs prompt p in rows rows_PxN[p] (all N), row
    rows_PxN[p, i] with the sampling seed seeds_PxN[p, i]."""
    p, t = tokens_PxT.shape
    n = rows_PxN.shape[1]
    fresh = self._empty_cache(p, t)
    positions_PxT = jnp.broadcast_to(jnp.arange(t), (p, t))
    # The prompts start at position 0: they attend to each other, to no cache slot. A window of
    # one (masked) slot spares scoring every token against the t empty ones.
    _, fresh = self._run(params, fresh, tokens_PxT, positions_PxT, window=1)
    last_P = jnp.maximum(lengths_P - 1, 0)
    fresh = fresh.replace(lengths_B=last_P)
    rows_R = rows_PxN.reshape(-1)
    copies = jax.tree.map(lambda a: jnp.repeat(a, n, axis=1 if a.ndim == 5 else 0), fresh)
    cache = _scatter_rows(state.cache, rows_R, copies, min(t, self.cache_size))
    pending_P = jnp.take_along_axis(tokens_PxT, last_P[:, None], axis=1)[:, 0]
    put = lambda a, v: a.at[rows_R].set(jnp.repeat(v, n).astype(a.dtype), mode="drop")
    return DecodeState(cache, put(state.pending_B, pending_P),
                       put(state.active_B, jnp.ones((p,), bool)),
                       put(state.budget_B, budgets_P),
                       state.seed_B.at[rows_R].set(seeds_PxN.reshape(-1), mode="drop"))

  def _extend(self, params, state: DecodeState, rows_R, tokens_RxT, counts_R, window: int = 0):
    """Appends tokens_RxT[r, :counts_R[r]] to row rows_R[r] and resumes it (count >= 1). The
    rows are extended in place, in blocks of tokens (see `extend_tokens`), reading the cache
    slots [0, window) (0: all; every row's length + T must fit)."""
    r, t = tokens_RxT.shape
    lengths_R = jnp.take(state.cache.lengths_B, rows_R, mode="clip")
    pending_R = jnp.take(state.pending_B, rows_R, mode="clip")
    inputs_RxT = jnp.concatenate([pending_R[:, None], tokens_RxT[:, :-1]], axis=1)
    positions_RxT = lengths_R[:, None] + jnp.arange(t)[None, :]
    # Tokens per call: the largest power of two that divides t within the bound.
    block = math.gcd(t, 1 << (max(1, self.extend_tokens // r).bit_length() - 1))

    def feed(i, cache):
      part = lambda a: jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=1)
      return self._run(params, cache, part(inputs_RxT), part(positions_RxT), rows_R,
                       window=window)[1]

    cache = jax.lax.fori_loop(0, t // block, feed, state.cache)
    cache = cache.replace(lengths_B=cache.lengths_B.at[rows_R].add(counts_R, mode="drop"))
    last_R = jnp.take_along_axis(tokens_RxT, jnp.maximum(counts_R - 1, 0)[:, None], axis=1)[:, 0]
    return state.replace(cache=cache,
                         pending_B=state.pending_B.at[rows_R].set(last_R, mode="drop"),
                         active_B=state.active_B.at[rows_R].set(True, mode="drop"))

  def _empty_chunk(self, b: int) -> Chunk:
    k, n = self.chunk, self.top_logprobs
    return Chunk(jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32),
                 jnp.zeros((b,), jnp.int32), jnp.zeros((b, k, n), jnp.int32),
                 jnp.zeros((b, k, n), jnp.float32))

  def _decode_chunk(self, params, state: DecodeState, key, row_sampling: RowSampling | None,
                    steps, window: int):
    """Samples up to `steps` (at most `chunk`) tokens per active row, attending over the cache
    slots [0, window) only (every active row's length + chunk - 1 must fit: `decode_window`);
    returns (state, Chunk)."""
    b = state.pending_B.shape[0]
    if not 0 < window <= self.cache_size:
      raise ValueError(f"decode window {window}: expected 1..{self.cache_size} cache slots")
    stop_ids = jnp.asarray(self.stop_ids, jnp.int32)
    out = self._empty_chunk(b)

    def step(carry):
      i, state, out = carry
      cache = state.cache
      logits, cache = self._run(params, cache, state.pending_B[:, None], cache.lengths_B[:, None],
                                model=self.decode_model, window=window)
      keys_B = token_keys(key, state.seed_B, cache.lengths_B)
      if row_sampling is None:
        token_B, logprob_B = sample_tokens(logits[:, -1], keys_B, self.sampling)
      else:
        token_B, logprob_B, logp_BxV = sample_rows(logits[:, -1], keys_B, row_sampling)
      active_B = state.active_B
      top_ids, top_logprobs = out.top_ids_BxKxN, out.top_logprobs_BxKxN
      if self.top_logprobs:
        values_BxN, ids_BxN = jax.lax.top_k(logp_BxV, self.top_logprobs)
        top_ids = top_ids.at[:, i].set(jnp.where(active_B[:, None], ids_BxN, 0))
        top_logprobs = top_logprobs.at[:, i].set(jnp.where(active_B[:, None], values_BxN, 0.0))
      out = Chunk(out.tokens_BxK.at[:, i].set(jnp.where(active_B, token_B, 0)),
                  out.logprobs_BxK.at[:, i].set(jnp.where(active_B, logprob_B, 0.0)),
                  out.counts_B + active_B, top_ids, top_logprobs)
      lengths_B = cache.lengths_B + active_B
      stopped_B = jnp.isin(token_B, stop_ids) | (lengths_B + 1 >= state.budget_B)
      state = state.replace(cache=cache.replace(lengths_B=lengths_B),
                            pending_B=jnp.where(active_B, token_B, state.pending_B),
                            active_B=active_B & ~stopped_B)
      return i + 1, state, out

    def running(carry):
      i, state, _ = carry
      return (i < steps) & jnp.any(state.active_B)

    _, state, out = jax.lax.while_loop(running, step, (jnp.int32(0), state, out))
    return state, out

  def _decode_rows(self, params, state: DecodeState, rows_R, key,
                   row_sampling: RowSampling | None, steps, window: int):
    """`_decode_chunk` of the rows rows_R alone (indices >= B pad): a state of those rows and
    the window's slots (and the one after, which the last step writes) is gathered, decoded and
    written back. Rows not active in `state` (and the padding) are left as they were; the Chunk
    has B rows, zeros in the others."""
    b = state.pending_B.shape[0]
    take = lambda a, axis=0: jnp.take(a, rows_R, axis=axis, mode="clip")
    cache = state.cache
    heads = (slice(None),) * cache.heads_first
    # The window covers what the rows read; the K-th step also writes one slot past it.
    slots = min(window + 1, self.cache_size)
    window_slots = lambda a: take(a[(slice(None), slice(None), *heads, slice(slots))], 1)
    part = DecodeState(cache.replace(k=window_slots(cache.k), v=window_slots(cache.v),
                                     lengths_B=take(cache.lengths_B)),
                       take(state.pending_B), take(state.active_B) & (rows_R < b),
                       take(state.budget_B), take(state.seed_B))
    part = jax.lax.with_sharding_constraint(part, self.state_shardings())
    back_R = jnp.where(part.active_B, rows_R, b)  # where each decoded row goes; b: dropped
    part, chunk = self._decode_chunk(params, part, key, jax.tree.map(take, row_sampling), steps,
                                     window)
    put = lambda a, p: a.at[back_R].set(p, mode="drop")
    return (state.replace(cache=_scatter_rows(cache, back_R, part.cache, slots),
                          pending_B=put(state.pending_B, part.pending_B),
                          active_B=put(state.active_B, part.active_B)),
            jax.tree.map(put, self._empty_chunk(b), chunk))

  def _set_rows(self, state: DecodeState, rows_R, active_R, budget_R, seed_R):
    """Sets rows_R's active flag, and where budget_R > 0 their budget and seed (rows >= B pad)."""
    put = lambda a, v, where=True: a.at[rows_R].set(
        jnp.where(where, v, jnp.take(a, rows_R, mode="clip")), mode="drop")
    renew_R = budget_R > 0
    return state.replace(active_B=put(state.active_B, active_R),
                         budget_B=put(state.budget_B, budget_R, renew_R),
                         seed_B=put(state.seed_B, seed_R, renew_R))

  # --- host-side helpers -----------------------------------------------------------------

  def set_rows(self, state: DecodeState, active: bool, rows: Sequence[int],
               budgets: Sequence[int] | None = None,
               seeds: Sequence[int] | None = None) -> DecodeState:
    """Returns `state` with `rows` frozen (active False: a caller ends them early) or active,
    and with `budgets` and `seeds` given, those too (a row whose cache a new request extends
    takes that request's budget and seed). Rows are padded to a bucket of 8."""
    r = bucket(len(rows))
    padded = np.full((r,), self.batch_size, np.int32)
    padded[:len(rows)] = rows
    row_budgets, row_seeds = np.zeros((r,), np.int32), np.zeros((r,), np.int32)
    if budgets is not None:
      row_budgets[:len(rows)], row_seeds[:len(rows)] = budgets, seeds
    return self._set(state, padded, np.full((r,), active), row_budgets, row_seeds)


  def _compact_rows(self, state: DecodeState, rows: Sequence[int] | None) -> np.ndarray | None:
    """Returns `rows` padded (with B) to a power-of-two bucket when decoding them alone pays:
    the batch has at least `rows_alone_from` rows, the bucket is at most half of it and splits
    over the mesh's batch ranks, and this process holds the whole state (on several hosts
    every host must run the same program). None otherwise: decode the whole batch."""
    if (rows is None or self.batch_size < self.rows_alone_from
        or not state.active_B.is_fully_addressable):
      return None
    r = bucket(len(rows))
    if 2 * r > self.batch_size or r % self._row_ranks:
      return None
    padded = np.full((r,), self.batch_size, np.int32)
    padded[:len(rows)] = rows
    return padded

  def window_for(self, longest: int) -> int:
    """Returns the cache slots a decode chunk of this sampler reads when its longest active
    row holds `longest` tokens (module-level `window_for`)."""
    return window_for(longest, self.chunk, self.cache_size)

  def decode_window(self, state: DecodeState) -> int:
    """Returns the window of the next decode chunk from `state`: `window_for` its longest
    active row (`_longest`)."""
    longest = self._longest(state, state.active_B)
    return self.cache_size if longest is None else self.window_for(longest)

  def _longest(self, state: DecodeState, rows) -> int | None:
    """Returns the longest filled length of the given rows (a mask or indices) of `state`,
    fetching the rows' lengths: one wait for the state's producer (the rollout loop has
    already waited for it). None for a state this process does not hold alone (a multi-host
    mesh, where every host must compile the same program: it reads the whole cache)."""
    arrays = [state.cache.lengths_B] + ([rows] if isinstance(rows, jax.Array) else [])
    if not all(a.is_fully_addressable for a in arrays):
      return None
    return int(np.asarray(state.cache.lengths_B)[np.asarray(rows)].max(initial=0))

  def prefill_groups(self, params, state: DecodeState, groups: Sequence[tuple[Sequence[int],
                                                                              Sequence[int]]],
                     budgets: Sequence[int],
                     seeds: Sequence[Sequence[int]] | None = None,
                     pad_to: int | None = None) -> DecodeState:
    """Installs each (rows, prompt ids) group with its total-length budget and its rows'
    sampling seeds (default: the row indices); pads the groups to `pad_to` (default: a power
    of two) and the prompts to a bucket."""
    if pad_to is not None and len(groups) > pad_to:
      raise ValueError(f"{len(groups)} groups do not fit in pad_to={pad_to}")
    p = pad_to or bucket(len(groups), 1)
    n = len(groups[0][0])
    t = bucket(max(len(ids) for _, ids in groups))
    rows = np.full((p, n), self.batch_size, np.int32)
    tokens = np.zeros((p, t), np.int32)
    lengths = np.ones((p,), np.int32)
    budget = np.zeros((p,), np.int32)
    row_seeds = np.zeros((p, n), np.int32)
    for g, ((group_rows, ids), limit) in enumerate(zip(groups, budgets)):
      if len(group_rows) != n:
        raise ValueError("every group in one prefill call must have the same number of rows")
      rows[g], tokens[g, :len(ids)], lengths[g], budget[g] = group_rows, ids, len(ids), limit
      row_seeds[g] = group_rows if seeds is None else seeds[g]
    return self.prefill(params, state, rows, tokens, lengths, budget, row_seeds)

  def extend_rows(self, params, state: DecodeState, appends: dict[int, Sequence[int]],
                  window: int | None = None, pad_to: int | None = None) -> DecodeState:
    """Appends the given ids to each row (at least one id each) and resumes those rows,
    reading the cache slots [0, window): by default those its rows can fill (`window_for` the
    longest of them and the padded ids, in 4x steps: an extend compiles once per (rows, tokens,
    window) bucket, so every window step multiplies its programs). Rows are padded to at least
    8 (or the batch), as a decode chunk's are: 1, 2 or 4 tool results arriving together were
    one more program each (the main job's DAPO compiled 22 extends, 11 s of its 65), or to
    `pad_to` rows."""
    if pad_to is not None and len(appends) > pad_to:
      raise ValueError(f"{len(appends)} rows do not fit in pad_to={pad_to}")
    r = pad_to or min(bucket(len(appends)), self.batch_size)  # rows past B are padding
    t = bucket(max(len(ids) for ids in appends.values()))
    if window is None:
      longest = self._longest(state, list(appends))
      window = (self.cache_size if longest is None else
                window_for(longest, t, self.cache_size, growth=4))
    rows = np.full((r,), self.batch_size, np.int32)
    tokens = np.zeros((r, t), np.int32)
    counts = np.ones((r,), np.int32)
    for i, (row, ids) in enumerate(appends.items()):
      rows[i], tokens[i, :len(ids)], counts[i] = row, ids, len(ids)
    return self.extend(params, state, rows, tokens, counts, window=min(window, self.cache_size))

  def compilations(self) -> int:
    """Returns how many programs the jitted steps have compiled so far (a decode chunk once per
    window, and once per row bucket and window when it decodes some rows alone)."""
    return sum(f._cache_size() for f in self._jits)
