"""PPO's critic: a value model beside the actor, masked GAE, and the clipped value update.

With rl.advantage = "gae" the RL job trains a `Critic` next to the policy (verl's PPO with
`adv_estimator=gae`). The value model is the actor's checkpoint with its LM head replaced by a
one-output, bias-free value head (zeros: a fresh critic predicts 0); it has its own train
state, AdamW (learning rate rl.critic.learning_rate, default 10x the actor's), learning-rate
schedule (`optimizer_settings`), gradient clipping and weight decay, sharded by the same logical
rules on the same mesh, and it is checkpointed with the actor.

A step: the critic values every rollout token (the value at position t is read after input
token t, the state in which target t, the next token, is sampled; a bootstrapped row also gets
the value after its last token, `values_with_value_after`); masked GAE (`coa_jax.losses.gae`) turns each sample's outcome
reward, placed on its last trainable token (on each segment's, for an agent session's calls
packed one sample each), into token advantages for the actor (lambda_actor,
or VAPO's length-adaptive lambda) and returns for the critic (lambda_critic); the advantages
are whitened over the step's trainable tokens. The actor then takes the DAPO update with these
token advantages, and the critic the clipped value loss (token-mean over the loss mask). Each
update reads only its own parameters: the actor's gradient never reaches the critic's, nor the
critic's the actor's.

Schedule: the first rl.critic.warmup steps train the critic only (rollouts go on). With
rl.critic.pretrain_steps > 0, the critic first trains on Monte-Carlo returns (lambda 1) of the
frozen policy until the explained variance of a step's values, measured on its fresh rollouts
before the update, reaches rl.critic.pretrain_explained_variance (or pretrain_steps steps have
passed); both phases count toward rl.steps. The critic trains through both, so its
learning-rate schedule counts its own updates (rl.critic.schedule, warmup_steps, total_steps,
...; default constant, as verl's critic), never the actor's, which start after them.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from coa_jax.losses import gae as gae_lib
from coa_jax.losses.dapo import aggregation_weights
from coa_jax.losses.value import value_loss
from coa_jax.model import ConfigError, ModelConfig, Transformer
from coa_jax.rollout import RolloutRecord
from coa_jax.rollout.tool_loop import LENGTH
from coa_jax.runtime import sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train.batch import PolicyBatch
from coa_jax.train.optimizer import OptimizerSettings
from coa_jax.train.state import TrainState
from coa_jax.train.step import jit_state_step, run_step, summed_update, unrolled_layers

TRUNCATIONS = ("terminal", "bootstrap")
PLOT_KEYS = ("value_loss", "explained_variance", "value_clip_frac")
SHOWN = ("value_loss", "explained_variance", "return_mean")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """The critic's settings (rl.critic); the defaults are the reference release's and verl's."""

  learning_rate: float = 0.0  # 0: 10x the actor's peak learning rate
  grad_clip: float = 1.0
  weight_decay: float = 0.0
  cliprange_value: float = 0.5  # 0: no value clipping
  gamma: float = 1.0
  lambda_actor: float = 1.0
  lambda_critic: float = 1.0
  adaptive_lambda: float = 0.0  # VAPO's alpha: lambda_actor = 1 - 1 / (alpha * length); 0: off
  # A truncated sample: "terminal", or "bootstrap" (from the value after its last token).
  truncation: str = "terminal"
  whiten: bool = True  # advantages over the step's trainable tokens
  warmup: int = 0  # first steps that train the critic only
  pretrain_steps: int = 0  # at most this many steps of value pre-training (0: off)
  pretrain_explained_variance: float = 0.5  # pre-training ends once a step's values reach it
  # The learning-rate schedule over the critic's own updates (`train.optimizer`'s fields):
  schedule: str = "constant"  # verl's critic: constant; or "cosine", "wsd"
  warmup_steps: int = 0  # linear warm-up over its first updates (not `warmup`, RL steps)
  total_steps: int = 0  # 0: every critic update of the run (`RLConfig.critic_settings`)
  decay_steps: int = 0  # "wsd": how many of the last updates decay
  final_lr_fraction: float = 0.1  # "cosine", "wsd": the learning rate at the end, of the peak

  def __post_init__(self):
    if self.schedule not in optimizer.SCHEDULES:
      raise ConfigError(f"rl.critic.schedule={self.schedule!r}: expected one of "
                        f"{optimizer.SCHEDULES}")
    if self.truncation not in TRUNCATIONS:
      raise ConfigError(f"rl.critic.truncation={self.truncation!r}: expected one of "
                        f"{TRUNCATIONS}")
    for name in ("gamma", "lambda_actor", "lambda_critic"):
      if not 0 <= getattr(self, name) <= 1:
        raise ConfigError(f"rl.critic.{name}={getattr(self, name)}: expected 0..1")
    for name in ("learning_rate", "grad_clip", "weight_decay", "cliprange_value",
                 "adaptive_lambda", "warmup", "pretrain_steps", "warmup_steps", "total_steps",
                 "decay_steps", "final_lr_fraction"):
      if getattr(self, name) < 0:
        raise ConfigError(f"rl.critic.{name}={getattr(self, name)}: expected >= 0")
    if self.pretrain_explained_variance > 1:
      raise ConfigError(f"rl.critic.pretrain_explained_variance="
                        f"{self.pretrain_explained_variance}: explained variance is at most 1")


