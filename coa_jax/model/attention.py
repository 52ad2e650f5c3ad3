"""Attention kernels: dense (`jax.nn.dot_product_attention`), exact blockwise causal, and
Pallas splash attention on TPU.

Layout conventions: q (B, T, N, H), k and v (B, S, K, H) with N a multiple of K (GQA);
segment ids (B, T) / (B, S) let a query see only keys of its own segment (packed rows).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

_NEG = -1e30  # additive mask value: exp() of it underflows to exactly 0
_TARGET_PLATFORM = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str):
  """Within it, models are traced for `platform` ("gpu", "tpu", ...): an ahead-of-time compile
  for devices this process does not run on, rather than for JAX's default backend."""
  token = _TARGET_PLATFORM.set(platform)
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)


def target_platform() -> str:
  """Returns the platform programs are being traced for (see `compiling_for`)."""
  return _TARGET_PLATFORM.get() or jax.default_backend()


def segment_mask(q_segment_ids_BxT: jax.Array, kv_segment_ids_BxS: jax.Array) -> jax.Array:
  """Returns the (B, 1, T, S) boolean mask that lets a query see only keys of its own segment."""
  return q_segment_ids_BxT[:, None, :, None] == kv_segment_ids_BxS[:, None, None, :]


def _block_bias(segment_ids_BxT: jax.Array, start: int, end: int) -> jax.Array:
  """Returns the (B, 1, 1, end - start, end) additive causal + segment mask of a query block."""
  causal = jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :]
  same = segment_ids_BxT[:, start:end, None] == segment_ids_BxT[:, None, :end]
  return jnp.where(causal & same, 0.0, _NEG)[:, None, None]


def _blocks(seq: int, block: int):
  return [(start, min(start + block, seq)) for start in range(0, seq, block)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT, block):
  return _blockwise_fwd(q_BxKxGxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT, block)[0]


def _blockwise_fwd(q, k, v, segment_ids, block):
  """Returns the output and (inputs, output, log-sum-exp) saved for the backward pass."""
  outs, lses = [], []
  for start, end in _blocks(q.shape[3], block):
    scores = jnp.einsum("bkgqh,bksh->bkgqs", q[:, :, :, start:end], k[:, :, :end],
                        preferred_element_type=jnp.float32)
    scores = scores + _block_bias(segment_ids, start, end)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - peak)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bkgqs,bksh->bkgqh", probs.astype(v.dtype), v[:, :, :end],
                     preferred_element_type=jnp.float32) / total
    outs.append(out.astype(q.dtype))
    lses.append(peak + jnp.log(total))
  out = jnp.concatenate(outs, axis=3)
  return out, (q, k, v, segment_ids, out, jnp.concatenate(lses, axis=3))


