"""Sharding on 8 fake CPU devices: results equal one device, params follow the rules table."""

import dataclasses

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from coa_jax.model import ConfigError, Transformer, get_preset
from coa_jax.runtime import distributed, sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib

MESHES = [(8, 1, 1), (2, 4, 1), (1, 2, 4), (2, 2, 2)]
CONFIG = get_preset("tiny", num_heads=8, num_kv_heads=4, hidden_size=64, intermediate_size=128)

# What the rules table means for each parameter, written out by hand.
EXPECTED_SPECS = {
    "embedding": P("tensor", "fsdp"),
    "final_norm/scale": P(None),
    "layers/input_norm/scale": P(None, None),
    "layers/post_attn_norm/scale": P(None, None),
    "layers/attn/q_proj/kernel": P(None, "fsdp", "tensor", None),
    "layers/attn/k_proj/kernel": P(None, "fsdp", "tensor", None),
    "layers/attn/v_proj/kernel": P(None, "fsdp", "tensor", None),
    "layers/attn/q_proj/bias": P(None, "tensor", None),
    "layers/attn/k_proj/bias": P(None, "tensor", None),
    "layers/attn/v_proj/bias": P(None, "tensor", None),
    "layers/attn/o_proj/kernel": P(None, "tensor", None, "fsdp"),
    "layers/mlp/gate_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/up_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/down_proj/kernel": P(None, "tensor", "fsdp"),
}


def _opt_config():
  # eps is large so that Adam's first step, m / (sqrt(v) + eps), does not amplify float
  # rounding in near-zero gradients into visible differences.
  return ml_collections.ConfigDict(dict(
      learning_rate=1e-2, warmup_steps=0, schedule="constant", total_steps=10,
      final_lr_fraction=0.0, b1=0.9, b2=0.95, eps=1e-3, weight_decay=0.1, grad_clip=1.0))


def _flat(tree):
  return {"/".join(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _batch(seed=0):
  tokens = np.random.RandomState(seed).randint(0, CONFIG.vocab_size, (8, 17))
  batch = step_lib.next_token_batch(tokens)
  batch.loss_mask[:, :3] = 0  # a prompt-like prefix that is not trained on
  return batch


def _loss_and_grads(model, params, mesh):
  batch = sharding.shard_batch(_batch(), mesh)
  fn = jax.jit(jax.value_and_grad(lambda p, b: step_lib.lm_loss(model, p, b)[0]))
  with sharding.activate(mesh):
    return jax.device_get(fn(params, batch))


@pytest.fixture(scope="module")
def reference(single_device_mesh):
  """On one device: params at init, (loss, grads), params after one step, step metrics."""
  model, tx = Transformer(CONFIG), optimizer.make_optimizer(_opt_config())
  state = state_lib.init_state(model, tx, single_device_mesh, jax.random.key(0))
  before = jax.device_get(state.params)
  loss_grads = _loss_and_grads(model, state.params, single_device_mesh)
  step = step_lib.jit_train_step(model, tx, single_device_mesh)
  state, metrics = step(state, sharding.shard_batch(_batch(), single_device_mesh))
  return before, loss_grads, jax.device_get(state.params), jax.device_get(metrics)


def _assert_trees_close(got, want, atol):
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(g), w, atol=atol)


@pytest.mark.parametrize("shape", MESHES)
def test_param_shardings_follow_the_rules_table(shape):
  mesh = sharding.make_mesh(shape)
  shardings = _flat(sharding.param_shardings(Transformer(CONFIG), mesh))
  specs = {k: s.spec for k, s in shardings.items()}
  assert specs == EXPECTED_SPECS


@pytest.mark.parametrize("shape", MESHES)
def test_sharded_forward_backward_and_step_equal_single_device(shape, reference):
  before, (ref_loss, ref_grads), after, ref_metrics = reference
  mesh = sharding.make_mesh(shape)
  model, tx = Transformer(CONFIG), optimizer.make_optimizer(_opt_config())
  state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
  _assert_trees_close(state.params, before, atol=0)  # the same init whatever the mesh
  assert {k: v.sharding.spec for k, v in _flat(state.params).items()} == EXPECTED_SPECS

  loss, grads = _loss_and_grads(model, state.params, mesh)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  _assert_trees_close(grads, ref_grads, atol=1e-7)

  state, metrics = step_lib.jit_train_step(model, tx, mesh)(
      state, sharding.shard_batch(_batch(), mesh))
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
  assert metrics["tokens"] == ref_metrics["tokens"] == 8 * 13
  _assert_trees_close(state.params, after, atol=1e-6)


def test_the_reference_step_is_one_clipped_adamw_step(reference):
  """What the meshes above are compared to, against NumPy: the gradient clipped to global norm
  1, then AdamW's first step, lr * (g / (|g| + eps) + weight_decay * w on matrices)."""
  before, (_, grads), after, metrics = reference
  norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree_util.tree_leaves(
      grads)))
  np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-6)
  assert norm > 1.0  # 1.59: the clip is exercised

  def adamw(name, w, g):
    g = np.asarray(g, np.float64) / norm
    decayed = name.split("/")[-1] in ("kernel", "embedding")  # not norm scales or biases
    return w - 1e-2 * (g / (np.abs(g) + 1e-3) + (0.1 * w if decayed else 0.0))

  want = {name: adamw(name, w, _flat(grads)[name]) for name, w in _flat(before).items()}
  for name, w in _flat(after).items():
    np.testing.assert_allclose(w, want[name], atol=1e-6, err_msg=name)


