"""Losses: pure functions of arrays returning token-exact (sum, count) pairs.

Variants chosen by a config string live in a `Registry` (a function and a name): the DAPO
loss's aggregations in `AGGREGATIONS` (`register_aggregation`); the RL advantage estimators
are in `coa_jax.rl.advantages.ADVANTAGE_ESTIMATORS`, as rl builds on losses.
"""

from coa_jax.losses.cross_entropy import (
                                          LossSums,
                                          token_cross_entropy,
                                          token_cross_entropy_and_z,
                                          token_entropy,
                                          token_logprobs,
)
from coa_jax.losses.dapo import AGGREGATIONS, register_aggregation
from coa_jax.losses.registry import Registry
