"""Evaluation: run a policy (a checkpoint with tools, or the teacher system) on tasks, k samples
each, and report pass@1, avg@k, pass@k (unbiased), majority-vote best-of-k, tokens and tool
calls per task, the format-error rate and finish reasons, and the test-time scaling curves
(pass@j and maj@j for j = 1..k, `scaling.curves`).

Task files: `coa_jax.data.tasks`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax

from coa_jax.data import World, WorldConfig, coa_format, rewards
from coa_jax.data.tasks import Task, load_tasks
from coa_jax.data.tokenizer import load_tokenizer
from coa_jax.distill.teacher import build_teacher, to_trajectory
from coa_jax.evaluation.scaling import answer_groups, curves, pass_at_k
from coa_jax.evaluation.settings import EvaluationSettings, evaluation_settings
from coa_jax.model import ConfigError
from coa_jax.rollout import settings as agent
from coa_jax.rollout.tool_loop import check_prompt_lengths, progress_line
from coa_jax.runtime import distributed, paths
from coa_jax.runtime.cache import write_json, write_jsonl
from coa_jax.runtime.distributed import say
from tools_env import registry as tools_registry
from tools_env import sandbox


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
  # How the grader decided (`GRADING_KEYS` of the reward's details): its method, an error (a
  # judge that could not be reached), QA's em and f1, code tests passed, the judge's reply.
  grading: dict[str, Any] = dataclasses.field(default_factory=dict)


GRADING_KEYS = ("domain", "method", "error", "error_kind", "em", "f1", "passed", "total", "reply")


def majority_correct(samples: Sequence[Sample]) -> bool:
  """Returns whether the most frequent answer (`answer_groups`; ties: the first seen) is
  correct."""
  votes = answer_groups(samples)
  if not votes:
    return False
  best = max(votes, key=len)  # max keeps the first of equal counts
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


def invented_number_rates(outcomes: dict[str, Sequence[Sample]], tasks: Sequence[Task],
                          tool_tags: tuple[str, ...]) -> dict[str, float]:
  """Returns the fraction of samples whose plan or tool calls write a number from nowhere
  (`copy_probe.invented_numbers`): over every task ("all") and per task family."""
  from coa_jax.evaluation.copy_probe import invented_numbers

  flagged: dict[str, list[bool]] = collections.defaultdict(list)
  for task in tasks:
    for sample in outcomes.get(task.id, ()):
      steps, _ = coa_format.parse(sample.text, tool_tags)
      invented = bool(invented_numbers(task.question, steps))
      flagged["all"].append(invented)
      if "family" in task.data:
        flagged[task.data["family"]].append(invented)
  return {group: sum(v) / len(v) for group, v in sorted(flagged.items())}


def _check_heldout(world: World, tasks_path: str) -> None:
  """Raises ConfigError unless `tasks_path` holds the held-out split of `world`."""
  with open(tasks_path) as f:
    tasks = [json.loads(line) for line in f if line.strip()]
  if [t["question"] for t in tasks] != [t["question"] for t in world.tasks["heldout"]]:
    raise ConfigError(f"{tasks_path} is not the held-out split of the config's world: the "
                      f"main job there ran on another world")


def pass_at_1_by_page(world: WorldConfig, tasks_path: str, eval_dir: str) -> dict[str, float]:
  """Returns pass@1 over the held-out tasks grouped by where the answer's page states a
  near-miss figure ("before" or "after" the entity's own sentence, or "none"), from an
  evaluation's samples (eval_dir) and the world `world` generates, checked against the task
  file."""
  generated = World(world)
  _check_heldout(generated, tasks_path)
  page = {t["id"]: generated.near_miss(t) for t in generated.tasks["heldout"]}
  with open(os.path.join(eval_dir, "samples.jsonl")) as f:
    outcomes = {r["task_id"]: [Sample(**s) for s in r["samples"]] for r in map(json.loads, f)}
  return pass_at_1_by(outcomes, page)


def probe_trajectories(path: str, tool_tags: Sequence[str]) -> list[coa_format.Trajectory]:
  """Returns the teacher's trajectories in `path` that a probe reads, saying how many it could
  not read (a probe measured on fewer than the file holds, e.g. trajectories whose tools the
  model has no tags for, says so)."""
  from coa_jax.data import packing
  from coa_jax.data.importers import DropCounter

  counter = DropCounter()
  trajectories = packing.load_source(path, counter, tuple(tool_tags))
  if counter.kept < counter.total:
    say(f"probe data {path}: {counter.summary()}")
  return trajectories


def near_miss_chance(world: WorldConfig, tasks_path: str, trajectories_path: str,
                     tokenizer: Any, model: Any, params: Any) -> dict[str, float]:
  """Returns the near-miss probe (`copy_probe.near_miss_chance`) of a model on the held-out
  tasks whose answer's page states a near-miss figure before the entity's own, from the
  teacher's held-out trajectories (`trajectories_path`) of the world `world` generates, checked
  against the task file."""
  from coa_jax.evaluation import copy_probe

  generated = World(world)
  _check_heldout(generated, tasks_path)
  teacher = {t.question: t for t in probe_trajectories(trajectories_path, tokenizer.tool_tags)}
  pairs = []
  for task in generated.tasks["heldout"]:
    if generated.near_miss(task) == "before" and task["question"] in teacher:
      near, own = generated.near_miss_figures(task)
      pair = copy_probe.near_miss_pairs(teacher[task["question"]], tokenizer, str(near), str(own))
      pairs += [pair] if pair else []
  return copy_probe.near_miss_chance(model, params, pairs)


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
                         finish_reason: str, reward: rewards.Reward,
                         tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> Sample:
  """Returns the outcome of one response text scored by `reward`."""
  _, errors = coa_format.parse_and_validate(text, True, tool_tags)
  grading = {key: reward.details[key] for key in GRADING_KEYS if key in reward.details}
  return Sample(reward.correct, reward.details.get("answer"), tokens, dict(tool_calls),
                len(errors), finish_reason, text, grading)


# --- runners -------------------------------------------------------------------------------


def evaluate_rollouts(engine: Any, tokenizer: Any, tasks: Sequence[Task],
                      rewarder: rewards.Rewarder, every_s: float = 10.0
                      ) -> dict[str, list[Sample]]:
  """Returns each task's samples from a Rollout engine (its group size is k), printing a
  progress line (`progress_line`) at most every `every_s` seconds and after the last task."""
  outcomes: dict[str, list[Sample]] = {}
  start = last = time.perf_counter()
  tokens = 0
  hosts = "" if jax.process_count() == 1 else " (host 0's share)"
  for done, group in enumerate(engine.run(tasks), 1):
    for record in group:
      text = record.response_text(tokenizer)
      reward = rewarder(text, record.task_data, record.response_len, sum(record.loss_mask))
      outcomes.setdefault(record.task_id, []).append(sample_from_response(
          text, record.response_len, record.tool_calls, record.finish_reason, reward,
          rewarder.tool_tags))
      tokens += record.response_len
    now = time.perf_counter()
    if now - last >= every_s or done == len(tasks):
      distributed.say(f"evaluation{hosts}: "
                      f"{progress_line(done, len(tasks), tokens, now - start)}")
      last = now
  return outcomes


def evaluate_teacher(teachers: Sequence[Any], tasks: Sequence[Task], system_prompt: str,
                     rewarder: rewards.Rewarder, tokenizer: Any) -> dict[str, list[Sample]]:
  """Returns each task's samples from teacher systems (one sample per teacher, e.g. seeds);
  tokens are the multi-agent system's whole message traffic, in `tokenizer` tokens."""
  outcomes: dict[str, list[Sample]] = {}
  for task in tasks:
    record = task.record()
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
          text, len(tokenizer.encode(traffic)), calls, "answer", rewarder(text, task.data),
          rewarder.tool_tags))
  return outcomes


