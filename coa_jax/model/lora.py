"""LoRA adapters in a parameter tree: split from the base weights, put back, merged into them.

A LoRA model (ModelConfig.lora_rank > 0) holds, beside each adapted projection's `kernel`, its
adapter `lora_a` (in x rank) and `lora_b` (rank x out), and the trained embedding and LM-head
rows of its `trained_token_ids` (`embedding_rows`, `lm_head_rows`: token x embed); the
functions here take any tree of that structure (arrays, shardings, abstract shapes), layers
stacked or not.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from flax import traverse_util

from coa_jax.model.config import ModelConfig

ADAPTERS = ("lora_a", "lora_b")
TOKEN_ROWS = ("embedding_rows", "lm_head_rows")  # each replaces rows of the table it names
TRAINED = ADAPTERS + TOKEN_ROWS


def split(params: Any) -> tuple[dict, dict]:
  """Returns (base, adapters): the tree's frozen leaves and what LoRA trains (its adapters and
  token rows), as two trees."""
  flat = traverse_util.flatten_dict(params)
  base = {path: leaf for path, leaf in flat.items() if path[-1] not in TRAINED}
  adapters = {path: leaf for path, leaf in flat.items() if path[-1] in TRAINED}
  return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def base_token_rows(base: Any, config: ModelConfig, names: Any = TOKEN_ROWS) -> dict:
  """Returns the base weights' rows of `config.trained_token_ids` as the token-row leaves
  `names` (those of a model's tree) hold them, in the params dtype: where trained rows start."""
  ids = jnp.asarray(config.trained_token_ids)
  tables = {"embedding_rows": lambda: base["embedding"],
            "lm_head_rows": lambda: base["lm_head"].T}
  return {name: jnp.take(tables[name](), ids, axis=0).astype(config.params_dtype)
          for name in names}


def combine(base: Any, adapters: Any) -> dict:
  """Returns the tree holding both `base`'s and `adapters`' leaves (split's inverse)."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base),
                                       **traverse_util.flatten_dict(adapters)})


def merge(params: Any, config: ModelConfig) -> dict:
  """Returns the base parameters with each adapter folded into its kernel: kernel + A B
  alpha / rank in float32 (a bf16 kernel would round small adapter updates away; the export
  casts once, to its own dtype), and the trained token rows written over the embedding's and
  LM head's. The result runs in the model without LoRA (config.replace(lora_rank=0)) as the
  LoRA model runs `params`."""
  base, adapters = split(params)
  flat_base = traverse_util.flatten_dict(base)
  flat_adapters = traverse_util.flatten_dict(adapters)
  for path in {path[:-1] for path in flat_adapters if path[-1] in ADAPTERS}:
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
  ids = jnp.asarray(config.trained_token_ids)
  if "embedding_rows" in adapters:
    flat_base[("embedding",)] = flat_base[("embedding",)].astype(jnp.float32).at[ids].set(
        adapters["embedding_rows"].astype(jnp.float32))
  if "lm_head_rows" in adapters:
    flat_base[("lm_head",)] = flat_base[("lm_head",)].astype(jnp.float32).at[:, ids].set(
        adapters["lm_head_rows"].astype(jnp.float32).T)
  return traverse_util.unflatten_dict(flat_base)
