"""One of two processes of tests/test_host_failures.py: host-side work before a collective fails
on one process, and both processes exit with that error instead of one waiting for the other.

usage: python tests/failure_worker.py SCENARIO OUT_DIR PROCESS_ID PORT

Scenarios (the process that fails in brackets); the worker runs the library code that fails,
and the error, uncaught, ends the process:
- cache-read [0]: process 0's cached file is not JSON (the others have none to read);
- cache-compute [1]: the cached computation (host-side work) raises on process 1;
- sft-data [1]: process 1's SFT batch iterator raises (an unreadable shard), not exhaustion;
- export [0]: process 0's disk is full while it writes an HF export between the gathers;
- set-aside [0]: process 0 cannot rename a damaged checkpoint step out of the way;
- metrics [0]: process 0 cannot write a step's metrics row (a full disk); both stop at the
  next save, having gone on stepping together until then;
- metrics-close [0]: process 0's metric file fails as it closes (a gs:// upload at the end);
- agent-start [1]: process 1 cannot import the RL job's agent program (the module is missing on
  its machine); process 0 has started its endpoint;
- rl-batch [1]: a sample of process 1's RL step does not fit the update (a record whose ids and
  log-probs differ in length), before the step's first global program.
"""

import errno
import faulthandler
import os
import resource
import signal
import sys
import types

scenario, out, process_id, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump of a hang

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from coa_jax.model import Transformer, get_preset  # noqa: E402
from coa_jax.rl import dapo  # noqa: E402
from coa_jax.rl import job as rl_job  # noqa: E402
from coa_jax.rl.dynamic_sampling import ScoredGroup  # noqa: E402
from coa_jax.rollout.tool_loop import RolloutRecord  # noqa: E402
from coa_jax.runtime import hf_checkpoint, sharding  # noqa: E402
from coa_jax.runtime.cache import cached_json  # noqa: E402
from coa_jax.runtime.checkpointing import Checkpointer  # noqa: E402
from coa_jax.sft.job import SFTJob  # noqa: E402
from coa_jax.train import writers  # noqa: E402
from coa_jax.train.loop import LoopConfig, run_loop  # noqa: E402
from configs import common, dapo_tiny_cpu  # noqa: E402
from state_job import StateJob, join  # noqa: E402

MESH, SHARDED = join(process_id, port)


def global_sum() -> float:
  """A global program: each process waits in it for the other."""
  w = jax.make_array_from_callback((2,), SHARDED, lambda index: np.ones((1,), np.float32))
  return float(jax.jit(jnp.sum)(w))


def cache_read() -> None:
  path = os.path.join(out, f"cache-{process_id}.json")
  if process_id == 0:
    with open(path, "w") as f:
      f.write('{"key": {"k": 1}, "value": ')  # cut short by hand: atomic writes never leave it
  cached_json(path, {"k": 1}, global_sum)


def cache_compute() -> None:
  def compute() -> dict:  # host-side work (a teacher's evaluation, a report)
    if process_id == 1:
      raise ValueError("the evaluation's tool crashed")
    return {"process": process_id}

  cached_json(os.path.join(out, f"compute-{process_id}.json"), {"k": 1}, compute)


class Shards:
  """An SFT batch iterator whose shard cannot be read on process 1."""

  def __next__(self):
    if process_id == 1:
      raise OSError(errno.EIO, "Input/output error", "shard-00001.jsonl")
    return {"ids": np.zeros((1, 4), np.int32)}


def sft_data() -> None:
  SFTJob(state=None, batches=Shards(), step_fn=None, mesh=MESH).step(1)


def export() -> None:
  config = get_preset("tiny", num_layers=1, vocab_size=128)
  params = sharding.init_params(Transformer(config), MESH, jax.random.key(0))
  limit = resource.getrlimit(resource.RLIMIT_FSIZE)
  if process_id == 0:  # a full disk: every write past 0 bytes fails with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limit[1]))
  try:
    hf_checkpoint.save_checkpoint(os.path.join(out, "export"), config, params, dtype="float32")
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)  # the log can take the traceback


