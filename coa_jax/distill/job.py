"""Distillation: teacher traces -> CoA trajectories -> progressive filtering -> SFT data.

Each agent activation of a trace becomes one step (a tool agent's also brings its
observation). The filter stages run in order, each on what the previous kept, with counts:

1. `correct`: the final answer is right (the task's reward checker);
2. `format`: the response parses and follows the transition rules;
3. `complexity`: the number of tool calls and of steps lies in the configured range;
4. `quality`: no duplicated tool call, a reflection after every error the trace recovered
   from (a failed tool call or a rejected double check), and no skipped verification (the
   answer follows a double check).

`run(config)` is the job behind `experiments/distill.py`: build the embedded world (or the
config's `environment`: a user's tasks and tools), run the teacher (the scripted one, or the
config's `teacher.hook`) on its training tasks, filter, and write the trajectory JSONL SFT reads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

from coa_jax.data import coa_format, rewards
from coa_jax.data.coa_format import OBSERVATION, Trajectory
from coa_jax.data.tasks import Task, load_tasks
from coa_jax.data.tokenizer import declared_tags
from coa_jax.data.world import World, WorldConfig, load_tools_spec
from coa_jax.distill.teacher import TeacherConfig, Trace, build_teacher, to_trajectory
from coa_jax.model.config import ConfigError
from coa_jax.runtime.cache import write_json, write_jsonl
from coa_jax.runtime.distributed import say
from coa_jax.runtime.paths import local
from coa_jax.runtime.settings import build
from tools_env import registry as tools_registry
from tools_env.base import import_object

STAGES = ("correct", "format", "complexity", "quality")
DEFAULT_REWARDS = {"domains": {"math": {"kind": "math"}, "qa": {"kind": "qa"}},
                   "default_domain": "qa"}


@dataclasses.dataclass(frozen=True)
class EnvironmentSettings:
  """A user's environment: `build`, the import path of build(directory, **options) -> {"train",
  "heldout", "tools": paths}."""

  build: str
  options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FilterConfig:
  """The complexity range a kept trajectory must lie in."""

  min_tool_calls: int = 1
  max_tool_calls: int = 12
  max_steps: int = 48

  def __post_init__(self):
    if not 0 <= self.min_tool_calls <= self.max_tool_calls or self.max_steps < 1:
      raise ValueError(f"filters: need 0 <= min_tool_calls <= max_tool_calls and "
                       f"max_steps >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class DistillSettings:
  """Everything a distillation reads (configs/distill_tiny.py shows every key): the embedded
  world, or a user's `environment`, its tasks and tools; the teacher; the filters; `tools`, a
  tool spec that replaces the world's or environment's tools.json (None: that file);
  `rewards`, the spec of the `correct` stage's rewards (None: math and QA by domain)."""

  output_dir: str
  system_prompt: str
  world: WorldConfig = WorldConfig()
  teacher: TeacherConfig = TeacherConfig()
  filters: FilterConfig = FilterConfig()
  workers: int = 4
  environment: EnvironmentSettings | None = None
  tools: dict[str, Any] | None = None
  rewards: dict[str, Any] | None = None

  def __post_init__(self):
    if self.workers < 1:
      raise ConfigError(f"workers={self.workers}: expected >= 1")


def distill_settings(config: Any, where: str = "distill") -> DistillSettings:
  """Returns a distillation config's settings; raises ConfigError naming `where`.key for an
  unknown key, a wrong type or a bad value."""
  return build(DistillSettings, config, where)


def _score(text: str) -> int | None:
  found = re.search(r"Score:\s*([1-4])", text)
  return int(found.group(1)) if found else None


def quality_problem(trajectory: Trajectory) -> str | None:
  """Returns why a trajectory fails the quality stage, or None."""
  steps = trajectory.steps
  calls = [(s.tag, " ".join(s.content.split()).lower()) for s in steps if s.is_tool]
  if len(calls) != len(set(calls)):
    return "duplicate_call"
  for i, step in enumerate(steps):
    failed_tool = step.tag == OBSERVATION and step.content.lstrip().startswith("Error")
    rejected = step.tag == "double_check" and (_score(step.content) or 4) <= 2
    if (failed_tool or rejected) and not any(s.tag == "reflection" for s in steps[i + 1:]):
      return "no_reflection_after_error"
  answers = [i for i, s in enumerate(steps) if s.tag == "answer"]
  if not answers or answers[-1] == 0 or steps[answers[-1] - 1].tag != "double_check":
    return "verification_skipped"
  return None


