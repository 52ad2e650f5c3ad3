"""Reward shaping and advantages on the host: overlong shaping, group-normalized advantages.

The config's `advantage` names an estimator in the `ADVANTAGE_ESTIMATORS` registry. A new one is
a function and a name: `@ADVANTAGE_ESTIMATORS.register("name")` on a function
`(rewards_GxN float64, eps) -> advantages_GxN`, each row a prompt's group of samples;
`group_advantages(rewards_GxN, "name")` then uses it (and scales its negative advantages).

"gae" (PPO) is registered too, as the config's name for the critic's estimator: GAE is token
level and needs the critic's values, so the RL job computes it on the device
(`coa_jax.rl.critic`); it has no group form.
"""

from __future__ import annotations

import numpy as np

from coa_jax.losses.registry import Registry

# (rewards_GxN float64, eps) -> advantages_GxN, by the config's `advantage` name.
ADVANTAGE_ESTIMATORS = Registry("advantage normalize")
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register


CRITIC_ESTIMATORS = ("gae",)  # the names that train a critic (coa_jax.rl.critic)


def needs_critic(name: str) -> bool:
  """Returns whether the advantage estimator `name` is computed by a critic (PPO)."""
  return name in CRITIC_ESTIMATORS


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

  `normalize` names an estimator in `ADVANTAGE_ESTIMATORS` ("std": GRPO/DAPO's, the default;
  "mean": Dr.GRPO's; an unknown name raises ValueError listing the registered ones), given the
  rewards as float64 and `eps`. Negative advantages are then scaled by `negative_weight` (1: the
  reference; below 1 pushes failed samples down less than successful ones up).
  """
  rewards = np.asarray(rewards_GxN, np.float64)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be (groups, samples), got shape {rewards.shape}")
  if not 0 <= negative_weight <= 1:
    raise ValueError(f"advantage negative_weight={negative_weight}: expected 0..1")
  advantages = ADVANTAGE_ESTIMATORS.get(normalize)(rewards, eps)
  return np.where(advantages < 0, negative_weight * advantages, advantages)


@ADVANTAGE_ESTIMATORS.register("std")
def std_advantages(rewards_GxN: np.ndarray, eps: float) -> np.ndarray:
  """Returns (R - mean) / (std + eps) within each group, with the Bessel-corrected std (ddof=1,
  the reference's); a group of one sample, or of equal rewards, gets 0."""
  if rewards_GxN.shape[1] < 2:
    return np.zeros_like(rewards_GxN)
  centered = rewards_GxN - rewards_GxN.mean(axis=1, keepdims=True)
  return centered / (rewards_GxN.std(axis=1, ddof=1, keepdims=True) + eps)


@ADVANTAGE_ESTIMATORS.register("mean")
def mean_advantages(rewards_GxN: np.ndarray, eps: float) -> np.ndarray:
  """Returns R - mean within each group (Dr.GRPO: no std normalization, so `eps` is unused); a
  group of one sample, or of equal rewards, gets 0."""
  del eps
  return rewards_GxN - rewards_GxN.mean(axis=1, keepdims=True)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(rewards_GxN: np.ndarray, eps: float) -> np.ndarray:
  """Raises ValueError: GAE's advantages are per token, from the critic's values, on the
  device (`coa_jax.rl.critic`), never from a group's rewards."""
  del rewards_GxN, eps
  raise ValueError("advantage 'gae' is token-level and computed by the critic "
                   "(coa_jax.rl.critic), not from a group's rewards")
