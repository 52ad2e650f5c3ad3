"""Pure-functional Flax Linen decoder-only transformer (Qwen2/Qwen2.5 and Llama 3 families).

Parameters and main activations carry logical axis names; `coa_jax.sharding` maps them to mesh
axes through one rules table. Layers are stacked with `nn.scan` (one compiled layer body
whatever the depth) and optionally rematerialized.

Parameter layout (leading `layers` axis on everything under `layers/`):
  embedding                     (vocab, embed)
  layers/input_norm/scale       (layers, embed)
  layers/attn/{q,k,v}_proj      kernel (layers, embed, heads|kv_heads, head_dim),
                                bias (layers, heads|kv_heads, head_dim)
  layers/attn/o_proj/kernel     (layers, heads, head_dim, embed)
  layers/post_attn_norm/scale   (layers, embed)
  layers/mlp/{gate,up}_proj     kernel (layers, embed, mlp)
  layers/mlp/down_proj/kernel   (layers, mlp, embed)
  final_norm/scale              (embed,)
  lm_head                       (embed, vocab)      absent when embeddings are tied
  value_head                    (embed, 1)          a value model's head instead (head="value")
  embedding_rows                (token_rows, embed) LoRA's trained rows of the embedding (and of
                                                    a tied LM head) at trained_token_ids
  lm_head_rows                  (token_rows, embed) and of an untied LM head
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from coa_jax.model.attention import attend, cached_attention, target_platform
from coa_jax.model.config import LORA_TARGETS, ConfigError, ModelConfig, check_backend
from coa_jax.model.rope import apply_rope, inverse_frequencies

# Logical names of activation axes (parameter axes are named in the layout above).
ACT_BTD = ("act_batch", "act_seq", "act_embed")
ACT_BTNH = ("act_batch", "act_seq", "act_heads", "act_head_dim")
ACT_BTKH = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
ACT_BTF = ("act_batch", "act_seq", "act_mlp")
ACT_BTV = ("act_batch", "act_seq", "act_vocab")
CACHE_LBSKH = ("layers", "act_batch", "act_seq", "act_kv_heads", "act_head_dim")
CACHE_LBKSH = ("layers", "act_batch", "act_kv_heads", "act_seq", "act_head_dim")


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer for every cache slot, plus each row's filled length.

  Slot s of a row holds the token at position s. The model writes a call's keys and values
  at the slots named by its positions and leaves `lengths_B` to the caller (the sampler).

  `k` and `v` are (layer, row, slot, kv head, head dim), or (layer, row, kv head, slot, head
  dim) with `heads_first`. The sampler picks by platform. XLA:CPU runs a batched dot only with
  its batch dims (row, kv head) leading, so it transposes a slot-first cache twice per layer
  and token (decoding 1.6x slower in the tiny pipeline's model). The TPU compiler keeps a
  slot-first cache in place but copies a heads-first one whole into that layout (the 7B
  decode on v5p: 20.3 GiB of temporaries instead of 4.8).
  """

  k: jax.Array
  v: jax.Array
  lengths_B: jax.Array
  heads_first: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def axes(self) -> tuple[str, ...]:
    """Returns the logical axis names of `k` and `v`."""
    return cache_axes(self.heads_first)


def cache_axes(heads_first: bool) -> tuple[str, ...]:
  """Returns the logical axis names of a KV cache's `k` and `v` in the given layout."""
  return CACHE_LBKSH if heads_first else CACHE_LBSKH


def _cache_window(cache: KVCache | None, window: int) -> int:
  """Returns the slots the cached layers read, as DecoderLayer.cache_window: 0 for all of them
  (no cache, no window, or a window of the whole cache)."""
  if cache is None or not window:
    return 0
  slots = cache.k.shape[3 if cache.heads_first else 2]
  if window < 0:
    raise ValueError(f"cache_window={window}: expected a slot count >= 0")
  return 0 if window >= slots else int(window)


