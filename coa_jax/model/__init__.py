"""The decoder-only transformer, its configuration and presets."""

from coa_jax.model.config import (
                                  PRESETS,
                                  ConfigError,
                                  Llama3RopeScaling,
                                  ModelConfig,
                                  ModelSettings,
                                  build_config,
                                  from_hf_config,
                                  get_preset,
                                  to_hf_config,
)
from coa_jax.model.attention import compiling_for
from coa_jax.model.transformer import Transformer
