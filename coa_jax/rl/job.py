"""The RL job: `run(config)` behind `experiments/dapo.py` (DAPO, or PPO with rl.advantage =
"gae"), synchronous (`coa_jax.rl.dapo.Trainer`) or asynchronous with rl.async.enabled
(`coa_jax.rl.async_trainer.AsyncTrainer`), on the job scaffold `coa_jax.train.loop`.

The run resumes from its newest checkpoint (with a critic, actor and critic together), writes
metrics.jsonl, TensorBoard events and dapo.png (async.png too when asynchronous) under
config.workdir, with rollouts.jsonl, the last step's samples token by token (`rl.rollout_log`, for
the trajectory viewer, `coa_jax.evaluation.viewer`), and exports the trained policy as an HF
folder at config.export_dir, and a critic beside it (`critic_export_dir`) as a one-label token
classifier (verl's format); both exports hold the tokenizer (`data.hf_tokenizer.export_files`),
and every checkpoint the tokenizer's tag mapping.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np

from coa_jax.data import hf_tokenizer
from coa_jax.model import lora
from coa_jax.rl import async_trainer, dapo
from coa_jax.rl import critic as critic_lib
from coa_jax.rl import rollout_log
from coa_jax.rl.settings import rl_settings
from coa_jax.runtime import distributed, hf_checkpoint, paths
from coa_jax.runtime.distributed import say
from coa_jax.train import LoopConfig, run_loop
from tools_env import sandbox


def critic_export_dir(export_dir: str) -> str:
  """Returns where the critic is exported beside the policy's HF folder `export_dir`."""
  return export_dir.rstrip("/") + "_critic"


def run(config: Any) -> dict[str, Any]:
  """Trains per `config` (a ConfigDict, checked by `rl_settings`, or RLSettings); returns a
  summary (rewards, accuracy, steps, paths, and the isolation the code tool and the code reward
  ran programs under)."""
  settings = rl_settings(config)
  rl = settings.rl
  plot_keys, shown = dapo.PLOT_KEYS, dapo.SHOWN
  if rl.async_.enabled:
    trainer = async_trainer.AsyncTrainer(settings)
    plot_keys, shown = async_trainer.PLOT_KEYS, async_trainer.SHOWN
    say(f"asynchronous: rollouts on {trainer.host.devices.size} device(s) per host, updates on "
        f"{trainer.mesh.devices.size}, staleness <= {rl.async_.staleness}")
  else:
    trainer = dapo.Trainer(settings)
  name = "DAPO"
  if trainer.critic is not None:
    name = "PPO"
    plot_keys, shown = plot_keys + critic_lib.PLOT_KEYS, shown + critic_lib.SHOWN
  say(f"{name}: {trainer.model_config.num_params():,} params on mesh {dict(trainer.mesh.shape)}; "
      f"{len(trainer.tasks)} tasks, {rl.batch_groups} groups x {trainer.n} samples per step in "
      f"{rl.batch_groups // rl.mini_batch_groups} mini-batch(es); "
      f"{len(trainer.eval_tasks)} held-out tasks")
  files = hf_tokenizer.export_files(trainer.tokenizer, dataclasses.asdict(settings.sampling))
  loop = LoopConfig(steps=rl.steps, workdir=settings.workdir, checkpoint=settings.checkpoint,
                    log_every=rl.log_every, stop_after=rl.stop_after,
                    nonfinite_skips=rl.nonfinite_skips,
                    export_dir=settings.export_dir, export_dtype=settings.export_dtype,
                    base_checkpoint=settings.model.checkpoint, unit="samples",
                    units_per_step=rl.batch_groups * trainer.n, shown=shown,
                    plot_keys=plot_keys, plot_file="dapo.png", title=name,
                    tokenizer=trainer.tokenizer, export_files=files)
  try:
    result = run_loop(trainer, loop, trainer.abstract_checkpoint(), trainer.model_config)
  finally:  # agreed, as gathers follow
    distributed.agreed(trainer.close, "closing the trainer's tools and endpoint")
  # The weakest isolation any host ran code under: the code tool's, and the code reward's.
  summary = dict(result.summary(), state=trainer.state,
                 sandbox_isolation=sandbox.weakest(distributed.gather_json(
                     sandbox.isolation_of(trainer.engine.tools.tools))),
                 reward_sandbox_isolation=sandbox.weakest(distributed.gather_json(
                     trainer.rewarder.sandbox_isolation())))
  if trainer.critic is not None:
    summary["critic_state"] = trainer.critic.state
  if "critic_state" in summary and result.export_dir:
    summary["critic_export_dir"] = critic_export_dir(result.export_dir)
    params, model_config = trainer.critic.state.model_params(), trainer.model_config
    if model_config.lora_rank:  # the critic's adapters merged into its copy of the base
      params, model_config = lora.merge(params, model_config), model_config.replace(lora_rank=0)
    hf_checkpoint.save_checkpoint(  # a value model generates nothing: no generation defaults
        summary["critic_export_dir"], model_config, params, dtype=settings.export_dtype,
        head="value", files={k: v for k, v in files.items() if k != hf_tokenizer.GENERATION_FILE})
    say(f"exported the critic to {summary['critic_export_dir']}")
  report = trainer.prompt_report() if rl.track_prompts else None  # a gather: before the writes
  if report is not None:
    summary["prompts"] = os.path.join(settings.workdir, "prompts.json")

  def write() -> None:  # process 0's files, agreed: the caller's next collective waits on them
    if jax.process_index():
      return
    if rl.async_.enabled and result.rows:
      summary["overlap_plot"] = async_trainer.plot_overlap(
          result.metrics, os.path.join(settings.workdir, "async.png"), rl.async_.staleness)
    if report is not None:
      paths.to_epath(summary["prompts"]).write_text(json.dumps(report, indent=1))
    if trainer.last_batch is not None:  # for reading: never fatal
      try:
        rows = rollout_log.rollout_rows(*trainer.last_batch, trainer.tokenizer,
                                        trainer.tasks, trainer.rewarder.tool_tags)
        paths.to_epath(os.path.join(settings.workdir, rollout_log.ROLLOUTS)).write_text(
            "".join(json.dumps(row) + "\n" for row in rows))
      except Exception as e:  # noqa: BLE001
        say(f"{rollout_log.ROLLOUTS} not written: {type(e).__name__}: {e}")

  distributed.agreed(write, f"writing the RL reports in {settings.workdir}")
  if result.rows:
    # The rollouts' own accuracy (at the sampling temperature) averaged over the first and the
    # last quarter of the steps: one step's batch is too few samples to compare.
    window = max(len(result.rows) // 4, 1)
    first, final = ({k: float(np.mean([r[k] for r in rows])) for k in ("reward", "accuracy")}
                    for rows in (result.rows[:window], result.rows[-window:]))
    summary.update(first_reward=first["reward"], final_reward=final["reward"],
                   first_accuracy=first["accuracy"], final_accuracy=final["accuracy"])
    span = f"{window} step{'s' * (window > 1)}"
    say(f"rollout reward {first['reward']:.3f} -> {final['reward']:.3f}, rollout accuracy "
        f"{first['accuracy']:.3f} -> {final['accuracy']:.3f} (training rollouts, means of "
        f"the first and the last {span}); plot {result.plot}")
  return summary