def _copy_probe(engine: Any, tokenizer: Any, path: str, max_len: int,
                temperature: float) -> dict[str, float]:
  """Returns the copy probe (coa_jax.copy_probe) of the engine's model on the trajectories in
  `path`, its sampled rates at the evaluation's temperature."""
  from coa_jax.evaluation import copy_probe

  trajectories = probe_trajectories(path, tokenizer.tool_tags)
  examples = copy_probe.copy_examples(trajectories, tokenizer, max_len)
  return copy_probe.copy_accuracy(engine.sampler.model, engine.params, examples,
                                  temperature=temperature)


def run(config: Any) -> dict[str, Any]:
  """Evaluates config.system ("model": a checkpoint with tools, or "teacher") on config.tasks
  with k samples per task; prints the table and writes metrics.json (with `sandbox_isolation`
  and `reward_sandbox_isolation`, the weakest isolation the code tool and the code reward ran
  under) and samples.jsonl. `config`: a ConfigDict (checked by `evaluation_settings`) or
  EvaluationSettings."""
  settings = evaluation_settings(config)
  paths.local(settings.output_dir, "output_dir")

  def tasks_rewarder_tokenizer() -> tuple[list[Task], rewards.Rewarder, Any]:
    tasks = load_tasks(settings.tasks, settings.max_tasks)
    # The model's saved tags (no tool server starts for them), else the declared tools'.
    tokenizer = load_tokenizer(settings.tokenizer, settings.model.checkpoint, settings.tools)
    rewarder = rewards.build_rewarder(settings.rewards, tokenizer.tool_tags)
    rewarder.check(tasks)
    return tasks, rewarder, tokenizer

  tasks, rewarder, tokenizer = distributed.agreed(tasks_rewarder_tokenizer,
                                                  "loading the tasks, the rewards, the tokenizer")
  k, probe = settings.k, {}
  say(f"evaluating {settings.system} on {len(tasks)} tasks x {k} samples from {settings.tasks}")
  if settings.system == "teacher":
    outcomes, isolation = distributed.agreed(  # host-side work, the same on every host
        lambda: _teacher_outcomes(settings, tasks, rewarder, tokenizer),
        "the teacher's evaluation")
  else:
    outcomes, isolation, probe = _model_outcomes(settings, tasks, rewarder, tokenizer)
  # In task-file order: groups finish in an order that tool and thread timing move, and the
  # metrics' float sums (and samples.jsonl) must not depend on it.
  outcomes = {task.id: outcomes[task.id] for task in tasks if task.id in outcomes}
  reward_isolation = sandbox.weakest(distributed.gather_json(rewarder.sandbox_isolation()))
  metrics = {**summarize(outcomes, k), "sandbox_isolation": isolation,
             "reward_sandbox_isolation": reward_isolation,
             "curves": curves(outcomes, range(1, k + 1)),  # test-time scaling
             "tool_tags": list(rewarder.tool_tags)}  # what the responses were read with
  families = {task.id: task.data["family"] for task in tasks if "family" in task.data}
  if families:
    metrics["pass@1_by_family"] = pass_at_1_by(outcomes, families)
    say("pass@1 by task family: " + ", ".join(
        f"{family} {value:.3f}" for family, value in metrics["pass@1_by_family"].items()))
  metrics["invented_numbers"] = invented_number_rates(outcomes, tasks, rewarder.tool_tags)
  say("samples writing a number from nowhere in a plan or a tool call: " + ", ".join(
      f"{group} {value:.3f}" for group, value in metrics["invented_numbers"].items()))
  if probe:
    metrics.update(probe)
    say(f"copy probe (teacher-forced, {probe['copy_steps']:.0f} held-out answers copied from an "
        f"observation / {probe['calls']:.0f} tool calls / {probe['question_copies']:.0f} "
        f"question items a call writes): exact {probe['copy_exact']:.3f} / "
        f"{probe['call_exact']:.3f} / {probe['question_exact']:.3f}, sampled at "
        f"T={settings.sampling.temperature} {probe['copy_sampled']:.3f} / "
        f"{probe['call_sampled']:.3f} / {probe['question_sampled']:.3f}; question copies "
        f"sampled exactly less than 9 times in 10: {probe['question_unsure']:.3f}")
  say(format_table({settings.system: metrics}, k))
  # Process 0 writes (atomically: a killed run leaves no half file that looks done); every
  # process waits for it, as callers read the files on every host, and a failed write ends all.
  distributed.agreed(
      lambda: jax.process_index() or _write(settings.output_dir, metrics, outcomes),
      f"writing the evaluation to {settings.output_dir}")
  if jax.process_index() == 0:  # the samples as a page to read (a failure is only printed)
    from coa_jax.evaluation import viewer
    viewer.logged(viewer.write_page, settings.output_dir, tasks=settings.tasks)
  return metrics