def outcomes(records: Sequence[RolloutRecord], scores: Sequence[float],
             overlong: Sequence[float], truncation: str) -> tuple[np.ndarray, np.ndarray]:
  """Returns each sample's reward for its last trainable token and whether GAE bootstraps it.

  A truncated sample (finish "length") is terminal with its whole score, or, with truncation
  "bootstrap", has no outcome: its reward is the overlong penalty alone (`overlong`, the
  shaping part of `scores`) and its return is bootstrapped from the critic's value of the state
  after its last token (`values_with_value_after`). A sample that
  ends on an observation for any other reason raises ValueError: its outcome would land on a
  token no update trains.
  """
  rewards, bootstrap = np.zeros(len(records), np.float32), np.zeros(len(records), bool)
  for i, (record, score, penalty) in enumerate(zip(records, scores, overlong)):
    truncated = record.finish_reason == LENGTH
    if any(record.loss_mask) and not record.loss_mask[-1] and not truncated:
      raise ValueError(f"task {record.task_id} sample {record.sample} ends on an observation "
                       f"(finish {record.finish_reason!r}): its outcome reward has no "
                       f"trainable token to sit on")
    bootstrap[i] = truncated and truncation == "bootstrap"
    rewards[i] = penalty if bootstrap[i] else score
  return rewards, bootstrap


def value_params(actor_params: Any, model: Transformer, mesh: Mesh) -> Any:
  """Returns a value model's params: the actor's body and a zero value head. The body is a
  copy (the actor's updates donate their params), except a LoRA actor's frozen base weights
  (`actor_params` then), which the critic holds as they are: its own adapters and head train
  on the same arrays."""
  copy = (lambda x: x) if model.config.lora_rank else (lambda x: x.copy())
  body = {k: jax.tree_util.tree_map(copy, v) for k, v in actor_params.items() if k != "lm_head"}
  shardings = sharding.param_shardings(model, mesh)
  head = jnp.zeros((model.config.hidden_size, 1), model.config.params_dtype)
  return {**body, "value_head": jax.device_put(head, shardings["value_head"])}


def values(model: Transformer, params: Any, batch: PolicyBatch) -> jax.Array:
  """Returns the value model's (B, T) float32 values of `batch`'s rows."""
  return model.apply({"params": params}, batch.input_ids, batch.positions, batch.segment_ids)


def values_with_value_after(model: Transformer, params: Any,
                            batch: PolicyBatch) -> tuple[jax.Array, jax.Array]:
  """Returns the (B, T) values of `batch`'s rows and each row's (B,) value after its last token.

  A row of n inputs predicts targets 0..n-1; its last token, target n-1, is no input, so the
  state after it (the whole sequence) has no value among the row's. One forward pass gets it:
  that token goes in as input n (its position and segment continue the row's), where the
  row's padding was; attention is causal, so the values before it stay as they were. A row
  needs one padding position for it (`rollout_batch` checks).
  """
  seq = batch.input_ids.shape[1]
  length_B = jnp.sum(batch.segment_ids > 0, axis=1)  # rows are right-padded
  at_end_BxT = jnp.arange(seq)[None, :] == length_B[:, None]
  last = lambda x_BxT: jnp.take_along_axis(x_BxT, jnp.maximum(length_B - 1, 0)[:, None], axis=1)
  appended = lambda x_BxT, x_Bx1: jnp.where(at_end_BxT, x_Bx1, x_BxT)
  extended = batch.replace(input_ids=appended(batch.input_ids, last(batch.targets)),
                           positions=appended(batch.positions, last(batch.positions) + 1),
                           segment_ids=appended(batch.segment_ids, last(batch.segment_ids)))
  values_BxT = values(model, params, extended)
  after_B = jnp.take_along_axis(values_BxT, jnp.minimum(length_B, seq - 1)[:, None], axis=1)
  return values_BxT, after_B[:, 0]


