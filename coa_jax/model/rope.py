"""Rotary position embeddings (HF `rotate_half` layout), with optional Llama 3 frequency scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from coa_jax.model.config import Llama3RopeScaling


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: Llama3RopeScaling | None = None) -> np.ndarray:
  """Returns the (head_dim // 2,) float32 inverse frequencies, Llama 3 scaled if asked."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
  inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
  if scaling is None:
    return inv_freq
  old_len = scaling.original_max_position_embeddings
  low_freq_wavelen = old_len / scaling.low_freq_factor
  high_freq_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BxTxNxH: jnp.ndarray, positions_BxT: jnp.ndarray,
               inv_freq: np.ndarray) -> jnp.ndarray:
  """Returns x rotated by its positions: x * cos + rotate_half(x) * sin, computed in float32."""
  freqs_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles_BxTx1xH = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)[:, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * jnp.cos(angles_BxTx1xH) + rotated * jnp.sin(angles_BxTx1xH)
  return out.astype(x_BxTxNxH.dtype)
