"""LoRA adapters in a parameter tree: split from the base weights, put back, merged into them.

A LoRA model (ModelConfig.lora_rank > 0) holds, beside each adapted projection's `kernel`, its
adapter `lora_a` (in x rank) and `lora_b` (rank x out); the functions here take any tree of
that structure (arrays, shardings, abstract shapes), layers stacked or not.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from flax import traverse_util

from coa_jax.model.config import ModelConfig

ADAPTERS = ("lora_a", "lora_b")


def split(params: Any) -> tuple[dict, dict]:
  """Returns (base, adapters): the tree's non-adapter leaves and its adapters, as two trees."""
  flat = traverse_util.flatten_dict(params)
  base = {path: leaf for path, leaf in flat.items() if path[-1] not in ADAPTERS}
  adapters = {path: leaf for path, leaf in flat.items() if path[-1] in ADAPTERS}
  return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def combine(base: Any, adapters: Any) -> dict:
  """Returns the tree holding both `base`'s and `adapters`' leaves (split's inverse)."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base),
                                       **traverse_util.flatten_dict(adapters)})


def merge(params: Any, config: ModelConfig) -> dict:
  """Returns the base parameters with each adapter folded into its kernel: kernel + A B
  alpha / rank in float32 (a bf16 kernel would round small adapter updates away; the export
  casts once, to its own dtype). The result runs in the model without LoRA
  (config.replace(lora_rank=0)) as the LoRA model runs `params`."""
  base, adapters = split(params)
  flat_base = traverse_util.flatten_dict(base)
  flat_adapters = traverse_util.flatten_dict(adapters)
  for path in {path[:-1] for path in flat_adapters}:
    kernel = flat_base[path + ("kernel",)]
    a, b = flat_adapters[path + ("lora_a",)], flat_adapters[path + ("lora_b",)]
    # kernel: lead + in + out axes; a: lead + in + (rank,); b: lead + (rank,) + out.
    n_out = kernel.ndim - (a.ndim - 1)
    lead = kernel.shape[:b.ndim - 1 - n_out]
    rank = a.shape[-1]
    a_2d = a.astype(jnp.float32).reshape(lead + (-1, rank))
    b_2d = b.astype(jnp.float32).reshape(lead + (rank, math.prod(kernel.shape[-n_out:])))
    delta = jnp.matmul(a_2d, b_2d).reshape(kernel.shape) * (config.lora_alpha / rank)
    flat_base[path + ("kernel",)] = kernel.astype(jnp.float32) + delta
  return traverse_util.unflatten_dict(flat_base)
