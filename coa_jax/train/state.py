"""The train state pytree, its sharded initialization, and a job's step-0 state from its model
section (`load_state`: an HF checkpoint's weights or a fresh init)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from coa_jax.model import ModelConfig, ModelSettings, Transformer, lora
from coa_jax.runtime import distributed, hf_checkpoint, sharding
from coa_jax.runtime.sharding import abstract_params, init_ids, param_shardings


@flax.struct.dataclass
class TrainState:
  """Step counter, parameters, optimizer state and the run's PRNG key (raw uint32 key data,
  so checkpoints store it like any array).

  A LoRA model's state (ModelConfig.lora_rank > 0) trains its adapters only: `params` and the
  optimizer state hold the adapters (and the embedding and LM-head rows that train beside them,
  ModelConfig.lora_train_embeddings), and `frozen` the base weights in the compute dtype, which
  no update changes and checkpoints leave out (`checkpointed`)."""

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  frozen: Any = None

  def model_params(self, params: Any = None) -> Any:
    """Returns the whole tree that the model applies: `params` (default: the state's) with
    the frozen base weights beside them, if any."""
    params = self.params if params is None else params
    return params if self.frozen is None else lora.combine(self.frozen, params)

  def checkpointed(self) -> "TrainState":
    """Returns what a checkpoint holds: the state without its frozen base weights."""
    return self.replace(frozen=None)


def _split_frozen(params: Any, config) -> tuple[Any, Any]:
  """Returns (trained, frozen) of a model's whole params: (params, None) without LoRA, else
  (adapters and token rows, base weights cast to the compute dtype); a value model's head,
  which no base checkpoint has, trains whole beside the adapters. With
  lora_train_embeddings="all" a copy of the embedding and LM head in the params dtype trains
  too, and the frozen base keeps its own (the KL reference's and a critic's)."""
  if not config.lora_rank:
    return params, None
  base, trained = lora.split(params)
  if "value_head" in base:
    trained["value_head"] = base.pop("value_head")
  cast = lambda tree, dtype: jax.tree_util.tree_map(  # noqa: E731
      lambda x: x if x.dtype == dtype else x.astype(dtype), tree)
  if config.trains_embeddings:
    trained.update({name: cast(base[name], config.params_dtype)
                    for name in ("embedding", "lm_head") if name in base})
  return trained, cast(base, config.compute_dtype)


def abstract_placed_params(model: nn.Module, mesh: Mesh) -> Any:
  """Returns the parameters as ShapeDtypeStructs carrying their shardings (for AOT lowering)."""
  return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(abstract_params(model)), param_shardings(model, mesh))


def _boxed_state(model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array):
  init_rng, run_rng = jax.random.split(rng)
  params, frozen = _split_frozen(sharding.initializer(model).init(init_rng, init_ids())["params"],
                                 model.config)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=jax.random.key_data(run_rng), frozen=frozen)


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """Returns the NamedShardings of a TrainState: optimizer moments follow their parameters."""
  abstract = jax.eval_shape(lambda r: _boxed_state(model, tx, r), jax.random.key(0))
  return sharding.logical_shardings(abstract, mesh)


def abstract_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """Returns the TrainState as ShapeDtypeStructs carrying their shardings (for AOT lowering)."""
  abstract = nn.unbox(jax.eval_shape(lambda r: _boxed_state(model, tx, r), jax.random.key(0)))
  return jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, state_shardings(model, tx, mesh))


def init_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
               rng: jax.Array) -> TrainState:
  """Returns a fresh TrainState, every array created directly in its sharding."""
  init = lambda r: nn.unbox(_boxed_state(model, tx, r))
  out = state_shardings(model, tx, mesh)
  return sharding.bind_mesh(jax.jit(init, out_shardings=out), mesh)(rng)


def state_from_params(params: Any, tx: optax.GradientTransformation, model: nn.Module,
                      mesh: Mesh, rng: jax.Array) -> TrainState:
  """Returns a step-0 TrainState around already placed params (e.g. from an HF checkpoint).
  A LoRA model's params are its base weights (a value model's: and its head), and its adapters
  start fresh, its trained token rows as the base's rows; base weights already in the compute
  dtype become the state's frozen weights as they are, the same arrays (PPO's critic holds the
  actor's)."""
  out = state_shardings(model, tx, mesh)
  trained, frozen = _split_frozen(params, model.config)

  def make(p, f, r):
    init_rng, run_rng = jax.random.split(r)
    if model.config.lora_rank:  # (the compiler drops the base weights' unused init)
      _, adapters = lora.split(nn.unbox(sharding.initializer(model).init(
          init_rng, init_ids())["params"]))
      rows = [name for name in lora.TOKEN_ROWS if name in adapters]
      p = lora.combine(p, {**adapters, **lora.base_token_rows(f, model.config, rows)})
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                      rng=jax.random.key_data(run_rng))

  rows_from = frozen if model.config.trained_token_ids else None
  state = sharding.bind_mesh(jax.jit(make, out_shardings=out.checkpointed()), mesh)(
      trained, rows_from, rng)
  return state.replace(frozen=frozen)


def load_state(model: ModelSettings, tokenizer: Any, mesh: Mesh,
               tx: optax.GradientTransformation, rng: jax.Array,
               ) -> tuple[ModelConfig, TrainState]:
  """Returns (model config, step-0 TrainState) of a job's model section: the HF checkpoint
  folder's weights (`state_from_params`), or a fresh init when it names none. The load is
  agreed: a host that cannot read the folder stops every host before the first collective."""
  model_config, params = distributed.agreed(
      lambda: hf_checkpoint.load_model(model, tokenizer, mesh), "loading the model")
  module = Transformer(model_config)
  if params is None:
    distributed.say("model.checkpoint is empty: initializing a fresh model")
    return model_config, init_state(module, tx, mesh, rng)
  return model_config, state_from_params(params, tx, module, mesh, rng)
