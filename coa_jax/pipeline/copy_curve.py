"""The copy curve: when (and whether) each seed's SFT learns to copy values out of
observations, probed every few steps on the held-out teacher trajectories
(`experiments/copy_curve.py`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from coa_jax import evaluation, sft
from coa_jax.data.tokenizer import load_tokenizer
from coa_jax.model import Transformer
from coa_jax.pipeline.job import StageConfigs, Stages, StageTimes, distill_stage
from coa_jax.pipeline.results import pyplot
from coa_jax.runtime import load_model, sharding
from coa_jax.runtime.distributed import say


def copy_curve(config: Any, stage_configs: StageConfigs, seeds: int,
               every: int) -> dict[int, list[dict[str, Any]]]:
  """Trains the SFT stage of `seeds` seeds, stopping every `every` steps to run the copy probe
  on the held-out trajectories: when (and whether) each seed learns to copy. Distils first
  unless the distilled data exist. Writes copy_curve/copy_curve.json and .png; returns the
  curves (seed -> list of {step, loss, probe metrics})."""
  if seeds < 1 or every < 1:
    raise ValueError(f"seeds={seeds}, every={every}: expected at least 1 of each")
  stages = Stages(config, stage_configs)
  output_dir, first_seed = stages.settings.output_dir, stages.settings.seed
  times = StageTimes(os.path.join(output_dir, "stage_seconds.json"))
  os.makedirs(output_dir, exist_ok=True)
  distill_stage(stages.of(), times)
  out_dir = os.path.join(output_dir, "copy_curve")
  first = stages.of()  # rebuilt: the stages' tool spec is the one distillation wrote
  train, evaluate = first["sft"], first["eval_sft"]
  tokenizer = load_tokenizer(train.tokenizer, train.model.checkpoint, train.tools)
  model_config, _ = load_model(train.model, tokenizer, sharding.make_mesh(train.mesh))
  model = Transformer(model_config)
  heldout = evaluation.probe_trajectories(evaluate.copy_probe, tokenizer.tool_tags)
  examples = evaluation.copy_examples(heldout, tokenizer, train.seq_len)
  curves: dict[int, list[dict[str, float]]] = {}
  for seed in range(first_seed, first_seed + seeds):
    settings = stages.of(seed)["sft"]
    workdir = os.path.join(out_dir, f"seed-{seed}")
    settings = dataclasses.replace(
        settings, workdir=workdir, export_dir="",
        checkpoint=dataclasses.replace(settings.checkpoint, every=every,
                                       directory=os.path.join(workdir, "checkpoints")),
        train=dataclasses.replace(settings.train, stop_after=every))
    curves[seed] = []
    steps = 0
    while steps < settings.train.steps:  # each run resumes from the last segment's checkpoint
      out = sft.run(settings)
      if out["steps"] == steps:
        raise RuntimeError(f"seed {seed}: SFT made no progress past step {steps}")
      steps = out["steps"]
      probe = evaluation.copy_accuracy(model, out["state"].params, examples,
                                       temperature=evaluate.sampling.temperature)
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
