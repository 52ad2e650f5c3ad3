"""The end-to-end recipe: world -> distil (teacher) -> filter -> SFT -> evaluate -> DAPO ->
evaluate, and a table of the teacher system, the AFM after SFT and after DAPO on held-out
tasks.

`run(config, seeds)` is `experiments/pipeline.py`; each stage is the library job of that
stage (`distill.run`, `sft.run`, `evaluation.run`, `rl.run`) on a config derived from the
pipeline config. Distillation (the world and the teacher's data) is shared by every seed and
written under config.output_dir/distill; each seed (model init, data order, sampling) trains and
evaluates under config.output_dir/seed-<seed>/<stage>. Stages whose outputs exist are reused,
so a re-run resumes where the last one stopped. On several hosts, output_dir is a folder they
share: process 0's files decide which stages are done and give every host the metrics.
results.json holds every seed's metrics, their mean and standard deviation, and the stage wall
times; results.png shows them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np

from coa_jax import distill, evaluation, rl, sft
from coa_jax.data import DropCounter, load_source, load_tasks, tokenizer_of
from coa_jax.evaluation import model_settings
from coa_jax.model import ModelSettings, Transformer
from coa_jax.rl import query_selection
from coa_jax.runtime import distributed, load_model, paths, sharding
from coa_jax.runtime.cache import exists, file_fingerprint, fingerprint, write_json
from coa_jax.runtime.distributed import say

SYSTEMS = {"teacher": "teacher system", "sft": "AFM after SFT", "dapo": "AFM after DAPO"}


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


class StageTimes:
  """The wall time of each finished stage, kept in a JSON file beside the stages' outputs (so
  a stage reused from an earlier invocation still reports the time it took when it ran), and
  with it which stages finished: a stage's job is done when its output exists and its time is
  here, written (atomically) once the job returned."""

  def __init__(self, path: str):
    self.path = path
    self.seconds: dict[str, float] = _on_process_0(
        lambda: _read_json(path) if os.path.exists(path) else {}, f"reading {path}")

  def run(self, name: str, done: str, job: Callable[[], Any]) -> None:
    """Runs `job` unless it finished in an earlier invocation and its output `done` exists;
    records its wall time under `name`."""
    if _stage(name, done, name in self.seconds):
      return
    self.seconds.pop(name, None)
    start = time.perf_counter()
    job()
    # A training stage stopped by a signal (SIGTERM, Ctrl-C) saves a checkpoint and returns:
    # the run ends here rather than go on to stages that need this one's output.
    if not _on_process_0(lambda: exists(done), f"checking {done}"):
      raise StageStopped(f"the {name} stage stopped before it finished (no {done}; a training "
                         f"stage stopped by a signal has saved a checkpoint): run the same "
                         f"command again to resume it")
    self.seconds[name] = round(time.perf_counter() - start, 1)
    # a killed run leaves the last complete file; process 0 writes it, every host waits
    distributed.agreed(lambda: jax.process_index() or write_json(self.path, self.seconds),
                       f"writing {self.path}")


def _distill(config: Any, configs: dict[str, Any], times: StageTimes) -> None:
  """Runs the distillation stage unless it finished. Host-side work (a teacher, tools) that may
  fail on one host alone, e.g. keeping nothing: agreed, so every host stops with it rather than
  wait in the next collective."""
  times.run("distill", os.path.join(config.output_dir, "distill", "distill_report.json"),
            lambda: distributed.agreed(lambda: distill.run(configs["distill"]), "distilling"))


def _metrics(cfg: Any, times: StageTimes, name: str, world: Any) -> dict[str, Any]:
  """Returns an evaluation's metrics (running it if needed); on a world with near-miss
  figures, with pass@1 by where the answer's page states one."""
  path = os.path.join(cfg.output_dir, "metrics.json")
  if cfg.system == "model":  # what `experiments/evaluate.py --model` will evaluate it with
    distributed.agreed(lambda: jax.process_index() or model_settings.save(cfg),
                       f"saving the evaluation settings in {cfg.model.checkpoint}")
  times.run(name, path, lambda: evaluation.run(cfg))

  def read() -> dict[str, Any]:
    metrics = _read_json(path)
    if world.get("distractors"):
      metrics["pass@1_by_page"] = evaluation.pass_at_1_by_page(world, cfg.tasks, cfg.output_dir)
    return metrics

  return _on_process_0(read, f"reading {path}")


