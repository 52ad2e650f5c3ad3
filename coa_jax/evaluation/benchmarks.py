"""The paper's benchmarks on a trained model: each named benchmark's file (the reference
release's, `coa_jax.data.benchmark_files`) evaluated by the evaluation job with the grader the
paper uses, then one table like the paper's (per benchmark: grader, pass@1, avg@k, tokens and
tool calls per task) as JSON, Markdown and a plot.

The model is evaluated with the tools, system prompt and tokenizer its run saved beside it
(`model_settings`), else the command's config's. Every benchmark is one `evaluation.job.run`
(its progress lines, metrics.json, samples.jsonl and trajectories.html in
`<output_dir>/<name>/`), so the model is loaded once per benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
import time
from typing import Any, Sequence

import jax
import ml_collections

from coa_jax.data import benchmark_files
from coa_jax.data.benchmark_files import JudgeSettings
from coa_jax.evaluation import job as evaluation
from coa_jax.evaluation import model_settings
from coa_jax.model import ConfigError
from coa_jax.runtime import distributed, paths
from coa_jax.runtime.cache import write_json, write_jsonl
from coa_jax.runtime.distributed import say


@dataclasses.dataclass(frozen=True)
class BenchmarkSettings:
  """What the benchmark command evaluates: the model folder (an HF export), the benchmarks by
  name, their folder, samples per task, at most `max_tasks` tasks each (0: all), the judge
  (`judge_url` empty: exact match, named as a fallback) and the code tests' time limit."""

  model: str
  benchmarks: tuple[str, ...]
  data_dir: str = benchmark_files.DEFAULT_DATA_DIR
  output_dir: str = "runs/benchmark"
  k: int = 1
  max_tasks: int = 0
  judge_url: str = ""
  judge_model: str = ""
  judge_api_key_env: str = "OPENAI_API_KEY"  # "": the endpoint takes no key
  code_timeout_s: float = 6.0

  def __post_init__(self):
    if not self.benchmarks:
      raise ConfigError(f"no benchmarks named; known: {', '.join(benchmark_files.BENCHMARKS)}")
    for name in self.benchmarks:
      benchmark_files.benchmark(name)
    if len(set(self.benchmarks)) != len(self.benchmarks):
      raise ConfigError(f"benchmarks {list(self.benchmarks)} name one twice")
    if self.k < 1:
      raise ConfigError(f"k={self.k}: expected at least 1 sample per task")
    if self.max_tasks < 0:
      raise ConfigError(f"max_tasks={self.max_tasks}: expected 0 (all) or more")
    if not self.code_timeout_s > 0:
      raise ConfigError(f"code_timeout_s={self.code_timeout_s}: expected > 0 seconds")
    if not self.judge_url and self.judge_model:
      raise ConfigError(f"judge_model={self.judge_model!r} without a judge_url")
    _ = self.judge  # a judge URL that is not one, or no judge model, is an error here
    if not os.path.isfile(os.path.join(self.model, "config.json")):
      raise ConfigError(f"model {self.model!r}: no config.json there; expected a model folder "
                        f"that coa-jax exported (hf_export) or another HF folder")

  @property
  def judge(self) -> JudgeSettings | None:
    """Returns the judge's settings, or None without a judge_url."""
    if not self.judge_url:
      return None
    return JudgeSettings(self.judge_url, self.judge_model, self.judge_api_key_env or None)


def _has_tokenizer(folder: str) -> bool:
  return any(os.path.isfile(os.path.join(folder, name))
             for name in ("tokenizer.json", "tokenizer_config.json"))


