"""Defaults shared by experiment configs (the one place they live)."""

import dataclasses

import ml_collections

from coa_jax.model.config import ModelConfig

# Numerics and execution fields of ModelConfig, listed here so that the command line can
# override them (--config.model.remat=full); their defaults stay in ModelConfig.
NUMERICS = ("dtype", "param_dtype", "remat", "attention_impl", "attention_block", "scan_unroll")


def model(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """Model preset name plus numerics; any ModelConfig field may be added as an override."""
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in NUMERICS}
  values = dict(preset=preset, **defaults)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def mesh(data: int = 1, fsdp: int = -1, tensor: int = 1) -> ml_collections.ConfigDict:
  """Mesh axis sizes; -1 takes all remaining devices."""
  return ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))


def optimizer(**overrides) -> ml_collections.ConfigDict:
  """AdamW settings (see coa_jax.train.optimizer)."""
  values = dict(learning_rate=1e-5, warmup_steps=0, schedule="cosine", total_steps=1000,
                final_lr_fraction=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                grad_clip=1.0)
  values.update(overrides)
  return ml_collections.ConfigDict(values)
