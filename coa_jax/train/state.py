"""The train state pytree and its sharded initialization."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from coa_jax.runtime import sharding
from coa_jax.runtime.sharding import abstract_params, init_ids, param_shardings


@flax.struct.dataclass
class TrainState:
  """Step counter, parameters, optimizer state and the run's PRNG key (raw uint32 key data,
  so checkpoints store it like any array)."""

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def abstract_placed_params(model: nn.Module, mesh: Mesh) -> Any:
  """Returns the parameters as ShapeDtypeStructs carrying their shardings (for AOT lowering)."""
  return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(abstract_params(model)), param_shardings(model, mesh))


def _boxed_state(model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array):
  init_rng, run_rng = jax.random.split(rng)
  params = model.init(init_rng, init_ids())["params"]
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