def test_init_compiles_one_layer_body_to_the_same_weights(single_device_mesh):
  model = Transformer(dataclasses.replace(CONFIG, scan_unroll=CONFIG.num_layers))
  assert sharding.initializer(model).config.scan_unroll == 1
  want = jax.jit(lambda r: nn.unbox(model.init(jax.random.split(r)[0],
                                               sharding.init_ids())["params"]))(jax.random.key(0))
  got = sharding.init_params(model, single_device_mesh, jax.random.key(0))
  _assert_trees_close(got, want, atol=0)
  tx = optimizer.make_optimizer(_opt_config())
  state = state_lib.init_state(model, tx, single_device_mesh, jax.random.key(0))
  _assert_trees_close(state.params, want, atol=0)


def test_optimizer_moments_are_sharded_like_their_params():
  mesh = sharding.make_mesh((2, 2, 2))
  model, tx = Transformer(CONFIG), optimizer.make_optimizer(_opt_config())
  shardings = state_lib.state_shardings(model, tx, mesh)
  adam = shardings.opt_state[1][0]
  assert {k: s.spec for k, s in _flat(adam.mu).items()} == EXPECTED_SPECS
  assert {k: s.spec for k, s in _flat(adam.nu).items()} == EXPECTED_SPECS
  assert adam.count.spec == P()


def test_mesh_fill_axis_takes_the_remaining_devices():
  assert sharding.MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)


@pytest.mark.parametrize("config,message", [
    (sharding.MeshConfig(data=3, fsdp=1, tensor=1), "needs 3 devices but 8 are available"),
    (sharding.MeshConfig(data=3, fsdp=-1, tensor=1), "8 devices are not divisible by 3"),
    (sharding.MeshConfig(data=-1, fsdp=-1, tensor=1), "at most one -1"),
])
def test_bad_mesh_shapes_are_named(config, message):
  with pytest.raises(ConfigError, match=message):
    sharding.make_mesh(config)


def test_heads_not_divisible_by_tensor_axis_are_named():
  mesh = sharding.make_mesh((1, 2, 4))
  with pytest.raises(ConfigError, match="num_kv_heads=2 is not divisible by the tensor axis"):
    sharding.check_model_fits_mesh(get_preset("tiny"), mesh)


def test_uneven_parameter_split_is_named():
  mesh = sharding.make_mesh((1, 8, 1))
  with pytest.raises(ConfigError, match="does not split over mesh axes"):
    sharding.param_shardings(Transformer(get_preset("tiny", hidden_size=36, num_heads=2,
                                                     num_kv_heads=2)), mesh)


def test_batch_rows_must_split_over_data_ranks():
  mesh = sharding.make_mesh((2, 2, 2))
  with pytest.raises(ConfigError, match="local batch of 6 rows does not split"):
    sharding.shard_batch({"x": np.zeros((6, 4))}, mesh)


def test_distributed_initialize_is_a_no_op_on_one_process():
  assert distributed.initialize() is False
  assert distributed.initialize(distributed.DistributedConfig(mode="explicit")) is False
  assert jax.process_count() == 1


def test_distributed_explicit_mode_needs_a_coordinator():
  with pytest.raises(ConfigError, match="needs coordinator_address"):
    distributed.initialize(distributed.DistributedConfig(mode="explicit", num_processes=2))


def test_blockwise_attention_sharded_equals_dense_single_device(reference):
  _, (ref_loss, ref_grads), _, _ = reference
  mesh = sharding.make_mesh((2, 2, 2))
  model = Transformer(CONFIG.replace(attention_impl="blockwise", attention_block=8))
  params = sharding.init_params(model, mesh, jax.random.key(0))
  loss, grads = _loss_and_grads(model, params, mesh)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  _assert_trees_close(grads, ref_grads, atol=1e-7)