def metric_names(k: int) -> tuple[str, ...]:
  """Returns the metrics the results table reports, in its column order."""
  return ("pass@1", f"avg@{k}", f"pass@{k}", f"maj@{k}", "tokens_per_task",
          "tool_calls_per_task", "format_error_rate", "copy_exact", "copy_sampled", "call_exact",
          "call_sampled", "question_exact", "question_sampled")


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]],
              k: int) -> dict[str, dict[str, dict[str, Any]]]:
  """Returns, per system and metric, the seeds' values, their mean and their sample standard
  deviation (0 for one seed)."""
  summary: dict[str, dict[str, dict[str, Any]]] = {}
  for system in SYSTEMS:
    summary[system] = {}
    for metric in metric_names(k):
      values = [rows[system][metric] for rows in per_seed.values()
                if metric in rows.get(system, {})]
      if values:
        summary[system][metric] = dict(
            values=values, mean=float(np.mean(values)),
            sd=float(np.std(values, ddof=1)) if len(values) > 1 else 0.0)
  return summary


def family_means(per_seed: dict[int, dict[str, dict[str, Any]]],
                 key: str = "pass@1_by_family") -> dict[str, dict[str, float]]:
  """Returns, per system, each task family's pass@1 (or each group's of `key`) averaged over
  seeds (where the score is won and lost)."""
  means: dict[str, dict[str, float]] = {}
  for system in SYSTEMS:
    rows = [r[system][key] for r in per_seed.values() if key in r.get(system, {})]
    if rows:
      means[system] = {family: float(np.mean([r[family] for r in rows])) for family in rows[0]}
  return means


