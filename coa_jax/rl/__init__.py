"""Agentic RL with DAPO or PPO (a critic and masked GAE): advantages, dynamic sampling, rollout
batches, updates and the job, synchronous or asynchronous (bounded staleness)."""

from coa_jax.rl.advantages import (
                                   ADVANTAGE_ESTIMATORS,
                                   group_advantages,
                                   overlong_penalty,
                                   register_advantage_estimator,
)
from coa_jax.rl.async_trainer import AsyncTrainer
from coa_jax.rl.critic import Critic, CriticConfig
from coa_jax.rl.dapo import Trainer
from coa_jax.rl.dynamic_sampling import DynamicSamplingError, ScoredGroup, fill_batch
from coa_jax.rl.job import run
