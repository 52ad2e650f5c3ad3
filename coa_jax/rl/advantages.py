"""Reward shaping and advantages on the host: overlong shaping, group-normalized advantages."""

from __future__ import annotations

import numpy as np


def overlong_penalty(response_len: int, max_len: int, cache_len: int) -> float:
  """Returns DAPO's soft overlong punishment, in tokens: 0 up to max_len - cache_len, then
  linear down to -1 at max_len, and -1 beyond."""
  if not 0 <= cache_len <= max_len:
    raise ValueError(f"overlong cache_len={cache_len} must be in [0, max_len={max_len}]")
  start = max_len - cache_len
  if response_len <= start:
    return 0.0
  if response_len >= max_len:
    return -1.0
  return -(response_len - start) / cache_len


def group_advantages(rewards_GxN: np.ndarray, normalize: str = "std", eps: float = 1e-6,
                     negative_weight: float = 1.0) -> np.ndarray:
  """Returns each sample's advantage within its prompt's group (rows of `rewards_GxN`).

  "std": (R - mean) / (std + eps) with the Bessel-corrected std (ddof=1, the reference's);
  "mean": R - mean (Dr.GRPO). A group of one sample, or of equal rewards, gets 0.
  Negative advantages are then scaled by `negative_weight` (1: the reference; below 1 pushes
  failed samples down less than successful ones up).
  """
  rewards = np.asarray(rewards_GxN, np.float64)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be (groups, samples), got shape {rewards.shape}")
  if not 0 <= negative_weight <= 1:
    raise ValueError(f"advantage negative_weight={negative_weight}: expected 0..1")
  centered = rewards - rewards.mean(axis=1, keepdims=True)
  if normalize == "mean":
    advantages = centered
  elif normalize != "std":
    raise ValueError(f"advantage normalize={normalize!r}: expected 'std' or 'mean'")
  elif rewards.shape[1] < 2:
    advantages = np.zeros_like(rewards)
  else:
    advantages = centered / (rewards.std(axis=1, ddof=1, keepdims=True) + eps)
  return np.where(advantages < 0, negative_weight * advantages, advantages)
