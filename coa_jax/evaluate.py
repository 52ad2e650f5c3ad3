"""Evaluation: run a policy (a checkpoint with tools, or the teacher system) on tasks, k samples
each, and report pass@1, avg@k, pass@k (unbiased), majority-vote best-of-k, tokens and tool
calls per task, the format-error rate and finish reasons.

Task files (local only), by extension and fields:
- JSONL of {"question", ...} (ours; answers in `answer` / `metadata.ground_truth`), including
  the reference release's plain QA JSONL ({"question", "answer": str | list, "data_source"});
- parquet rows of the reference release's RL files ({"prompt": [messages],
  "reward_model": {"ground_truth": '{"target": ...}'}, "data_source", "extra_info"});
- benchmark files (AIME, MATH500, GAIA text, HLE, BrowseComp, WebWalker) as JSONL or parquet
  whose question and answer sit under any of the usual names (`problem`, `Question`, ...);
- LiveCodeBench rows ({"question_content", "public_test_cases": JSON of stdin tests}), scored
  by the code reward;
- prepared TFDS datasets (`tfds:trivia_qa/rc.nocontext:validation`,
  `tfds:natural_questions_open:validation`), when the `tfds` extra is installed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from typing import Any, Iterable, Sequence

import jax

from coa_jax import coa_format, distributed, importers, rewards
from coa_jax.model import ConfigError
from coa_jax.rollout import Task, check_prompt_lengths

_QUESTION_KEYS = ("question", "Question", "problem", "Problem", "question_content", "prompt",
                  "query", "input")
_ANSWER_KEYS = ("answer", "Answer", "Final answer", "final_answer", "ground_truth", "solution",
                "target", "gold")


@dataclasses.dataclass(frozen=True)
class Sample:
  """One sampled solution's outcome."""

  correct: bool
  answer: str | None
  tokens: int  # response tokens
  tool_calls: dict[str, int]
  format_errors: int
  finish_reason: str = "answer"
  text: str = ""  # the response, for reading failures in samples.jsonl