def estimate(model: Transformer, config: CriticConfig, params: Any, batch: PolicyBatch,
             lambda_critic: jax.Array) -> tuple[jax.Array, ...]:
  """Returns (values, advantages before whitening, returns, moments) of a mini-batch; moments
  stacks the `masked_moments` of the advantages, the returns and returns - values. Rows with
  `batch.bootstrap` (truncation "bootstrap") take the value after their last token as the
  value after their last action."""
  mask = batch.loss_mask
  next_value_B = None  # every row terminal
  if config.truncation == "bootstrap":
    values_BxT, after_B = values_with_value_after(model, params, batch)
    next_value_B = jnp.where(batch.bootstrap, after_B, 0.0)
  else:
    values_BxT = values(model, params, batch)
  segments = batch.segment_ids  # packed samples: an episode each
  rewards_BxT = gae_lib.outcome_rewards(batch.rewards, mask, segments)
  lam_actor = (gae_lib.adaptive_lambda(mask, config.adaptive_lambda, segments)
               if config.adaptive_lambda else config.lambda_actor)
  advantages, _ = gae_lib.gae(rewards_BxT, values_BxT, mask, config.gamma, lam_actor,
                              next_value_B, segments)
  _, returns = gae_lib.gae(rewards_BxT, values_BxT, mask, config.gamma, lambda_critic,
                           next_value_B, segments)
  # Targets, not functions of the critic: neither update's gradient reaches the other's params.
  advantages, returns = jax.lax.stop_gradient((advantages, returns))
  moments = jnp.stack([gae_lib.masked_moments(advantages, mask),
                       gae_lib.masked_moments(returns, mask),
                       gae_lib.masked_moments(returns - values_BxT, mask)])
  return values_BxT, advantages, returns, moments