def _write(cache, new_LxBxTxKxH, rows_B, positions_BxT, heads_first: bool):
  """Returns the cache with new[l, b, t, k] written at row rows[b], slot positions[b, t] of
  layer l, kv head k; writes past the last row or slot (the padding of a bucketed extend) are
  dropped.

  Every (layer, row, slot, kv head) is indexed, so each written window is one head-dim vector,
  the cache's minor dim, in either layout. With wider windows (all layers, say) the TPU
  compiler lays the cache out to suit the write rather than the attention, and copies the
  whole donated cache at every decode call or every token.
  """
  layers, kv_heads = cache.shape[0], new_LxBxTxKxH.shape[3]
  batch, seq = positions_BxT.shape
  index = lambda a: jnp.broadcast_to(a, (layers, batch, seq, kv_heads))
  layer = index(jnp.arange(layers)[:, None, None, None])
  row = index(rows_B[None, :, None, None])
  slot = index(positions_BxT[None, :, :, None])
  head = index(jnp.arange(kv_heads)[None, None, None, :])
  where = (layer, row, head, slot) if heads_first else (layer, row, slot, head)
  return cache.at[where].set(new_LxBxTxKxH.astype(cache.dtype), unique_indices=True,
                             mode="drop")


# What the backward pass keeps of a layer's forward (ModelConfig.remat), by the names the layer
# gives its projections' outputs (LORA_TARGETS) and attention's output ("context"):
# "full" keeps nothing and reruns the layer; "minimal" keeps every projection's output and
# reruns attention and the elementwise ops; "minimal_with_context" keeps attention's output too
# (the splash kernel names its residuals so as well; the dense kernel's scores are rerun);
# "qkv_context" keeps q, k, v and the context and reruns the rest of the layer; "offload" keeps what "minimal_with_context" does in host memory
# (TPU and GPU); "dots" keeps every matmul's output (attention's scores too, unless a kernel
# computes them).
_SAVED = LORA_TARGETS + ("context",)
_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*LORA_TARGETS),
    "minimal_with_context": jax.checkpoint_policies.save_only_these_names(*_SAVED),
    "qkv_context": jax.checkpoint_policies.save_only_these_names(
        "q_proj", "k_proj", "v_proj", "context"),
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=_SAVED,
        offload_src="device", offload_dst="pinned_host"),
    "dots": jax.checkpoint_policies.dots_saveable,
}


def _init(stddev: float, names: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(stddev), names)


class RMSNorm(nn.Module):
  """RMS normalization computed in float32, scaled by a learned per-feature weight."""

  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return normed.astype(self.dtype) * scale.astype(self.dtype)


class Projection(nn.Module):
  """A linear map contracting the trailing `len(in_names)` axes of x into `features` axes;
  with `lora_rank`, plus a LoRA adapter's update (ModelConfig.lora_rank)."""

  features: tuple[int, ...]
  in_names: tuple[str, ...]
  out_names: tuple[str, ...]
  use_bias: bool
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0

  @nn.compact
  def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
    n_in = len(self.in_names)
    in_shape, lead_shape = x.shape[-n_in:], x.shape[:-n_in]
    kernel = self.param("kernel", _init(0.02, self.in_names + self.out_names),
                        in_shape + self.features, self.param_dtype)
    # One 2-D matmul (tokens x in) @ (in x out): its gradients are plain 2-D matmuls too,
    # which backends run markedly faster than contractions over several axes.
    in_size, out_size = math.prod(in_shape), math.prod(self.features)
    x_NxI = x.astype(self.dtype).reshape(-1, in_size)
    y = x_NxI @ kernel.astype(self.dtype).reshape(in_size, out_size)
    if self.lora_rank:
      y = y + self._lora(x_NxI, in_shape, in_size, out_size)
    y = checkpoint_name(y.reshape(lead_shape + self.features), self.name)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             self.out_names),
                        self.features, self.param_dtype)
      y = y + bias.astype(self.dtype)
    return y

  def _lora(self, x_NxI, in_shape, in_size, out_size):
    """(x A) B alpha / rank. A starts as PEFT's does (uniform, bound 1 / sqrt(fan in)) and B
    at zero, so a fresh adapter changes nothing; dropout only when a "dropout" rng is given."""
    rank = self.lora_rank
    a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform",
                                              in_axis=tuple(range(len(in_shape))), out_axis=-1)
    a = self.param("lora_a", nn.with_logical_partitioning(a_init, self.in_names + ("lora_rank",)),
                   in_shape + (rank,), self.param_dtype)
    b = self.param("lora_b", nn.with_logical_partitioning(
        nn.initializers.zeros, ("lora_rank",) + self.out_names), (rank,) + self.features,
                   self.param_dtype)
    if self.lora_dropout and self.has_rng("dropout"):
      x_NxI = nn.Dropout(self.lora_dropout, deterministic=False)(x_NxI)
    x_NxR = x_NxI @ a.astype(self.dtype).reshape(in_size, rank)
    return (x_NxR @ b.astype(self.dtype).reshape(rank, out_size)) * (self.lora_alpha / rank)