def set_aside() -> None:
  directory = os.path.join(out, "ckpt")
  checkpointer = Checkpointer(directory, async_save=False)
  replicated = NamedSharding(MESH, P())
  for step in (1, 2):
    w = jax.make_array_from_callback((4,), replicated, lambda i, s=step: np.full((4,), s, "f4"))
    checkpointer.save(step, {"w": w}, {})
  checkpointer.close()
  if process_id == 0:  # step 2 is damaged; process 0 may not rename it
    os.remove(os.path.join(directory, "2", "state", "_METADATA"))

    def refuse(self, target):
      raise PermissionError(errno.EACCES, "Permission denied", str(self))

    type(epath.Path(directory)).rename = refuse
  abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=replicated)}
  Checkpointer(directory).restore_latest(abstract)


class Steps(StateJob):
  """A job whose every step is a global program."""

  def __init__(self):
    self.state = {"w": jax.make_array_from_callback((2,), SHARDED,
                                                    lambda index: np.zeros((1,), np.float32))}

  def step(self, step):
    self.state = {"w": jax.jit(lambda w: w + 1.0 + 0.0 * jnp.sum(w))(self.state["w"])}
    return {"loss": float(step)}


def metrics() -> None:
  if process_id == 0:
    def full_disk(self, step, scalars):
      raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")

    writers.MetricWriter.write_scalars = full_disk
  abstract = {"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=SHARDED)}
  config = LoopConfig(steps=10, workdir=os.path.join(out, "work"), log_every=100,
                      checkpoint=common.checkpoint(os.path.join(out, "steps"), every=4,
                                                   async_save=False))
  run_loop(Steps(), config, abstract, model_config=None)


def metrics_close() -> None:
  if process_id == 0:
    def failed_upload(self):
      raise OSError(errno.EIO, "Input/output error", "gs://bucket/work/metrics.jsonl")

    writers.MetricWriter.close = failed_upload
  abstract = {"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=SHARDED)}
  config = LoopConfig(steps=2, workdir=os.path.join(out, "work"), log_every=100, checkpoint=None)
  run_loop(Steps(), config, abstract, model_config=None)


def agent_start() -> None:
  config = dapo_tiny_cpu.get_config()
  config.model.checkpoint, config.max_tasks, config.eval_tasks = "", 8, ""
  config.mesh, config.batch_size = common.mesh(data=2, fsdp=1, tensor=1), 8
  config.rl = common.rl(steps=1, batch_groups=2, prompts_per_round=2, mini_batch_groups=2,
                        dynamic_sampling=False, agent=("test_serving_rl:low_ids_agent"
                                                       if process_id == 0 else "gone:agent"))
  config.workdir, config.export_dir = os.path.join(out, f"rl-{process_id}"), ""
  rl_job.run(config)


def rl_batch() -> None:
  trainer = object.__new__(dapo.Trainer)  # the parts an update reads before its programs
  rl = types.SimpleNamespace(advantage="std", advantage_eps=1e-6, negative_weight=1.0,
                             overlong_filter=False, mini_batch_groups=2)
  trainer.settings = types.SimpleNamespace(rl=rl, sampling=types.SimpleNamespace(truncates=False))
  trainer.critic, trainer.hosts, trainer.host_index, trainer.n = None, 2, process_id, 2
  trainer.seq_len, trainer.mesh = 8, MESH
  trainer._with_old_logprobs = lambda batches: global_sum()  # the step's first global program
  logprobs = [0.0, -0.5, -0.5] if process_id == 0 else [0.0, -0.5]
  records = [RolloutRecord("t", i, [1, 2, 3], [0, 1, 1], logprobs, 1, [0, 0, 0]) for i in (0, 1)]
  trainer._train_on([ScoredGroup("t", records, [1.0, 0.0], [True, False])], step=1)


SCENARIOS = {"cache-read": cache_read, "cache-compute": cache_compute, "sft-data": sft_data,
             "export": export, "set-aside": set_aside, "metrics": metrics,
             "metrics-close": metrics_close, "agent-start": agent_start, "rl-batch": rl_batch}
SCENARIOS[scenario]()
global_sum()  # not reached: a process that got here would wait for the other in this program
print("no error", flush=True)
