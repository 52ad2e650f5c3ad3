"""AdamW with warm-up and a constant, cosine or warm-up-stable-decay schedule, global-norm
clipping, decay on weights."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import optax

from coa_jax.model.config import ConfigError

SCHEDULES = ("constant", "cosine", "wsd")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """AdamW and its learning-rate schedule (`learning_rate_schedule`); decay_steps: how many of
  the last steps the "wsd" schedule decays over (unused otherwise)."""

  learning_rate: float = 1e-5
  warmup_steps: int = 0
  schedule: str = "cosine"
  total_steps: int = 1000
  final_lr_fraction: float = 0.1
  decay_steps: int = 0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0

  def __post_init__(self):
    learning_rate_schedule(self)  # its checks name the field


def learning_rate_schedule(cfg: Any, where: str = "optimizer") -> optax.Schedule:
  """Returns the schedule: linear warm-up to `learning_rate`, then "constant"; "cosine" decay to
  `final_lr_fraction` of the peak by `total_steps`; or "wsd" (warm-up, stable, decay): constant
  at the peak, then that cosine decay over the last `decay_steps` steps only. `cfg`:
  OptimizerSettings or settings with its schedule fields (the critic's). Errors name the
  settings as `where`.<field>."""
  if cfg.schedule not in SCHEDULES:
    raise ConfigError(f"{where}.schedule={cfg.schedule!r}: expected one of {SCHEDULES}")
  if cfg.learning_rate <= 0 or cfg.warmup_steps < 0:
    raise ConfigError(f"{where}.learning_rate must be > 0 and {where}.warmup_steps >= 0")
  after_warmup = cfg.total_steps - cfg.warmup_steps
  if cfg.schedule != "constant" and after_warmup <= 0:
    raise ConfigError(f"{where}.total_steps={cfg.total_steps} must exceed "
                      f"warmup_steps={cfg.warmup_steps} for a {cfg.schedule} schedule")
  lr = cfg.learning_rate
  if cfg.schedule == "constant":
    after = optax.constant_schedule(lr)
  else:
    decay = after_warmup if cfg.schedule == "cosine" else getattr(cfg, "decay_steps", 0)
    if not 0 < decay <= after_warmup:
      raise ConfigError(f"{where}.decay_steps={decay}: expected 1..total_steps - warmup_steps "
                        f"({after_warmup}) for a wsd schedule")
    after = optax.cosine_decay_schedule(lr, decay, alpha=cfg.final_lr_fraction)
    if decay < after_warmup:  # "wsd": stable at the peak first
      after = optax.join_schedules([optax.constant_schedule(lr), after], [after_warmup - decay])
  if cfg.warmup_steps == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps), after],
                              [cfg.warmup_steps])


# LoRA's trained token rows too: the same tables' rows, decayed when the whole tables train.
DECAYED_PARAMS = ("kernel", "embedding", "lm_head", "value_head", "lora_a", "lora_b",
                  "embedding_rows", "lm_head_rows")


def weight_decay_mask(params: Any) -> Any:
  """Returns a bool tree: True for weight matrices (and LoRA's token rows of the embedding and
  LM head), False for norm scales and biases."""
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


@functools.lru_cache(maxsize=8)
def schedule_and_optimizer(settings: OptimizerSettings
                           ) -> tuple[Callable[[Any], Any], optax.GradientTransformation]:
  """Returns `learning_rate_schedule(settings)` and `make_optimizer(settings)`, one pair per
  settings in this process: the jobs build their jitted steps on them, and runs alike in one
  process share those steps (`sft.job`, `rl.dapo`)."""
  return learning_rate_schedule(settings), make_optimizer(settings)