def _projection(cfg: ModelConfig, name: str, features, in_names, out_names,
                use_bias: bool) -> Projection:
  return Projection(features, in_names, out_names, use_bias, cfg.compute_dtype,
                    cfg.params_dtype, cfg.lora_rank_of(name), cfg.lora_alpha, cfg.lora_dropout,
                    name=name)


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE and optional q/k/v bias."""

  config: ModelConfig

  def _linear(self, name, features, in_names, out_names, use_bias=False) -> Projection:
    return _projection(self.config, name, features, in_names, out_names, use_bias)

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT, cache=None,
               cache_heads_first: bool = False):
    """Self-attention over x. With `cache` = this layer's (keys, values) it attends over the
    cache slots before x's first position and causally within x, and also returns x's keys
    and values (the caller writes them into the cache)."""
    cfg = self.config
    inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q_shape, kv_shape = (cfg.num_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)
    q_BxTxNxH = self._linear("q_proj", q_shape, ("embed",), ("heads", "head_dim"),
                             cfg.qkv_bias)(x_BxTxD)
    k_BxTxKxH = self._linear("k_proj", kv_shape, ("embed",), ("kv_heads", "head_dim"),
                             cfg.qkv_bias)(x_BxTxD)
    v_BxTxKxH = self._linear("v_proj", kv_shape, ("embed",), ("kv_heads", "head_dim"),
                             cfg.qkv_bias)(x_BxTxD)
    q_BxTxNxH = nn.with_logical_constraint(
        apply_rope(q_BxTxNxH, positions_BxT, inv_freq), ACT_BTNH)
    k_BxTxKxH = nn.with_logical_constraint(
        apply_rope(k_BxTxKxH, positions_BxT, inv_freq), ACT_BTKH)
    v_BxTxKxH = nn.with_logical_constraint(v_BxTxKxH, ACT_BTKH)
    if cache is None:
      # Initializing traces a few tokens for the parameters' shapes, which no kernel's tiles
      # need to fit: the dense kernel does.
      implementation = "xla" if self.is_initializing() else cfg.attention_impl
      out_BxTxNxH = attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, q_segment_ids_BxT=segment_ids_BxT,
                           is_causal=True, implementation=implementation,
                           block=cfg.attention_block, block_kv=cfg.attention_block_kv)
    else:
      out_BxTxNxH = cached_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *cache,
                                     positions_BxT[:, 0], cache_heads_first)
    out_BxTxNxH = nn.with_logical_constraint(checkpoint_name(out_BxTxNxH, "context"), ACT_BTNH)
    out_BxTxD = self._linear("o_proj", (cfg.hidden_size,), ("heads", "head_dim"),
                             ("embed",))(out_BxTxNxH)
    return out_BxTxD if cache is None else (out_BxTxD, k_BxTxKxH, v_BxTxKxH)


class Mlp(nn.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  config: ModelConfig

  def _linear(self, name, features, in_name, out_name) -> Projection:
    return _projection(self.config, name, (features,), (in_name,), (out_name,), False)

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    gate_BxTxF = self._linear("gate_proj", cfg.intermediate_size, "embed", "mlp")(x_BxTxD)
    up_BxTxF = self._linear("up_proj", cfg.intermediate_size, "embed", "mlp")(x_BxTxD)
    hidden_BxTxF = nn.with_logical_constraint(nn.silu(gate_BxTxF) * up_BxTxF, ACT_BTF)
    return self._linear("down_proj", cfg.hidden_size, "mlp", "embed")(hidden_BxTxF)


class DecoderLayer(nn.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); scan-compatible.

  With a KV cache the scan carry is (x, k_all, v_all, layer, rows): the layer reads its
  slice of the whole cache (the cache rows `rows` of x's rows, or all of them when None;
  with `cache_window`, only the slots [0, cache_window)), passes the cache on unchanged and
  returns x's new keys and values as the scan output. (Carrying the cache, rather than
  scanning over it, lets XLA update it in place after the loop instead of copying it to keep
  the loop's input alive.)
  """

  config: ModelConfig
  cache_heads_first: bool = False  # the layout of a KV cache in the carry (see KVCache)
  cache_window: int = 0  # read only the cache slots [0, cache_window); 0: all of them

  @nn.compact
  def __call__(self, carry, positions_BxT, segment_ids_BxT):
    cfg = self.config
    cached = isinstance(carry, tuple)
    x_BxTxD = carry[0] if cached else carry
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype, name=name)
    cache = None
    if cached:
      _, k_all, v_all, layer, rows = carry
      slots = (slice(None),) * (1 + self.cache_heads_first) + (slice(self.cache_window),)
      at = (layer, *slots) if self.cache_window else layer  # a static slice: no copy
      read = lambda a: a[at] if rows is None else jnp.take(a[at], rows, 0, mode="clip")
      cache = (read(k_all), read(v_all))
    attended = Attention(cfg, name="attn")(norm("input_norm")(x_BxTxD), positions_BxT,
                                           segment_ids_BxT, cache, self.cache_heads_first)
    new_kv = None
    if cached:
      attended, *new_kv = attended
    x_BxTxD = x_BxTxD + attended
    x_BxTxD = x_BxTxD + Mlp(cfg, name="mlp")(norm("post_attn_norm")(x_BxTxD))
    x_BxTxD = nn.with_logical_constraint(x_BxTxD, ACT_BTD)
    return ((x_BxTxD, k_all, v_all, layer + 1, rows) if cached else x_BxTxD), new_kv


