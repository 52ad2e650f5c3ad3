"""The end-to-end recipe: world -> distil (teacher) -> filter -> SFT -> evaluate -> DAPO ->
evaluate, and a table of the teacher system, the AFM after SFT and after DAPO on held-out
tasks.

`run(config, seeds)` is `experiments/pipeline.py`; each stage is the library job of that stage
(`distill.run`, `sft.run`, `evaluation.run`, `rl.run`) on the settings of a config derived from the
pipeline config (`Stages`: every stage's config is checked by its job's settings builder before the
first stage runs). Distillation (the world and the teacher's data) is shared by every seed and
written under config.output_dir/distill; each seed (model init, data order, sampling) trains and
evaluates under config.output_dir/seed-<seed>/<stage>. Stages whose outputs exist are reused, so a
re-run resumes where the last one stopped. On several hosts, output_dir is a folder they share:
process 0's files decide which stages are done and give every host the metrics.
results.json holds every seed's metrics, their mean and standard deviation, and the stage wall
times; results.png shows them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import ml_collections

from coa_jax import distill, evaluation, rl, sft
from coa_jax.data import load_tasks
from coa_jax.data.world import WorldConfig
from coa_jax.distill.job import distill_settings
from coa_jax.evaluation import model_settings
from coa_jax.evaluation.settings import EvaluationSettings, evaluation_settings
from coa_jax.model import ConfigError
from coa_jax.pipeline.results import (SYSTEMS, family_means, plot, results_of,
                                      write_results_page)
from coa_jax.rl import query_selection
from coa_jax.rl.query_selection import SelectionConfig
from coa_jax.rl.settings import rl_settings
from coa_jax.runtime import distributed, paths
from coa_jax.runtime.cache import (check_shared, exists, file_fingerprint, fingerprint,
                                   write_json)
from coa_jax.runtime.distributed import say
from coa_jax.runtime.settings import build, to_section
from coa_jax.sft.settings import sft_settings

StageConfigs = Callable[..., dict[str, ml_collections.ConfigDict]]
# Each stage's settings builder: a stage's config is checked by the job that runs it.
STAGE_SETTINGS = {"distill": distill_settings, "sft": sft_settings, "dapo": rl_settings,
                  "ppo": rl_settings, "eval_teacher": evaluation_settings,
                  "eval_sft": evaluation_settings, "eval_dapo": evaluation_settings}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """The held-out evaluations: `k` samples of each of the first `max_tasks` tasks, decoded
  `batch_size` rows at a time (the pipeline reads k; the evaluation stages read all three)."""

  k: int
  max_tasks: int
  batch_size: int


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
  """What the pipeline reads itself (the stages read their own: `stages`): where it writes,
  the first seed, the world (its near-miss figures add pass@1 by page), the evaluations'
  k, query selection before RL."""

  output_dir: str
  seed: int
  world: WorldConfig
  eval: EvalSettings
  selection: SelectionConfig


class Stages:
  """The pipeline's settings (`settings`) and every stage's settings for a seed (`of`), from
  the pipeline config and its `stage_configs`; the one place that reads the pipeline config."""

  def __init__(self, config: Any, stage_configs: StageConfigs):
    self._config, self.stage_configs = config, stage_configs
    self.settings = build(PipelineSettings, {
        f.name: config[f.name] for f in dataclasses.fields(PipelineSettings)
        if f.name in config}, "pipeline")

  def of(self, seed: int | None = None) -> dict[str, Any]:
    """Returns {stage name: its job's settings} for `seed` (default the first); raises
    ConfigError naming the stage and key of a stage config its job would refuse."""
    configs = self.stage_configs(self._config, seed)
    unknown = sorted(set(configs) - set(STAGE_SETTINGS))
    if unknown:
      raise ConfigError(f"stage_configs returned stages {unknown}: expected some of "
                        f"{sorted(STAGE_SETTINGS)}")
    return {name: STAGE_SETTINGS[name](cfg, name) for name, cfg in configs.items()}

  def section(self) -> dict[str, Any]:
    """Returns the pipeline config as plain values (what names a run in a cache)."""
    return self._config.to_dict()

  def moved(self, output_dir: str, seed: int) -> "Stages":
    """Returns the stages of the same recipe run from `seed` into `output_dir`."""
    config = ml_collections.ConfigDict(self.section())
    config.output_dir, config.seed = output_dir, seed
    return Stages(config, self.stage_configs)


def _stage(name: str, path: str, finished: bool) -> bool:
  """Returns whether a stage is done: its output exists and its job `finished` (a job killed
  while writing its output leaves one that must not be reused); says which. Process 0's files
  decide for every host (a host that alone skipped a stage would leave the others in its
  collectives)."""
  found = exists(path)
  if found and finished:
    say(f"== {name}: reusing {path}")
    return True
  say(f"== {name}" + (" (an earlier run was stopped before the stage finished: running it "
                      "again)" if found else ""))
  return False


def _on_process_0(read: Callable[[], Any], where: str) -> Any:
  """Returns process 0's read() on every host: the files process 0 wrote decide, and its
  failure to read them ends every host."""
  return distributed.agreed_all(lambda: read() if jax.process_index() == 0 else None, where)[0]


def _read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


class StageStopped(RuntimeError):
  """A stage returned without its output: it was stopped (a signal) and resumes on a rerun."""


# Settings of how a stage runs, not of what it makes: a finished stage is reused whatever they
# are (a run resumed on another mesh, with other logging or checkpointing). The sections by name
# (the model's `checkpoint`, a path to the weights it starts from, is not one), the values too.
EXECUTION_SECTIONS = frozenset({"mesh", "checkpoint"})
EXECUTION_VALUES = frozenset({"log_every", "workers", "xla_flags", "topology", "eval_every",
                              "track_prompts"})


def _execution(key: str, value: Any) -> bool:
  return key in EXECUTION_VALUES or (key in EXECUTION_SECTIONS and isinstance(value, dict))


def stage_section(settings: Any, output_dir: str) -> Any:
  """Returns a stage's settings as the plain values that decide its output: the execution
  settings left out (`EXECUTION_SECTIONS`, `EXECUTION_VALUES`), and paths under `output_dir`
  written relative to it (a run folder can move)."""
  roots = [root for root in (output_dir.rstrip("/"), os.path.abspath(output_dir)) if root]

  def plain(value: Any) -> Any:
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items() if not _execution(k, v)}
    if isinstance(value, list):
      return [plain(v) for v in value]
    for root in roots if isinstance(value, str) else ():
      if value == root or value.startswith(root + "/"):
        return "<output_dir>" + value[len(root):]
    return value

  return plain(json.loads(json.dumps(to_section(settings))))


def _differences(recorded: Any, now: Any, where: str = "") -> list[str]:
  """Returns "key: recorded -> now" for each setting that differs (nested keys dotted)."""
  if isinstance(recorded, dict) and isinstance(now, dict):
    return [line for key in sorted(set(recorded) | set(now), key=str) for line in _differences(
        recorded.get(key), now.get(key), f"{where}.{key}" if where else str(key))]
  return [] if recorded == now else [f"{where}: {recorded!r} -> {now!r}"]


class StageTimes:
  """The wall time of each finished stage, kept in a JSON file beside the stages' outputs (so
  a stage reused from an earlier invocation still reports the time it took when it ran), and
  with it which stages finished: a stage's job is done when its output exists and its time is
  here, written (atomically) once the job returned. Beside it, `stage_settings.json` keeps the
  settings each finished stage ran with (`stage_section`): a stage is reused only with the same
  settings, and a run folder asked to reuse a stage made with others is an error naming them."""

  def __init__(self, path: str):
    self.path = path
    self.root = os.path.dirname(path)
    self.settings_path = os.path.join(self.root, "stage_settings.json")
    self.seconds, self.settings = _on_process_0(
        lambda: [_read_json(p) if os.path.exists(p) else {} for p in (path, self.settings_path)],
        f"reading {path}")

  def check(self, name: str, settings: Any, remedy: str) -> None:
    """Raises ConfigError when the finished stage `name` ran with other settings than
    `settings` (a stage recorded without them, by older code, passes)."""
    section = stage_section(settings, self.root)
    differences = _differences(self.settings.get(name, section), section)
    if differences:
      raise ConfigError(f"{self.root} holds a finished {name} stage made with other settings "
                        f"({'; '.join(differences[:6])}{'; ...' if len(differences) > 6 else ''})"
                        f": run with another --config.output_dir, or {remedy}")

  def run(self, name: str, done: str, job: Callable[[], Any], settings: Any = None) -> None:
    """Runs `job` unless it finished in an earlier invocation and its output `done` exists;
    records its wall time under `name`, and `settings` (what the stage ran with; None: not
    checked) beside it. Raises ConfigError when the finished stage ran with other settings."""
    if _stage(name, done, name in self.seconds):
      if settings is not None:
        self.check(name, settings, f"delete that stage's output ({done}) and every later "
                                   f"stage's to run them again")
      return
    self.seconds.pop(name, None)
    start = time.perf_counter()
    job()
    # A training stage stopped by a signal (SIGTERM, Ctrl-C) saves a checkpoint and returns:
    # the run ends here rather than go on to stages that need this one's output.
    if not exists(done):  # process 0's file decides for every host (a collective)
      raise StageStopped(f"the {name} stage stopped before it finished (no {done}; a training "
                         f"stage stopped by a signal has saved a checkpoint): run the same "
                         f"command again to resume it")
    self.seconds[name] = round(time.perf_counter() - start, 1)
    if settings is not None:
      self.settings[name] = stage_section(settings, self.root)

    def write() -> None:  # a killed run leaves the last complete files
      write_json(self.settings_path, self.settings)
      write_json(self.path, self.seconds)  # the record that the stage finished: last

    distributed.agreed(lambda: jax.process_index() or write(), f"writing {self.path}")


def distill_stage(stages: dict[str, Any], times: StageTimes) -> None:
  """Runs the distillation stage unless it finished, on process 0 alone: a teacher behind an
  API is called once per task, not once per host, and every host reads the same data from the
  output folder (shared, as checkpoints need it). Agreed: an error there (a teacher, a tool,
  nothing kept) stops every host rather than leave the others waiting."""
  settings = stages["distill"]
  times.run("distill", os.path.join(settings.output_dir, "distill_report.json"),
            lambda: distributed.agreed(lambda: jax.process_index() or distill.run(settings),
                                       "distilling on process 0"), settings)


def _metrics(settings: EvaluationSettings, times: StageTimes, name: str,
             world: WorldConfig) -> dict[str, Any]:
  """Returns an evaluation's metrics (running it if needed); on a world with near-miss
  figures, with pass@1 by where the answer's page states one."""
  path = os.path.join(settings.output_dir, "metrics.json")
  if settings.system == "model":  # what `experiments/evaluate.py --model` will evaluate it with
    distributed.agreed(lambda: jax.process_index() or model_settings.save(settings),
                       f"saving the evaluation settings in {settings.model.checkpoint}")
  # the teacher's k samples are seeded 0..k-1 whatever the run's seed: one evaluation serves all
  compared = settings if settings.system == "model" else dataclasses.replace(settings, seed=0)
  times.run(name, path, lambda: evaluation.run(settings), compared)

  def read() -> dict[str, Any]:
    metrics = _read_json(path)
    if world.distractors:
      metrics["pass@1_by_page"] = evaluation.pass_at_1_by_page(world, settings.tasks,
                                                               settings.output_dir)
    return metrics

  return _on_process_0(read, f"reading {path}")


