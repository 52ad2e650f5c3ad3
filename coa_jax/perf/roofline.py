"""Rooflines of the jitted steps: the FLOPs a step executes and the HBM bytes it moves, per
device, from the model's shapes alone; and the time a chip's published peaks bound them to.

Training step (tokens split over data x fsdp, matmuls over tensor):
- FLOPs: the model FLOPs (`flops.train_flops`; LoRA: no weight gradient for the frozen
  weights) with what the implementation changes: causal
  kernels ("blockwise", "cudnn", "splash") skip the blocks above the diagonal, remat reruns what
  its policy does not keep ("full": the forward pass; "minimal": attention; "qkv_context": the
  output projection and the MLP), and the backward pass of blockwise and splash attention
  recomputes the scores.
- HBM bytes: weights (the compute-dtype copy read by each forward pass and the backward pass,
  a gradient in the parameter dtype written and read back, per micro-batch; with LoRA, the
  frozen weights get no gradient); the AdamW update on the device's shard of the trained
  parameters (parameter, gradient and two moments read, three written); activations
  (each op's inputs and outputs once per forward pass, twice that for the backward pass, with
  attention one fused kernel whose scores stay on chip); float32 logits, written and read in
  both directions.
Decode step (one token for every row, rows over data, weights and kv heads over tensor): the
device's share of the compute-dtype weights and of a full KV cache read once, float32 logits
written; FLOPs as `flops.decode_flops`.

Collectives are not counted: a step is assumed to overlap them with compute.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from coa_jax.model.config import ModelConfig
from coa_jax.perf import flops

_CAUSAL_TILE = {"blockwise": None, "cudnn": 128, "splash": None}  # None: attention_block
_RESCORING = ("blockwise", "splash")  # kernels whose backward pass recomputes the scores


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A step's executed FLOPs and HBM bytes per device, against the device's peaks."""

  flops: float
  hbm_bytes: float
  peak_flops: float
  hbm_bytes_per_s: float

  @property
  def seconds(self) -> float:
    """The step's lower bound: its FLOPs at peak or its bytes at full bandwidth."""
    return max(self.flops / self.peak_flops, self.hbm_bytes / self.hbm_bytes_per_s)

  @property
  def bound(self) -> str:
    return "compute" if self.flops / self.peak_flops >= self.hbm_bytes / self.hbm_bytes_per_s \
        else "HBM"

  def mfu(self, model_flops_per_device: float) -> float:
    """Model FLOPs over what the chip could do in the roofline time (the projected MFU)."""
    return model_flops_per_device / (self.seconds * self.peak_flops)


def _itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def _computed_fraction(config: ModelConfig, seq_len: int) -> float:
  """Returns the part of the full T x T score square that the attention kernel computes."""
  if config.attention_impl not in _CAUSAL_TILE:
    return 1.0
  tile = _CAUSAL_TILE[config.attention_impl] or config.attention_block
  blocks = math.ceil(seq_len / tile)
  return (blocks + 1) / (2 * blocks)


def _attention_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
  """Returns the FLOPs of attention's forward pass (scores and weighted values) that its kernel
  computes, all layers and rows."""
  return (4.0 * config.num_layers * config.num_heads * config.head_dim * seq_len * seq_len
          * batch_size * _computed_fraction(config, seq_len))


def _rerun_attention(config: ModelConfig) -> bool:
  """Returns whether the backward pass reruns attention's forward (its remat keeps no output)."""
  return config.remat in ("full", "minimal")


def train_flops_executed(config: ModelConfig, batch_size: int, seq_len: int,
                         head: str = "lm") -> float:
  """Returns the FLOPs one training step executes (all devices); head="value": a value
  model's."""
  tokens = batch_size * seq_len
  matmul = 2.0 * flops.matmul_params(config, head) * tokens
  adapters = 2.0 * config.lora_params() * tokens
  attention = _attention_flops(config, batch_size, seq_len)
  forward = matmul + adapters + attention
  d, f = config.hidden_size, config.intermediate_size
  output_and_mlp = 2.0 * config.num_layers * (config.num_heads * config.head_dim * d + 3 * d * f)
  recompute = {"full": forward, "minimal": attention,
               "qkv_context": output_and_mlp * tokens}.get(config.remat, 0.0)
  rescore = attention / 2 if config.attention_impl in _RESCORING else 0.0
  # Backward: the input's and the weights' gradients, each a forward's matmuls; frozen (LoRA)
  # weights need only the input's (a LoRA model's trained LM head: both).
  head_grad = 2.0 * flops.trained_head_params(config, head) * tokens
  backward = (1 if config.lora_rank else 2) * matmul + 2 * (adapters + attention) + head_grad
  return forward + recompute + backward + rescore


