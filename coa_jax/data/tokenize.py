"""Tokenizing a trajectory for SFT, span by span, so every mask boundary is exact.

The sequence is the prompt (template tokens, system prompt, question), then each response
step as its own span, then the end token. `loss_mask[i]` is 1 when token i is a training
target: assistant tokens that are not observations, plus the end token. The prompt and every
observation token are 0, tags included. A step after the first carries the newline that
separates it from the previous step, so an observation span is exactly what the environment
appends in a rollout (`\\n<observation>\\n...\\n</observation>`), and the newline after it
belongs to the model's next step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from coa_jax.data import coa_format
from coa_jax.data.coa_format import Trajectory
from coa_jax.data.tokenizer import CoATokenizer

OVERLONG_POLICIES = ("truncate", "drop")


@dataclasses.dataclass(frozen=True)
class TokenizedExample:
  """Token ids and their loss mask (int32 arrays of one length); the response starts at
  `response_start`."""

  input_ids: np.ndarray
  loss_mask: np.ndarray
  response_start: int

  def __len__(self) -> int:
    return len(self.input_ids)


class DroppedExample(ValueError):
  """An example that cannot be trained on; `reason` is a short countable key."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def step_ids(tokenizer: CoATokenizer, step: coa_format.Step, first: bool) -> list[int]:
  """Returns the ids of one step: [newline], <tag>, newline + content + newline, </tag>."""
  ids = [] if first else tokenizer.encode("\n")
  ids.append(tokenizer.tag_id(step.tag))
  ids.extend(tokenizer.encode(f"\n{step.content}\n"))
  ids.append(tokenizer.tag_id(step.tag, close=True))
  return ids


def tokenize_trajectory(trajectory: Trajectory, tokenizer: CoATokenizer, max_len: int,
                        overlong: str = "truncate") -> TokenizedExample:
  """Returns the ids and loss mask of a trajectory; raises DroppedExample when it cannot be
  used (too long under overlong="drop", or no target token left after truncation)."""
  if overlong not in OVERLONG_POLICIES:
    raise ValueError(f"overlong={overlong!r}: expected one of {OVERLONG_POLICIES}")
  ids = tokenizer.prompt_ids(trajectory.system, trajectory.question)
  mask = [0] * len(ids)
  response_start = len(ids)
  for i, step in enumerate(trajectory.steps):
    span = step_ids(tokenizer, step, first=i == 0)
    ids.extend(span)
    mask.extend([0 if step.tag == coa_format.OBSERVATION else 1] * len(span))
  ids.append(tokenizer.end_id)
  mask.append(1)
  if len(ids) > max_len:
    if overlong == "drop":
      raise DroppedExample("too_long", f"{len(ids)} tokens > max_len={max_len}")
    ids, mask = ids[:max_len], mask[:max_len]  # masks are per token: no span is half-masked
  if not any(mask[1:]):
    raise DroppedExample("no_targets", f"no target token within max_len={max_len}")
  return TokenizedExample(np.asarray(ids, np.int32), np.asarray(mask, np.int32),
                          min(response_start, len(ids)))
