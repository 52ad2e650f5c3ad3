"""One of two processes of tests/test_host_agreement.py: decisions that precede a collective
are the same on every process.

usage: python tests/agreement_worker.py OUT_DIR PROCESS_ID PORT

Scenarios, in order, each process writing OUT_DIR/<scenario>-<process>.json:
- failure: process 1's host-side work raises; `distributed.agreed` ends both;
- out-of-step: the processes gather at different places; both raise, naming them;
- unreadable: a checkpoint step whose metadata only process 1 cannot read is set aside by both,
  which restore the previous step;
- mismatch: a checkpoint that does not fit the run raises on both and moves nothing;
- cache: a cached value only process 0 finds is taken by both, neither computing (the
  computation runs a collective); a value neither finds is computed by both, process 0's is
  returned on both and only process 0 stores it;
- pipeline: the quick main job runs every stage on both processes, the teacher on process 0
  alone;
- unshared: an output folder that is each process's own is an error on both;
- preemption: process 1 alone gets SIGINT (Ctrl-C on its host), which it sends on as the
  SIGTERM a preemption is; both save at one step and stop.
"""

import faulthandler
import json
import os
import signal
import sys
import time

out, process_id, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump of a hang

import jax
import jax.numpy as jnp
import numpy as np

from coa_jax.runtime import distributed
from coa_jax.runtime.cache import cached_json, check_shared, write_json
from coa_jax.runtime.checkpointing import Checkpointer
from coa_jax.train.loop import LoopConfig, run_loop
from configs import common
from state_job import StateJob, join

MESH, SHARDED = join(process_id, port)
# Every step's program sums over both processes' shards: a process that stopped or saved alone
# would leave the other waiting in it.
ADD_ONE = jax.jit(lambda w: w + 1.0 + 0.0 * jnp.sum(w), out_shardings=SHARDED)


def write(scenario: str, **result) -> None:
  with open(os.path.join(out, f"{scenario}-{process_id}.json"), "w") as f:
    json.dump(result, f)


def outcome(fn) -> dict:
  """Returns what fn() did: its value, or the type and message of what it raised."""
  try:
    return {"value": fn()}
  except Exception as e:  # noqa: BLE001 - the test checks what each process raised
    return {"error": type(e).__name__, "message": str(e)}


def weights(value: float, size: int = 4) -> jax.Array:
  return jax.make_array_from_callback((size,), SHARDED,
                                      lambda index: np.full((size // 2,), value, np.float32))


def abstract(size: int = 4) -> dict:
  return {"w": jax.ShapeDtypeStruct((size,), jnp.float32, sharding=SHARDED)}


def failing_work() -> str:
  if process_id == 1:
    raise ValueError("the code tool crashed")
  time.sleep(1.0)  # the other process is still working when process 1 fails
  return "done"


write("failure", **outcome(lambda: distributed.agreed(failing_work, "a test")))


def out_of_step() -> list:
  """Process 1 gathers elsewhere than process 0: it left a computation early and reports its
  error while process 0 gathers inside it."""
  if process_id == 1:
    return distributed.gather_json("an error", "leaving early")
  return distributed.gather_json(process_id, "inside")


write("out-of-step", **outcome(out_of_step))

directory = os.path.join(out, "ckpt")
checkpointer = Checkpointer(directory, async_save=False)
for step in (1, 2):
  checkpointer.save(step, {"w": weights(float(step))}, {"position": step})
checkpointer.close()
checkpointer = Checkpointer(directory, async_save=False)
if process_id == 1:  # only this process cannot read step 2's metadata (a truncated file)
  item_metadata = checkpointer._manager.item_metadata

  def flaky(step):
    if step == 2:
      raise ValueError("OUT_OF_RANGE: Error reading _METADATA: a truncated file")
    return item_metadata(step)

  checkpointer._manager.item_metadata = flaky


def restored_step():
  step, state, data = checkpointer.restore_latest(abstract())
  return [step, float(np.asarray(state["w"].addressable_data(0))[0]), data["position"]]


write("unreadable", **outcome(restored_step))
checkpointer.close()
write("mismatch", **outcome(lambda: Checkpointer(directory).restore_latest(abstract(size=8))),
      steps=sorted(os.listdir(directory)))

computed = []


def compute() -> dict:
  computed.append(process_id)
  ADD_ONE(weights(0.0)).block_until_ready()  # a global program: both must run it
  return {"process": process_id}


if process_id == 0:  # only process 0's cache holds the value
  write_json(os.path.join(out, "hit-0.json"), {"key": {"k": 1}, "value": "stored"})
hit = cached_json(os.path.join(out, f"hit-{process_id}.json"), {"k": 1}, compute)
miss = cached_json(os.path.join(out, f"miss-{process_id}.json"), {"k": 2}, compute)
write("cache", hit=hit, miss=miss, computed=len(computed))


def quick_pipeline() -> dict:
  """The quick main job on both processes (its stages' completion checks and reads are
  collectives); only process 0 runs the teacher."""
  from coa_jax import distill, pipeline
  from configs import pipeline_tiny_cpu

  config = pipeline_tiny_cpu.quick(pipeline_tiny_cpu.get_config())
  config.output_dir = os.path.join(out, "pipeline")
  config.mesh = common.mesh(data=1, fsdp=2, tensor=1)
  run = distill.run

  def marked(settings):
    write_json(os.path.join(out, f"distilled-{process_id}.json"), {})
    return run(settings)

  distill.run = marked
  results = pipeline.run(config, pipeline_tiny_cpu.stage_configs)
  return {"table": results["table"], "stages": sorted(results["stage_seconds"])}


write("pipeline", **outcome(quick_pipeline))
own = os.path.join(out, f"own-{process_id}")  # each host's own disk
os.makedirs(own)
write("unshared", **outcome(lambda: check_shared(own, "output_dir", wait_s=0.5)))


class Counter(StateJob):
  """A job whose every step is a global program; process 1 gets SIGINT during step 3."""

  def __init__(self):
    self.state = {"w": weights(0.0)}

  def step(self, step):
    if process_id == 1 and step == 3:
      os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    self.state = {"w": ADD_ONE(self.state["w"])}
    return {"loss": float(step)}


checkpoint = common.checkpoint(os.path.join(out, "preempt"), every=1000, async_save=False)
result = run_loop(Counter(), LoopConfig(steps=200, workdir=os.path.join(out, "work"),
                                        checkpoint=checkpoint, log_every=1000),
                  abstract(), model_config=None)
write("preemption", steps=result.steps, stopped_by_signal=result.stopped_by_signal,
      saved=sorted(os.listdir(os.path.join(out, "preempt"))))

