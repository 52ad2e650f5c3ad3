"""rollouts.jsonl: an RL run's last step's scored groups, token by token, written beside its
metrics for the trajectory viewer (`coa_jax.evaluation.viewer` reads it)."""

from __future__ import annotations

from typing import Any, Sequence

from coa_jax.data.tasks import Task
from coa_jax.rl.dynamic_sampling import ScoredGroup

ROLLOUTS = "rollouts.jsonl"  # the last step's scored groups (coa_jax.evaluation.viewer reads it)
ROLLOUT_GROUPS = 16  # of this host's share of the step: what a page can hold


def rollout_rows(step: int, groups: Sequence[ScoredGroup], advantages: Any, tokenizer: Any,
                 tasks: Sequence[Task], tool_tags: Sequence[str]) -> list[dict[str, Any]]:
  """Returns the rows of rollouts.jsonl for an RL step's scored groups (the first
  ROLLOUT_GROUPS): per group its task (id, question, gold answer, family) and the run's tool
  tags (`tool_tags`, what the responses were read with), per sample its
  response text, reward (the shaped score), correctness, finish reason, tool calls and its
  response's per-token arrays: token texts, loss mask, the sampler's log-probs (to 1e-4) and
  policy versions; and the sample's advantage (`advantages`: flat over the step's samples, None
  when a critic gives token advantages)."""
  by_id = {task.id: task for task in tasks}
  rows, index = [], 0
  for group in groups[:ROLLOUT_GROUPS]:
    task = by_id.get(group.task_id)
    data = group.records[0].task_data
    samples = []
    for record, score, correct in zip(group.records, group.scores, group.correct):
      start, ids = record.prompt_len, record.ids[record.prompt_len:]
      samples.append({
          "correct": bool(correct), "reward": float(score), "finish_reason": record.finish_reason,
          "tokens": len(ids), "tool_calls": dict(record.tool_calls),
          "text": tokenizer.decode(ids),
          "token_texts": tokenizer.backend.decode_batch([[i] for i in ids],
                                                        skip_special_tokens=False),
          "loss_mask": record.loss_mask[start:],
          "logprobs": [round(float(x), 4) for x in record.logprobs[start:]],
          "versions": record.versions[start:],
          "advantage": None if advantages is None else float(advantages[index])})
      index += 1
    rows.append({"step": step, "task_id": group.task_id,
                 "question": task.question if task is not None else "",
                 "gold": data.get("ground_truth"), "family": data.get("family", ""),
                 "tool_tags": list(tool_tags), "samples": samples})
  return rows
