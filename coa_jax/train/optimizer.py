"""AdamW with warm-up and a constant or cosine schedule, global-norm clipping, decay on weights."""

from __future__ import annotations

from typing import Any

import jax
import optax

from coa_jax.model.config import ConfigError

SCHEDULES = ("constant", "cosine")


def learning_rate_schedule(cfg: Any) -> optax.Schedule:
  """Returns the schedule: linear warm-up to `learning_rate`, then constant or cosine decay."""
  if cfg.schedule not in SCHEDULES:
    raise ConfigError(f"optimizer.schedule={cfg.schedule!r}: expected one of {SCHEDULES}")
  if cfg.learning_rate <= 0 or cfg.warmup_steps < 0:
    raise ConfigError("optimizer.learning_rate must be > 0 and optimizer.warmup_steps >= 0")
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.learning_rate)
  else:
    if cfg.total_steps <= cfg.warmup_steps:
      raise ConfigError(f"optimizer.total_steps={cfg.total_steps} must exceed "
                        f"warmup_steps={cfg.warmup_steps} for a cosine schedule")
    after = optax.cosine_decay_schedule(cfg.learning_rate, cfg.total_steps - cfg.warmup_steps,
                                        alpha=cfg.final_lr_fraction)
  if cfg.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


DECAYED_PARAMS = ("kernel", "embedding", "lm_head")


def weight_decay_mask(params: Any) -> Any:
  """Returns a bool tree: True for weight matrices, False for norm scales and biases."""
  def decays(path, _):
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return bool(names) and names[-1] in DECAYED_PARAMS

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: Any) -> optax.GradientTransformation:
  """Returns AdamW (decay on weight matrices only) after global-norm clipping."""
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=weight_decay_mask))
  return optax.chain(*parts)
