"""The transformer: presets, packing, scan, remat, config errors."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.model import ConfigError, Transformer, get_preset
from coa_jax.runtime import sharding
from coa_jax.runtime.sharding import abstract_params


def _init(config, seed=0):
  model = Transformer(config)
  return model, model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]


# Parameter counts of the published checkpoints (safetensors totals on the HF hub).
@pytest.mark.parametrize("preset,count", [
    ("qwen2_5_0_5b", 494_032_768),
    ("qwen2_5_7b", 7_615_616_512),
    ("qwen2_5_32b", 32_763_876_352),
    ("llama3_2_1b", 1_235_814_400),
    ("llama3_1_8b", 8_030_261_248),
])
def test_preset_matches_published_parameter_count(preset, count):
  config = get_preset(preset)
  assert config.num_params() == count
  shapes = abstract_params(Transformer(config))
  leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x: x.value, shapes,
                                                            is_leaf=lambda x: hasattr(x, "value")))
  assert sum(int(np.prod(x.shape)) for x in leaves) == count


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_packed_segments_match_separate_examples(attention):
  config = get_preset("tiny", attention_impl=attention, attention_block=4)
  model, params = _init(config)
  rng = np.random.RandomState(0)
  a, b = rng.randint(0, config.vocab_size, 5), rng.randint(0, config.vocab_size, 7)
  packed = np.concatenate([a, b, [0, 0]])[None]
  segments = np.array([[1] * 5 + [2] * 7 + [0, 0]])
  positions = np.array([list(range(5)) + list(range(7)) + [0, 0]])
  logits = model.apply({"params": params}, packed, positions, segments)[0]
  alone_a = model.apply({"params": params}, a[None])[0]
  alone_b = model.apply({"params": params}, b[None])[0]
  np.testing.assert_allclose(logits[:5], alone_a, atol=1e-5)
  np.testing.assert_allclose(logits[5:12], alone_b, atol=1e-5)


def test_segments_change_logits_only_after_the_boundary():
  config = get_preset("tiny")
  model, params = _init(config)
  ids = np.arange(10)[None] % config.vocab_size
  one = model.apply({"params": params}, ids, None, np.ones((1, 10), np.int32))
  two = model.apply({"params": params}, ids, None, np.array([[1] * 4 + [2] * 6]))
  np.testing.assert_allclose(one[0, :4], two[0, :4], atol=1e-6)
  assert np.abs(one[0, 4:] - two[0, 4:]).max() > 1e-3


def test_blockwise_attention_equals_dense_attention_and_its_gradients():
  rng = np.random.RandomState(0)
  ids = rng.randint(0, 512, (2, 14))  # 14 is not a multiple of the block size
  segments = np.array([[1] * 9 + [2] * 5, [1] * 14])
  _, params = _init(get_preset("tiny"))

  def loss_and_grads(attention):
    model = Transformer(get_preset("tiny", attention_impl=attention, attention_block=4))
    loss = lambda p: (model.apply({"params": p}, ids, None, segments) ** 2).mean()
    return jax.jit(jax.value_and_grad(loss))(params)

  (dense, dense_grads), (blocked, blocked_grads) = loss_and_grads("xla"), loss_and_grads(
      "blockwise")
  np.testing.assert_allclose(blocked, dense, rtol=1e-6)
  for g, ref in zip(jax.tree_util.tree_leaves(blocked_grads),
                    jax.tree_util.tree_leaves(dense_grads)):
    np.testing.assert_allclose(g, ref, atol=1e-6)


def test_blockwise_attention_backward_transposes_no_query_by_key_array():
  """The backward accumulates dk and dv transposed (docs/benchmarks.md, "The backward's
  transposes"): on XLA:CPU the contraction over queries then reads each block's probabilities
  in place, and only arrays that carry a head dimension are transposed."""
  from coa_jax.model import attention

  batch, seq, heads, head_dim = 2, 256, 4, 16  # head_dim: the one dimension of size 16
  q = k = v = jnp.ones((batch, seq, heads, head_dim))
  segments = jnp.ones((batch, seq), jnp.int32)
  loss = lambda q, k, v: attention.blockwise_causal_attention(q, k, v, segments, 64).sum()
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  shapes = [[int(d) for d in dims.split(",")]
            for dims in re.findall(r"= f32\[([\d,]*)\]\{[\d,]*\} transpose\(", hlo)]
  assert shapes  # the head-sized transposes are there: the pattern still matches XLA's text
  assert all(head_dim in shape for shape in shapes), shapes


def test_scanned_program_size_does_not_grow_with_depth():
  ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)

  def hlo_size(layers):
    model = Transformer(get_preset("tiny", num_layers=layers))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))
    return len(jax.jit(model.apply).lower(params, ids).as_text())

  assert abs(hlo_size(2) - hlo_size(12)) < 200  # only a loop bound changes


def test_layers_are_unrolled_only_in_programs_over_several_cpu_devices():
  """XLA:CPU can deadlock collectives inside the layer loop (`transformer.layer_unroll`)."""
  model = Transformer(get_preset("tiny", num_layers=3))
  ids = jnp.zeros((8, 16), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids))

  def layer_loops(mesh):
    with sharding.activate(mesh):
      return jax.jit(model.apply).lower(params, ids).as_text().count("stablehlo.while")

  assert layer_loops(sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])) == 1
  assert layer_loops(sharding.make_mesh((2, 2, 2))) == 0



@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_apply_slices_of_the_stacked_weights_as_the_scan_does(remat):
  """scan_unroll = num_layers: the same parameters (stacked), no layer loop, the scan's
  logits and gradients."""
  config = get_preset("tiny", num_layers=3, remat=remat)
  ids = jnp.asarray(np.random.RandomState(2).randint(0, 512, (2, 16)))
  segments = jnp.asarray([[1] * 6 + [2] * 10] * 2)
  _, params = _init(config)

  def grads(model):
    loss = lambda p: jnp.mean(model.apply({"params": p}, ids, segment_ids_BxT=segments) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params), jax.jit(jax.grad(loss)).lower(
        params).as_text().count("stablehlo.while")

  (scanned, loops), (unrolled, no_loops) = (
      grads(Transformer(config)), grads(Transformer(config.replace(scan_unroll=3))))
  assert loops > 0 and no_loops == 0  # the scan's forward and backward loops, none
  for got, want in zip(jax.tree_util.tree_leaves(unrolled), jax.tree_util.tree_leaves(scanned)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

@functools.cache
def _remat_grads(remat_policy):
  """Gradients of the tiny model's mean logit under `remat_policy` (each policy computed once)."""
  ids = np.random.RandomState(1).randint(0, 512, (2, 12))
  _, params = _init(get_preset("tiny"))
  m = Transformer(get_preset("tiny", remat=remat_policy))
  return jax.jit(jax.grad(lambda p: m.apply({"params": p}, ids).mean()))(params)


@pytest.mark.parametrize("remat", ["full", "minimal", "minimal_with_context", "qkv_context",
                                   "dots"])
def test_remat_policies_give_the_same_gradients(remat):
  for g, ref in zip(jax.tree_util.tree_leaves(_remat_grads(remat)),
                    jax.tree_util.tree_leaves(_remat_grads("none"))):
    np.testing.assert_allclose(g, ref, atol=1e-6)


def test_bf16_compute_with_f32_params():
  config = get_preset("tiny", dtype="bfloat16")
  model, params = _init(config)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  ids = np.random.RandomState(0).randint(0, config.vocab_size, (1, 8))
  logits = model.apply({"params": params}, ids)
  assert logits.dtype == jnp.float32
  # The same params computed in float32: bf16 rounding (8 mantissa bits, 2**-8 = 0.4% on
  # logits of about 1) moves the logits, a little; float32 compute would move them by 0.
  exact = Transformer(get_preset("tiny")).apply({"params": params}, ids)
  assert 1e-4 < np.abs(np.asarray(logits) - np.asarray(exact)).max() < 2e-2  # 3.2e-3


def test_cudnn_attention_on_cpu_fails_early_and_clearly():
  model, params = _init(get_preset("tiny"))
  cudnn = Transformer(get_preset("tiny", attention_impl="cudnn"))
  with pytest.raises(ConfigError, match="attention_impl='cudnn' needs a GPU"):
    cudnn.apply({"params": params}, np.zeros((1, 4), np.int32))


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_impl="splash"), "attention_impl='splash' needs a TPU"),
    (dict(remat="offload"), "remat='offload' moves activations to host memory")])
