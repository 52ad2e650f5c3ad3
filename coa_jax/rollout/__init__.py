"""Rollouts: the sampler (chunked decoding with a KV cache) and the tool loop that runs tools
between decoding chunks, token in, token out; the rollout job."""

from coa_jax.rollout.job import interactive, run
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.settings import AgentSettings, RolloutSettings, rollout_settings
from coa_jax.rollout.tool_loop import (
                                       Rollout,
                                       RolloutConfig,
                                       RolloutRecord,
                                       callable_tools,
                                       check_prompt_lengths,
                                       stop_ids,
)