class Distiller:
  """The four filter stages over trajectories; `filter` returns what survives and a report."""

  def __init__(self, filters: FilterConfig = FilterConfig(),
               rewarder: rewards.Rewarder | None = None,
               task_data: Mapping[str, Mapping[str, Any]] | None = None):
    """`task_data`: each task's data by task id, what the `correct` stage's reward sees, as
    RL's and the evaluation's do (default: each trajectory's metadata)."""
    self.filters = filters
    self.rewarder = rewarder or rewards.build_rewarder(DEFAULT_REWARDS)
    self.task_data = task_data or {}

  def problem(self, stage: str, trajectory: Trajectory) -> str | None:
    """Returns why `trajectory` fails `stage`, or None when it passes."""
    text = trajectory.response_text()
    if stage == "correct":
      data = self.task_data.get(trajectory.metadata.get("task_id"), trajectory.metadata)
      reward = self.rewarder(text, data)
      return None if reward.correct else "wrong_answer"
    if stage == "format":
      _, errors = coa_format.parse_and_validate(text, True, self.rewarder.tool_tags)
      return errors[0].kind if errors else None
    if stage == "complexity":
      calls = sum(s.is_tool for s in trajectory.steps)
      if not self.filters.min_tool_calls <= calls <= self.filters.max_tool_calls:
        return "tool_calls_out_of_range"
      return "too_many_steps" if len(trajectory.steps) > self.filters.max_steps else None
    return quality_problem(trajectory)

  def progressive(self, trajectories: Iterable[Trajectory]
                  ) -> Iterator[tuple[str, list[Trajectory], dict[str, int]]]:
    """Yields, stage by stage, the stage, the trajectories that passed it and every stage
    before, and why the others were dropped (the trajectory-quality ablation trains on each)."""
    kept = list(trajectories)
    for stage in STAGES:
      survivors, reasons = [], {}
      for trajectory in kept:
        problem = self.problem(stage, trajectory)
        if problem is None:
          survivors.append(trajectory)
        else:
          reasons[problem] = reasons.get(problem, 0) + 1
      yield stage, survivors, reasons
      kept = survivors

  def filter(self, trajectories: Iterable[Trajectory]) -> tuple[list[Trajectory], dict]:
    """Returns the trajectories that pass every stage, and per stage: kept, dropped, reasons."""
    kept = list(trajectories)
    report = {"input": len(kept), "stages": []}
    for stage, survivors, reasons in self.progressive(kept):
      report["stages"].append({"stage": stage, "in": len(kept), "kept": len(survivors),
                               "dropped": len(kept) - len(survivors), "reasons": reasons})
      kept = survivors
    report["output"] = len(kept)
    return kept, report


class DistillError(RuntimeError):
  """Distillation kept no trajectory: there is nothing to train on."""


def nothing_kept(report: dict, tasks: Sequence[Task], failures: int, task_file: str,
                 traces_file: str) -> str:
  """Returns why a distillation kept no trajectory: what the teacher solved, each stage's drop
  reasons, and where the rewards looked for the truth."""
  correct = report["stages"][0]
  drops = "; ".join(f"{row['stage']}: {row['reasons']}" for row in report["stages"]
                    if row["dropped"])
  first = tasks[0]
  return (f"distillation kept no trajectory of {len(tasks)} tasks ({task_file}): the teacher "
          f"solved {correct['kept']} of {correct['in']} it answered ({failures} runs failed); "
          f"dropped by stage: {drops or 'none'}. The rewards read a task's truth from its data's "
          f"`ground_truth` (taken from a row's `answer`, `ground_truth` or "
          f"`metadata.ground_truth`) and its domain from `domain` / `data_source`: task "
          f"{first.id!r} has ground_truth={first.data.get('ground_truth')!r}, "
          f"domain={first.data.get('domain', first.data.get('data_source'))!r}. The teacher's "
          f"traces are in {traces_file}.")


def format_report(report: dict) -> str:
  """Returns the stage-by-stage table of a filter report (counts and retention)."""
  lines = [f"{'stage':<11} {'in':>6} {'kept':>6} {'dropped':>8} {'retention':>10}  reasons"]
  for row in report["stages"]:
    retention = row["kept"] / max(row["in"], 1)
    lines.append(f"{row['stage']:<11} {row['in']:>6} {row['kept']:>6} {row['dropped']:>8} "
                 f"{retention:>10.1%}  {row['reasons'] or ''}")
  lines.append(f"overall: {report['output']} of {report['input']} "
               f"({report['output'] / max(report['input'], 1):.1%})")
  return "\n".join(lines)


