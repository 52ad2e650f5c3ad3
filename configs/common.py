"""Defaults shared by experiment configs (the one place they live)."""

import ml_collections


def model(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """Model preset name plus numerics; any ModelConfig field may be added as an override."""
  values = dict(preset=preset, dtype="float32", param_dtype="float32", remat="none",
                attention_impl="xla")
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