def pass_at_k(n: int, c: int, k: int) -> float:
  """Returns the unbiased estimate of pass@k from n samples of which c are correct:
  1 - C(n - c, k) / C(n, k)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(samples: Sequence[Sample]) -> bool:
  """Returns whether the most frequent normalized answer (ties: the first seen) is correct."""
  votes: dict[str, list[Sample]] = {}
  for sample in samples:
    if sample.answer is not None:
      votes.setdefault(rewards.normalize_text(sample.answer), []).append(sample)
  if not votes:
    return False
  best = max(votes.values(), key=len)  # max keeps the first of equal counts
  return best[0].correct


def summarize(outcomes: dict[str, Sequence[Sample]], k: int) -> dict[str, Any]:
  """Returns the metrics of per-task samples (each task with the same n >= k samples)."""
  if not outcomes:
    raise ValueError("no tasks to summarize")
  tasks = len(outcomes)
  samples = [s for group in outcomes.values() for s in group]
  calls: collections.Counter = collections.Counter()
  for s in samples:
    calls.update(s.tool_calls)
  per_task = lambda values: sum(values) / tasks
  return {
      "tasks": tasks, "samples_per_task": len(samples) / tasks,
      "pass@1": per_task(pass_at_k(len(g), sum(s.correct for s in g), 1)
                         for g in outcomes.values()),
      f"avg@{k}": per_task(sum(s.correct for s in g[:k]) / k for g in outcomes.values()),
      f"pass@{k}": per_task(pass_at_k(len(g), sum(s.correct for s in g), k)
                            for g in outcomes.values()),
      f"maj@{k}": per_task(majority_correct(g[:k]) for g in outcomes.values()),
      "tokens_per_task": sum(s.tokens for s in samples) / len(samples),
      "tool_calls_per_task": sum(calls.values()) / len(samples),
      "tool_calls_by_kind": {kind: n / len(samples) for kind, n in sorted(calls.items())},
      "format_error_rate": sum(s.format_errors > 0 for s in samples) / len(samples),
      "finish_reasons": dict(collections.Counter(s.finish_reason for s in samples)),
  }


def pass_at_1_by(outcomes: dict[str, Sequence[Sample]],
                 group_of: dict[str, str]) -> dict[str, float]:
  """Returns pass@1 over the tasks of each group (e.g. the embedded world's task families)."""
  groups: dict[str, list[float]] = collections.defaultdict(list)
  for task_id, samples in outcomes.items():
    if task_id in group_of:
      groups[group_of[task_id]].append(sum(s.correct for s in samples) / len(samples))
  return {group: sum(values) / len(values) for group, values in sorted(groups.items())}


def format_table(rows: dict[str, dict[str, Any]], k: int) -> str:
  """Returns a text table of several systems' metrics (one row each)."""
  columns = ["pass@1", f"avg@{k}", f"pass@{k}", f"maj@{k}", "tokens_per_task",
             "tool_calls_per_task", "format_error_rate"]
  width = max(len(name) for name in rows) + 2
  lines = [f"{'system':<{width}}" + "".join(f"{c:>21}" for c in columns)]
  for name, metrics in rows.items():
    cells = [f"{metrics[c]:>21.3f}" if metrics[c] < 10 else f"{metrics[c]:>21,.0f}"
             for c in columns]
    lines.append(f"{name:<{width}}" + "".join(cells))
  return "\n".join(lines)


def sample_from_response(text: str, tokens: int, tool_calls: dict[str, int],
                         finish_reason: str, reward: rewards.Reward) -> Sample:
  """Returns the outcome of one response text scored by `reward`."""
  _, errors = coa_format.parse_and_validate(text)
  return Sample(reward.correct, reward.details.get("answer"), tokens, dict(tool_calls),
                len(errors), finish_reason, text)


# --- task files ----------------------------------------------------------------------------


def _rows(path: str) -> Iterable[Any]:
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
  return importers.read_records(path)


def task_from_row(row: dict[str, Any], number: int) -> Task:
  """Returns the Task of one task-file row in any of the supported layouts."""
  data = {k: v for k, v in row.items() if k not in ("steps", "system")}
  data.update(row.get("metadata") or {})
  prompt = row.get("prompt")
  if isinstance(prompt, (list, tuple)):  # the reference RL rows: chat messages
    question = next((m.get("content") for m in reversed(prompt) if m.get("role") == "user"), None)
    truth = (row.get("reward_model") or {}).get("ground_truth")
    data["ground_truth"] = rewards.gold_answers(truth)
  else:
    question = next((row[k] for k in _QUESTION_KEYS if isinstance(row.get(k), str)), None)
    if row.get("public_test_cases"):  # LiveCodeBench: stdin/stdout tests
      cases = row["public_test_cases"]
      cases = json.loads(cases) if isinstance(cases, str) else cases
      data.update(domain="code", ground_truth="tests", tests=[
          {"stdin": c["input"], "stdout": c["output"]} for c in cases
          if c.get("testtype", "stdin") == "stdin"])
      if not data["tests"]:
        raise ConfigError(f"task {number}: no stdin test cases (functional tests are not run)")
    if "ground_truth" not in data:
      answer = next((row[k] for k in _ANSWER_KEYS if row.get(k) is not None), None)
      data["ground_truth"] = answer
  if not isinstance(question, str) or not question.strip():
    raise ConfigError(f"task {number}: no question under any of {_QUESTION_KEYS} or prompt "
                      f"messages")
  if data.get("ground_truth") in (None, [], ""):
    raise ConfigError(f"task {number}: no answer under any of {_ANSWER_KEYS} or "
                      f"reward_model.ground_truth")
  if not question.lstrip().startswith("Question:"):
    question = f"Question: {question.strip()}"
  return Task(str(row.get("id", row.get("task_id", number))), question, data)


def _text(value: Any) -> str:
  return value.decode() if isinstance(value, bytes) else str(value)


def load_tfds_tasks(name: str, split: str, limit: int = 0,
                    data_dir: str | None = None) -> list[Task]:
  """Returns QA / math tasks from a prepared TFDS dataset read with `tfds.data_source` (no
  TensorFlow needed): `question` plus an `answer` that is text (a `#### n` tail is the math
  answer, as in GSM8K), a list of texts (natural_questions_open) or a dict of `aliases` /
  `value` (trivia_qa)."""
  import tensorflow_datasets as tfds

  source = tfds.data_source(name, split=split, data_dir=data_dir)
  tasks = []
  for index in range(min(len(source), limit or len(source))):
    example = source[index]
    answer, domain = example["answer"], "qa"
    if isinstance(answer, dict):
      golds = [_text(a) for a in answer.get("aliases", [])] or [_text(answer.get("value", ""))]
    elif isinstance(answer, (str, bytes)):
      text = _text(answer)
      golds, domain = ([text.rsplit("####", 1)[1].strip()], "math") if "####" in text else (
          [text], "qa")
    else:
      golds = [_text(a) for a in answer]
    tasks.append(Task(f"{name}:{split}:{index}", f"Question: {_text(example['question'])}",
                      {"domain": domain, "ground_truth": golds, "data_source": name}))
  if not tasks:
    raise ConfigError(f"TFDS {name}:{split} has no examples")
  return tasks


def load_tasks(path: str, limit: int = 0) -> list[Task]:
  """Returns the tasks of a local task file (JSONL or parquet, see the module docstring), or
  of a prepared TFDS dataset named `tfds:<name>:<split>`."""
  if path.startswith("tfds:"):
    _, name, split = path.split(":", 2)
    return load_tfds_tasks(name, split, limit)
  if not os.path.isfile(path):
    raise ConfigError(f"task file {path!r} does not exist")
  tasks = []
  for number, row in enumerate(_rows(path) if os.path.getsize(path) else [], 1):
    if not isinstance(row, dict):
      raise ConfigError(f"{path}:{number}: not a JSON object"
                        f"{' (not JSON)' if row is importers.BAD_JSON else ''}")
    tasks.append(task_from_row(row, number))
    if limit and len(tasks) == limit:
      break
  if not tasks:
    raise ConfigError(f"task file {path!r} has no tasks")
  return tasks


# --- runners -------------------------------------------------------------------------------


def evaluate_rollouts(engine: Any, tokenizer: Any, tasks: Sequence[Task],
                      rewarder: rewards.Rewarder) -> dict[str, list[Sample]]:
  """Returns each task's samples from a Rollout engine (its group size is k)."""
  outcomes: dict[str, list[Sample]] = {}
  for group in engine.run(tasks):
    for record in group:
      text = record.response_text(tokenizer)
      reward = rewarder(text, record.task_data)
      outcomes.setdefault(record.task_id, []).append(sample_from_response(
          text, record.response_len, record.tool_calls, record.finish_reason, reward))
  return outcomes


def evaluate_teacher(teachers: Sequence[Any], tasks: Sequence[Task], system_prompt: str,
                     rewarder: rewards.Rewarder, tokenizer: Any) -> dict[str, list[Sample]]:
  """Returns each task's samples from teacher systems (one sample per teacher, e.g. seeds);
  tokens are the multi-agent system's whole message traffic, in `tokenizer` tokens."""
  from coa_jax.distill import to_trajectory

  outcomes: dict[str, list[Sample]] = {}
  for task in tasks:
    record = {"id": task.id, "question": task.question, "metadata": task.data}
    for teacher in teachers:
      try:
        trace = teacher.run(record)
      except Exception:  # noqa: BLE001 - a task the teacher cannot solve is a failed sample
        outcomes.setdefault(task.id, []).append(Sample(False, None, 0, {}, 1, "error"))
        continue
      text = to_trajectory(trace, system_prompt).response_text()
      traffic = "\n".join(m.content for a in trace.activations
                          for m in a.inputs + [a.output]) + "".join(
                              a.tool_result or "" for a in trace.activations)
      calls = collections.Counter(a.step for a in trace.activations if a.tool_call is not None)
      outcomes.setdefault(task.id, []).append(sample_from_response(
          text, len(tokenizer.encode(traffic)), calls, "answer", rewarder(text, task.data)))
  return outcomes


def _copy_probe(engine: Any, tokenizer: Any, path: str, max_len: int,
                temperature: float) -> dict[str, float]:
  """Returns the copy probe (coa_jax.copy_probe) of the engine's model on the trajectories in
  `path`, its sampled rates at the evaluation's temperature."""
  from coa_jax import copy_probe, data_pipeline
  from coa_jax.importers import DropCounter

  trajectories = data_pipeline.load_source(path, DropCounter())
  examples = copy_probe.copy_examples(trajectories, tokenizer, max_len)
  return copy_probe.copy_accuracy(engine.sampler.model, engine.params, examples,
                                  temperature=temperature)


def run(config: Any) -> dict[str, Any]:
  """Evaluates config.system ("model": a checkpoint with tools, or "teacher") on config.tasks
  with k samples per task; prints the table and writes metrics.json and samples.jsonl."""
  from coa_jax import rollout_job
  from coa_jax.metrics import say
  from coa_jax.teacher import ScriptedTeacher, TeacherConfig
  from tools_env import registry as tools_registry

  tasks = load_tasks(config.tasks, config.max_tasks)
  rewarder = rewards.build_rewarder(config.rewards.to_dict())
  k = config.k
  say(f"evaluating {config.system} on {len(tasks)} tasks x {k} samples from {config.tasks}")
  if config.system == "teacher":
    tools = tools_registry.build_registry(config.tools.to_dict())
    teachers = [ScriptedTeacher(tools, TeacherConfig(**{**config.teacher, "seed": seed}))
                for seed in range(k)]
    outcomes = evaluate_teacher(teachers, tasks, config.system_prompt, rewarder,
                                rollout_job.load_tokenizer(config))
  elif config.system == "model":
    config.rollout.group_size = k
    tokenizer = rollout_job.load_tokenizer(config)  # checked before the model loads
    check_prompt_lengths(tokenizer, config.system_prompt, tasks,
                         config.rollout.max_prompt_tokens)
    engine, _ = rollout_job.build(config, tokenizer)
    if config.get("copy_probe"):
      probe = _copy_probe(engine, tokenizer, config.copy_probe,
                          config.rollout.max_prompt_tokens + config.rollout.max_response_tokens,
                          config.sampling.temperature)
    mine = tasks[jax.process_index()::jax.process_count()]  # each host its share
    outcomes = evaluate_rollouts(engine, tokenizer, mine, rewarder)
    outcomes = {task_id: [Sample(**s) for s in samples]
                for part in distributed.gather_json(
                    {t: [dataclasses.asdict(s) for s in v] for t, v in outcomes.items()})
                for task_id, samples in part.items()}
  else:
    raise ConfigError(f"evaluate system={config.system!r}: expected 'model' or 'teacher'")
  metrics = summarize(outcomes, k)
  families = {task.id: task.data["family"] for task in tasks if "family" in task.data}
  if families:
    metrics["pass@1_by_family"] = pass_at_1_by(outcomes, families)
    say("pass@1 by task family: " + ", ".join(
        f"{family} {value:.3f}" for family, value in metrics["pass@1_by_family"].items()))
  if config.system == "model" and config.get("copy_probe"):
    metrics.update(probe)
    say(f"copy probe (teacher-forced, {probe['copy_steps']:.0f} held-out answers copied from an "
        f"observation, {probe['calls']:.0f} tool calls): exact {probe['copy_exact']:.3f} / "
        f"{probe['call_exact']:.3f}, sampled at T={config.sampling.temperature} "
        f"{probe['copy_sampled']:.3f} / {probe['call_sampled']:.3f}")
  say(format_table({config.system: metrics}, k))
  if jax.process_index():  # process 0 writes
    return metrics
  os.makedirs(config.output_dir, exist_ok=True)
  with open(os.path.join(config.output_dir, "metrics.json"), "w") as f:
    json.dump(metrics, f, indent=1)
  with open(os.path.join(config.output_dir, "samples.jsonl"), "w") as f:
    for task_id, samples in outcomes.items():
      f.write(json.dumps({"task_id": task_id, "samples": [dataclasses.asdict(s)
                                                          for s in samples]}) + "\n")
  return metrics
