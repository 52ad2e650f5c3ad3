"""Why a seed fails: the copy probes and the sampled numbers of a finished pipeline run, per task
family.

For each seed and model (after SFT, after DAPO): the copy probe (observation -> answer, tool
calls, question -> tool call; `copy_probe.copy_accuracy`) on the held-out teacher trajectories
of each family, and the share of the evaluation's samples that write a number from nowhere in
a plan or a tool call (`copy_probe.invented_numbers`), split by the step that first wrote it,
with where the long ones come from (a garbled copy of a number seen, a training figure).
`experiments/diagnose.py` runs it over a run folder.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Callable, Sequence

from coa_jax.data import coa_format
from coa_jax.data.coa_format import Trajectory
from coa_jax.data.importers import DropCounter
from coa_jax.data.packing import load_source
from coa_jax.data.tasks import load_tasks
from coa_jax.evaluation import copy_probe
from coa_jax.model import Transformer
from coa_jax.rollout.settings import agent_tokenizer
from coa_jax.runtime import sharding
from coa_jax.runtime.hf_checkpoint import load_model

MODELS = ("sft", "dapo")


def probe_by_family(model: Any, params: Any, trajectories: Sequence[Trajectory], tokenizer: Any,
                    max_len: int, temperature: float) -> dict[str, dict[str, float]]:
  """Returns the copy probe of each task family's trajectories (metadata "family"; "all")."""
  groups: dict[str, list[Trajectory]] = collections.defaultdict(list)
  for trajectory in trajectories:
    groups["all"].append(trajectory)
    groups[trajectory.metadata.get("family", "none")].append(trajectory)
  out = {}
  for family, members in sorted(groups.items()):
    examples = copy_probe.copy_examples(members, tokenizer, max_len)
    if examples:
      out[family] = copy_probe.copy_accuracy(model, params, examples, temperature=temperature)
  return out


DISTANCES = (0, 100, 200, 300)  # bucket edges, in tokens after the prompt


def question_copies_by_distance(model: Any, params: Any, trajectories: Sequence[Trajectory],
                                tokenizer: Any, max_len: int) -> dict[str, dict[str, float]]:
  """Returns the question-copy probe's greedy exact rate of the copies that start 0-99, 100-199,
  ... tokens into the response (how far back the question lies), and their counts."""
  examples, starts = [], []
  for trajectory in trajectories:
    example = copy_probe.copy_example(trajectory, tokenizer, max_len)
    if example is not None and example.question_spans:
      examples.append(example)
      starts.append(len(tokenizer.prompt_ids(trajectory.system, trajectory.question)))
  hits: dict[int, list[bool]] = collections.defaultdict(list)
  forced = copy_probe.teacher_forced(model, params, examples, 16, 0.0)
  for start, (example, predicted_T, _) in zip(starts, forced):
    for begin, end in example.question_spans:
      edge = max(e for e in DISTANCES if e <= begin - start)
      hits[edge].append(bool((predicted_T[begin - 1:end - 1] == example.input_ids[begin:end])
                             .all()))
  return {f"{edge}+": {"exact": sum(v) / len(v), "copies": len(v)}
          for edge, v in sorted(hits.items())}


def invented_by_step(samples_path: str, tasks: dict[str, Any],
                     tool_tags: tuple[str, ...]) -> dict[str, dict[str, float]]:
  """Returns, per task family ("all" too), the share of samples (and of failed samples) that
  write a number from nowhere, and the share whose first such number is in each step tag."""
  counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  with open(samples_path) as f:
    for line in f:
      row = json.loads(line)
      task = tasks[row["task_id"]]
      for sample in row["samples"]:
        steps, _ = coa_format.parse(sample["text"], tool_tags)
        invented = copy_probe.invented_numbers(task.question, steps)
        for group in ("all", task.data.get("family", "none")):
          c = counts[group]
          c["samples"] += 1
          c["failed"] += not sample["correct"]
          if invented:
            c["invented"] += 1
            c["failed_invented"] += not sample["correct"]
            c[f"first_in_{invented[0][0]}"] += 1
  return {group: {"samples": c["samples"],
                  "invented": c["invented"] / c["samples"],
                  "failed_with_invented": c["failed_invented"] / max(c["failed"], 1),
                  **{k: v / c["samples"] for k, v in sorted(c.items()) if k.startswith("first")}}
          for group, c in sorted(counts.items())}