def _layer_list(layers: list):
  """Returns a function running `layers` (each with its own weights) one after another as a
  scanned `layers` runs: (carry, positions, segment ids) -> (carry, stacked new keys and values
  or None)."""

  def run(carry, positions_BxT, segment_ids_BxT):
    new_kvs = []
    for layer in layers:
      carry, new_kv = layer(carry, positions_BxT, segment_ids_BxT)
      new_kvs.append(new_kv)
    if new_kvs[0] is None:
      return carry, None
    return carry, tuple(jnp.stack(parts) for parts in zip(*new_kvs))
  return run


def _switched_scan(layer: nn.Module, weights: list, unroll: int):
  """Returns a function scanning unbound `layer` over its per-layer `weights` as a scanned
  `layers` runs: step i switches to weights[i]."""

  def step(carry_and_inputs, i):
    carry, positions_BxT, segment_ids_BxT = carry_and_inputs
    params = jax.lax.switch(i, [lambda w, j=j: w[j] for j in range(len(weights))], weights)
    carry, new_kv = layer.apply({"params": params}, carry, positions_BxT, segment_ids_BxT)
    return (carry, positions_BxT, segment_ids_BxT), new_kv

  def run(carry, positions_BxT, segment_ids_BxT):
    (carry, *_), new_kv = jax.lax.scan(step, (carry, positions_BxT, segment_ids_BxT),
                                       jnp.arange(len(weights)), unroll=unroll)
    return carry, new_kv
  return run


