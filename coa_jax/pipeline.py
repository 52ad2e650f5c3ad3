"""The end-to-end recipe: world -> distil (teacher) -> filter -> SFT -> evaluate -> DAPO ->
evaluate, and a table of the teacher system, the AFM after SFT and after DAPO on held-out
tasks.

`run(config)` is `experiments/pipeline.py`; each stage is the library job of that stage
(`distill.run`, `sft.run`, `evaluate.run`, `rl.dapo.run`) on a config derived from the
pipeline config, writing under config.output_dir/<stage>. Stages whose outputs exist are
reused, so a re-run resumes where the last one stopped.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ml_collections

from coa_jax import distill, evaluate, sft
from coa_jax.metrics import say
from coa_jax.rl import dapo
from configs import common, dapo_tiny_cpu, evaluate_tiny, sft_tiny_cpu

COLUMNS = ("pass@1", "tokens_per_task", "tool_calls_per_task", "format_error_rate")


def _stage(name: str, path: str) -> bool:
  """Returns whether a stage's output exists (and says so), so the stage can be skipped."""
  if os.path.exists(path):
    say(f"== {name}: reusing {path}")
    return True
  say(f"== {name}")
  return False


def stage_configs(config: Any) -> dict[str, ml_collections.ConfigDict]:
  """Returns the configs of every stage, derived from the pipeline config."""
  out = os.path.abspath(config.output_dir)
  world_dir = os.path.join(out, "distill", "world")
  model = dict(config.model)

  distill_config = ml_collections.ConfigDict(dict(
      world=config.world, teacher=config.teacher, filters=config.filters,
      system_prompt=config.system_prompt, workers=config.workers,
      output_dir=os.path.join(out, "distill")))

  sft_config = sft_tiny_cpu.get_config()
  sft_config.seed = config.seed
  sft_config.model = common.model(**model)
  sft_config.mesh = config.mesh
  sft_config.data = common.data(os.path.join(out, "distill", "trajectories.jsonl"),
                                num_epochs=1000)
  sft_config.seq_len, sft_config.batch_size = config.sft.seq_len, config.sft.batch_size
  sft_config.optimizer = common.optimizer(
      learning_rate=config.sft.learning_rate, warmup_steps=config.sft.warmup_steps,
      schedule="cosine", total_steps=config.sft.steps, weight_decay=0.0)
  sft_config.train = common.train(steps=config.sft.steps, log_every=config.log_every)
  sft_config.checkpoint = common.checkpoint(os.path.join(out, "sft", "checkpoints"),
                                            every=config.sft.steps, max_to_keep=1)
  sft_config.workdir = os.path.join(out, "sft")
  sft_config.export_dir = os.path.join(out, "sft", "hf_export")

  tools = ml_collections.ConfigDict()  # the world's tools, once distillation has written them
  if os.path.exists(os.path.join(world_dir, "tools.json")):
    with open(os.path.join(world_dir, "tools.json")) as f:
      tools = ml_collections.ConfigDict(json.load(f))

  def evaluation(system: str, checkpoint: str, name: str) -> ml_collections.ConfigDict:
    cfg = evaluate_tiny.get_config()
    cfg.system, cfg.seed, cfg.k = system, config.seed, config.eval.k
    cfg.model = common.model(**model)
    cfg.model.checkpoint = checkpoint
    cfg.mesh = config.mesh
    cfg.tasks = os.path.join(world_dir, "heldout.jsonl")
    cfg.max_tasks = config.eval.max_tasks
    cfg.batch_size = config.eval.batch_size
    cfg.rollout.update(dict(config.rollout), group_size=config.eval.k)
    cfg.sampling, cfg.system_prompt = config.sampling, config.system_prompt
    cfg.tools = tools
    cfg.teacher = config.teacher
    cfg.output_dir = os.path.join(out, name)
    return cfg

  dapo_config = dapo_tiny_cpu.get_config()
  dapo_config.seed = config.seed
  dapo_config.model = common.model(**model)
  dapo_config.mesh = config.mesh
  dapo_config.model.checkpoint = sft_config.export_dir
  dapo_config.tasks = os.path.join(world_dir, "train.jsonl")
  dapo_config.eval_tasks = ""  # the pipeline evaluates after DAPO
  dapo_config.batch_size = config.dapo.batch_size
  dapo_config.sampling, dapo_config.system_prompt = config.sampling, config.system_prompt
  dapo_config.rollout = ml_collections.ConfigDict(dict(config.rollout))
  dapo_config.rollout.group_size = config.dapo.group_size
  dapo_config.tools = tools
  dapo_config.rewards.format_penalty = config.dapo.get("format_penalty", 0.0)
  dapo_config.rl = common.rl(**dict(config.dapo.rl))
  dapo_config.optimizer = common.optimizer(learning_rate=config.dapo.learning_rate,
                                           schedule="constant", weight_decay=0.0)
  dapo_config.checkpoint = common.checkpoint(os.path.join(out, "dapo", "checkpoints"),
                                             every=config.dapo.rl.steps, max_to_keep=1)
  dapo_config.workdir = os.path.join(out, "dapo")
  dapo_config.export_dir = os.path.join(out, "dapo", "hf_export")

  return {"distill": distill_config, "sft": sft_config, "dapo": dapo_config,
          "eval_teacher": evaluation("teacher", "", "eval_teacher"),
          "eval_sft": evaluation("model", sft_config.export_dir, "eval_sft"),
          "eval_dapo": evaluation("model", dapo_config.export_dir, "eval_dapo")}


def _metrics(cfg: Any) -> dict[str, Any]:
  path = os.path.join(cfg.output_dir, "metrics.json")
  if not _stage(f"evaluate {cfg.system} {cfg.model.checkpoint}", path):
    evaluate.run(cfg)
  with open(path) as f:
    return json.load(f)


def plot(rows: dict[str, dict[str, Any]], path: str) -> str | None:
  """Writes bar charts of the table's columns to `path`; returns it (None without matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, axes = plt.subplots(1, len(COLUMNS), figsize=(4 * len(COLUMNS), 3.5))
  for ax, column in zip(axes, COLUMNS):
    ax.bar(list(rows), [rows[name][column] for name in rows], color=["#888", "#4a7", "#47a"])
    ax.set_title(column)
  fig.suptitle("held-out tasks: teacher system vs AFM after SFT and after DAPO")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def run(config: Any) -> dict[str, Any]:
  """Runs every stage; returns the final table (also written as results.json and a PNG)."""
  start = time.perf_counter()
  os.makedirs(config.output_dir, exist_ok=True)
  configs = stage_configs(config)
  if not _stage("distill", os.path.join(config.output_dir, "distill", "trajectories.jsonl")):
    distill.run(configs["distill"])
  configs = stage_configs(config)  # the tools spec now exists
  if not _stage("sft", configs["sft"].export_dir):
    sft.run(configs["sft"])
  rows = {"teacher": _metrics(configs["eval_teacher"]), "sft": _metrics(configs["eval_sft"])}
  if not _stage("dapo", configs["dapo"].export_dir):
    dapo.run(configs["dapo"])
  rows["dapo"] = _metrics(configs["eval_dapo"])
  table = evaluate.format_table(rows, config.eval.k)
  say(table)
  results = {"rows": rows, "table": table, "wall_s": time.perf_counter() - start,
             "plot": plot(rows, os.path.join(config.output_dir, "results.png"))}
  with open(os.path.join(config.output_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  say(f"pipeline done in {results['wall_s']:.0f}s; results in {config.output_dir}")
  return results
