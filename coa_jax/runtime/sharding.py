"""Device mesh, the logical-axis rules table, and helpers that place params, state and batches.

Every parameter and main activation of the model carries logical axis names; `AXIS_RULES` is
the one table that maps them to the mesh axes `data`, `fsdp` and `tensor`:

- batch is split over `data` x `fsdp` (FSDP ranks see different examples, like data ranks);
- parameters are split over `fsdp` on their `embed` dimension (ZeRO-3 style) and over
  `tensor` on heads, MLP width and vocabulary (Megatron style);
- everything else is replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from coa_jax.model import config as config_lib
from coa_jax.model.config import ConfigError, ModelConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

AXIS_RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    ("lora_rank", None),
    ("token_rows", None),
    # Activations.
    ("act_batch", BATCH_AXES),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the `data`, `fsdp` and `tensor` axes; one of them may be -1 (all the rest)."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """Returns the concrete (data, fsdp, tensor) shape for `num_devices` devices."""
    shape = [self.data, self.fsdp, self.tensor]
    if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
      raise ConfigError(f"mesh {self}: sizes must be positive, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
      if num_devices % known:
        raise ConfigError(f"mesh {self}: {num_devices} devices are not divisible by {known}")
      shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
      raise ConfigError(
          f"mesh {self} needs {math.prod(shape)} devices but {num_devices} are available")
    return tuple(shape)


def make_mesh(config: MeshConfig | Sequence[int] = MeshConfig(),
              devices: Sequence[Any] | None = None) -> Mesh:
  """Returns a (data, fsdp, tensor) mesh over `devices` (default: all global devices)."""
  if not isinstance(config, MeshConfig):
    config = MeshConfig(*config)
  devices = list(jax.devices() if devices is None else devices)
  shape = config.resolve(len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def check_backend(attention_impl: str, remat: str, mesh: Mesh) -> None:
  """Raises ConfigError when the model's attention kernel or remat policy needs other devices
  than the mesh's (checked before a checkpoint loads, not deep in the first trace)."""
  config_lib.check_backend(attention_impl, remat, mesh.devices.flat[0].platform)


def check_model_fits_mesh(config: ModelConfig, mesh: Mesh) -> None:
  """Raises ConfigError when a model dimension cannot be split evenly over its mesh axis, or
  when the model needs another kind of device than the mesh's (see check_backend)."""
  check_backend(config.attention_impl, config.remat, mesh)
  tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
  for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
    if getattr(config, name) % tensor:
      raise ConfigError(f"{name}={getattr(config, name)} is not divisible by the tensor axis "
                        f"({tensor}); choose a tensor size that divides it")
  if config.hidden_size % fsdp:
    raise ConfigError(f"hidden_size={config.hidden_size} is not divisible by the fsdp axis "
                      f"({fsdp})")


def check_batch_fits_mesh(batch_size: int, micro_batches: int, mesh: Mesh) -> None:
  """Raises ConfigError unless every micro-batch splits evenly over the data x fsdp ranks."""
  ranks = mesh.shape["data"] * mesh.shape["fsdp"]
  if micro_batches < 1 or batch_size % micro_batches or (batch_size // micro_batches) % ranks:
    raise ConfigError(f"batch_size={batch_size} in {micro_batches} micro-batch(es) does not "
                      f"split over data x fsdp = {ranks} ranks")


@contextlib.contextmanager
def activate(mesh: Mesh) -> Iterator[None]:
  """Makes `mesh` and `AXIS_RULES` current, so logical constraints in the model resolve."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(AXIS_RULES):
    yield


def bind_mesh(fn: Callable, mesh: Mesh) -> Callable:
  """Wraps a jitted function so that calling or lowering it happens under `activate(mesh)`."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with activate(mesh):
      return fn(*args, **kwargs)

  def lower(*args, **kwargs):
    with activate(mesh):
      return fn.lower(*args, **kwargs)

  call.lower = lower
  return call


def logical_shardings(boxed_tree: Any, mesh: Mesh) -> Any:
  """Returns NamedShardings for a tree whose leaves carry logical axis names (flax boxes)."""
  specs = nn.get_partition_spec(boxed_tree)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, AXIS_RULES)
  _check_even(boxed_tree, shardings)
  return shardings


