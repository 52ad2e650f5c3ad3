"""LoRA adapters on the model's projections (coa_jax/model/lora.py): a fresh adapter changes
nothing, merged adapters equal unmerged ones, and the adapters' shardings follow their kernels'."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from coa_jax.model import ConfigError, Transformer, get_preset
from coa_jax.model import lora
from coa_jax.model.config import LORA_TARGETS
from coa_jax.runtime import sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib

BASE = get_preset("tiny", num_layers=2)
LORA = BASE.replace(lora_rank=4, lora_alpha=8.0)
IDS = jax.random.randint(jax.random.key(1), (2, 12), 0, BASE.vocab_size)


@pytest.fixture(scope="module")
def params():
  return nn.unbox(jax.jit(Transformer(LORA).init)(jax.random.key(0), IDS)["params"])


def _logits(config, params):
  return jax.jit(lambda p: Transformer(config).apply({"params": p}, IDS))(params)


def test_adapters_sit_on_every_target_projection_with_b_at_zero(params):
  base, adapters = lora.split(params)
  attn, mlp = adapters["layers"]["attn"], adapters["layers"]["mlp"]
  assert set(attn) | set(mlp) == set(LORA_TARGETS)
  assert attn["q_proj"]["lora_a"].shape == (2, BASE.hidden_size, 4)  # layers, embed, rank
  assert attn["o_proj"]["lora_a"].shape == (2, BASE.num_heads, BASE.head_dim, 4)
  assert attn["o_proj"]["lora_b"].shape == (2, 4, BASE.hidden_size)
  assert not any(np.any(p["lora_b"]) for p in (*attn.values(), *mlp.values()))
  assert all(jax.tree_util.tree_leaves(optimizer.weight_decay_mask(adapters)))  # matrices
  assert sum(a.size for a in jax.tree_util.tree_leaves(adapters)) == LORA.lora_params()
  assert lora.combine(base, adapters).keys() == params.keys()
  assert jax.tree_util.tree_structure(lora.combine(base, adapters)) == (
      jax.tree_util.tree_structure(params))


def test_a_fresh_adapter_leaves_the_base_models_logits_exactly(params):
  base, _ = lora.split(params)
  np.testing.assert_array_equal(_logits(LORA, params), _logits(BASE, base))


def test_merged_adapters_give_the_unmerged_models_logits(params):
  _, adapters = lora.split(params)
  trained = jax.tree_util.tree_map(  # B as if trained: random, of a kernel's scale
      lambda a: jax.random.normal(jax.random.key(a.size), a.shape) * 0.05, adapters)
  full = lora.combine(lora.split(params)[0], trained)
  merged = lora.merge(full, LORA)
  assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(lora.split(full)[0])
  np.testing.assert_allclose(_logits(BASE, merged), _logits(LORA, full), rtol=2e-5, atol=2e-5)
  assert not np.allclose(_logits(BASE, merged), _logits(BASE, lora.split(full)[0]), atol=1e-3)


def test_targets_choose_the_projections_and_dropout_needs_an_rng(params):
  config = LORA.replace(lora_targets=("q_proj", "down_proj"), lora_dropout=0.5)
  variables = nn.unbox(Transformer(config).init(jax.random.key(0), IDS))
  _, adapters = lora.split(variables["params"])
  assert set(adapters["layers"]["attn"]) == {"q_proj"} and set(adapters["layers"]["mlp"]) == {
      "down_proj"}
  b_set = jax.tree_util.tree_map(lambda a: jnp.ones_like(a) * 0.1, adapters)
  full = lora.combine(lora.split(variables["params"])[0], b_set)
  apply = lambda **rngs: Transformer(config).apply({"params": full}, IDS, rngs=rngs)  # noqa: E731
  np.testing.assert_array_equal(apply(), apply())  # no rng: no dropout
  assert not np.allclose(apply(dropout=jax.random.key(1)), apply())


def test_adapter_shardings_follow_their_kernels():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = sharding.param_shardings(Transformer(LORA), mesh)
  q, down = shardings["layers"]["attn"]["q_proj"], shardings["layers"]["mlp"]["down_proj"]
  assert q["lora_a"].spec == P(None, "fsdp", None)  # layers, embed, rank
  assert q["lora_b"].spec == P(None, None, "tensor", None)  # layers, rank, heads, head_dim
  assert down["lora_a"].spec == P(None, "tensor", None)  # layers, mlp, rank
  assert down["lora_b"].spec == P(None, None, "fsdp")  # layers, rank, embed


def test_lora_steps_on_eight_devices_equal_one_device(single_device_mesh):
  """Two steps of 2 micro-batches each, dropout on: the same adapters on a (2, 2, 2) mesh as on
  one device, the base weights untouched on both."""
  config = LORA.replace(lora_dropout=0.1)
  model, tx = Transformer(config), optax.adamw(1e-2, eps=1e-3)  # eps: as test_sharding
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 17))
  batch = step_lib.next_token_batch(tokens)
  ends = []
  for mesh in (single_device_mesh, sharding.make_mesh(sharding.MeshConfig(2, 2, 2))):
    state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
    frozen = jax.device_get(state.frozen)
    step = step_lib.jit_train_step(model, tx, mesh, micro_batches=2)
    for _ in range(2):
      state, metrics = step(state, sharding.shard_batch(batch, mesh))
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.frozen), frozen)
    ends.append((jax.device_get(state.params), float(metrics["loss"])))
  (one, loss_one), (eight, loss_eight) = ends
  np.testing.assert_allclose(loss_eight, loss_one, rtol=1e-5)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), eight, one)
  assert np.any(one["layers"]["attn"]["q_proj"]["lora_b"])  # the adapters moved


@pytest.mark.parametrize("change, message", [
    (dict(lora_rank=-1), "lora_rank=-1"),
    (dict(lora_alpha=0.0), "lora_alpha=0.0"),
    (dict(lora_dropout=1.0), "lora_dropout=1.0"),
    (dict(lora_targets=("q_proj", "c_attn")), "lora_targets=.*expected one or more of"),
])
def test_bad_lora_settings_are_named(change, message):
  with pytest.raises(ConfigError, match=message):
    BASE.replace(**change)


def test_a_lora_models_base_loads_in_the_compute_dtype_and_becomes_the_frozen_weights(tmp_path):
  """The base of a LoRA model is read straight into bf16 (no float32 pass) and the train state
  takes those arrays as its frozen weights, without a copy."""
  from hf_reference import make_hf_model
  from coa_jax.runtime import hf_checkpoint

  make_hf_model("qwen2", vocab=96, heads=4, kv_heads=2, layers=1).save_pretrained(tmp_path)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  config, base = hf_checkpoint.load_checkpoint(str(tmp_path), mesh, dtype="bfloat16",
                                               param_dtype="float32", lora_rank=4)
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(base)} == {jnp.dtype(jnp.bfloat16)}
  model = Transformer(config)
  state = state_lib.state_from_params(base, optax.adamw(1e-3), model, mesh, jax.random.key(0))
  assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(state.frozen),
                                    jax.tree_util.tree_leaves(base)))
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(state.params)} == {
      jnp.dtype(jnp.float32)}