def test_a_kernel_or_memory_this_backend_lacks_fails_early_and_clearly(overrides, message):
  _, params = _init(get_preset("tiny"))
  with pytest.raises(ConfigError, match=message):
    Transformer(get_preset("tiny", **overrides)).apply({"params": params},
                                                       np.zeros((1, 4), np.int32))


def test_unknown_preset_is_named():
  with pytest.raises(ConfigError, match="unknown model preset 'qwen9'"):
    get_preset("qwen9")


@pytest.mark.parametrize("overrides,message", [
    (dict(num_kv_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(remat="sometimes"), "remat='sometimes'"),
    (dict(attention_impl="flash"), "attention_impl='flash'"),
    (dict(dtype="float17"), "dtype='float17' is not a dtype name"),
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(colour="blue"), "unknown ModelConfig field"),
])
def test_invalid_config_values_are_named(overrides, message):
  with pytest.raises(ConfigError, match=message):
    get_preset("tiny", **overrides)


def test_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    get_preset("tiny").num_layers = 3

def test_head_dim_derives_from_the_overridden_width_and_heads():
  assert get_preset("tiny").head_dim == 16  # 64 wide, 4 heads
  assert get_preset("tiny", hidden_size=128).head_dim == 32
  assert get_preset("tiny", hidden_size=128, num_heads=8, num_kv_heads=2).head_dim == 16
  assert get_preset("tiny", hidden_size=128, head_dim=16).head_dim == 16  # named: kept
  assert get_preset("llama3_2_1b", hidden_size=1024, num_heads=16).head_dim == 64