def edits(a: str, b: str) -> int:
  """The Levenshtein distance of two strings: the fewest insertions, deletions and substitutions
  that make one the other."""
  row = list(range(len(b) + 1))
  for i, x in enumerate(a, 1):
    previous, row[0] = row[0], i
    for j, y in enumerate(b, 1):
      previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
  return row[-1]


def invented_origins(samples_path: str, tasks: dict[str, Any], tool_tags: tuple[str, ...],
                     training_path: str, min_digits: int = 4) -> dict[str, float]:
  """Where the samples' numbers from nowhere of `min_digits` digits or more come from: the
  share that lie within two edits of a number of at least 3 digits that the question or an
  earlier step held (a garbled copy), the share that the training trajectories
  (`training_path`) write, and the share a number drawn at random with as many digits would
  have there (the training set's count of such numbers over all of them)."""
  with open(training_path) as f:
    training = copy_probe.numbers_in(f.read())
  of_length = collections.Counter(len(n) for n in training if n[0] != "0")
  counts = collections.Counter()
  with open(samples_path) as f:
    for line in f:
      row = json.loads(line)
      question = tasks[row["task_id"]].question
      for sample in row["samples"]:
        steps, _ = coa_format.parse(sample["text"], tool_tags)
        for _, number, seen in copy_probe.invented_numbers_seen(question, steps):
          if len(number) < min_digits:
            continue
          counts["numbers"] += 1
          counts["near_seen"] += any(len(m) >= 3 and edits(number, m) <= 2 for m in seen)
          counts["in_training"] += number in training
          counts["chance"] += of_length[len(number)] / (9 * 10 ** (len(number) - 1))
  n = max(counts["numbers"], 1)
  return {"numbers": counts["numbers"], "near_seen": counts["near_seen"] / n,
          "in_training": counts["in_training"] / n, "in_training_by_chance": counts["chance"] / n}


def diagnose(stages_of: Callable[[int], dict[str, Any]], seeds: Sequence[int],
             probes: bool = True) -> dict[str, Any]:
  """Returns {seed: {model: {"invented": invented_by_step, "origins": invented_origins, and with
  `probes` (which load the model) "probe": probe_by_family, "question_by_distance":
  question_copies_by_distance}}} of the finished seeds of a pipeline run; `stages_of(seed)`:
  that seed's stage settings (`pipeline.Stages.of`)."""
  out: dict[str, Any] = {}
  for seed in seeds:
    stages = stages_of(seed)
    out[str(seed)] = {}
    for name in MODELS:
      evaluate = stages[f"eval_{name}"]
      samples = os.path.join(evaluate.output_dir, "samples.jsonl")
      if not os.path.exists(samples):
        continue
      tokenizer = agent_tokenizer(evaluate)
      tasks = {t.id: t for t in load_tasks(evaluate.tasks, evaluate.max_tasks)}
      parts = out[str(seed)][name] = {
          "invented": invented_by_step(samples, tasks, tokenizer.tool_tags),
          "origins": invented_origins(samples, tasks, tokenizer.tool_tags,
                                      stages["sft"].data.path)}
      if probes:
        model_config, params = load_model(evaluate.model, tokenizer,
                                          sharding.make_mesh(evaluate.mesh))
        model = Transformer(model_config)
        trajectories = load_source(evaluate.copy_probe, DropCounter(), tokenizer.tool_tags)
        max_len = evaluate.rollout.cache_size
        parts["probe"] = probe_by_family(model, params, trajectories, tokenizer, max_len,
                                         evaluate.sampling.temperature)
        parts["question_by_distance"] = question_copies_by_distance(
            model, params, trajectories, tokenizer, max_len)
  return out
