"""The typed batches that jitted steps take: pytrees of (B, T) arrays, sharded over rows.

`TokenBatch` is next-token training data (SFT's packed rows, the LM demo); `PolicyBatch` adds
what a policy-gradient update needs. Leaves are numpy arrays on the host and global jax
Arrays once sharded (`runtime.sharding.shard_batch`); a field left None is absent.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = Any  # np.ndarray on the host, jax.Array on devices


@flax.struct.dataclass
class TokenBatch:
  """Row b predicts targets[b, t] from input_ids[b, :t + 1]; loss_mask marks the tokens that
  count; positions restart and segment_ids change at each packed sequence (0: padding)."""

  input_ids: Array  # (B, T) int32
  targets: Array  # (B, T) int32
  loss_mask: Array  # (B, T) int32
  positions: Array  # (B, T) int32
  segment_ids: Array  # (B, T) int32

  @classmethod
  def concatenate(cls, parts: list[Any]) -> Any:
    """Returns the batches in `parts` stacked row-wise (host arrays)."""
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *parts)


@flax.struct.dataclass
class PolicyBatch(TokenBatch):
  """A rollout mini-batch: sampled tokens (loss_mask) with their advantages.

  sampler_logp: the log-probs the sampler drew each token with; old_logp: the rollout policy's
  teacher-forced log-probs, recomputed before the update (the ratio's denominator); ref_logp:
  the reference policy's (only with a KL term); group: each row's prompt-group id; stale_mask: 1
  on tokens whose sampling distribution was not old_logp's policy (asynchronous RL: an older
  version sampled them or wrote their KV cache; any sampling truncated by top-k / top-p), which
  the loss importance-weights by old_logp vs sampler_logp.

  PPO with a critic (rl.advantage = "gae") adds: rewards, each row's outcome reward (GAE puts
  it on the row's last trainable token); bootstrap, 1 where GAE bootstraps the row from the
  critic's value after its last token (a truncated sample); and, once the critic has run,
  old_values (its values at rollout time) and returns (the critic's targets). `advantages`
  then holds GAE's token advantages.
  """

  sampler_logp: Array = None  # (B, T) float32
  stale_mask: Array = None  # (B, T) float32
  advantages: Array = None  # (B, T) float32
  group: Array = None  # (B,) int32
  old_logp: Array = None  # (B, T) float32
  ref_logp: Array = None  # (B, T) float32
  rewards: Array = None  # (B,) float32
  bootstrap: Array = None  # (B,) bool
  old_values: Array = None  # (B, T) float32
  returns: Array = None  # (B, T) float32


def abstract_batch(cls: type, batch_size: int, seq_len: int, sharding: Any,
                   ppo: bool = False) -> Any:
  """Returns a batch of `cls` as ShapeDtypeStructs in `sharding` (for ahead-of-time lowering);
  a PolicyBatch gets every field but ref_logp, and PPO's (rewards, bootstrap, old_values,
  returns) only with `ppo`."""
  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  tokens = {name: spec((batch_size, seq_len), jnp.int32)
            for name in ("input_ids", "targets", "loss_mask", "positions", "segment_ids")}
  if cls is TokenBatch:
    return TokenBatch(**tokens)
  names = ("sampler_logp", "stale_mask", "advantages", "old_logp") + (
      ("old_values", "returns") if ppo else ())
  floats = {name: spec((batch_size, seq_len), jnp.float32) for name in names}
  if ppo:
    floats.update(rewards=spec((batch_size,), jnp.float32), bootstrap=spec((batch_size,), bool))
  return PolicyBatch(**tokens, **floats, group=spec((batch_size,), jnp.int32))
