"""The "lora" experiment kind: LoRA against full fine-tuning at a fixed budget. The main job's SFT
starts from scratch, where LoRA has no base to adapt; so a LoRA cell (options "rank" > 0:
adapters of that rank on every projection, alpha 2 x rank) starts from the main job's own SFT
stopped at step options "from_step" (the same run, schedule and data order up to there,
exported; shared by the cells of a seed) and trains the rest of the main job's steps on its
data, at the main job's learning rate times options "lr_scale", on the tail of its schedule
(the hold, then the decay), with fresh AdamW moments and the data from the start of their
order. Its merged export is evaluated like the main job, and so is the prefix's (the cells'
starting point). Rank 0 is full fine-tuning over the same steps: the main job's SFT itself,
whose model and evaluation are reused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from coa_jax import evaluation, sft
from coa_jax.evaluation.settings import EvaluationSettings
from coa_jax.experiments.runner import cell, mean_sd, new_figure, save_figure, shared_dir, without
from coa_jax.model import ConfigError
from coa_jax.pipeline import Stages
from coa_jax.runtime import hf_checkpoint
from coa_jax.runtime.cache import exists
from coa_jax.runtime.distributed import say
from coa_jax.runtime.settings import to_section
from coa_jax.sft.settings import SFTSettings

COLUMNS = ("trained_params", "train_loss", "start_pass@1", "pass@1", "format_error_rate",
           "tokens_per_task")


def _run_sft(stages: Stages, train: SFTSettings, kind: str, what: str) -> SFTSettings:
  """Runs `train` in its content-addressed folder (named after its settings without its output
  paths) unless its export exists; returns the settings it ran with."""
  folder = shared_dir(stages, kind, without(to_section(train), "workdir", "export_dir",
                                            "checkpoint"))
  # saved every 250 steps: a run cut short resumes
  train = dataclasses.replace(
      train, workdir=folder, export_dir=os.path.join(folder, "hf_export"),
      checkpoint=dataclasses.replace(train.checkpoint, every=250,
                                     directory=os.path.join(folder, "checkpoints")))
  if not exists(hf_checkpoint.written_last(train.export_dir)):  # cut short: run again
    say(f"== {what} in {folder}")
    sft.run(train)
  return train


def _final_loss(folder: str, last: int = 50) -> float:
  """Returns the mean training loss of a run's last `last` steps (its metrics.jsonl; a resumed
  run's file holds every invocation's steps)."""
  with open(os.path.join(folder, "metrics.jsonl")) as f:
    losses = [json.loads(line)["loss"] for line in f if line.strip()]
  return float(np.mean(losses[-last:]))


def run_cell(stages: Stages, seed: int, options: Mapping[str, Any]) -> dict[str, Any]:
  """Returns one seed's held-out metrics after the cell's fine-tuning (see the module doc)."""
  main = stages.of(seed)
  sft_main, start = main["sft"], int(options["from_step"])
  total, rank = sft_main.train.steps, int(options["rank"])
  opt = sft_main.optimizer
  if opt.schedule != "wsd" or not opt.warmup_steps <= start <= total - opt.decay_steps:
    raise ConfigError(f"lora experiment: from_step={start} must lie in the main job's SFT "
                      f"schedule's hold (a 'wsd' schedule: warm-up to step {opt.warmup_steps}, "
                      f"decay over the last {opt.decay_steps} of {total} steps; this one is "
                      f"{opt.schedule!r}), where its tail is a hold and a decay")
  base = _run_sft(stages, dataclasses.replace(  # the schedule's total_steps stays the main job's
      sft_main, train=dataclasses.replace(sft_main.train, steps=start)),
                  "sft-prefix", f"the main job's SFT up to step {start}")
  start_metrics = _evaluate(main["eval_sft"], base.export_dir, base.workdir)
  if not rank:  # full fine-tuning: the main job's SFT
    metrics_path = os.path.join(main["eval_sft"].output_dir, "metrics.json")
    if not exists(metrics_path):
      raise ConfigError(f"{metrics_path} is missing: run the main job first (make pipeline "
                        f"ARGS=\"--seeds 3\")")
    return _result(sft_main.model.fresh_config().num_params(), sft_main.workdir,
                   metrics_path, start_metrics)
  # The tail of the main job's schedule: its hold at the peak, then its decay.
  train = _run_sft(stages, dataclasses.replace(
      sft_main,
      model=sft_main.model.replace(checkpoint=base.export_dir, lora_rank=rank,
                                   lora_alpha=2.0 * rank, lora_dropout=0.0),
      train=dataclasses.replace(sft_main.train, steps=total - start),
      optimizer=dataclasses.replace(opt, learning_rate=opt.learning_rate * options["lr_scale"],
                                    warmup_steps=0, total_steps=total - start)),
                   "sft-lora", f"rank-{rank} LoRA from step {start} to {total}")
  return _result(train.model.fresh_config().lora_params(), train.workdir,
                 _evaluate(main["eval_sft"], train.export_dir, train.workdir), start_metrics)


def _evaluate(main_eval: EvaluationSettings, checkpoint: str, run_dir: str) -> str:
  """Evaluates `checkpoint` as the main job evaluates its SFT model, once, into
  <run_dir>/eval; returns the path of its metrics.json."""
  evaluate = dataclasses.replace(main_eval, model=main_eval.model.replace(checkpoint=checkpoint),
                                 output_dir=os.path.join(run_dir, "eval"))
  metrics_path = os.path.join(evaluate.output_dir, "metrics.json")
  if not exists(metrics_path):
    evaluation.run(evaluate)
  return metrics_path


def _result(trained_params: int, run_dir: str, metrics_path: str,
            start_metrics_path: str) -> dict[str, Any]:
  """Returns a cell's result: what trained, the run's final training loss, the held-out
  pass@1 of the model it started from and its own held-out evaluation (metrics.json)."""
  with open(metrics_path) as f:
    metrics = json.load(f)
  with open(start_metrics_path) as f:
    start = json.load(f)["pass@1"]
  return {"trained_params": trained_params, "train_loss": _final_loss(run_dir),
          "start_pass@1": start, **{c: metrics[c] for c in COLUMNS[3:]},
          "pass@1_by_family": metrics.get("pass@1_by_family", {})}


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Returns, per cell, the mean +- sd over seeds of each column."""
  return {name: {c: mean_sd([r[c] for r in by_seed.values()]) for c in COLUMNS}
          for name, by_seed in results.items()}