def _sample_pass(evaluate: EvaluationSettings, folder: str):
  """Returns a query-selection sampler (coa_jax.rl.query_selection.Sampler) that evaluates
  the model of `evaluate` on the given tasks (written to `folder`) and reads each sample's
  correctness from the evaluation's samples.jsonl."""

  def sample(tasks, k):
    path = query_selection.write_tasks(tasks, os.path.join(folder, "pool.jsonl"))
    evaluation.run(dataclasses.replace(
        evaluate, tasks=path, max_tasks=0, k=k, copy_probe="", output_dir=folder,
        batch_size=max(evaluate.batch_size // k, 1) * k))
    if jax.process_index():  # process 0 wrote the samples; its outcomes are shared
      return {}
    with open(os.path.join(folder, "samples.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    return {row["task_id"]: [s["correct"] for s in row["samples"]] for row in rows}

  return sample


def rl_tasks(selection: SelectionConfig, stages: dict[str, Any],
             stage: str = "dapo") -> tuple[str, dict[str, Any]]:
  """Returns the task file the RL `stage` trains on and the query-selection report: the
  stage's own task file, or with `selection` on (coa_jax.rl.query_selection), the tasks whose
  pass rate under the SFT model lies in [low, high], written beside the SFT model. The pass
  rates are cached there under the model, the task file, k and the sampling."""
  tasks_path = stages[stage].tasks
  if not selection.enabled:
    return tasks_path, {"sampled": 0, "low": 0.0, "high": 1.0}
  evaluate = stages["eval_sft"]
  # process 0's key names the folder for every host (a folder's fingerprint holds its times)
  key = _on_process_0(lambda: {
      "model": file_fingerprint(evaluate.model.checkpoint),
      "tasks": file_fingerprint(tasks_path), "max_tasks": selection.max_tasks,
      "sampling": dataclasses.asdict(evaluate.sampling),
      "rollout": dataclasses.asdict(evaluate.rollout),
      "system_prompt": evaluate.system_prompt, "seed": evaluate.seed},
      f"fingerprinting {evaluate.model.checkpoint} and {tasks_path}")
  tasks = distributed.agreed(lambda: load_tasks(tasks_path), f"reading {tasks_path}")
  folder = os.path.join(os.path.dirname(stages["sft"].workdir.rstrip("/")),
                        "selection", f"k{selection.k}-{fingerprint(key)}")
  kept, report = query_selection.select_tasks(
      selection, tasks, _sample_pass(evaluate, os.path.join(folder, "samples")),
      os.path.join(folder, "pass_rates.json"), key)
  path = os.path.join(folder, f"tasks-{selection.low:g}-{selection.high:g}.jsonl")
  distributed.agreed(lambda: query_selection.write_tasks(kept, path), f"writing {path}")
  say(f"query selection: kept {len(kept)} of {report['sampled']} tasks with pass rate in "
      f"[{selection.low:g}, {selection.high:g}] over {selection.k} samples (pass rates "
      f"{report['pass_rates']}) -> {path}")
  return path, report


def trained(stages: Stages, seed: int) -> dict[str, Any]:
  """Returns the settings the training stages of `seed` are reused under (`StageTimes`)."""
  seed_stages = stages.of(seed)
  return {f"seed {seed} sft": seed_stages["sft"],
          f"seed {seed} dapo": {"dapo": seed_stages["dapo"],
                                "selection": stages.settings.selection}}


def run(config: Any, stage_configs: StageConfigs, seeds: int = 1) -> dict[str, Any]:
  """Distils once, then trains and evaluates `seeds` seeds (config.seed, config.seed + 1,
  ...); returns the results (also written as results.json and results.png).

  `stage_configs(config, seed=None)` returns the config of every stage ("distill", "sft",
  "eval_teacher", "eval_sft", "dapo", "eval_dapo") derived from the pipeline config, e.g.
  `configs/pipeline_tiny_cpu.py`'s; each is checked by its job's settings builder before any
  stage runs."""
  return run_stages(Stages(config, stage_configs), seeds)


def run_stages(stages: Stages, seeds: int = 1) -> dict[str, Any]:
  """`run` on the stages of a pipeline config."""
  if seeds < 1:
    raise ValueError(f"seeds={seeds}: expected at least 1")
  start = time.perf_counter()
  settings = stages.settings
  output_dir, k, world = settings.output_dir, settings.eval.k, settings.world
  first = stages.of()  # every stage checked before the first runs
  distributed.agreed(lambda: os.makedirs(paths.local(output_dir, "output_dir"), exist_ok=True),
                     f"making {output_dir}")
  check_shared(output_dir, "output_dir")  # process 0 writes what every host's stages read
  times = StageTimes(os.path.join(output_dir, "stage_seconds.json"))
  distill_stage(first, times)
  # rebuilt: the evaluations' tool spec is the one distillation wrote
  teacher = _metrics(stages.of()["eval_teacher"], times, "eval teacher", world)
  per_seed = {}
  for seed in range(settings.seed, settings.seed + seeds):
    seed_stages = stages.of(seed)  # the tools spec exists now
    say(f"=== seed {seed}")
    compared = trained(stages, seed)
    times.run(f"seed {seed} sft", seed_stages["sft"].export_dir,
              lambda: sft.run(seed_stages["sft"]), compared[f"seed {seed} sft"])
    rows = {"teacher": teacher,
            "sft": _metrics(seed_stages["eval_sft"], times, f"seed {seed} eval sft", world)}

    def train_rl(seed_stages=seed_stages):
      tasks, _ = rl_tasks(settings.selection, seed_stages)  # query selection, when on
      rl.run(dataclasses.replace(seed_stages["dapo"], tasks=tasks))

    times.run(f"seed {seed} dapo", seed_stages["dapo"].export_dir, train_rl,
              compared[f"seed {seed} dapo"])
    rows["dapo"] = _metrics(seed_stages["eval_dapo"], times, f"seed {seed} eval dapo", world)
    per_seed[seed] = rows
  say("== results")
  names = ["distill", "eval teacher"] + [f"seed {seed} {stage}" for seed in per_seed
                                         for stage in ("sft", "eval sft", "dapo", "eval dapo")]
  seconds = {name: times.seconds[name] for name in names if name in times.seconds}
  results = results_of(per_seed, k)
  table = results["table"]
  if world.distractors:
    results["pass@1_by_page"] = family_means(per_seed, "pass@1_by_page")
  results.update(stage_seconds=seconds, wall_s=round(time.perf_counter() - start, 1),
                 plot=plot(results["summary"], k, seeds, os.path.join(output_dir, "results.png")))
  write_json(os.path.join(output_dir, "results.json"), results)
  if jax.process_index() == 0:  # pages to read (a failure is only printed): each seed's RL
    from coa_jax.evaluation import viewer  # run, then every evaluation side by side
    for seed in per_seed:
      viewer.logged(viewer.write_page, stages.of(seed)["dapo"].workdir)
    viewer.logged(viewer.write_page, output_dir, tasks=first["eval_sft"].tasks)
    write_results_page(output_dir, table, seeds, results["per_seed_table"])
  say(f"held-out tasks, mean +- sd over {seeds} seed(s):\n{table}")
  groups = {"task family": "pass@1_by_family", "where the answer's page states a near-miss "
            "figure": "pass@1_by_page"}
  for what, key in groups.items():
    if key in results:
      say(f"pass@1 by {what}, mean over seeds: " + "; ".join(
          f"{SYSTEMS[system]} " + ", ".join(f"{g} {v:.3f}" for g, v in values.items())
          for system, values in results[key].items()))
  say("stage wall times (s): " + ", ".join(f"{name} {t:.0f}" for name, t in seconds.items()))
  say(f"pipeline done in {results['wall_s']:.0f}s; results in {output_dir}")
  return results