def _blockwise_bwd(block, saved, d_out):
  """Flash-attention backward: probabilities are recomputed from the saved log-sum-exp."""
  q, k, v, segment_ids, out, lse = saved
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  dq_blocks = []
  # dk and dv are accumulated transposed, (B, K, H, S): each block's contraction over its
  # queries then reads the (q, s) probabilities as they are, and only the small (q, h)
  # operand is transposed, rather than the probabilities.
  dk_t = jnp.zeros(k.shape[:2] + k.shape[3:] + k.shape[2:3], jnp.float32)
  dv_t = jnp.zeros(dk_t.shape, jnp.float32)
  for start, end in _blocks(q.shape[3], block):
    q_blk, do_blk = q[:, :, :, start:end], d_out[:, :, :, start:end]
    scores = jnp.einsum("bkgqh,bksh->bkgqs", q_blk, k[:, :, :end],
                        preferred_element_type=jnp.float32)
    probs = jnp.exp(scores + _block_bias(segment_ids, start, end) - lse[:, :, :, start:end])
    dv_t = dv_t.at[:, :, :, :end].add(jnp.einsum("bkgqh,bkgqs->bkhs", do_blk,
                                                 probs.astype(do_blk.dtype),
                                                 preferred_element_type=jnp.float32))
    d_probs = jnp.einsum("bkgqh,bksh->bkgqs", do_blk, v[:, :, :end],
                         preferred_element_type=jnp.float32)
    d_scores = (probs * (d_probs - delta[:, :, :, start:end])).astype(q.dtype)
    dq_blocks.append(jnp.einsum("bkgqs,bksh->bkgqh", d_scores, k[:, :, :end],
                                preferred_element_type=jnp.float32))
    dk_t = dk_t.at[:, :, :, :end].add(jnp.einsum("bkgqh,bkgqs->bkhs", q_blk, d_scores,
                                                 preferred_element_type=jnp.float32))
  dq = jnp.concatenate(dq_blocks, axis=3)
  dk, dv = dk_t.transpose(0, 1, 3, 2), dv_t.transpose(0, 1, 3, 2)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          jnp.zeros_like(segment_ids))


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_causal_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT,
                               block: int) -> jax.Array:
  """Returns causal (and segment-masked) softmax attention, exact, one query block at a time.

  Query block i attends only to the keys it can see (up to the block's end), so the masked
  upper triangle is never computed and no (T, T) array is materialized. The backward pass is
  flash-attention style: it saves only the output and each row's log-sum-exp and recomputes
  the probabilities block by block. Query heads are grouped over their K/V head (GQA).
  """
  batch, seq, heads, head_dim = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  scaled = q_BxTxNxH * jnp.asarray(head_dim ** -0.5, q_BxTxNxH.dtype)
  q_BxKxGxTxH = scaled.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim).transpose(
      0, 2, 3, 1, 4)
  if segment_ids_BxT is None:
    segment_ids_BxT = jnp.ones((batch, seq), jnp.float32)
  out_BxKxGxTxH = _blockwise(q_BxKxGxTxH, k_BxTxKxH.transpose(0, 2, 1, 3),
                             v_BxTxKxH.transpose(0, 2, 1, 3),
                             segment_ids_BxT.astype(jnp.float32), block)
  return out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(batch, seq, heads, head_dim)


def splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, block_q: int,
                     block_kv: int, interpret: bool = False) -> jax.Array:
  """Returns causal (and segment-masked) softmax attention by the Pallas TPU splash-attention
  kernel: (q block, kv block) tiles above the diagonal or outside every row's segments are
  skipped, the backward pass is one fused kernel for dq, dk and dv, and the kernel's residuals
  (output and log-sum-exp) are named "context" for the remat policies that keep them.

  Under a mesh the kernel runs per device (`jax.shard_map`): rows split as the batch is, heads
  as `tensor` splits them; each device's rows and heads are whole, so no collective is needed.
  `interpret` runs the kernel in Pallas' interpreter (any backend; for tests).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)

  batch, seq, heads, head_dim = q_BxTxNxH.shape
  if block_q % 128 or block_kv % 128:
    raise ValueError(f"splash attention: blocks of {block_q} queries by {block_kv} keys; the "
                     f"kernel tiles by multiples of 128")
  if seq % block_q or seq % block_kv:
    raise ValueError(f"splash attention: sequence length {seq} is not a multiple of the query "
                     f"block {block_q} and the key block {block_kv}")
  if segment_ids_BxT is None:
    segment_ids_BxT = jnp.ones((batch, seq), jnp.int32)
  blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dkv=block_q,
                             block_kv_dkv=block_kv, use_fused_bwd_kernel=True)

  def local(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT):
    mask = masks.MultiHeadMask([masks.CausalMask((seq, seq))] * q_BxNxTxH.shape[1])
    kernel = splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                    residual_checkpoint_name="context", interpret=interpret)
    segments = splash.SegmentIds(q=segment_ids_BxT, kv=segment_ids_BxT)
    return jax.vmap(kernel)(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids=segments)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    rows, heads_axis = nn.logical_to_mesh_axes(("act_batch", "act_heads"))
    spec = jax.sharding.PartitionSpec(rows, heads_axis)
    local = jax.shard_map(local, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec(rows)),
                          out_specs=spec, check_vma=False)
  scaled = q_BxTxNxH * jnp.asarray(head_dim ** -0.5, q_BxTxNxH.dtype)
  heads_first = lambda x: x.transpose(0, 2, 1, 3)
  out_BxNxTxH = local(heads_first(scaled), heads_first(k_BxTxKxH), heads_first(v_BxTxKxH),
                      segment_ids_BxT.astype(jnp.int32))
  return heads_first(out_BxNxTxH)


def cached_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, k_cache, v_cache, starts_B,
                     heads_first: bool = False) -> jax.Array:
  """Returns (B, T, N, H) attention of T new tokens over the cache slots before their first
  position `starts_B` and, causally, over each other (the KV-cache decode path). The cache is
  (B, S, K, H), or (B, K, S, H) with `heads_first`.

  Each kv head serves its group of query heads in place, and the cache and the new keys are
  scored separately and combined in one softmax, so no key or value is copied or repeated.
  """
  batch, seq, heads, head_dim = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
  q_BxTxKxGxH = q_BxTxKxGxH / jnp.sqrt(jnp.asarray(head_dim, q_BxTxNxH.dtype))
  cache_dims = "bksh" if heads_first else "bskh"
  old = jnp.einsum(f"btkgh,{cache_dims}->bkgts", q_BxTxKxGxH, k_cache.astype(q_BxTxNxH.dtype),
                   preferred_element_type=jnp.float32)
  new = jnp.einsum("btkgh,bukh->bkgtu", q_BxTxKxGxH, k_BxTxKxH,
                   preferred_element_type=jnp.float32)
  slots = jnp.arange(k_cache.shape[2 if heads_first else 1])
  old = jnp.where((slots[None, :] < starts_B[:, None])[:, None, None, None, :], old, _NEG)
  new = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), new, _NEG)
  peak = jnp.maximum(old.max(axis=-1, keepdims=True), new.max(axis=-1, keepdims=True))
  old, new = jnp.exp(old - peak), jnp.exp(new - peak)
  total = old.sum(axis=-1, keepdims=True) + new.sum(axis=-1, keepdims=True)
  dtype = v_BxTxKxH.dtype
  out = (jnp.einsum(f"bkgts,{cache_dims}->btkgh", (old / total).astype(dtype),
                    v_cache.astype(dtype), preferred_element_type=jnp.float32) +
         jnp.einsum("bkgtu,bukh->btkgh", (new / total).astype(dtype), v_BxTxKxH,
                    preferred_element_type=jnp.float32))
  return out.reshape(batch, seq, heads, head_dim).astype(q_BxTxNxH.dtype)


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, *, q_segment_ids_BxT=None, kv_segment_ids_BxS=None,
           is_causal: bool, implementation: str, block: int = 128,
           block_kv: int = 0) -> jax.Array:
  """Returns softmax(q k^T / sqrt(H) + masks) v as (B, T, N, H).

  `implementation` is "xla" or "cudnn" (`jax.nn.dot_product_attention`), "blockwise"
  (`blockwise_causal_attention`, query blocks of `block`) or "splash" (`splash_attention`, TPU:
  tiles of `block` queries by `block_kv` keys, 0: `block`); the last two serve causal
  self-attention, and other calls fall back to the dense XLA kernel. The KV-cache decode path
  uses `cached_attention`.
  """
  self_attention = is_causal and k_BxSxKxH.shape[1] == q_BxTxNxH.shape[1]
  if implementation == "blockwise" and self_attention:
    return blockwise_causal_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_segment_ids_BxT, block)
  if implementation == "splash" and self_attention:
    return splash_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_segment_ids_BxT, block,
                            block_kv or block)
  mask = None
  if q_segment_ids_BxT is not None:
    kv_segment_ids_BxS = q_segment_ids_BxT if kv_segment_ids_BxS is None else kv_segment_ids_BxS
    mask = segment_mask(q_segment_ids_BxT, kv_segment_ids_BxS)
  return jax.nn.dot_product_attention(
      q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask, is_causal=is_causal,
      implementation=None if implementation in ("blockwise", "splash") else implementation)
