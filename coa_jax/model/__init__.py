"""The decoder-only transformer, its configuration and presets."""

from coa_jax.model.config import (ConfigError, Llama3RopeScaling, ModelConfig, PRESETS,
                                  build_config, from_hf_config, get_preset, to_hf_config)
from coa_jax.model.transformer import Transformer

__all__ = ["ConfigError", "Llama3RopeScaling", "ModelConfig", "PRESETS", "Transformer",
           "build_config", "from_hf_config", "get_preset", "to_hf_config"]
