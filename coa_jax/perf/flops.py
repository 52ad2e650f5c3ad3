"""Analytic training FLOPs of the transformer (model FLOPs, the MFU convention)."""

from __future__ import annotations

from coa_jax.model.config import ModelConfig


def matmul_params(config: ModelConfig, head: str = "lm") -> int:
  """Returns the number of parameters used in matrix multiplies (weights incl. the LM head, or
  a value model's one-output head with head="value")."""
  d, h = config.hidden_size, config.head_dim
  q, kv = config.num_heads * h, config.num_kv_heads * h
  per_layer = d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size
  return config.num_layers * per_layer + (config.vocab_size if head == "lm" else 1) * d


def decode_flops(config: ModelConfig, rows: int, context: int) -> float:
  """Returns model FLOPs of one decoding step of `rows` rows that each attend to `context`
  cached tokens: 2 x matmul params plus 4 x layers x heads x head_dim x context per row."""
  attention = 4 * config.num_layers * config.num_heads * config.head_dim * context
  return float(2 * matmul_params(config) + attention) * rows


def train_flops(config: ModelConfig, batch_size: int, seq_len: int, head: str = "lm") -> float:
  """Returns model FLOPs of one forward + backward pass: 6 x matmul params x tokens plus the
  causal attention's scores and values (12 x layers x heads x head_dim per (query, key) pair,
  T (T + 1) / 2 pairs per row: what a causal model needs, however much of the square a kernel
  computes). Rematerialization is not counted (model, not hardware, FLOPs). head="value": a
  value model's step (`matmul_params`). With LoRA the frozen weights need no gradient of their
  own (4 x, forward and the input's gradient) and the adapters train (6 x their params), as
  does a trained LM head (lora_train_embeddings="all"; trained token rows are too few to
  count)."""
  tokens = batch_size * seq_len
  pairs = seq_len * (seq_len + 1) / 2
  attention = 12 * config.num_layers * config.num_heads * config.head_dim * pairs
  weights = (4.0 if config.lora_rank else 6.0) * matmul_params(config, head)
  return ((weights + 6.0 * config.lora_params() + 2.0 * trained_head_params(config, head))
          * tokens + float(attention) * batch_size)


def trained_head_params(config: ModelConfig, head: str = "lm") -> int:
  """Returns the LM head's parameters when a LoRA model trains it whole (its weights' gradient
  is then computed), else 0."""
  return config.vocab_size * config.hidden_size if config.trains_embeddings and head == "lm" else 0