def evaluation_config(config: ml_collections.ConfigDict, settings: BenchmarkSettings,
                      name: str, tasks_path: str) -> tuple[ml_collections.ConfigDict, str]:
  """Returns (the evaluation config of one benchmark, a line saying where its model settings
  come from): the settings the model's run saved in its folder (`model_settings`: tools, system
  prompt, tokenizer, the model's runtime fields) over `config` (configs/benchmark.py's fields),
  with the config's own sampling, rollout limits and batch (a benchmark's, not the training
  tasks'), the tokenizer "auto" resolved (the model folder's own when it has one, template
  chatml; else the built-in one, template plain), k, the benchmark's rewards and its output
  folder."""
  entry = benchmark_files.benchmark(name)
  cfg, source = model_settings.evaluation_config(
      config, settings.model, tasks_path, os.path.join(settings.output_dir, name), settings.k)
  for key in ("sampling", "rollout"):
    cfg[key] = ml_collections.ConfigDict(config[key].to_dict())
  cfg.chunk = config.chunk
  cfg.batch_size = max(config.batch_size // settings.k, 1) * settings.k  # whole groups
  if cfg.tokenizer.path == "auto":
    cfg.tokenizer.path = settings.model if _has_tokenizer(settings.model) else "default"
  if cfg.tokenizer.template == "auto":
    cfg.tokenizer.template = "plain" if cfg.tokenizer.path == "default" else "chatml"
  cfg.rewards = ml_collections.ConfigDict(benchmark_files.reward_spec(
      entry.grader, settings.judge, settings.code_timeout_s))
  return cfg, source


def _read_samples(folder: str) -> list[evaluation.Sample]:
  with open(os.path.join(folder, "samples.jsonl")) as f:
    return [evaluation.Sample(**sample) for line in f if line.strip()
            for sample in json.loads(line)["samples"]]


def benchmark_row(name: str, label: str, metrics: dict[str, Any],
                  samples: Sequence[evaluation.Sample], k: int) -> dict[str, Any]:
  """Returns one benchmark's row of the results table: its names, grader, task count and the
  evaluation's metrics; `judge_errors` counts answers the judge could not grade (unreachable,
  malformed reply: scored 0), `f1` is the mean token F1 of a QA benchmark's samples (0 without
  an answer; None for other graders)."""
  entry = benchmark_files.benchmark(name)
  answered = [s for s in samples if s.answer is not None]
  judged = entry.grader == "judge" and label != benchmark_files.FALLBACK_LABEL
  return {
      "benchmark": entry.title, "name": name, "file": entry.file, "grader": label,
      "tasks": metrics["tasks"], "k": k, "pass@1": metrics["pass@1"],
      f"avg@{k}": metrics[f"avg@{k}"], f"pass@{k}": metrics[f"pass@{k}"],
      "tokens_per_task": metrics["tokens_per_task"],
      "tool_calls_per_task": metrics["tool_calls_per_task"],
      "format_error_rate": metrics["format_error_rate"],
      "judge_errors": sum("error" in s.grading for s in answered) if judged else None,
      "f1": (sum(s.grading.get("f1", 0.0) for s in samples) / len(samples)
             if entry.grader == "qa" and samples else None),
      "reward_sandbox_isolation": metrics.get("reward_sandbox_isolation"),
  }


def markdown_table(rows: Sequence[dict[str, Any]], k: int) -> str:
  """Returns the results as a Markdown table: rates in percent, as the paper writes them."""
  head = ["benchmark", "grader", "tasks", "pass@1 (%)", f"avg@{k} (%)", "tokens / task",
          "tool calls / task", "judge errors", "F1 (%)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in rows:
    cells = [row["benchmark"], row["grader"], str(row["tasks"]), f"{100 * row['pass@1']:.1f}",
             f"{100 * row[f'avg@{k}']:.1f}", f"{row['tokens_per_task']:,.0f}",
             f"{row['tool_calls_per_task']:.2f}",
             "-" if row["judge_errors"] is None else str(row["judge_errors"]),
             "-" if row["f1"] is None else f"{100 * row['f1']:.1f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], k: int, model: str, path: str) -> str | None:
  """Writes bar charts of pass@1 and avg@k (percent), tokens and tool calls per task, one bar
  group per benchmark labelled with its grader, to `path`; returns it (None without
  matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  graded = [f"{row['benchmark']}\n{textwrap.fill(row['grader'], 22)}" for row in rows]
  x = list(range(len(rows)))
  fig, axes = plt.subplots(1, 3, figsize=(max(10.0, 3.6 * len(rows) + 3.0), 4.6),
                           gridspec_kw={"width_ratios": [1.8, 1, 1]})
  for offset, metric, alpha in ((-0.2, "pass@1", 1.0), (0.2, f"avg@{k}", 0.55)):
    values = [100 * row[metric] for row in rows]
    bars = axes[0].bar([i + offset for i in x], values, 0.4, color="#4477aa", alpha=alpha,
                       label=metric)
    axes[0].bar_label(bars, [f"{v:.1f}" for v in values], fontsize=7, padding=2)
  axes[0].set_title(f"pass@1 (dark), avg@{k} (light), %", fontsize=9)
  axes[0].set_ylim(0, 105)
  for ax, metric, title in ((axes[1], "tokens_per_task", "tokens per task"),
                            (axes[2], "tool_calls_per_task", "tool calls per task")):
    values = [row[metric] for row in rows]
    bars = ax.bar(x, values, 0.6, color="#44aa77")
    ax.bar_label(bars, [f"{v:,.0f}" if v >= 10 else f"{v:.2f}" for v in values], fontsize=7,
                 padding=2)
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)
  axes[0].set_xticks(x, graded, fontsize=7)
  for ax in axes[1:]:
    ax.set_xticks(x, [row["benchmark"] for row in rows], fontsize=7, rotation=20, ha="right")
  fig.suptitle(f"{model}: the paper's benchmarks ({k} sample{'s' * (k > 1)} per task)",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _write_results(settings: BenchmarkSettings, rows: list[dict[str, Any]],
                   seconds: float) -> dict[str, Any]:
  """Writes results.json, results.md and results.png into the output folder; returns the
  results."""
  k, stem = settings.k, os.path.join(settings.output_dir, "results")
  judge = settings.judge
  results = {
      "model": settings.model, "data_dir": settings.data_dir, "k": k,
      "max_tasks": settings.max_tasks, "code_timeout_s": settings.code_timeout_s,
      "judge": None if judge is None else {"url": judge.base_url, "model": judge.model},
      "seconds": seconds, "rows": rows, "table": markdown_table(rows, k),
  }
  results["plot"] = plot(rows, k, settings.model, f"{stem}.png")
  write_json(f"{stem}.json", results)
  with open(f"{stem}.md", "w") as f:
    f.write(f"Model `{settings.model}`, {k} sample{'s' * (k > 1)} per task"
            f"{f', at most {settings.max_tasks} tasks per benchmark' if settings.max_tasks else ''}"
            f" (`{settings.data_dir}`).\n\n{results['table']}\n")
  return results


def run(config: ml_collections.ConfigDict, settings: BenchmarkSettings) -> dict[str, Any]:
  """Evaluates the model on each benchmark of `settings` with `config` (configs/benchmark.py)
  and returns the results it writes to the output folder (results.json, .md, .png; each
  benchmark's evaluation in a folder of its own). Every file is checked before the model
  loads."""
  # Each host's reads (a data copy it lacks, a file it cannot parse) are agreed: one host's
  # failure stops every host rather than leave them waiting in the evaluation's collectives.
  def check() -> None:
    paths.local(settings.output_dir, "output_dir")
    for name in settings.benchmarks:
      benchmark_files.benchmark_path(name, settings.data_dir)

  distributed.agreed(check, f"checking the benchmark files in {settings.data_dir}")
  start, rows, results = time.perf_counter(), [], {"rows": []}
  total = len(settings.benchmarks)
  for number, name in enumerate(settings.benchmarks, 1):
    entry = benchmark_files.benchmark(name)
    folder = os.path.join(settings.output_dir, name)
    tasks_path = os.path.join(folder, "tasks.jsonl")

    def prepare():
      tasks = benchmark_files.load_benchmark(name, settings.data_dir, settings.max_tasks)
      write_jsonl(tasks_path, benchmark_files.task_rows(tasks))  # every host: its own reads
      return tasks, evaluation_config(config, settings, name, tasks_path)

    tasks, (cfg, source) = distributed.agreed(prepare, f"reading {entry.title}")
    label = benchmark_files.grader_label(entry.grader, settings.judge, settings.code_timeout_s)
    say(f"benchmark {number}/{total}: {entry.title}, {len(tasks)} tasks x {settings.k} "
        f"samples, graded by {label}")
    if number == 1:
      say(f"evaluating {settings.model} with {source}")
    metrics = evaluation.run(cfg)

    def record():
      """Process 0 (it wrote the samples) writes the finished benchmarks so far: a run
      stopped later keeps them."""
      rows.append(benchmark_row(name, label, metrics, _read_samples(folder), settings.k))
      if rows[-1]["judge_errors"]:
        say(f"{entry.title}: the judge could not grade {rows[-1]['judge_errors']} answers "
            f"(scored 0); their errors are in {folder}/samples.jsonl")
      return _write_results(settings, rows, time.perf_counter() - start)

    # agreed: a failure there (a full disk) would stop process 0 alone, the others waiting in
    # the next benchmark's evaluation
    results = distributed.agreed(lambda: record() if jax.process_index() == 0 else results,
                                 f"recording {entry.title}")
    say(f"benchmark {number}/{total} done: {entry.title} pass@1 {metrics['pass@1']:.3f} "
        f"({time.perf_counter() - start:,.0f}s elapsed)")
  say(f"{results.get('table', '')}\n\nwrote {settings.output_dir}/results.json, results.md "
      f"and results.png")
  return results