def test_replacing_the_width_of_a_built_config_names_head_dim():
  config = get_preset("tiny")
  with pytest.raises(ConfigError, match=r"keeps head_dim=16; pass head_dim too"):
    config.replace(hidden_size=128)
  assert config.replace(hidden_size=128, head_dim=0).head_dim == 32
  assert config.replace(num_heads=2, num_kv_heads=2, head_dim=16).head_dim == 16



def _dots(jaxpr) -> int:
  """Counts the dot_general equations of a jaxpr and of every jaxpr nested in it."""
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == "dot_general"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          total += _dots(inner)
  return total


def test_each_remat_policy_reruns_what_it_does_not_keep():
  """Matmuls rerun in a gradient's program (a layer counted once; a matmul whose output no
  gradient needs, the MLP's down projection, is never rerun): full remat the layer's 6 other
  projections and attention's 2 dots; qkv_context the output, gate and up projections and
  attention's scores (the softmax's gradient needs them); minimal attention's 2 dots;
  minimal_with_context the scores alone (the dense XLA attention keeps no probabilities; the
  splash kernel's residuals are named "context" too)."""
  ids = np.zeros((1, 8), np.int32)
  _, params = _init(get_preset("tiny"))

  def dots(remat):
    m = Transformer(get_preset("tiny", remat=remat))
    return _dots(jax.make_jaxpr(jax.grad(lambda p: m.apply({"params": p}, ids).mean()))(
        params).jaxpr)

  base = dots("none")
  assert {r: dots(r) - base for r in ("full", "qkv_context", "minimal",
                                      "minimal_with_context")} == dict(
      full=8, qkv_context=4, minimal=2, minimal_with_context=1)
