"""The evaluation job's settings, typed: `evaluation_settings(config)` checks a config
(configs/evaluate_tiny.py shows every key) once, at the job's top."""

from __future__ import annotations

import dataclasses
from typing import Any

from coa_jax.distill.teacher import TeacherConfig
from coa_jax.model import ConfigError
from coa_jax.rollout.settings import AgentSettings
from coa_jax.runtime.settings import build

SYSTEMS = ("model", "teacher")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaluationSettings(AgentSettings):
  """`system`: "model" (the checkpoint with its tools, `k` samples a task: the rollout's group
  size) or "teacher" (`k` seeds of the teacher system); the tasks (a JSONL file, the first
  `max_tasks`, 0: all), `rewards` (`data.rewards.build_rewarder`'s spec), `copy_probe`
  (held-out teacher trajectories to probe copying on, "": none) and where the metrics go."""

  tasks: str
  output_dir: str
  rewards: dict[str, Any]
  system: str = "model"
  k: int = 1
  max_tasks: int = 0
  copy_probe: str = ""
  teacher: TeacherConfig = TeacherConfig()

  def __post_init__(self):
    super().__post_init__()
    if self.system not in SYSTEMS:
      raise ConfigError(f"system={self.system!r}: expected one of {SYSTEMS}")
    if self.k < 1:
      raise ConfigError(f"k={self.k}: expected >= 1")


def evaluation_settings(config: Any, where: str = "evaluation") -> EvaluationSettings:
  """Returns an evaluation config's settings; raises ConfigError naming the key for an unknown
  key, a wrong type or a bad value."""
  return build(EvaluationSettings, config, where)