def format_summary(summary: dict[str, dict[str, dict[str, Any]]], k: int) -> str:
  """Returns the results as a Markdown table of mean +- sd over seeds, with each system's
  worst seed's pass@1 beside its mean."""
  columns = [m for m in metric_names(k) if any(m in summary[s] for s in summary)]
  names = [c.replace("_", " ") for c in columns]
  lines = ["| system | " + " | ".join(names[:1] + ["worst seed"] + names[1:]) + " |",
           "|---" * (len(columns) + 2) + "|"]
  for system, metrics in summary.items():
    cells = []
    seeds = max((len(m["values"]) for m in metrics.values()), default=0)
    for column in columns:
      if column not in metrics or len(metrics[column]["values"]) < seeds:
        cells.append("-")  # not measured on every seed (an older run's results)
        continue
      mean, sd = metrics[column]["mean"], metrics[column]["sd"]
      digits = 0 if mean >= 10 else 3
      cells.append(f"{mean:.{digits}f} +- {sd:.{digits}f}")
    worst = min(metrics["pass@1"]["values"]) if "pass@1" in metrics else None
    cells.insert(1, "-" if worst is None else f"{worst:.3f}")
    lines.append(f"| {SYSTEMS[system]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def per_seed_table(per_seed: dict[int, dict[str, dict[str, Any]]]) -> str:
  """Returns a Markdown table of each seed's pass@1, overall and per task family, and its
  question-copy probe, after SFT and after DAPO; then the worst seed's and mean +- sd rows."""
  models = [m for m in ("sft", "dapo") if all(m in rows for rows in per_seed.values())]
  families = sorted({f for rows in per_seed.values() for m in models
                     for f in rows[m].get("pass@1_by_family", {})})
  columns = [(m, key, family) for m in models
             for key, family in [("pass@1", None)] + [("pass@1_by_family", f) for f in families]
             + [("question_exact", None)]]
  value = lambda rows, m, key, family: (rows[m][key][family] if family else rows[m].get(key))
  header = [f"{SYSTEMS[m].replace('AFM after ', '')} {family or key.replace('_', ' ')}"
            for m, key, family in columns]
  lines = ["| seed | " + " | ".join(header) + " |", "|---" * (len(columns) + 1) + "|"]
  cell = lambda v: "-" if v is None else f"{v:.3f}"
  for seed, rows in per_seed.items():
    lines.append(f"| {seed} | " + " | ".join(cell(value(rows, *c)) for c in columns) + " |")
  for name, reduce in (("worst", lambda v: f"{min(v):.3f}"),
                       ("mean +- sd", lambda v: f"{np.mean(v):.3f} +- "
                                                f"{np.std(v, ddof=1) if len(v) > 1 else 0:.3f}")):
    cells = []
    for c in columns:
      values = [value(rows, *c) for rows in per_seed.values()]
      cells.append("-" if None in values else reduce(values))
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def pyplot() -> Any:
  """Returns matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  return plt


def plot(summary: dict[str, dict[str, dict[str, Any]]], k: int, seeds: int,
         path: str) -> str | None:
  """Writes bar charts (mean over seeds, sd as error bars, values on the bars) of pass@1 and
  pass@k, tokens and tool calls per task and format errors to `path`; returns it (None
  without matplotlib)."""
  plt = pyplot()
  if plt is None:
    return None
  names = list(summary)
  colors = {"teacher": "#888888", "sft": "#44aa77", "dapo": "#4477aa"}
  panels = [(f"pass@1 (dark), pass@{k} (light)", ("pass@1", f"pass@{k}")),
            ("tokens per task", ("tokens_per_task",)),
            ("tool calls per task", ("tool_calls_per_task",)),
            ("format-error rate", ("format_error_rate",))]
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8),
                           gridspec_kw={"width_ratios": [1.6, 1, 1, 1]})
  for ax, (title, metrics) in zip(axes, panels):
    width = 0.8 / len(metrics)
    for j, metric in enumerate(metrics):
      x = np.arange(len(names)) + (j - (len(metrics) - 1) / 2) * width
      means = [summary[n][metric]["mean"] for n in names]
      sds = [summary[n][metric]["sd"] for n in names]
      bars = ax.bar(x, means, width, yerr=sds, capsize=3, color=[colors[n] for n in names],
                    alpha=1.0 if j == 0 else 0.55, label=metric)
      ax.bar_label(bars, [f"{m:.0f}" if m >= 10 else f"{m:.2f}" for m in means], fontsize=7,
                   padding=2)
    ax.set_xticks(np.arange(len(names)), [SYSTEMS[n].replace("AFM ", "") for n in names],
                  fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)
  fig.suptitle(f"held-out tasks, mean +- sd over {seeds} seed{'s' * (seeds > 1)}: "
               "teacher system vs AFM after SFT and after DAPO")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_spread(runs: dict[str, dict[str, Any]], path: str,
                floors: dict[str, float] | None = None) -> str | None:
  """Writes each seed's held-out pass@1, overall and per task family, after SFT (top) and
  after DAPO (bottom), one column of dots per run (`runs`: label -> results.json), the mean as
  a bar and each panel's worst seed named; `floors` draws a target line per panel ("pass@1",
  or a family). Returns `path` (None without matplotlib)."""
  plt = pyplot()
  if plt is None:
    return None
  families = sorted({f for results in runs.values() for rows in results["per_seed"].values()
                     for f in rows["sft"].get("pass@1_by_family", {})})
  panels = ["pass@1"] + families
  fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 6.4), sharey=True)
  for row, model in enumerate(("sft", "dapo")):
    for ax, panel in zip(axes[row], panels):
      for x, (label, results) in enumerate(runs.items()):
        seeds = list(results["per_seed"])
        values = [rows[model]["pass@1"] if panel == "pass@1" else
                  rows[model]["pass@1_by_family"][panel]
                  for rows in results["per_seed"].values()]
        jitter = np.linspace(-0.15, 0.15, len(values))
        ax.scatter(x + jitter, values, s=18, alpha=0.8)
        ax.hlines(np.mean(values), x - 0.25, x + 0.25, color="black")
        worst = int(np.argmin(values))
        ax.annotate(f"seed {seeds[worst]}", (x + jitter[worst], values[worst]), fontsize=7,
                    textcoords="offset points", xytext=(4, -8))
      if floors and panel in floors and model == "dapo":
        ax.axhline(floors[panel], color="#cc4444", linestyle="--", linewidth=1)
      ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
      ax.set_xlim(-0.6, len(runs) - 0.4)
      ax.set_title(f"{SYSTEMS[model].replace('AFM ', '')}: {panel}", fontsize=9)
  axes[0][0].set_ylabel("held-out pass@1 per seed")
  axes[1][0].set_ylabel("held-out pass@1 per seed")
  fig.suptitle("every seed, before and after (bar: mean; dashed: target after DAPO)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


StageConfigs = Callable[..., dict[str, ml_collections.ConfigDict]]


def _sample_pass(evaluate: ml_collections.ConfigDict, folder: str):
  """Returns a query-selection sampler (coa_jax.rl.query_selection.Sampler) that evaluates
  the model of `evaluate` on the given tasks (written to `folder`) and reads each sample's
  correctness from the evaluation's samples.jsonl."""

  def sample(tasks, k):
    cfg = ml_collections.ConfigDict(evaluate.to_dict())
    cfg.tasks = query_selection.write_tasks(tasks, os.path.join(folder, "pool.jsonl"))
    cfg.max_tasks, cfg.k, cfg.copy_probe, cfg.output_dir = 0, k, "", folder
    cfg.batch_size = max(cfg.batch_size // k, 1) * k
    evaluation.run(cfg)
    if jax.process_index():  # process 0 wrote the samples; its outcomes are shared
      return {}
    with open(os.path.join(folder, "samples.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    return {row["task_id"]: [s["correct"] for s in row["samples"]] for row in rows}

  return sample


def rl_tasks(config: Any, configs: dict[str, ml_collections.ConfigDict],
             stage: str = "dapo") -> tuple[str, dict[str, Any]]:
  """Returns the task file the RL `stage` trains on and the query-selection report: the
  stage's own task file, or with config.selection on (coa_jax.rl.query_selection), the tasks
  whose pass rate under the SFT model lies in [low, high], written beside the SFT model. The
  pass rates are cached there under the model, the task file, k and the sampling."""
  selection = query_selection.SelectionConfig(**config.selection)
  tasks_path = configs[stage].tasks
  if not selection.enabled:
    return tasks_path, {"sampled": 0, "low": 0.0, "high": 1.0}
  evaluate = configs["eval_sft"]
  key = {"model": file_fingerprint(evaluate.model.checkpoint),
         "tasks": file_fingerprint(tasks_path), "max_tasks": selection.max_tasks,
         "sampling": evaluate.sampling.to_dict(), "rollout": evaluate.rollout.to_dict(),
         "system_prompt": evaluate.system_prompt, "seed": evaluate.seed}
  folder = os.path.join(os.path.dirname(configs["sft"].workdir.rstrip("/")),
                        "selection", f"k{selection.k}-{fingerprint(key)}")
  tasks = load_tasks(tasks_path)
  kept, report = query_selection.select_tasks(
      selection, tasks, _sample_pass(evaluate, os.path.join(folder, "samples")),
      os.path.join(folder, "pass_rates.json"), key)
  path = query_selection.write_tasks(
      kept, os.path.join(folder, f"tasks-{selection.low:g}-{selection.high:g}.jsonl"))
  say(f"query selection: kept {len(kept)} of {report['sampled']} tasks with pass rate in "
      f"[{selection.low:g}, {selection.high:g}] over {selection.k} samples (pass rates "
      f"{report['pass_rates']}) -> {path}")
  return path, report


def run(config: Any, stage_configs: StageConfigs, seeds: int = 1) -> dict[str, Any]:
  """Distils once, then trains and evaluates `seeds` seeds (config.seed, config.seed + 1,
  ...); returns the results (also written as results.json and results.png).

  `stage_configs(config, seed=None)` returns the config of every stage ("distill", "sft",
  "eval_teacher", "eval_sft", "dapo", "eval_dapo") derived from the pipeline config, e.g.
  `configs/pipeline_tiny_cpu.py`'s."""
  if seeds < 1:
    raise ValueError(f"seeds={seeds}: expected at least 1")
  start = time.perf_counter()
  os.makedirs(paths.local(config.output_dir, "output_dir"), exist_ok=True)
  times = StageTimes(os.path.join(config.output_dir, "stage_seconds.json"))
  configs = stage_configs(config)
  _distill(config, configs, times)
  # rebuilt: the evaluations' tool spec is the one distillation wrote
  teacher = _metrics(stage_configs(config)["eval_teacher"], times, "eval teacher",
                     config.world)
  per_seed = {}
  for seed in range(config.seed, config.seed + seeds):
    configs = stage_configs(config, seed)  # the tools spec exists now
    say(f"=== seed {seed}")
    times.run(f"seed {seed} sft", configs["sft"].export_dir, lambda: sft.run(configs["sft"]))
    rows = {"teacher": teacher,
            "sft": _metrics(configs["eval_sft"], times, f"seed {seed} eval sft", config.world)}

    def train_rl(configs=configs):
      configs["dapo"].tasks, _ = rl_tasks(config, configs)  # query selection, when on
      rl.run(configs["dapo"])

    times.run(f"seed {seed} dapo", configs["dapo"].export_dir, train_rl)
    rows["dapo"] = _metrics(configs["eval_dapo"], times, f"seed {seed} eval dapo",
                            config.world)
    per_seed[seed] = rows
  say("== results")
  k = config.eval.k
  stages = ["distill", "eval teacher"] + [f"seed {seed} {stage}" for seed in per_seed
                                          for stage in ("sft", "eval sft", "dapo", "eval dapo")]
  seconds = {name: times.seconds[name] for name in stages if name in times.seconds}
  results = results_of(per_seed, k)
  table = results["table"]
  if config.world.get("distractors"):
    results["pass@1_by_page"] = family_means(per_seed, "pass@1_by_page")
  results.update(stage_seconds=seconds, wall_s=round(time.perf_counter() - start, 1),
                 plot=plot(results["summary"], k, seeds,
                           os.path.join(config.output_dir, "results.png")))
  write_json(os.path.join(config.output_dir, "results.json"), results)
  if jax.process_index() == 0:  # pages to read (a failure is only printed): each seed's RL
    from coa_jax.evaluation import viewer  # run, then every evaluation side by side
    for seed in per_seed:
      viewer.logged(viewer.write_page, stage_configs(config, seed)["dapo"].workdir)
    viewer.logged(viewer.write_page, config.output_dir, tasks=configs["eval_sft"].tasks)
    write_results_page(config.output_dir, table, seeds, results["per_seed_table"])
  say(f"held-out tasks, mean +- sd over {seeds} seed(s):\n{table}")
  groups = {"task family": "pass@1_by_family", "where the answer's page states a near-miss "
            "figure": "pass@1_by_page"}
  for what, key in groups.items():
    if key in results:
      say(f"pass@1 by {what}, mean over seeds: " + "; ".join(
          f"{SYSTEMS[system]} " + ", ".join(f"{g} {v:.3f}" for g, v in values.items())
          for system, values in results[key].items()))
  say("stage wall times (s): " + ", ".join(f"{name} {t:.0f}" for name, t in seconds.items()))
  say(f"pipeline done in {results['wall_s']:.0f}s; results in {config.output_dir}")
  return results


def results_of(per_seed: dict[int, dict[str, dict[str, Any]]], k: int) -> dict[str, Any]:
  """Returns the results of per-seed evaluation rows: the rows, their summary over seeds, the
  table, the per-seed table and pass@1 by task family averaged over seeds."""
  summary = aggregate(per_seed, k)
  return {"seeds": list(per_seed), "per_seed": per_seed, "summary": summary,
          "table": format_summary(summary, k), "per_seed_table": per_seed_table(per_seed),
          "pass@1_by_family": family_means(per_seed)}


def combine(runs: Sequence[dict[str, Any]], k: int) -> dict[str, Any]:
  """Returns the results of several pipeline runs' results.json over the same distillation as
  one (`results_of` every seed's rows); a seed in two runs is an error."""
  per_seed: dict[int, dict[str, dict[str, Any]]] = {}
  for results in runs:
    for seed, rows in results["per_seed"].items():
      if int(seed) in per_seed:
        raise ValueError(f"seed {seed} is in more than one of the runs combined")
      per_seed[int(seed)] = rows
  return results_of(dict(sorted(per_seed.items())), k)


def write_results_page(output_dir: str, table: str, seeds: int, by_seed: str = "") -> str:
  """Writes results.md beside results.json: the table, the plot, the per-seed table and a link
  to the page of every trajectory (trajectories.html); returns its path."""
  path = os.path.join(output_dir, "results.md")
  by_seed = f"Per seed and task family:\n\n{by_seed}\n\n" if by_seed else ""
  with open(path, "w") as f:
    f.write(f"# Held-out results, mean +- sd over {seeds} seed(s)\n\n{table}\n\n"
            f"![the table's metrics per system](results.png)\n\n{by_seed}"
            f"Every held-out trajectory, teacher, SFT and DAPO side by side, with filters: "
            f"[trajectories.html](trajectories.html) (`make view RUN={output_dir}`).\n")
  return path


def copy_curve(config: Any, stage_configs: StageConfigs, seeds: int,
               every: int) -> dict[int, list[dict[str, Any]]]:
  """Trains the SFT stage of `seeds` seeds, stopping every `every` steps to run the copy probe
  on the held-out trajectories: when (and whether) each seed learns to copy. Distils first
  unless the distilled data exist. Writes copy_curve/copy_curve.json and .png; returns the
  curves (seed -> list of {step, loss, probe metrics})."""
  if seeds < 1 or every < 1:
    raise ValueError(f"seeds={seeds}, every={every}: expected at least 1 of each")
  times = StageTimes(os.path.join(config.output_dir, "stage_seconds.json"))
  os.makedirs(config.output_dir, exist_ok=True)
  _distill(config, stage_configs(config), times)
  out_dir = os.path.join(config.output_dir, "copy_curve")
  configs = stage_configs(config)
  tokenizer = tokenizer_of(configs["sft"])
  model_config, _ = load_model(ModelSettings.from_section(configs["sft"].model), tokenizer,
                               sharding.make_mesh(sharding.MeshConfig(**config.mesh)))
  model = Transformer(model_config)
  heldout = load_source(configs["eval_sft"].copy_probe, DropCounter())
  examples = evaluation.copy_examples(heldout, tokenizer, config.sft.seq_len)
  curves: dict[int, list[dict[str, float]]] = {}
  for seed in range(config.seed, config.seed + seeds):
    cfg = stage_configs(config, seed)["sft"]
    cfg.workdir = os.path.join(out_dir, f"seed-{seed}")
    cfg.checkpoint.directory = os.path.join(cfg.workdir, "checkpoints")
    cfg.checkpoint.every, cfg.train.stop_after, cfg.export_dir = every, every, ""
    curves[seed] = []
    steps = 0
    while steps < cfg.train.steps:  # each run resumes from the last segment's checkpoint
      out = sft.run(cfg)
      if out["steps"] == steps:
        raise RuntimeError(f"seed {seed}: SFT made no progress past step {steps}")
      steps = out["steps"]
      probe = evaluation.copy_accuracy(model, out["state"].params, examples,
                                       temperature=config.sampling.temperature)
      curves[seed].append({"step": steps, "loss": out.get("final_loss"), **probe})
      say(f"seed {seed} step {steps}: copy exact {probe['copy_exact']:.3f} (sampled "
          f"{probe['copy_sampled']:.3f}), calls exact {probe['call_exact']:.3f}, question "
          f"copies exact {probe['question_exact']:.3f} (sampled "
          f"{probe['question_sampled']:.3f})")
  with open(os.path.join(out_dir, "copy_curve.json"), "w") as f:
    json.dump({"every": every, "curves": curves}, f, indent=1)
  _plot_copy_curve(curves, os.path.join(out_dir, "copy_curve.png"))
  return curves


def _plot_copy_curve(curves: dict[int, list[dict[str, float]]], path: str) -> None:
  """Plots each seed's copies out of observations (left) and out of the question (right),
  greedy exact (solid) and sampled exactly (dashed), against the step."""
  plt = pyplot()
  if plt is None:
    return
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for ax, what, title in ((axes[0], "copy", "observation -> answer"),
                          (axes[1], "question", "question -> tool call")):
    for seed, points in curves.items():
      steps = [p["step"] for p in points]
      line, = ax.plot(steps, [p[f"{what}_exact"] for p in points], marker="o",
                      label=f"seed {seed}")
      ax.plot(steps, [p[f"{what}_sampled"] for p in points], linestyle="--",
              color=line.get_color())
    ax.set(xlabel="SFT step", ylim=(-0.02, 1.02), title=title)
  axes[0].set_ylabel("held-out copies")
  axes[1].legend(fontsize=8)
  fig.suptitle("copy probes: greedy exact (solid), sampled exactly (dashed)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