def attention_kernel_seconds(config: ModelConfig, batch_size: int, seq_len: int, devices: int,
                             peak_flops: float) -> float:
  """Returns the time of one training step's attention kernels on one device at the chip's
  peak FLOP/s: forward, backward (twice the forward, plus the scores recomputed) and the
  forward rerun by remat. The kernels are compute-bound (a tile of 512 queries by 512 keys of
  128-wide heads does 512 FLOPs per byte of keys and values it reads)."""
  passes = 1 + 2 + 0.5 + _rerun_attention(config)
  return passes * _attention_flops(config, batch_size, seq_len) / devices / peak_flops


def _activation_bytes_per_token_layer(config: ModelConfig, tensor: int) -> float:
  """Bytes one forward pass of one layer reads and writes per token."""
  d, f = config.hidden_size, config.intermediate_size / tensor
  q = config.num_heads * config.head_dim / tensor
  kv = config.num_kv_heads * config.head_dim / tensor
  elements = (2 * d  # input norm
              + d + q + 2 * kv  # q, k, v projections
              + 2 * (q + kv)  # rotary embedding of q and k
              + q + 2 * kv + q  # fused attention
              + q + d  # output projection
              + 3 * d  # residual
              + 2 * d  # post-attention norm
              + d + 2 * f  # gate and up projections
              + 3 * f  # silu(gate) * up
              + f + d  # down projection
              + 3 * d)  # residual
  return elements * _itemsize(config.compute_dtype)


def train_roofline(config: ModelConfig, batch_size: int, seq_len: int, mesh: dict[str, int],
                   micro_batches: int, peak_flops: float, hbm_bytes_per_s: float,
                   head: str = "lm") -> Roofline:
  """Returns the roofline of one training step on one device of `mesh` (axis sizes); head=
  "value": a value model's (no vocabulary logits; its parameters are still counted whole)."""
  devices = mesh["data"] * mesh["fsdp"] * mesh["tensor"]
  tensor, shard = mesh["tensor"], mesh["fsdp"] * mesh["tensor"]
  params, compute, master = (config.num_params(), _itemsize(config.compute_dtype),
                             _itemsize(config.params_dtype))
  forward_passes = 2 if config.remat in ("full", "qkv_context") else 1
  # LoRA: the frozen weights are read in the compute dtype and get no gradient; the adapters
  # (and the embedding and LM-head rows that train beside them) are read as weights are and
  # are what the optimizer updates.
  trained = config.lora_params() + config.lora_embedding_params() if config.lora_rank else params
  frozen = params if config.lora_rank else 0
  weights = micro_batches / tensor * ((forward_passes + 1) * compute * (trained + frozen)
                                      + 2 * master * trained)
  optimizer = 7 * master * trained / shard
  tokens = batch_size * seq_len / (mesh["data"] * mesh["fsdp"])
  activations = (tokens * config.num_layers * (forward_passes + 2)
                 * _activation_bytes_per_token_layer(config, tensor))
  logits = tokens * config.vocab_size / tensor * 4 * 4 if head == "lm" else 0.0
  return Roofline(train_flops_executed(config, batch_size, seq_len, head) / devices,
                  weights + optimizer + activations + logits, peak_flops, hbm_bytes_per_s)


def decode_roofline(config: ModelConfig, rows: int, cache_size: int, mesh: dict[str, int],
                    peak_flops: float, hbm_bytes_per_s: float, cache_itemsize: int) -> Roofline:
  """Returns the roofline of one decode step (a token for each of `rows` rows over a full
  cache of `cache_size` slots) on one device of a decode mesh (`data` x `tensor`)."""
  data, tensor = mesh["data"] * mesh["fsdp"], mesh["tensor"]
  weights = config.num_params() * _itemsize(config.compute_dtype) / tensor
  cache = (2 * config.num_layers * rows / data * cache_size
           * config.num_kv_heads * config.head_dim / tensor * cache_itemsize)
  logits = rows / data * config.vocab_size / tensor * 4
  return Roofline(flops.decode_flops(config, rows, cache_size) / (data * tensor),
                  weights + cache + logits, peak_flops, hbm_bytes_per_s)