def _check_even(boxed_tree: Any, shardings: Any) -> None:
  """Raises ConfigError naming the first array whose dimension does not split evenly."""
  leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(boxed_tree))
  for (path, leaf), sharding in zip(leaves, jax.tree_util.tree_leaves(shardings)):
    for dim, axes in zip(leaf.shape, tuple(sharding.spec) + (None,) * leaf.ndim):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      size = math.prod(sharding.mesh.shape[a] for a in axes)
      if dim % size:
        raise ConfigError(f"{jax.tree_util.keystr(path)} of shape {leaf.shape}: dimension "
                          f"{dim} does not split over mesh axes {axes} of size {size}")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Returns the sharding of a (batch, ...) array: batch over `data` x `fsdp`."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  """Returns the fully replicated sharding on `mesh`."""
  return NamedSharding(mesh, P())


def shard_batch(batch: Any, mesh: Mesh) -> Any:
  """Returns global arrays built from this process's slice of the batch (every leaf (B, ...)).

  On several hosts, each passes only its own rows; the global batch is their concatenation.
  """
  sharding = batch_sharding(mesh)
  ranks = mesh.shape["data"] * mesh.shape["fsdp"]
  local_ranks = ranks // jax.process_count()

  def put(x):
    x = np.asarray(x)
    if x.shape[0] % max(local_ranks, 1):
      raise ConfigError(f"local batch of {x.shape[0]} rows does not split over the "
                        f"{local_ranks} local data x fsdp ranks")
    return jax.make_array_from_process_local_data(sharding, x)

  return jax.tree_util.tree_map(put, batch)


# --- per-host meshes (multi-host rollouts) ---------------------------------------------------


def _host_devices(mesh: Mesh) -> list[list[Any]]:
  """Returns the devices of `mesh` grouped by process, in mesh order."""
  hosts: list[list[Any]] = [[] for _ in range(jax.process_count())]
  for device in mesh.devices.flat:
    hosts[device.process_index].append(device)
  return hosts


def _host_shape(local: int, tensor: int) -> tuple[int, int, int]:
  if local % tensor:
    raise ConfigError(f"the tensor axis ({tensor}) must fit within one host's {local} devices "
                      f"for per-host decoding")
  return local // tensor, 1, tensor


def decode_mesh(devices: Sequence[Any], tensor: int) -> Mesh:
  """Returns the mesh one host decodes on: `devices` (in order) on `data` x `tensor`.

  Rows split over `data`; weights split over `tensor` only. With weights split over `fsdp`
  too, every token step would all-gather every layer's weights (in a 7B decode on v5p, 1.15
  GB per layer per device against the 0.27 GB of its KV cache).
  """
  return Mesh(np.array(devices, dtype=object).reshape(_host_shape(len(devices), tensor)),
              MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def host_mesh(mesh: Mesh) -> Mesh:
  """Returns the decode mesh (`decode_mesh`) of this process's devices of `mesh`, with its
  `tensor` axis.

  Rollouts decode on it: each host samples its own rows and runs its own tools, with no
  collective across hosts, so hosts may take different numbers of decoding steps.
  """
  # Devices in mesh order, like to_host_mesh's replicas, so shards land where they belong.
  return decode_mesh(_host_devices(mesh)[jax.process_index()], mesh.shape["tensor"])


def _identity(tree: Any) -> Any:
  return tree


def to_host_mesh(tree: Any, mesh: Mesh, host: Mesh, shardings: Any) -> Any:
  """Returns `tree` (global arrays on `mesh`) as arrays of this process's `host` mesh, each laid
  out by the matching PartitionSpec of `shardings` (NamedShardings on `host`): every host gets
  the whole value. One all-gather across hosts, then (when `host` holds other devices than
  this process's share of `mesh`, as in asynchronous RL) a device-to-device copy; on one
  process, a plain device_put (free when the devices are the same)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  hosts = _host_devices(mesh)
  shape = (len(hosts),) + _host_shape(len(hosts[0]), mesh.shape["tensor"])
  replicas = Mesh(np.array(hosts, dtype=object).reshape(shape), ("host",) + MESH_AXES,
                  axis_types=(AxisType.Auto,) * (1 + len(MESH_AXES)))
  # One function object: jit's cache hits at every later push (a fresh lambda traced anew).
  gathered = jax.jit(_identity, out_shardings=jax.tree_util.tree_map(
      lambda s: NamedSharding(replicas, s.spec), shardings))(tree)
  mine = host_mesh(mesh)

  def local(x, s):
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(mine, s.spec), [piece.data for piece in x.addressable_shards])

  return jax.device_put(jax.tree_util.tree_map(local, gathered, shardings), shardings)


def split_devices(rollout_per_host: int) -> tuple[list[Any], list[Any]]:
  """Returns (this process's first `rollout_per_host` devices, the other devices of every
  process, in process order): the rollout and the trainer devices of asynchronous RL."""
  by_process = [[d for d in jax.devices() if d.process_index == p]
                for p in range(jax.process_count())]
  local = by_process[jax.process_index()]
  if len(local) < 2:
    raise ConfigError(f"asynchronous RL needs 2 or more devices per host (some decode, the "
                      f"others train); this host has {len(local)}")
  if not 0 < rollout_per_host < len(local):
    raise ConfigError(f"rollout devices per host must be in [1, {len(local) - 1}] (the rest "
                      f"train), got {rollout_per_host} of {len(local)}")
  return (local[:rollout_per_host],
          [d for devices in by_process for d in devices[rollout_per_host:]])


# --- parameters ---------------------------------------------------------------------------


def init_ids(batch_size: int = 1, seq_len: int = 8) -> jax.Array:
  """Returns the token ids a model is initialized (or its shapes traced) with."""
  return jnp.zeros((batch_size, seq_len), jnp.int32)


def initializer(model: nn.Module) -> nn.Module:
  """Returns the model whose `init` makes `model`'s weights: the same model with its layer loop
  rolled (the same weights; one layer body compiles about 10x faster than 28 unrolled: the
  1.5B's init took 76 s on an H200, and compiles in 4 s against 41 s on a CPU)."""
  config = getattr(model, "config", None)
  if isinstance(config, ModelConfig) and config.scan_unroll > 1:
    return model.clone(config=dataclasses.replace(config, scan_unroll=1))
  return model


def abstract_params(model: nn.Module) -> Any:
  """Returns the model's parameter shapes as boxed ShapeDtypeStructs (logical names attached)."""
  return jax.eval_shape(lambda rng: model.init(rng, init_ids())["params"],
                        jax.random.key(0))


def param_shardings(model: nn.Module, mesh: Mesh) -> Any:
  """Returns the NamedSharding of every parameter, from the logical-axis rules table."""
  return logical_shardings(abstract_params(model), mesh)


def init_params(model: nn.Module, mesh: Mesh, rng: jax.Array) -> Any:
  """Returns freshly initialized parameters, created directly in their shardings."""
  shardings = param_shardings(model, mesh)
  init = lambda r: nn.unbox(initializer(model).init(jax.random.split(r)[0],
                                                   init_ids())["params"])
  return bind_mesh(jax.jit(init, out_shardings=shardings), mesh)(rng)