def _teacher_outcomes(settings: EvaluationSettings, tasks: list[Task], rewarder: rewards.Rewarder,
                      tokenizer: Any) -> tuple[dict[str, list[Sample]], str]:
  """Returns the teacher system's samples (k seeds) and the isolation its code tool ran under."""
  with tools_registry.build_registry(settings.tools) as tools:
    teachers = [build_teacher(tools, dataclasses.replace(settings.teacher, seed=seed))
                for seed in range(settings.k)]
    return (evaluate_teacher(teachers, tasks, settings.system_prompt, rewarder, tokenizer),
            sandbox.isolation_of(tools.tools))


def _model_outcomes(settings: EvaluationSettings, tasks: list[Task], rewarder: rewards.Rewarder,
                    tokenizer: Any) -> tuple[dict[str, list[Sample]], str, dict[str, float]]:
  """Returns the model's samples (k a task, each host rolling out its share), the weakest
  isolation any host's code tool ran under, and the copy probe's rates ({}: no probe)."""
  rollout = dataclasses.replace(settings.rollout, group_size=settings.k)
  distributed.agreed(  # checked before the model loads
      lambda: check_prompt_lengths(tokenizer, settings.system_prompt, tasks,
                                   rollout.max_prompt_tokens), "checking the prompts' lengths")
  engine = agent.engine(settings, tokenizer, rollout)
  probe = {}
  if settings.copy_probe:  # on the host's own devices, as the rollouts: agreed
    probe = distributed.agreed(lambda: _copy_probe(
        engine, tokenizer, settings.copy_probe, rollout.cache_size,
        settings.sampling.temperature), "the copy probe")
  mine = tasks[jax.process_index()::jax.process_count()]  # each host its share
  try:
    outcomes = distributed.agreed(
        lambda: evaluate_rollouts(engine, tokenizer, mine, rewarder), "evaluation rollouts")
  finally:  # MCP servers stop with the job; agreed, as a gather follows
    distributed.agreed(engine.tools.close, "closing the tools")
  outcomes = {task_id: [Sample(**s) for s in samples]
              for part in distributed.gather_json(
                  {t: [dataclasses.asdict(s) for s in v] for t, v in outcomes.items()})
              for task_id, samples in part.items()}
  isolation = sandbox.weakest(distributed.gather_json(sandbox.isolation_of(engine.tools.tools)))
  return outcomes, isolation, probe


def _write(folder: str, metrics: dict[str, Any], outcomes: dict[str, list[Sample]]) -> None:
  """Writes samples.jsonl (one line per task), then metrics.json into `folder`: metrics.json
  is what callers take for a finished evaluation."""
  write_jsonl(os.path.join(folder, "samples.jsonl"),
              ({"task_id": task_id, "samples": [dataclasses.asdict(s) for s in samples]}
               for task_id, samples in outcomes.items()))
  write_json(os.path.join(folder, "metrics.json"), metrics)
