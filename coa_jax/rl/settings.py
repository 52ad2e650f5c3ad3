"""The RL job's settings, typed: `rl_settings(config)` checks a config (configs/dapo_tiny_cpu.py
shows every key, configs/common.py's `rl` every key of the rl block) once, at the job's top;
below it the trainers read these, never the config."""

from __future__ import annotations

import dataclasses
from typing import Any

from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.model import ConfigError
from coa_jax.rl.advantages import ADVANTAGE_ESTIMATORS, needs_critic
from coa_jax.rl.critic import CriticConfig, optimizer_settings
from coa_jax.rollout.settings import AgentSettings
from coa_jax.runtime.checkpointing import CheckpointSettings
from coa_jax.runtime.settings import build
from coa_jax.train.optimizer import OptimizerSettings


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
  """Asynchronous RL (`coa_jax.rl.async_trainer`): rollouts on `rollout_devices` devices per
  host (0: half) overlap the updates; a group trains only while its oldest token's policy is
  within `staleness` updates; `weight_cap` truncates the importance weight of stale tokens. Every
  key is required (the defaults: configs/common.py's `rl`)."""

  enabled: bool
  staleness: int
  rollout_devices: int
  weight_cap: float

  def __post_init__(self):
    if self.staleness < 0 or self.rollout_devices < 0:
      raise ConfigError(f"staleness={self.staleness}, rollout_devices={self.rollout_devices}: "
                        f"expected >= 0")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The rl block: a step gathers `batch_groups` prompt groups (dynamic sampling generates
  rounds of `prompts_per_round` prompts, at most `max_rounds`), then updates once per
  mini-batch of `mini_batch_groups` groups (each accumulated over `micro_batches`),
  `ppo_epochs` times; the policy loss's fields (`policy_loss`); advantage "gae" is PPO's, from
  the critic (`critic`). Every key is required: the defaults, the reference's, are
  configs/common.py's `rl`."""

  steps: int
  # A step's batch: prompt groups, rounds of dynamic sampling, mini-batches and their passes.
  batch_groups: int
  prompts_per_round: int
  max_rounds: int
  mini_batch_groups: int
  micro_batches: int
  ppo_epochs: int
  dynamic_sampling: bool  # keep only groups whose samples disagree
  # Advantages ("std", "mean": Dr.GRPO's, "gae": the critic's) and overlong responses.
  advantage: str
  advantage_eps: float
  negative_weight: float  # scales negative advantages (1: the reference)
  overlong_shaping: bool
  overlong_cache: int
  overlong_filter: bool
  # The policy loss (`policy_loss`: coa_jax.losses.dapo.PolicyLossConfig).
  eps_low: float
  eps_high: float
  dual_clip: float
  aggregation: str
  norm_tokens: int
  log_ratio_clamp: float
  kl_coef: float
  entropy_coef: float
  # The job loop (as `train.loop.TrainSettings`), held-out evaluations, the prompts report.
  eval_every: int
  log_every: int
  stop_after: int
  nonfinite_skips: int
  track_prompts: bool  # the tasks always / never solved, in workdir/prompts.json
  # An agent program ("module:function", `coa_jax.serving.agent`) rolled out through the
  # trainer's own OpenAI-compatible endpoint in place of the built-in tool loop ("": that loop).
  agent: str
  async_: AsyncSettings = dataclasses.field(metadata={"key": "async"})
  critic: CriticConfig

  def __post_init__(self):
    for name in ("steps", "batch_groups", "prompts_per_round", "max_rounds",
                 "mini_batch_groups", "micro_batches", "ppo_epochs", "eval_every", "log_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name}={getattr(self, name)}: expected >= 1")
    if self.batch_groups % self.mini_batch_groups:
      raise ConfigError(f"batch_groups={self.batch_groups} is not a multiple of "
                        f"mini_batch_groups={self.mini_batch_groups}")
    ADVANTAGE_ESTIMATORS.get(self.advantage)  # an unknown name fails before any rollout
    if self.uses_critic and self.negative_weight != 1:
      raise ConfigError(f"negative_weight={self.negative_weight} scales group advantages; "
                        f"with advantage='gae' it must be 1")
    self.policy_loss()  # its checks name the field

  @property
  def uses_critic(self) -> bool:
    """Whether a critic gives the advantages (PPO)."""
    return needs_critic(self.advantage)

  def policy_loss(self) -> PolicyLossConfig:
    """Returns the policy loss's settings."""
    return PolicyLossConfig(eps_low=self.eps_low, eps_high=self.eps_high,
                            dual_clip=self.dual_clip, aggregation=self.aggregation,
                            norm_tokens=self.norm_tokens, log_ratio_clamp=self.log_ratio_clamp,
                            kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                            behaviour_weight_cap=self.async_.weight_cap)

  def critic_settings(self) -> CriticConfig:
    """Returns the critic's settings, total_steps 0 taken as every critic update of the run:
    steps x mini-batches per step x ppo_epochs (the critic trains on every one, warm-up and
    pre-training included)."""
    if self.critic.total_steps:
      return self.critic
    updates = self.steps * (self.batch_groups // self.mini_batch_groups) * self.ppo_epochs
    return dataclasses.replace(self.critic, total_steps=updates)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSettings(AgentSettings):
  """Everything an RL run reads: the agent's settings, the training tasks (`tasks`, the first
  `max_tasks`, 0: all) and held-out ones (`eval_tasks`, "": no evaluation), the rewards
  (`data.rewards.build_rewarder`'s spec, scored on `reward_workers` threads), the rl block,
  the optimizer, checkpoints (None: none), the workdir and the HF export ("": none)."""

  tasks: str
  workdir: str
  rl: RLConfig
  optimizer: OptimizerSettings
  rewards: dict[str, Any]
  max_tasks: int = 0
  eval_tasks: str = ""
  eval_max_tasks: int = 0
  reward_workers: int = 4
  checkpoint: CheckpointSettings | None = None
  export_dir: str = ""
  export_dtype: str = "bfloat16"

  def __post_init__(self):
    super().__post_init__()
    if self.sampling.temperature == 0:
      raise ConfigError("DAPO needs sampled rollouts: sampling.temperature must be > 0")
    if self.rl.uses_critic:  # the critic's schedule over its own updates, named rl.critic
      optimizer_settings(self.optimizer, self.rl.critic_settings())
    if self.reward_workers < 1:
      raise ConfigError(f"reward_workers={self.reward_workers}: expected >= 1")
    if self.export_dtype not in ("float32", "bfloat16", "float16"):
      raise ConfigError(f"export_dtype={self.export_dtype!r}: expected float32, bfloat16 or "
                        f"float16")


def rl_settings(config: Any, where: str = "dapo") -> RLSettings:
  """Returns an RL config's settings; raises ConfigError naming the key for an unknown key, a
  wrong type or a bad value."""
  return build(RLSettings, config, where)