def table(summary: Mapping[str, Any]) -> str:
  """Returns the markdown table: per cell, its trained parameters, final training loss, the
  held-out pass@1 of its starting point, and its held-out pass@1, format-error rate and tokens
  per task (mean +- sd over seeds)."""
  lines = ["| fine-tuning | trained parameters | training loss (last 50 steps) | pass@1 at "
           "the start | pass@1 | format errors | tokens per task |",
           "|---|---|---|---|---|---|---|"]
  for name, row in summary.items():
    lines.append(f"| {name} | {row['trained_params']['mean']:,.0f} | {cell(row['train_loss'])} | "
                 f"{cell(row['start_pass@1'])} | {cell(row['pass@1'])} | "
                 f"{cell(row['format_error_rate'])} | {cell(row['tokens_per_task'], 1)} |")
  return "\n".join(lines)


def plot(report: Mapping[str, Any], path: str) -> str | None:
  """Writes held-out pass@1 and the final training loss of each cell (every seed's point and
  the mean); returns the path, or None without matplotlib."""
  figure = new_figure(2, (10, 4))
  if figure is None:
    return None
  plt, fig, axes = figure
  names = list(report["summary"])
  for ax, metric, label in ((axes[0], "pass@1", "held-out pass@1"),
                            (axes[1], "train_loss", "training loss, last 50 steps")):
    for x, name in enumerate(names):
      stat = report["summary"][name][metric]
      ax.scatter([x] * len(stat["values"]), stat["values"], color="0.6", s=14)
      ax.errorbar([x], [stat["mean"]], yerr=[stat["sd"]], marker="o", capsize=4)
      if metric == "pass@1":  # where the cell started (the prefix of the main job's SFT)
        start = report["summary"][name]["start_pass@1"]["mean"]
        ax.scatter([x], [start], marker="x", color="k", label="start" if x == 0 else None)
    if metric == "pass@1":
      ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel=label)
    ax.margins(x=0.3)
    ax.grid(alpha=0.3)
  return save_figure(plt, fig, report, path)
