"""Asynchronous DAPO: rollouts on their own devices overlap the updates, with bounded staleness.

`AsyncTrainer` (config.rl.async.enabled) splits each host's devices in two: the first
`rl.async.rollout_devices` decode (a rollout mesh per host), the rest of every host form the
trainer mesh. A `RolloutWorker` thread per host keeps the rollout mesh busy: it starts groups
while the staleness budget allows (`coa_jax.rl.staleness`), runs their tools, scores them and
queues them; the main thread takes a batch of groups from the queue, updates, and pushes the
new weights to the rollout mesh (a device-to-device copy, cast to the compute dtype; across
hosts an all-gather first), where the worker picks them up before its next decode chunk. A LoRA
model's push moves its adapters and token rows only: the frozen base is copied once.

Partial rollouts: an unfinished sample continues with the new weights at once. Its KV cache,
computed by the older weights, is kept (recomputing it would cost a prefill of every row at
every push). Every token is tagged with the version that sampled it, and the importance weight
divides by the sampler's own log-probability, the distribution it actually drew from. A token
sampled over a cache that older weights wrote had a distribution that neither version gives, so
its behaviour version is the oldest among its row's tokens so far (`rl.batch.rollout_batch`).

The update is the decoupled objective (`coa_jax.losses.dapo`): the ratio is clipped against
the proximal policy (the trainer's weights when it takes the batch: the same teacher-forced
old log-probs as the synchronous step), and tokens whose behaviour version is older are
weighted by min(p_proximal / p_sampler, rl.async.weight_cap) (docs/async_rl.md says what that
leaves approximate). With staleness 0 the worker starts one
batch per version and no token is stale, so an update is the synchronous step's, bit for bit
on the same data and mesh. Dynamic sampling, overlong shaping and the format penalty work as
in the synchronous job (uniform groups give their place back; after rl.max_rounds x
rl.prompts_per_round of them in a row the run stops, as there).

Which groups make a batch depends on timing (tool latency, arrival order), so a run with
staleness > 0 is not bit-reproducible, and a resumed run skips the tasks that were in flight.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Any, Iterator

import jax
from flax import traverse_util
from jax.sharding import Mesh

from coa_jax.data import Task
from coa_jax.model import lora
from coa_jax.rl.dapo import Trainer, over_hosts
from coa_jax.rl.dynamic_sampling import DynamicSamplingError, ScoredGroup
from coa_jax.rl.settings import RLSettings
from coa_jax.rl.staleness import QueueClosed, StalenessQueue
from coa_jax.rollout import Rollout
from coa_jax.runtime import distributed, paths, sharding

PLOT_KEYS = ("reward", "accuracy", "response_len", "entropy", "stale", "behaviour_weight")
SHOWN = ("reward", "accuracy", "kept", "pg_loss", "queue_depth", "staleness_mean", "stale",
         "sampler_busy", "trainer_busy", "stale_dropped")


class _Stopped(Exception):
  """Raised inside the rollout loop to end the worker."""


class PolicyBox:
  """The newest pushed weights and their version, handed from the trainer to the worker."""

  def __init__(self, version: int, params: Any):
    self._lock = threading.Lock()
    self._latest = (version, params)

  def publish(self, version: int, params: Any) -> None:
    with self._lock:
      self._latest = (version, params)

  def latest(self) -> tuple[int, Any]:
    with self._lock:
      return self._latest


class RolloutWorker:
  """Generates scored groups on the rollout mesh in a thread, always with the newest weights."""

  def __init__(self, trainer: "AsyncTrainer", queue: StalenessQueue, box: PolicyBox):
    self.trainer, self.queue, self.box = trainer, queue, box
    base = trainer.engine
    if trainer.settings.rl.agent:  # an agent program's sessions, on an engine of their own
      self.engine = base.fork()
    else:
      self.engine = Rollout(base.sampler, None, base.tokenizer, base.tools, base.config,
                            base.system_prompt)
    self.engine.version, self.engine.params = box.latest()
    self.engine.key = jax.random.fold_in(jax.random.key(trainer.settings.seed), queue.version)
    self.engine.before_chunk = self._before_chunk
    rl = trainer.settings.rl
    self.max_rejected = rl.max_rounds * rl.prompts_per_round // trainer.hosts
    self.stop = threading.Event()
    self._lock = threading.Lock()
    self._generated: list[ScoredGroup] = []
    self._counts = self._no_counts()
    self._rejected_in_a_row = 0
    self._idle_s = 0.0
    self._issues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    self.thread = threading.Thread(target=self._run, name="rollout-worker", daemon=True)

  def start(self) -> None:
    self.thread.start()

  def close(self, timeout: float) -> None:
    """Stops the worker (at its next decode chunk or task) and waits up to `timeout` s."""
    self.stop.set()
    self.queue.close()
    if self.thread.is_alive():
      self.thread.join(timeout)
    if self.trainer.settings.rl.agent:
      self.engine.close()

  def drain(self) -> tuple[list[ScoredGroup], dict[str, int], float, int]:
    """Returns the groups scored since the last drain, the dynamic-sampling counts, the
    seconds the sampler sat idle (waiting for budget or for tools with no row decoding) and
    the tokens it sampled."""
    with self._lock:
      generated, counts = self._generated, dict(self._counts)
      self._generated, self._counts = [], self._no_counts()
      idle = self._idle_s + self.engine.tool_wait_s
      tokens = self.engine.tokens_sampled
      self._idle_s = self.engine.tool_wait_s = 0.0
      self.engine.tokens_sampled = 0
    return generated, counts, idle, tokens

  @staticmethod
  def _no_counts() -> dict[str, int]:
    return dict.fromkeys(("groups", "kept", "all_correct", "all_wrong"), 0)

  # --- the thread ----------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      for group in self.engine.run(self._tasks()):
        self._take(group)
    except (_Stopped, QueueClosed):
      pass
    except BaseException as e:  # noqa: BLE001 - the trainer re-raises it
      self.queue.close(e)

  def _take(self, records) -> None:
    seq = self._issues[records[0].task_id].popleft()
    group = self.trainer.score(records)
    drop = self.trainer.settings.rl.dynamic_sampling and group.uniform
    with self._lock:
      self._generated.append(group)
      self._counts["groups"] += 1
      if group.uniform:
        self._counts["all_correct" if all(group.correct) else "all_wrong"] += 1
      self._counts["kept"] += not drop
    if not drop:
      self._rejected_in_a_row = 0
      self.queue.put(seq, min(r.first_version for r in records), group)
      return
    self.queue.give_back()
    self._rejected_in_a_row += 1
    if self._rejected_in_a_row > self.max_rejected:
      raise DynamicSamplingError(
          f"{self._rejected_in_a_row} groups in a row had samples all correct or all wrong "
          f"(rl.max_rounds x rl.prompts_per_round = {self.max_rejected} per host): raise "
          f"rl.max_rounds, or use easier/harder tasks")

  def _tasks(self) -> Iterator[Task | None]:
    """Yields tasks while the budget allows, None while it does not and rows are in flight,
    and blocks when nothing is (the sampler's idle time)."""
    stream, hosts, index = self.trainer.stream, self.trainer.hosts, self.trainer.host_index
    while True:
      seq = self.queue.try_start(self.engine.version)
      if seq is None:
        if self.engine.in_flight:
          yield None
        else:  # no row holds a sample: the new weights can come in before the next prefill
          start = time.perf_counter()
          self.queue.wait(self.engine.version)
          with self._lock:
            self._idle_s += time.perf_counter() - start
          self._swap()
        continue
      task = stream.take(hosts)[index]  # every host walks the same order, a task each
      self._issues[task.id].append(seq)
      yield task

  def _before_chunk(self) -> None:
    if self.stop.is_set():
      raise _Stopped
    self._swap()

  def _swap(self) -> None:
    """Takes the newest pushed weights, if the engine does not have them."""
    version, params = self.box.latest()
    if version > self.engine.version:
      self.engine.version, self.engine.params = version, params


class AsyncTrainer(Trainer):
  """The DAPO job with rollouts and updates on disjoint devices (see the module docstring)."""

  def __init__(self, settings: RLSettings):
    self.staleness = settings.rl.async_.staleness
    super().__init__(settings)
    self.worker: RolloutWorker | None = None
    self._rollout_base: tuple[Any, Any] | None = None  # (the state's frozen base, its push)
    self._last = time.perf_counter()

  def _meshes(self) -> tuple[Mesh, Mesh]:
    """Returns the trainer mesh (every host's last devices) and this host's rollout mesh."""
    local = jax.local_device_count()
    per_host = self.settings.rl.async_.rollout_devices or local // 2
    rollout, training = sharding.split_devices(per_host)
    mesh = sharding.make_mesh(self.settings.mesh, devices=training)
    return mesh, sharding.decode_mesh(rollout, mesh.shape["tensor"])

  def _push(self) -> Any:
    """Returns the weights for the rollout mesh (`sampling_params`: other devices, so new
    buffers), once copied: the next update donates the train state. With LoRA only what trains
    moves (the adapters and token rows: for the 32B preset 269 MB a step, not 65.8 GB); the
    frozen base is copied at the first push, and again only if the state holds another base (no
    update changes it). The rollout model is the same tree either way."""
    if self.state.frozen is None:
      return jax.block_until_ready(self.sampling_params())
    if self._rollout_base is None or self._rollout_base[0] is not self.state.frozen:
      base = _without(self.state.frozen, self.state.params)  # ("all": the trained copies)
      self._rollout_base = (self.state.frozen, jax.block_until_ready(self._to_rollout(base)))
    trained = jax.block_until_ready(self._to_rollout(self.state.params))
    return lora.combine(self._rollout_base[1], trained)

  def _to_rollout(self, tree: Any) -> Any:
    """Returns `tree` (part of the model's params, on the trainer mesh) in the compute dtype on
    this host's rollout mesh, each leaf laid out as `sampling_params` lays it out."""
    shardings = traverse_util.flatten_dict(self.host_shardings)
    flat = traverse_util.flatten_dict(tree)
    mine = traverse_util.unflatten_dict({path: shardings[path] for path in flat})
    sampler = self.engine.sampler
    return sampler.layer_params(sharding.to_host_mesh(sampler.cast_params(tree), self.mesh,
                                                      self.host, mine))

  def _start_worker(self, version: int) -> None:
    queue = StalenessQueue(self.settings.rl.batch_groups // self.hosts, self.staleness, version)
    box = PolicyBox(version, self._push())  # a collective
    # An agent program's worker starts an engine and a server of its own: agreed.
    self.worker = distributed.agreed(lambda: RolloutWorker(self, queue, box),
                                     "starting the rollout worker")
    self.worker.start()
    self._last = time.perf_counter()

  def update_once(self, step: int) -> dict[str, float]:
    """Takes a batch of groups from the worker, updates on it and pushes the new weights;
    returns the step's metrics (the interval is the time since the previous update ended)."""
    if self.worker is None:
      self._start_worker(version=step - 1)
    queue = self.worker.queue

    def take():
      try:
        return queue.take(self.settings.rl.batch_groups // self.hosts)
      except QueueClosed as e:  # the worker's error
        raise (e.__cause__ or e) from None

    t0 = time.perf_counter()
    # A worker's error on any host stops every host before the update's collectives.
    taken, depth = distributed.agreed(take, f"rollouts for step {step}")
    t1 = time.perf_counter()
    version = queue.version
    out = self._train_on([r.group for r in taken], step, proximal_version=version)
    t2 = time.perf_counter()
    self.worker.box.publish(version + 1, self._push())
    queue.advance()
    now = time.perf_counter()
    interval, self._last = now - self._last, now
    generated, counts, idle, sampled = self.worker.drain()
    staleness = [version - r.version for r in taken]
    trained = sum(sum(rec.loss_mask) for r in taken for rec in r.group.records)
    partial = [len({v for v, m in zip(rec.versions, rec.loss_mask) if m}) > 1
               for r in taken for rec in r.group.records]
    self._track_prompts(generated)
    # Rewards and lengths of the batch trained on; counts of the groups generated meanwhile.
    out.update(rollout_s=t1 - t0, push_s=now - t2,
               **self._rollout_metrics([r.group for r in taken], counts))
    out.update(over_hosts(
        means=dict(queue_depth=[depth], staleness_mean=staleness, partial=partial,
                   sampler_busy=[max(0.0, 1.0 - idle / interval)],
                   trainer_busy=[(now - t1) / interval]),
        sums=dict(stale_dropped=queue.stale_dropped, sampler_tokens=sampled,
                  trainer_tokens=trained,
                  **{f"staleness_{s}": staleness.count(s) for s in range(self.staleness + 1)})))
    out["sampler_tokens_per_s"] = out.pop("sampler_tokens") / interval
    out["trainer_tokens_per_s"] = out.pop("trainer_tokens") / interval
    return out

  def close(self) -> None:
    if self.worker is not None:
      self.worker.close(timeout=self.rollout_config.tool_timeout_s + 10)
    super().close()


def _without(tree: Any, other: Any) -> dict:
  """Returns the leaves of `tree` whose paths `other` does not hold."""
  drop = traverse_util.flatten_dict(other).keys()
  return traverse_util.unflatten_dict({path: leaf for path, leaf in
                                       traverse_util.flatten_dict(tree).items()
                                       if path not in drop})


def plot_overlap(metrics_path: str, png_path: str, staleness: int) -> str | None:
  """Writes a PNG of how the roles overlapped, from a run's metrics.jsonl: the staleness
  histogram of every group trained on, queue depth, busy fractions and tokens/s of each role
  per update; returns its path, or None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  with paths.to_epath(metrics_path).open() as f:
    rows = [json.loads(line) for line in f if line.strip()]
  steps = [r["step"] for r in rows]
  series = lambda key: [r.get(key, float("nan")) for r in rows]
  fig, axes = plt.subplots(1, 4, figsize=(20, 3.5))
  ages = list(range(staleness + 1))
  axes[0].bar(ages, [sum(r.get(f"staleness_{a}", 0) for r in rows) for a in ages])
  axes[0].set(xlabel="staleness (updates)", ylabel="groups trained on", xticks=ages)
  axes[1].plot(steps, series("queue_depth"))
  axes[1].set(xlabel="step", ylabel="queue depth (groups)")
  for ax, keys, label in ((axes[2], ("sampler_busy", "trainer_busy"), "busy fraction"),
                          (axes[3], ("sampler_tokens_per_s", "trainer_tokens_per_s"),
                           "tokens / s")):
    for key in keys:
      ax.plot(steps, series(key), label=key.split("_")[0])
    ax.set(xlabel="step", ylabel=label)
    ax.legend()
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.suptitle(f"asynchronous DAPO, staleness <= {staleness}")
  fig.tight_layout()
  with paths.to_epath(png_path).open("wb") as f:  # a local file or a URL (gs://...)
    fig.savefig(f, format="png", dpi=100)
  plt.close(fig)
  return png_path
