"""The train state pytree and its sharded initialization."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from coa_jax import sharding


@flax.struct.dataclass
class TrainState:
  """Step counter, parameters, optimizer state and the run's PRNG key (raw uint32 key data,
  so checkpoints store it like any array)."""

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def _dummy_ids(batch_size: int = 1, seq_len: int = 8) -> jax.Array:
  return jnp.zeros((batch_size, seq_len), jnp.int32)


def abstract_params(model: nn.Module) -> Any:
  """Returns the model's parameter shapes as boxed ShapeDtypeStructs (logical names attached)."""
  return jax.eval_shape(lambda rng: model.init(rng, _dummy_ids())["params"],
                        jax.random.key(0))


def param_shardings(model: nn.Module, mesh: Mesh) -> Any:
  """Returns the NamedSharding of every parameter, from the logical-axis rules table."""
  return sharding.logical_shardings(abstract_params(model), mesh)


def abstract_placed_params(model: nn.Module, mesh: Mesh) -> Any:
  """Returns the parameters as ShapeDtypeStructs carrying their shardings (for AOT lowering)."""
  return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(abstract_params(model)), param_shardings(model, mesh))


def init_params(model: nn.Module, mesh: Mesh, rng: jax.Array) -> Any:
  """Returns freshly initialized parameters, created directly in their shardings."""
  shardings = param_shardings(model, mesh)
  init = lambda r: nn.unbox(model.init(jax.random.split(r)[0], _dummy_ids())["params"])
  return sharding.bind_mesh(jax.jit(init, out_shardings=shardings), mesh)(rng)


def _boxed_state(model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array):
  init_rng, run_rng = jax.random.split(rng)
  params = model.init(init_rng, _dummy_ids())["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=jax.random.key_data(run_rng))


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
  """Returns a step-0 TrainState around already placed params (e.g. from an HF checkpoint)."""
  out = state_shardings(model, tx, mesh)
  make = lambda p, r: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                                 rng=jax.random.key_data(jax.random.split(r)[1]))
  return sharding.bind_mesh(jax.jit(make, out_shardings=out), mesh)(params, rng)
