"""The RL trainer: rollout -> reward -> dynamic sampling -> advantages -> updates -> evaluation.

`Trainer` is the synchronous job that `coa_jax.rl.job.run` drives (see configs/dapo_tiny_cpu.py
for every field). The sampler and the updates share one mesh and one copy of the parameters:
each step's rollouts use the params the previous step's updates produced, with no transfer.
`coa_jax.rl.async_trainer.AsyncTrainer` builds on it: rollouts and updates at once on
disjoint devices, with bounded staleness. With rl.advantage = "gae" the trainer is PPO's: a
critic (`coa_jax.rl.critic`) trains beside the policy and gives it token advantages.

A step: dynamic sampling generates rounds of prompt groups with the current policy and scores
every sample (`coa_jax.data.rewards`), keeping groups whose samples disagree until the batch is
full; rewards get overlong shaping, groups get normalized advantages, and truncated samples
can be masked out (overlong filtering). The rollout policy's log-probs are recomputed
teacher-forced (and compared with the sampler's, a health metric), then the batch is split into
mini-batches, each one optimizer step. Checkpoints hold the train state and the task cursor;
rollout randomness is derived from the seed and the step, so a resumed run repeats the
uninterrupted one. A non-finite loss stops the run with the last good checkpoint intact.

On several hosts, each one decodes its share of every round's prompts on its own devices (the
parameters are gathered onto each host once per step) and runs its own tools; the hosts then
train on one global batch made of every host's rows. Each host fills its own share of the
batch, so with dynamic sampling the kept groups can differ from a one-host run's; without it
the batch is the same.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from coa_jax.data import Task, build_rewarder, load_tasks
from coa_jax.losses.dapo import PolicyLossConfig
from coa_jax.model import ConfigError, ModelConfig, Transformer
from coa_jax.rl import critic as critic_lib
from coa_jax.rl import update
from coa_jax.rl.advantages import group_advantages, overlong_penalty
from coa_jax.rl.batch import rollout_batch
from coa_jax.rl.dynamic_sampling import DynamicSamplingError, ScoredGroup, fill_batch
from coa_jax.rl.settings import RLSettings
from coa_jax.rollout import settings as agent
from coa_jax.rollout.tool_loop import Rollout, RolloutRecord, check_prompt_lengths
from coa_jax.runtime import distributed, sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train.batch import PolicyBatch
from coa_jax.train.step import run_step

PLOT_KEYS = ("reward", "accuracy", "response_len", "entropy", "clip_high", "clip_low")
SHOWN = ("reward", "accuracy", "eval_accuracy", "response_len", "kept", "rounds", "pg_loss",
         "entropy", "clip_high", "clip_low", "grad_norm", "logp_diff_max")


class TaskStream:
  """The training tasks in a fresh seeded order every epoch, read from a cursor (resumable)."""

  def __init__(self, tasks: list[Task], seed: int, cursor: int = 0):
    self.tasks, self.seed, self.cursor = tasks, seed, cursor

  def take(self, count: int) -> list[Task]:
    """Returns the next `count` tasks and moves the cursor past them."""
    out, orders = [], {}
    for position in range(self.cursor, self.cursor + count):
      epoch, index = divmod(position, len(self.tasks))
      if epoch not in orders:
        orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))
      out.append(self.tasks[orders[epoch][index]])
    self.cursor += count
    return out


@functools.lru_cache(maxsize=4)
def _update_step(model_config: ModelConfig, optimizer_settings: optimizer.OptimizerSettings,
                 mesh: Mesh, loss_config: PolicyLossConfig, micro_batches: int,
                 temperature: float) -> Callable:
  """Returns the jitted policy update, one per model, optimizer, mesh and loss in this process:
  RL runs alike in one process (a resumed run, an experiment's cells and seeds) trace and
  compile it once."""
  schedule, tx = optimizer.schedule_and_optimizer(optimizer_settings)
  return update.jit_dapo_step(Transformer(model_config), tx, mesh, loss_config=loss_config,
                              micro_batches=micro_batches, schedule=schedule,
                              temperature=temperature)


@functools.lru_cache(maxsize=4)
def _policy_logprobs(model_config: ModelConfig, mesh: Mesh, temperature: float) -> Callable:
  """Returns the jitted teacher-forced log-probs and entropies of a model, one per model, mesh
  and temperature in this process."""
  model = Transformer(model_config)
  return update.jit_policy_logprobs(model, mesh, sharding.param_shardings(model, mesh),
                                    temperature)


class Trainer:
  """The DAPO loop's parts, built from RL settings (`coa_jax.rl.settings`); `step()` does one
  rollout-and-update step."""

  def __init__(self, settings: RLSettings):
    self.settings, rl = settings, settings.rl
    # Host-side loading (files, the sandbox's set-up, tools) is agreed: a host that cannot
    # would otherwise leave the others waiting in the first collective.
    self.tokenizer = agent.agent_tokenizer(settings)
    self.mesh, self.host = self._meshes()
    self.rollout_config = settings.rollout
    self.n = self.rollout_config.group_size
    self.hosts, self.host_index = jax.process_count(), jax.process_index()
    for name, value in (("batch_size", settings.batch_size), ("rl.batch_groups", rl.batch_groups),
                        ("rl.mini_batch_groups", rl.mini_batch_groups),
                        ("rl.prompts_per_round", rl.prompts_per_round)):
      if value % self.hosts:
        raise ConfigError(f"{name}={value} does not split over {self.hosts} hosts")
    sharding.check_batch_fits_mesh(rl.mini_batch_groups * self.n, rl.micro_batches, self.mesh)
    self.loss_config = rl.policy_loss()
    self.tasks, self.eval_tasks, self.rewarder = distributed.agreed(
        self._tasks_and_rewarder, "loading the tasks and the rewards")
    self.schedule, self.tx = optimizer.schedule_and_optimizer(settings.optimizer)
    model_config, self.state = state_lib.load_state(settings.model, self.tokenizer, self.mesh,
                                                    self.tx, jax.random.key(settings.seed))
    self.model_config, self.model = model_config, Transformer(model_config)
    self.critic = None  # PPO's value model (rl.advantage = "gae")
    if rl.uses_critic:
      actor = self.state.frozen if model_config.lora_rank else self.state.params
      self.critic = critic_lib.Critic(rl.critic_settings(), model_config, actor, self.mesh,
                                      settings.optimizer, rl.micro_batches, settings.seed)
    self.critic_pretrained = self.critic is None or not self.critic.config.pretrain_steps
    self.last_batch = None  # (step, groups, advantages) of the last update, for rollouts.jsonl
    # The KL term's reference policy: a copy of the initial params (the train state's are
    # donated to the updates), or with LoRA the base model on the frozen weights (no copy).
    self.ref_params = None
    if rl.kl_coef and not model_config.lora_rank:
      self.ref_params = jax.tree_util.tree_map(lambda x: x.copy(), self.state.params)

    self.seq_len = self.rollout_config.cache_size
    self.host_shardings = sharding.param_shardings(self.model, self.host)
    tools = agent.tools(settings, self.tokenizer)
    if rl.agent:  # an agent program through the trainer's own endpoint
      def agent_rollout():  # its module, an engine and a server: agreed
        # imported here: the endpoint's packages (the `serve` extra) are not the main job's
        from coa_jax.serving.agent import AgentRollout, load_agent
        return AgentRollout(load_agent(rl.agent), model_config, self.host, self.tokenizer,
                            tools, self.rollout_config, settings.system_prompt,
                            settings.sampling, slots=settings.batch_size // self.hosts,
                            chunk=settings.chunk, seed=settings.seed)

      self.engine = distributed.agreed(agent_rollout, "starting the agent program's endpoint")
    else:
      sampler = agent.sampler(settings, model_config, self.host, self.tokenizer)
      self.engine = Rollout(sampler, None, self.tokenizer, tools, self.rollout_config,
                            settings.system_prompt, seed=settings.seed)
    temperature = settings.sampling.temperature
    self.update = _update_step(model_config, settings.optimizer, self.mesh, self.loss_config,
                               rl.micro_batches, temperature)
    # The KL term's reference with LoRA: the base model on the frozen weights (adapters off).
    self.logprobs, self.ref_logprobs = (_policy_logprobs(config, self.mesh, temperature)
                                        for config in (model_config,
                                                       model_config.replace(lora_rank=0)))
    self.stream = TaskStream(self.tasks, settings.seed)
    self.prompts: dict[str, list[int]] = {}  # task id -> [groups, all correct, all wrong]
    self.reward_pool = concurrent.futures.ThreadPoolExecutor(settings.reward_workers, "reward")

  def _tasks_and_rewarder(self) -> tuple[list, list, Any]:
    """Returns (training tasks, evaluation tasks, the rewarder), the tasks with their ground
    truth (metadata fields lifted up, as the evaluation reads them) and prompts that fit."""
    settings = self.settings
    tasks = load_tasks(settings.tasks, settings.max_tasks)
    eval_tasks = (load_tasks(settings.eval_tasks, settings.eval_max_tasks) if settings.eval_tasks
                  else [])
    rewarder = build_rewarder(settings.rewards, self.tokenizer.tool_tags)
    for some in (tasks, eval_tasks):
      check_prompt_lengths(self.tokenizer, settings.system_prompt, some,
                           self.rollout_config.max_prompt_tokens)
      rewarder.check(some)
    return tasks, eval_tasks, rewarder

  def _meshes(self) -> tuple[Mesh, Mesh]:
    """Returns the mesh the updates run on and this host's decode mesh: here the same
    devices (the rollouts wait for the updates and the updates for the rollouts)."""
    mesh = sharding.make_mesh(self.settings.mesh)
    return mesh, sharding.host_mesh(mesh)

  # --- rollouts and rewards ----------------------------------------------------------------

  def _rollouts(self, tasks: list[Task], key: jax.Array) -> list[ScoredGroup]:
    """Returns the scored groups of this host's share of `tasks` (in task order), rolled out
    from `key` with the sampling weights of the step (`_sampling`)."""
    self.engine.key = key
    mine = tasks[self.host_index::self.hosts]
    order = {task.id: i for i, task in enumerate(mine)}
    return sorted(map(self.score, self.engine.run(mine)), key=lambda group: order[group.task_id])

  @contextlib.contextmanager
  def _sampling(self):
    """Holds the current params as the engine's sampling weights while its body rolls out:
    gathered once (a collective: every host, whatever rounds of dynamic sampling it needs),
    then dropped, so that the updates do not hold them."""
    self.engine.params = self.sampling_params()
    try:
      yield
    finally:
      self.engine.params = None

  def sampling_params(self) -> Any:
    """Returns the train state's params in the compute dtype on this host's decode mesh: new
    buffers when the compute dtype or the devices differ (the train state is only read). A
    LoRA model decodes as it trains: its frozen base (already in the compute dtype) and its
    adapters, cast as the update's forward pass casts them. (Merged into bf16 kernels, small
    adapter updates would round away, and the rollouts would not sample the trained policy.)"""
    sampler = self.engine.sampler
    params = sampler.cast_params(self.state.model_params())
    return sampler.layer_params(sharding.to_host_mesh(params, self.mesh, self.host,
                                                      self.host_shardings))

  def score(self, group: list[RolloutRecord]) -> ScoredGroup:
    """Returns the group with its rewards (overlong shaping included) and correctness: an
    agent program's own reward where it gave one (correct when positive), else the rewards'."""
    texts = [record.response_text(self.tokenizer) for record in group]
    data = group[0].task_data
    rewards = list(self.reward_pool.map(
        lambda text, record: (None if record.reward is not None else
                              self.rewarder(text, data, record.response_len,
                                            sum(record.loss_mask))), texts, group))
    scores = [(record.reward if r is None else r.score) + self._overlong(record.response_len)
              for r, record in zip(rewards, group)]
    correct = [record.reward > 0 if r is None else r.correct for r, record in zip(rewards, group)]
    return ScoredGroup(group[0].task_id, group, scores, correct)

  def _overlong(self, response_len: int) -> float:
    rl = self.settings.rl
    if not rl.overlong_shaping:
      return 0.0
    return overlong_penalty(response_len, self.rollout_config.max_response_tokens,
                            rl.overlong_cache)

  # --- one step ----------------------------------------------------------------------------

  def step(self, step: int) -> dict[str, float]:
    """Runs step `step` for the job loop: one update, then an evaluation on the held-out tasks
    every rl.eval_every steps and at the last; returns the metrics of both."""
    metrics = self.update_once(step)
    rl = self.settings.rl
    if self.eval_tasks and (step % rl.eval_every == 0 or step == rl.steps):
      metrics.update(self.evaluate(step))
    return metrics

  def update_once(self, step: int) -> dict[str, float]:
    """Rolls out, filters and updates once; returns the step's metrics."""
    rl = self.settings.rl
    generated: list[ScoredGroup] = []
    rounds = iter(range(rl.max_rounds))
    step_key = jax.random.fold_in(jax.random.key(self.settings.seed), step)

    def next_round():
      key = jax.random.fold_in(step_key, next(rounds))
      for group in self._rollouts(self.stream.take(rl.prompts_per_round), key):
        generated.append(group)
        yield group

    t0, tool_wait = time.perf_counter(), self.engine.tool_wait_s
    # A failure on any host (dynamic sampling gave up, a tool or reward crashed) stops all.
    with self._sampling():
      kept, stats = distributed.agreed(
          lambda: fill_batch(next_round, rl.batch_groups // self.hosts, rl.max_rounds,
                             rl.dynamic_sampling), f"rollouts of step {step}")
    # Hosts that needed fewer rounds skip the prompts of the others' extra rounds.
    self.stream.cursor = max(distributed.gather_json(self.stream.cursor))
    t1 = time.perf_counter()
    out = self._train_on(kept, step)
    wall = time.perf_counter() - t0
    # The devices' busy fractions, defined as in asynchronous RL: the sampler is idle while
    # every row waits for a tool, and for the whole update.
    idle = self.engine.tool_wait_s - tool_wait
    self._track_prompts(generated)
    out.update(rollout_s=t1 - t0, sampler_busy=(t1 - t0 - idle) / wall,
               trainer_busy=(wall - (t1 - t0)) / wall,
               **self._rollout_metrics(generated, stats.to_json()))
    return out

  def _train_on(self, kept: list[ScoredGroup], step: int,
                proximal_version: int | None = None) -> dict[str, float]:
    """Updates once per mini-batch of this host's `kept` groups, rl.ppo_epochs times over them
    (every host calls it with its share); returns the updates' mean metrics and the log-prob
    health. `proximal_version` (asynchronous RL) is the policy version of the current params:
    tokens an older one shaped are importance-weighted (None: none is), as is every token when
    top-k / top-p truncate the sampling (`rollout_batch`).
    With a critic (PPO), the critic updates on every mini-batch too, and the actor only after
    the critic's warm-up and pre-training."""
    rl = self.settings.rl
    # Built on each host from its own records (a sample the batch cannot hold raises there
    # alone): agreed, or the other hosts would wait in the first log-prob program.
    mini_batches = [sharding.shard_batch(batch, self.mesh) for batch in distributed.agreed(
        lambda: self._host_batches(kept, step, proximal_version), f"the batch of step {step}")]
    mini_batches, health = self._with_old_logprobs(mini_batches)
    actor_trains, critic_metrics = True, {}
    if self.critic is not None:
      pretraining = not self.critic_pretrained
      mini_batches, critic_metrics = self.critic.prepare(mini_batches, pretraining)
      actor_trains = step > self.critic.config.warmup and not pretraining
      if pretraining and (critic_metrics["explained_variance"] >=
                          self.critic.config.pretrain_explained_variance or
                          step >= self.critic.config.pretrain_steps):
        self.critic_pretrained = True  # the actor trains from the next step on
      critic_metrics.update(actor_trained=float(actor_trains), pretraining=float(pretraining))
    update_metrics = []
    for _ in range(rl.ppo_epochs):
      for batch in mini_batches:
        metrics = {"nonfinite": 0.0, "empty": 0.0}
        if actor_trains:
          self.state, metrics = run_step(self.update, self.state, batch)
        if self.critic is not None:
          metrics.update(self.critic.train(batch))
          for key in ("nonfinite", "empty"):
            metrics[key] = max(metrics[key], metrics.pop(f"critic_{key}"))
        update_metrics.append(metrics)
    # nonfinite: the fraction of mini-batches whose update (actor or critic) was not finite;
    # empty: whose mini-batch had no trainable token (e.g. every row overlong-filtered). Neither
    # was applied.
    out = {k: float(np.mean([m[k] for m in update_metrics])) for k in update_metrics[0]}
    return {**out, **health, **critic_metrics}

  def _host_batches(self, kept: list[ScoredGroup], step: int,
                    proximal_version: int | None) -> list[PolicyBatch]:
    """Returns this host's mini-batches of `kept` (host arrays, `rollout_batch`): the groups'
    advantages, or with a critic their outcomes (the token advantages come later)."""
    rl = self.settings.rl
    records = [record for group in kept for record in group.records]
    scores = np.array([g.scores for g in kept])
    outcomes = None
    if self.critic is None:
      advantages = group_advantages(scores, rl.advantage, rl.advantage_eps,
                                    rl.negative_weight).reshape(-1)
    else:
      advantages = np.zeros(len(records))
      outcomes = critic_lib.outcomes(records, scores.reshape(-1),
                                     [self._overlong(r.response_len) for r in records],
                                     self.critic.config.truncation)
    self.last_batch = (step, kept, None if self.critic is not None else advantages)
    drop = [rl.overlong_filter and r.finish_reason == "length" for r in records]
    local_groups = rl.mini_batch_groups // self.hosts  # this host's groups per mini-batch
    rows = local_groups * self.n
    groups = np.arange(rows) // self.n + self.host_index * local_groups
    return [rollout_batch(records[part], advantages[part], groups, self.seq_len, drop[part],
                          proximal_version,
                          None if outcomes is None else (outcomes[0][part], outcomes[1][part]),
                          truncated_sampling=self.settings.sampling.truncates)
            for part in (slice(start, start + rows) for start in range(0, len(records), rows))]

  def _track_prompts(self, generated: list[ScoredGroup]) -> None:
    """Counts each generated group's prompt: groups, all correct, all wrong (rl.track_prompts)."""
    if self.settings.rl.track_prompts:
      for group in generated:
        tally = self.prompts.setdefault(group.task_id, [0, 0, 0])
        tally[0] += 1
        tally[1] += all(group.correct)
        tally[2] += not any(group.correct)

  @staticmethod
  def _rollout_metrics(groups: list[ScoredGroup], counts: dict[str, int]) -> dict[str, float]:
    """Returns the means of the groups' rewards, accuracy and lengths and the sums of `counts`
    over every host (a collective)."""
    every = [r for g in groups for r in g.records]
    return over_hosts(
        means=dict(reward=[s for g in groups for s in g.scores],
                   accuracy=[c for g in groups for c in g.correct],
                   response_len=[r.response_len for r in every],
                   truncated=[r.finish_reason == "length" for r in every]),
        sums=counts)

  def _with_old_logprobs(self, mini_batches: list[PolicyBatch]
                         ) -> tuple[list[PolicyBatch], dict[str, float]]:
    """Returns the batches with old_logp, the rollout policy's teacher-forced log-probs (and
    ref_logp when a KL term is on), beside the sampler's; and how far the two were apart."""
    diffs, tokens, worst = 0.0, 0.0, 0.0
    out = []
    for batch in mini_batches:
      old_logp, _ = self.logprobs(self.state.model_params(), batch)
      mask = batch.loss_mask > 0
      gap = jnp.where(mask, jnp.abs(old_logp - batch.sampler_logp), 0.0)
      diffs += float(gap.sum())
      tokens += float(mask.sum())
      worst = max(worst, float(gap.max()))
      ref_logp = None
      if self.settings.rl.kl_coef:  # with LoRA: the base model, adapters off
        ref_logp = (self.logprobs(self.ref_params, batch)[0] if self.ref_params is not None
                    else self.ref_logprobs(self.state.frozen, batch)[0])
      out.append(batch.replace(old_logp=old_logp, ref_logp=ref_logp))
    return out, dict(logp_diff_mean=diffs / max(tokens, 1.0), logp_diff_max=worst)

  def evaluate(self, step: int) -> dict[str, float]:
    """Returns accuracy (avg@n at the sampling temperature) and lengths on the held-out tasks."""
    key = jax.random.fold_in(jax.random.key(self.settings.seed + 1), step)
    with self._sampling():
      groups = distributed.agreed(lambda: self._rollouts(self.eval_tasks, key),
                                  f"evaluation at step {step}")
    return over_hosts(means=dict(
        eval_accuracy=[c for g in groups for c in g.correct],
        eval_response_len=[r.response_len for g in groups for r in g.records]))

  def all_prompts(self) -> dict[str, list[int]]:
    """Returns the prompt counts of every host, summed (a collective)."""
    total: dict[str, list[int]] = {}
    for counts in distributed.gather_json(self.prompts):
      for task_id, values in counts.items():
        total[task_id] = [a + b for a, b in zip(total.get(task_id, [0, 0, 0]), values)]
    return total

  def prompt_report(self) -> dict[str, list[str]]:
    """Returns the task ids every one of whose groups was all correct, or all wrong."""
    prompts = self.all_prompts()
    return {"always_solved": sorted(t for t, (n, ok, _) in prompts.items() if ok == n),
            "never_solved": sorted(t for t, (n, _, bad) in prompts.items() if bad == n)}

  def checkpoint_state(self) -> Any:
    """Returns the arrays a checkpoint holds: the actor's train state, and with a critic
    {"actor": ..., "critic": ...}."""
    if self.critic is None:
      return self.state.checkpointed()
    return {"actor": self.state.checkpointed(), "critic": self.critic.state.checkpointed()}

  def abstract_checkpoint(self) -> Any:
    """Returns `checkpoint_state`'s shapes and shardings (what a restore reads into)."""
    actor = state_lib.abstract_state(self.model, self.tx, self.mesh).checkpointed()
    if self.critic is None:
      return actor
    return {"actor": actor, "critic": self.critic.abstract_state()}

  def data_state(self, step: int) -> dict[str, Any]:
    """Returns what a checkpoint keeps beside the train state (the same on every host: the
    furthest cursor, as asynchronous rollouts walk the stream on each host on their own)."""
    return {"cursor": max(distributed.gather_json(self.stream.cursor)),
            "prompts": self.all_prompts(),
            "critic_pretrained": self.critic_pretrained}

  def restore(self, state: Any, data_state: dict[str, Any]) -> None:
    """Takes a restored checkpoint (of `abstract_checkpoint`)."""
    if self.critic is not None:
      state, critic = state["actor"], state["critic"]
      self.critic.state = critic.replace(frozen=self.critic.state.frozen)
      self.critic_pretrained = bool(data_state["critic_pretrained"])
    self.state = state.replace(frozen=self.state.frozen)  # LoRA: the base is not checkpointed
    self.stream.cursor = int(data_state["cursor"])
    # Host 0 carries the counts so far; the others count from here (all_prompts sums them).
    self.prompts = data_state.get("prompts", {}) if self.host_index == 0 else {}

  def close(self) -> None:
    self.reward_pool.shutdown(wait=False, cancel_futures=True)
    if self.settings.rl.agent:
      self.engine.close()  # the endpoint and its engine
    self.engine.tools.close()  # MCP servers stop with the job


def over_hosts(means: dict[str, list[float]],
               sums: dict[str, int] | None = None) -> dict[str, float]:
  """Returns the mean of each list and the total of each count over every host's values (a
  collective; `rounds`, the most any host needed, is a maximum)."""
  mine = {"means": {k: [float(np.sum(v)), len(v)] for k, v in means.items()},
          "sums": sums or {}}
  hosts = distributed.gather_json(mine)
  out = {k: sum(h["means"][k][0] for h in hosts) / max(sum(h["means"][k][1] for h in hosts), 1)
         for k in means}
  for k in mine["sums"]:
    values = [h["sums"][k] for h in hosts]
    out[k] = float(max(values) if k == "rounds" else sum(values))
  return out


__all__ = ["DynamicSamplingError", "TaskStream", "Trainer"]