def solve(teacher: Any, tasks: Sequence[dict[str, Any]],
          workers: int) -> tuple[list[Trace], int]:
  """Returns the teacher's traces of `tasks` (in task order) and the number it failed on."""
  traces, failures, start = [], 0, time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for done, future in enumerate([pool.submit(teacher.run, t) for t in tasks], 1):
      try:
        traces.append(future.result())
      except Exception as e:  # noqa: BLE001 - a failed task is counted, not fatal
        failures += 1
        say(f"teacher failed on a task: {type(e).__name__}: {e}")
      if done % 200 == 0 or done == len(tasks):
        rate = done / (time.perf_counter() - start)
        say(f"teacher: {done}/{len(tasks)} tasks  {rate:.1f} tasks/s  "
            f"ETA {(len(tasks) - done) / rate:.0f}s")
  return traces, failures


def environment(settings: DistillSettings) -> tuple[dict[str, str], dict[str, list[Task]]]:
  """Writes the task files and the tool spec of the settings' `environment` (the task files in
  any layout `coa_jax.data.tasks` reads), else of the embedded world, under output_dir/world;
  returns (the paths, the tasks by split, read as every later stage reads them)."""
  directory, env = os.path.join(settings.output_dir, "world"), settings.environment
  if env is None:
    world = World(settings.world)
    paths = world.write(directory)
    say(f"world: {len(world.by_name)} entities, {len(world.tasks['train'])} train / "
        f"{len(world.tasks['heldout'])} held-out tasks -> {directory}")
  else:
    paths = import_object(env.build, "environment.build")(directory, **env.options)
    missing = {"train", "heldout", *(() if settings.tools else ("tools",))} - set(paths)
    if missing:
      raise ValueError(f"environment.build {env.build!r} returned no {sorted(missing)} "
                       f"path(s)")
  tasks = {split: load_tasks(paths[split]) for split in ("train", "heldout")}
  if env is not None:
    say(f"environment {env.build}: {len(tasks['train'])} train / {len(tasks['heldout'])} "
        f"held-out tasks -> {directory}")
  return paths, tasks


def tool_spec(settings: DistillSettings, paths: dict[str, str]) -> dict[str, Any]:
  """Returns the tools the teacher calls: the settings' `tools` when they declare them (they
  replace the world's or environment's tools.json), else that tools.json."""
  return settings.tools or load_tools_spec(os.path.dirname(paths["tools"]))


def run(config: Any) -> dict[str, Any]:
  """Builds the world (or environment), runs the teacher on its training tasks with its tools
  (`tool_spec`), filters, writes the data. `config`: a ConfigDict (checked by
  `distill_settings`) or DistillSettings."""
  settings = distill_settings(config)
  os.makedirs(local(settings.output_dir, "output_dir"), exist_ok=True)
  paths, tasks = environment(settings)
  tools_spec = tool_spec(settings, paths)
  rewarder = rewards.build_rewarder(settings.rewards or DEFAULT_REWARDS,
                                    declared_tags(tools_spec))
  teacher_config, workers, prompt = settings.teacher, settings.workers, settings.system_prompt
  with tools_registry.build_registry(tools_spec) as tools:
    traces, failures = solve(build_teacher(tools, teacher_config),
                             [task.record() for task in tasks["train"]], workers)
    # The error-free teacher on the held-out tasks: the copy probe's data (coa_jax.copy_probe).
    clean = dataclasses.replace(teacher_config, vague_query_rate=0.0, misread_rate=0.0,
                                skip_verify_rate=0.0, mental_math_rate=0.0)
    heldout, _ = solve(build_teacher(tools, clean), [task.record() for task in tasks["heldout"]],
                       workers)
  trajectories = [to_trajectory(trace, prompt) for trace in traces]
  kept, report = Distiller(settings.filters, rewarder,
                           {task.id: task.data for task in tasks["train"]}).filter(trajectories)
  say(format_report(report))
  out = {name: os.path.join(settings.output_dir, file) for name, file in (
      ("traces", "traces.jsonl"), ("trajectories", "trajectories.jsonl"),
      ("heldout_trajectories", "heldout_trajectories.jsonl"), ("report", "distill_report.json"))}
  # Each file atomically, the report last: a killed run leaves no half file, and no report.
  write_jsonl(out["heldout_trajectories"],
              (to_trajectory(trace, prompt).to_json() for trace in heldout))
  write_jsonl(out["traces"], (trace.to_json() for trace in traces))
  if not kept:
    raise DistillError(nothing_kept(report, tasks["train"], failures, paths["train"],
                                    out["traces"]))
  write_jsonl(out["trajectories"], (t.to_json() for t in kept))
  summary = {**report, "teacher_failures": failures, "world": paths, **out,
             "teacher_accuracy": report["stages"][0]["kept"] / max(len(traces), 1),
             "teacher_tokens_per_task": sum(t.tokens for t in traces) / max(len(traces), 1)}
  write_json(out["report"], summary)
  say(f"wrote {len(kept)} trajectories to {out['trajectories']}")
  return summary
