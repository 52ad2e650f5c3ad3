"""Builds tiny random HF PyTorch models (Qwen2 / Llama) and saves them as local HF folders."""

from __future__ import annotations

import numpy as np
import torch
import transformers


def make_hf_model(family: str, *, vocab=96, hidden=32, intermediate=64, layers=2, heads=4,
                  kv_heads=2, head_dim=None, tie=False, rope_scaling=None, seed=0):
  """Returns a random-initialized float32 Qwen2ForCausalLM or LlamaForCausalLM in eval mode."""
  torch.manual_seed(seed)
  common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                max_position_embeddings=256, torch_dtype="float32", initializer_range=0.1)
  if head_dim is not None:
    common["head_dim"] = head_dim
  if family == "qwen2":
    config = transformers.Qwen2Config(rope_theta=1_000_000.0, rms_norm_eps=1e-6, **common)
    model = transformers.Qwen2ForCausalLM(config)
  else:
    config = transformers.LlamaConfig(rope_theta=500_000.0, rms_norm_eps=1e-5,
                                      rope_scaling=rope_scaling, **common)
    model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomize them too
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
  return model.eval()


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
  """Returns the HF model's float32 logits for int ids (B, T)."""
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
