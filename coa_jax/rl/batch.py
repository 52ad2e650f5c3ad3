"""Rollout records -> the fixed-shape arrays a DAPO update trains on (token in, token out)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from coa_jax.rollout.tool_loop import RolloutRecord
from coa_jax.train.batch import PolicyBatch


def rollout_batch(records: Sequence[RolloutRecord], advantages: Sequence[float],
                  groups: Sequence[int], seq_len: int,
                  drop_mask: Sequence[bool] | None = None,
                  proximal_version: int | None = None,
                  outcomes: tuple[Sequence[float], Sequence[bool]] | None = None,
                  truncated_sampling: bool = False) -> PolicyBatch:
  """Returns the (B, seq_len) next-token arrays of `records`, right-padded.

  Row b predicts ids[1:] from ids[:-1]; its loss mask is the record's mask on the predicted
  tokens (sampled tokens only) and 0 where `drop_mask[b]` (e.g. overlong filtering);
  sampler_logp holds the sampler's log-probs there; every token gets the row's advantage;
  `group` is the row's prompt-group id. stale_mask is 1 on the predicted sampled tokens whose
  sampling distribution was not the proximal policy's, to be importance-weighted: every one
  when `truncated_sampling` (top-k / top-p cut the policy), else those whose distribution a
  policy older than `proximal_version` shaped (None: none, the synchronous case). A token was
  sampled over a KV cache that its row's earlier tokens' versions wrote (partial rollouts), so
  its behaviour version is the oldest of its own and theirs; versions only grow, so that is
  the prompt's. `outcomes` (PPO: each row's reward and bootstrap flag,
  `coa_jax.rl.critic.outcomes`) fill `rewards` and `bootstrap`; a bootstrapped row must leave
  a padding position, where the critic reads the value after its last token. old_logp is left
  for the update to recompute.
  """
  rows = len(records)
  if not rows == len(advantages) == len(groups):
    raise ValueError(f"{rows} records, {len(advantages)} advantages, {len(groups)} groups")
  arrays = {k: np.zeros((rows, seq_len), np.int32) for k in
            ("input_ids", "targets", "loss_mask", "positions", "segment_ids")}
  for name in ("sampler_logp", "advantages", "stale_mask"):
    arrays[name] = np.zeros((rows, seq_len), np.float32)
  for b, record in enumerate(records):
    n = len(record.ids) - 1
    if n > seq_len:
      raise ValueError(f"task {record.task_id} sample {record.sample}: {len(record.ids)} tokens "
                       f"exceed the update's seq_len + 1 = {seq_len + 1}")
    if outcomes is not None and outcomes[1][b] and n == seq_len:
      raise ValueError(f"task {record.task_id} sample {record.sample}: bootstrapped, its "
                       f"{len(record.ids)} tokens leave no position for the value after its "
                       f"last token (seq_len {seq_len}; a rollout's fit in seq_len)")
    if not (len(record.ids) == len(record.loss_mask) == len(record.logprobs) ==
            len(record.versions)):
      raise ValueError(f"task {record.task_id} sample {record.sample}: ids, loss_mask, "
                       f"logprobs and versions differ in length")
    ids = np.asarray(record.ids, np.int32)
    arrays["input_ids"][b, :n] = ids[:-1]
    arrays["targets"][b, :n] = ids[1:]
    if not (drop_mask is not None and drop_mask[b]):
      arrays["loss_mask"][b, :n] = record.loss_mask[1:]
    if record.segments:  # packed samples: positions restart, attention stays within each
      if sum(record.segments) != len(record.ids):
        raise ValueError(f"task {record.task_id} sample {record.sample}: segments "
                         f"{record.segments} do not add up to its {len(record.ids)} tokens")
      segment = np.repeat(np.arange(1, len(record.segments) + 1), record.segments)
      starts = np.repeat(np.cumsum([0] + record.segments[:-1]), record.segments)
      arrays["positions"][b, :n] = (np.arange(len(record.ids)) - starts)[:n]
      arrays["segment_ids"][b, :n] = segment[:n]
    else:
      arrays["positions"][b, :n] = np.arange(n)
      arrays["segment_ids"][b, :n] = 1
    arrays["sampler_logp"][b, :n] = record.logprobs[1:]
    arrays["advantages"][b, :n] = advantages[b]
    if truncated_sampling:
      arrays["stale_mask"][b, :n] = arrays["loss_mask"][b, :n] > 0
    elif proximal_version is not None:
      # The oldest weights behind each token's cache, within its own call: a packed sample's
      # segment was prefilled afresh, by the weights that then sampled it.
      calls = np.split(np.asarray(record.versions), np.cumsum(record.segments, dtype=int)[:-1])
      behaviour = np.concatenate([np.minimum.accumulate(call) for call in calls])
      arrays["stale_mask"][b, :n] = (behaviour[1:] < proximal_version) & (
          arrays["loss_mask"][b, :n] > 0)
  if outcomes is not None:
    arrays["rewards"] = np.asarray(outcomes[0], np.float32)
    arrays["bootstrap"] = np.asarray(outcomes[1], bool)
  return PolicyBatch(**arrays, group=np.asarray(groups, np.int32))