def _unrolled_layers(layer: nn.Module, stacked: dict, num_layers: int):
  """Returns a function applying unbound `layer` num_layers times, each time to a static slice
  of the `stacked` layers' weights, as the scanned `layers` runs without a cache.

  The scan's parameters and results (to float rounding), without a loop: the scan, even
  unrolled, slices each layer's weights and saved activations out of stacked arrays and writes
  its outputs and gradients back into them; here each layer's are arrays of their own (the
  main job's SFT step on a CPU: 5% faster, docs/benchmarks.md).
  """

  def run(x_BxTxD, positions_BxT, segment_ids_BxT):
    for i in range(num_layers):
      weights = jax.tree.map(lambda a, i=i: a[i], nn.unbox(stacked))
      x_BxTxD, _ = layer.apply({"params": weights}, x_BxTxD, positions_BxT, segment_ids_BxT)
    return x_BxTxD, None
  return run


def split_layers(params: dict, num_layers: int, take=lambda a, i: a[i]) -> dict:
  """Returns `params` with the stacked `layers` subtree split into `layers_0`, `layers_1`, ...
  (the layout of a Transformer with `layer_arrays`): `take(leaf, i)` is layer i's slice."""
  rest = {name: tree for name, tree in params.items() if name != "layers"}
  return {**rest, **{f"layers_{i}": jax.tree.map(lambda a: take(a, i), params["layers"])
                     for i in range(num_layers)}}


HEADS = ("lm", "value")



