"""One process of the multi-host test (tests/test_multihost.py), or the one-process reference.

usage: python tests/multihost_worker.py OUT_DIR NUM_PROCESSES PROCESS_ID PORT

Runs, on one global 8-device mesh: SFT for 2 steps, then 2 more resumed from the orbax
checkpoint both processes wrote (each process reads its own data shard), then one DAPO step
whose rollouts each host decodes on its own devices with its own tools, then an evaluation of
the DAPO export (each host its share of the tasks), then one PPO step (a critic beside the
policy, both sharded over both processes), then 2 steps of asynchronous DAPO (each host decodes
on half its devices; the other halves train) with staleness 1 (two processes only: nothing
compares it to one), and 2 with staleness 0 (whose batches do not depend on timing, so one
process is its reference). Process 0 writes OUT_DIR/result.json; SFT, DAPO and PPO (its critic
too) export HF folders.
"""

import faulthandler
import json
import signal
import sys

out, processes, process_id, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump of a hang
faulthandler.enable(all_threads=True)  # and the stacks of an abort (XLA's collective timeout)

import jax

from coa_jax.evaluation import job as evaluate
from coa_jax.rl import job as rl_job
from coa_jax.runtime import distributed
from coa_jax.sft import job as sft
from configs import common, dapo_tiny_cpu, evaluate_tiny, sft_tiny_cpu

if processes > 1:
  distributed.initialize(distributed.DistributedConfig(
      mode="explicit", coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
      process_id=process_id))
assert jax.device_count() == 8, jax.devices()
MESH = common.mesh(data=2, fsdp=2, tensor=2)


def sft_config(stop_after: int):
  config = sft_tiny_cpu.get_config()
  config.mesh, config.batch_size, config.seq_len = MESH, 8, 256
  config.data.shards = 2  # the same batches on 1 or 2 processes
  config.train = common.train(steps=4, stop_after=stop_after, log_every=1)
  config.optimizer = common.optimizer(learning_rate=3e-3, warmup_steps=0, schedule="constant",
                                      weight_decay=0.0)
  config.checkpoint = common.checkpoint(f"{out}/sft/ckpt", every=2, async_save=False)
  config.workdir, config.export_dir = f"{out}/sft", f"{out}/sft/hf_export"
  return config


def dapo_config():
  config = dapo_tiny_cpu.get_config()
  config.model.checkpoint = f"{out}/sft/hf_export"
  config.mesh, config.max_tasks, config.eval_tasks = MESH, 8, ""
  config.batch_size, config.chunk = 8, 16
  config.sampling.temperature = 1.0
  config.rollout.update(group_size=2, max_response_tokens=48, max_observation_tokens=32,
                        max_turns=2)
  config.rl = common.rl(steps=1, batch_groups=4, prompts_per_round=4, max_rounds=1,
                        mini_batch_groups=2, overlong_cache=16, dynamic_sampling=False)
  config.optimizer = common.optimizer(learning_rate=1e-3, schedule="constant", weight_decay=0.0)
  config.checkpoint = common.checkpoint(f"{out}/dapo/ckpt", every=1, async_save=False)
  config.workdir, config.export_dir = f"{out}/dapo", f"{out}/dapo/hf_export"
  return config


def evaluate_config():
  config = evaluate_tiny.get_config()
  dapo = dapo_config()
  for field in ("mesh", "tokenizer", "system_prompt", "tasks", "tools", "rollout", "rewards"):
    config[field] = dapo[field]
  config.model.checkpoint, config.max_tasks, config.k = dapo.export_dir, 6, 2
  config.batch_size, config.chunk, config.output_dir = 8, 16, f"{out}/eval"
  return config


def ppo_config():
  """PPO: the DAPO step's settings with a critic (rl.advantage = "gae")."""
  config = dapo_config()
  config.rl.advantage = "gae"
  config.checkpoint = common.checkpoint(f"{out}/ppo/ckpt", every=1, async_save=False)
  config.workdir, config.export_dir = f"{out}/ppo", f"{out}/ppo/hf_export"
  return config


def async_dapo_config(staleness: int, name: str):
  """Asynchronous DAPO: each host decodes on half its devices, every host's other half train."""
  config = dapo_config()
  config.mesh = common.mesh(data=1, fsdp=2, tensor=2)
  config.rl.steps = 2
  config.rl["async"].update(enabled=True, staleness=staleness)
  config.checkpoint = common.checkpoint(f"{out}/{name}/ckpt", every=2, async_save=False)
  config.workdir, config.export_dir = f"{out}/{name}", f"{out}/{name}/hf_export"
  return config


first = sft.run(sft_config(stop_after=2))
second = sft.run(sft_config(stop_after=0))
rl = rl_job.run(dapo_config())
metrics = evaluate.run(evaluate_config())
ppo = rl_job.run(ppo_config())
if processes > 1:  # which groups make a batch depends on timing: no reference to compare
  rl_job.run(async_dapo_config(staleness=1, name="async"))
# With staleness 0 which groups make a batch does not depend on timing: a reference to compare.
rl_job.run(async_dapo_config(staleness=0, name="async0"))
if jax.process_index() == 0:
  rows = lambda path: [json.loads(line) for line in open(path)]
  with open(f"{out}/result.json", "w") as f:
    json.dump({"processes": jax.process_count(),
               "sft_steps": [first["steps"], second["steps"]],
               "sft_resumed_from": second["resumed_from"],
               "sft_loss": [r["loss"] for r in rows(f"{out}/sft/metrics.jsonl")],
               "dapo": rows(f"{out}/dapo/metrics.jsonl"), "eval": metrics,
               "ppo": rows(f"{out}/ppo/metrics.jsonl"),
               "async": rows(f"{out}/async/metrics.jsonl") if processes > 1 else None,
               "async0": rows(f"{out}/async0/metrics.jsonl")}, f)
print(f"process {jax.process_index()} done", flush=True)