def critic_step(model: Transformer, tx: optax.GradientTransformation, state: TrainState,
                batch: PolicyBatch, *, cliprange_value: float, micro_batches: int = 1,
                schedule: optax.Schedule | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
  """Returns the critic's state after one optimizer step of the clipped value loss (token-mean
  over the whole mini-batch's loss mask) on `batch`, and its metrics."""
  weights_BxT = aggregation_weights(batch.loss_mask, batch.group, "token-mean")

  def objective(params, micro):
    micro, weights = micro
    values_BxT = values(model, state.model_params(params), micro)
    sums = value_loss(values_BxT, micro.old_values, micro.returns, micro.loss_mask, weights,
                      cliprange_value)
    return sums.loss, sums

  new_state, sums, metrics = summed_update(objective, tx, state, (batch, weights_BxT),
                                           micro_batches, schedule,
                                           unrolled_layers(model))
  flags = {k: metrics.pop(k) for k in ("is_finite", "applied")}  # for `run_step`
  return new_state, {**sums.metrics(), **flags, **{f"critic_{k}": v for k, v in metrics.items()}}


def optimizer_settings(actor: OptimizerSettings, config: CriticConfig) -> OptimizerSettings:
  """Returns the critic's AdamW settings: its own learning rate (default 10x the actor's peak),
  schedule over its own updates, clipping and weight decay; the actor's betas and eps. Raises
  ConfigError naming rl.critic when the schedule cannot be built."""
  values = dict(learning_rate=config.learning_rate or 10 * actor.learning_rate,
                grad_clip=config.grad_clip, weight_decay=config.weight_decay,
                schedule=config.schedule, warmup_steps=config.warmup_steps,
                total_steps=config.total_steps, decay_steps=config.decay_steps,
                final_lr_fraction=config.final_lr_fraction)
  # Checked under the critic's name first (OptimizerSettings' own checks name `optimizer`).
  optimizer.learning_rate_schedule(types.SimpleNamespace(**{**dataclasses.asdict(actor),
                                                            **values}), where="rl.critic")
  return dataclasses.replace(actor, **values)


@functools.lru_cache(maxsize=4)
def _programs(config: CriticConfig, model_config: ModelConfig, mesh: Mesh,
              opt: OptimizerSettings, micro_batches: int) -> tuple[Callable, Callable, Callable]:
  """Returns the critic's jitted (update, estimate, whiten), one triple per critic, model,
  mesh and optimizer in this process: PPO runs alike in one process (a resumed run, an
  experiment's cells and seeds) trace and compile them once."""
  model = Transformer(model_config, head="value")
  schedule, tx = optimizer.schedule_and_optimizer(opt)
  update = jit_state_step(
      lambda s, b: critic_step(model, tx, s, b, cliprange_value=config.cliprange_value,
                               micro_batches=micro_batches, schedule=schedule),
      model, tx, mesh)
  params_sh = sharding.param_shardings(model, mesh)
  batch_sh, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  estimate_fn = sharding.bind_mesh(jax.jit(
      lambda p, b, lam: estimate(model, config, p, b, lam),
      in_shardings=(params_sh, batch_sh, rep), out_shardings=(batch_sh,) * 3 + (rep,)), mesh)
  whiten = sharding.bind_mesh(jax.jit(
      lambda adv, mask, moments: (gae_lib.whiten(adv, mask, moments) if config.whiten
                                  else jnp.where(mask > 0, adv, 0.0)),
      in_shardings=(batch_sh, batch_sh, rep), out_shardings=batch_sh), mesh)
  return update, estimate_fn, whiten


class Critic:
  """The value model's state and jitted programs on the actor's mesh (see the module doc)."""

  def __init__(self, config: CriticConfig, model_config: ModelConfig, actor_params: Any,
               mesh: Mesh, actor_optimizer: OptimizerSettings, micro_batches: int, seed: int):
    """`actor_params`: the actor's initial params, or with LoRA its frozen base weights."""
    self.config, self.mesh = config, mesh
    self.model = Transformer(model_config, head="value")
    opt = optimizer_settings(actor_optimizer, config)
    self.schedule, self.tx = optimizer.schedule_and_optimizer(opt)
    params = value_params(actor_params, self.model, mesh)
    rng = jax.random.fold_in(jax.random.key(seed), 1)
    self.state = state_lib.state_from_params(params, self.tx, self.model, mesh, rng)
    self.update, self._estimate, self._whiten = _programs(config, model_config, mesh, opt,
                                                          micro_batches)

  def abstract_state(self) -> TrainState:
    """Returns the critic's checkpointed train state (without a LoRA critic's frozen base) as
    ShapeDtypeStructs with shardings (for restores)."""
    return state_lib.abstract_state(self.model, self.tx, self.mesh).checkpointed()

  def prepare(self, batches: list[PolicyBatch], pretraining: bool
              ) -> tuple[list[PolicyBatch], dict[str, float]]:
    """Returns the mini-batches with the critic's values, whitened GAE advantages and returns
    (lambda 1 while `pretraining`), and the step's value statistics over trainable tokens."""
    lam = jnp.float32(1.0 if pretraining else self.config.lambda_critic)
    parts = [self._estimate(self.state.model_params(), batch, lam) for batch in batches]
    moments = np.sum([np.asarray(jax.device_get(p[3])) for p in parts], axis=0)
    adv_moments = moments[0].astype(np.float32)  # a host value: the same on every process
    out = [batch.replace(advantages=self._whiten(adv, batch.loss_mask, adv_moments), old_values=v,
                         returns=ret) for batch, (v, adv, ret, _) in zip(batches, parts)]
    adv_mean, adv_std = (float(x) for x in gae_lib.mean_std(moments[0]))
    ret_mean, ret_std = (float(x) for x in gae_lib.mean_std(moments[1]))
    _, residual_std = gae_lib.mean_std(moments[2])
    # Undefined (NaN) when every return is the same (e.g. a batch of all-correct samples).
    explained = (1.0 - float(residual_std) ** 2 / ret_std ** 2 if ret_std > 1e-6
                 else float("nan"))
    return out, dict(advantage_mean=adv_mean, advantage_std=adv_std, return_mean=ret_mean,
                     explained_variance=explained)

  def train(self, batch: PolicyBatch) -> dict[str, float]:
    """Takes one critic update on `batch` (from `prepare`); returns its metrics (`run_step`'s
    flags as critic_nonfinite, critic_empty and critic_applied)."""
    self.state, metrics = run_step(self.update, self.state, batch)
    for key in ("nonfinite", "empty", "applied"):
      metrics[f"critic_{key}"] = metrics.pop(key)
    return metrics