def layer_unroll(cfg: ModelConfig) -> int:
  """Returns how many layers one step of the layer scan runs: all of them in a program over
  several CPU devices (the current mesh), else `cfg.scan_unroll`. All of them: no layer loop
  (`_unrolled_layers`, the scan's results to float rounding: tests/test_model.py).

  XLA:CPU (jaxlib 0.10.2) can deadlock a program whose collectives sit inside a while loop
  beside independent collectives outside it: one device enters the loop and blocks in its
  all-gather while its peers block in an all-reduce before the loop that it never joins
  (docs/testing.md). An 8-device tiny SFT step loop hung in 8 of 10 runs, 0 of 20 unrolled.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.size > 1 and target_platform() == "cpu":
    return cfg.num_layers
  return cfg.scan_unroll


class Transformer(nn.Module):
  """Decoder-only language model; `__call__` returns float32 logits (B, T, V), or with
  head="value" (a critic) float32 values (B, T): a bias-free linear map of the last hidden
  state, so the value at t is read after token t, where the logits predict token t + 1."""

  config: ModelConfig
  head: str = "lm"
  # "" (default): the layers' weights stacked (params `layers`), the layers scanned. Else each
  # layer's weights in arrays of their own (params `layers_0`, `layers_1`, ...; see
  # `split_layers`), and "each" applies the layers one after another, "scan" scans them, each
  # step switching to its layer's weights (a copy of one layer's at a time).
  layer_arrays: str = ""

  @nn.compact
  def __call__(self, input_ids_BxT, positions_BxT=None, segment_ids_BxT=None,
               cache: KVCache | None = None, cache_rows_B: jax.Array | None = None,
               cache_window: int = 0):
    """Returns next-token logits; positions default to 0..T-1, segment ids to one segment.

    With `segment_ids_BxT` (packed rows; 0 may mark padding) a token attends only to earlier
    tokens of its own segment, and `positions_BxT` should restart at 0 for every segment.

    With `cache` (decoding), row b's tokens sit at consecutive positions starting anywhere;
    their keys and values are written into the cache at those slots, each token attends to
    the slots up to its own position, and (logits, updated cache) is returned. Row b uses
    cache row `cache_rows_B[b]` (default: row b), so a few rows extend a large cache in place;
    rows past the cache's last one read its last row and write nothing. With `cache_window`
    (static; 0 or the cache size: every slot) the layers read only the slots [0,
    cache_window) and write into the whole cache: the caller keeps every position a token
    attends to below it (a row past it would see only the window).
    """
    cfg = self.config
    if self.head not in HEADS or (self.head == "value" and cache is not None):
      raise ConfigError(f"head={self.head!r}: expected one of {HEADS} (a value model does not "
                        f"decode)")
    if not self.is_initializing():  # initializing runs no kernel (see Attention)
      check_backend(cfg.attention_impl, cfg.remat, target_platform())
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(input_ids_BxT.shape[1]), input_ids_BxT.shape)
    embedding_VxD = self.param("embedding", _init(0.02, ("vocab", "embed")),
                               (cfg.vocab_size, cfg.hidden_size), cfg.params_dtype)
    # Gather the fsdp-split embed dimension before the lookup (as FSDP does for every weight).
    lookup_VxD = nn.with_logical_constraint(embedding_VxD, ("vocab", None))
    x_BxTxD = jnp.take(lookup_VxD, input_ids_BxT, axis=0).astype(cfg.compute_dtype)
    token_ids = cfg.trained_token_ids
    if token_ids:  # LoRA: these tokens' rows train, in place of the frozen ones
      embedding_rows_RxD = self._token_rows("embedding_rows", embedding_VxD)
      x_BxTxD = _embed_token_rows(x_BxTxD, input_ids_BxT, embedding_rows_RxD, token_ids)
    x_BxTxD = nn.with_logical_constraint(x_BxTxD, ACT_BTD)

    layer = DecoderLayer
    if cfg.remat != "none" and cache is None:
      # The backward pass's rerun of a layer sits in another loop than its first forward, so
      # XLA cannot merge the two; with every layer unrolled (no loop left) it could, and would
      # keep what the policy drops.
      layer = nn.remat(layer, policy=_REMAT_POLICIES[cfg.remat],
                       prevent_cse=layer_unroll(cfg) >= cfg.num_layers)
    heads_first = cache is not None and cache.heads_first
    window = _cache_window(cache, cache_window)
    if self.layer_arrays == "scan" and not self.is_initializing():
      weights = [self.variables["params"][f"layers_{i}"] for i in range(cfg.num_layers)]
      layers = _switched_scan(layer(cfg, cache_heads_first=heads_first, cache_window=window,
                                    parent=None), weights, layer_unroll(cfg))
    elif self.layer_arrays:
      layers = _layer_list([layer(cfg, cache_heads_first=heads_first, cache_window=window,
                                  name=f"layers_{i}") for i in range(cfg.num_layers)])
    elif (cache is None and layer_unroll(cfg) >= cfg.num_layers and not self.has_rng("dropout")
          and not self.is_initializing()):
      # Dropout keeps the scan, whose per-layer rngs a loop would have to mimic.
      layers = _unrolled_layers(layer(cfg, parent=None), self.variables["params"]["layers"],
                                cfg.num_layers)
    else:
      layers = nn.scan(
          layer, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast), length=cfg.num_layers,
          unroll=layer_unroll(cfg), metadata_params={nn.PARTITION_NAME: "layers"})(
              cfg, cache_heads_first=heads_first, cache_window=window, name="layers")
    if cache is None:
      x_BxTxD, _ = layers(x_BxTxD, positions_BxT, segment_ids_BxT)
    else:
      # Layers only read the cache; the new keys and values are written once, after the scan,
      # so the cache is updated in place rather than copied through the layer loop.
      k_all = nn.with_logical_constraint(cache.k, cache.axes)
      v_all = nn.with_logical_constraint(cache.v, cache.axes)
      (x_BxTxD, k_all, v_all, *_), (k_new, v_new) = layers(
          (x_BxTxD, k_all, v_all, jnp.int32(0), cache_rows_B), positions_BxT, segment_ids_BxT)
      rows_B = jnp.arange(x_BxTxD.shape[0]) if cache_rows_B is None else cache_rows_B
      cache = cache.replace(k=_write(k_all, k_new, rows_B, positions_BxT, cache.heads_first),
                            v=_write(v_all, v_new, rows_B, positions_BxT, cache.heads_first))
    x_BxTxD = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype,
                      name="final_norm")(x_BxTxD)
    if self.head == "value":
      # Zeros: a fresh critic predicts 0 everywhere (the body is the actor's, unchanged).
      head_Dx1 = self.param("value_head", nn.with_logical_partitioning(
          nn.initializers.zeros, ("embed", None)), (cfg.hidden_size, 1), cfg.params_dtype)
      values_BxTx1 = jnp.einsum("btd,dk->btk", x_BxTxD, head_Dx1.astype(cfg.compute_dtype),
                                preferred_element_type=jnp.float32)
      return nn.with_logical_constraint(values_BxTx1[..., 0], ("act_batch", "act_seq"))

    if cfg.tie_embeddings:
      head_DxV = embedding_VxD.T
    else:
      head_DxV = self.param("lm_head", _init(0.02, ("embed", "vocab")),
                            (cfg.hidden_size, cfg.vocab_size), cfg.params_dtype)
    batch, seq, _ = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(batch * seq, -1)
    logits_NxV = jnp.dot(x_NxD, head_DxV.astype(cfg.compute_dtype),
                         preferred_element_type=jnp.float32)
    if token_ids:
      head_rows_RxD = (embedding_rows_RxD if cfg.tie_embeddings else
                       self._token_rows("lm_head_rows", head_DxV.T))
      logits_NxV = _token_row_logits(logits_NxV, x_NxD, head_rows_RxD, token_ids)
    logits_BxTxV = nn.with_logical_constraint(logits_NxV.reshape(batch, seq, -1), ACT_BTV)
    return logits_BxTxV if cache is None else (logits_BxTxV, cache)

  def _token_rows(self, name: str, table_VxD: jax.Array) -> jax.Array:
    """Returns the trained rows `name` of the token ids `trained_token_ids`; a fresh model's
    are the table's own rows (PEFT's TrainableTokens start so), so they change nothing."""
    cfg = self.config
    init = lambda rng, shape, dtype: jnp.take(  # noqa: E731
        table_VxD, jnp.asarray(cfg.trained_token_ids), axis=0).astype(dtype)
    return self.param(name, nn.with_logical_partitioning(init, ("token_rows", "embed")),
                      (len(cfg.trained_token_ids), cfg.hidden_size), cfg.params_dtype)


def _embed_token_rows(x_BxTxD, input_ids_BxT, rows_RxD, token_ids) -> jax.Array:
  """Returns the embeddings with every token of `token_ids` (increasing) looked up in `rows_RxD`
  instead: its gradient reaches those rows only."""
  ids_R = jnp.asarray(token_ids, input_ids_BxT.dtype)
  slot_BxT = jnp.clip(jnp.searchsorted(ids_R, input_ids_BxT), 0, len(token_ids) - 1)
  hit_BxT = jnp.take(ids_R, slot_BxT) == input_ids_BxT
  from_rows_BxTxD = jnp.take(rows_RxD.astype(x_BxTxD.dtype), slot_BxT, axis=0)
  return jnp.where(hit_BxT[..., None], from_rows_BxTxD, x_BxTxD)


def _token_row_logits(logits_NxV, x_NxD, rows_RxD, token_ids) -> jax.Array:
  """Returns the logits with the columns of `token_ids` computed from `rows_RxD` instead: one
  small matmul written over those columns in place, a run of consecutive ids at a time (the
  added tags are one run), so no second vocabulary-sized array is formed and no gradient of the
  frozen head either."""
  rows_NxR = jnp.dot(x_NxD, rows_RxD.astype(x_NxD.dtype).T, preferred_element_type=jnp.float32)
  for start, stop in _runs(token_ids):
    logits_NxV = jax.lax.dynamic_update_slice_in_dim(
        logits_NxV, rows_NxR[:, start:stop], token_ids[start], axis=1)
  return logits_NxV


def _runs(token_ids) -> list[tuple[int, int]]:
  """Returns the [start, stop) index ranges of `token_ids` (increasing) whose ids are
  consecutive."""
  starts = [0] + [i for i in range(1, len(token_ids)) if token_ids[i] != token_ids[i - 1] + 1]
  return list(zip(starts, starts[1:] + [len(token_ids)]))
