"""Splash attention (Pallas, TPU): the kernel run by Pallas' interpreter on this CPU against the
exact blockwise attention, values and gradients; split over a mesh; compiled for a TPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.model import get_preset
from coa_jax.model.attention import blockwise_causal_attention, splash_attention
from coa_jax.perf import aot
from coa_jax.runtime import sharding
from configs import common

# Two rows of 256 tokens, 4 query heads over 2 kv heads; packed segments, 0 marking padding.
B, T, N, K, H = 2, 256, 4, 2, 64


@functools.cache
def _inputs():
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.randn(B, T, heads, H), jnp.float32) for heads in (N, K, K))
  segments = np.ones((B, T), np.int32)
  segments[0, 100:] = 2
  segments[1, 230:] = 0
  return q, k, v, jnp.asarray(segments)


def _loss(attention, q, k, v, segments):
  out = attention(q, k, v, segments)
  return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))


def _value_and_grads(attention):
  return jax.jit(jax.value_and_grad(functools.partial(_loss, attention), argnums=(0, 1, 2)))(
      *_inputs())


@functools.cache
def _reference():
  return _value_and_grads(lambda q, k, v, s: blockwise_causal_attention(q, k, v, s, 64))


@pytest.mark.parametrize("block_q,block_kv", [(128, 128), (256, 128)])
def test_splash_attention_equals_the_exact_attention_with_its_gradients(block_q, block_kv):
  splash = lambda q, k, v, s: splash_attention(q, k, v, s, block_q, block_kv, interpret=True)
  (value, grads), (ref_value, ref_grads) = _value_and_grads(splash), _reference()
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_splash_attention_split_over_a_mesh_equals_one_device():
  """Rows over data x fsdp, heads over tensor: each device runs the kernel on its own rows and
  heads."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=2),
                            devices=jax.devices()[:4])
  splash = lambda q, k, v, s: splash_attention(q, k, v, s, 128, 128, interpret=True)
  with sharding.activate(mesh):
    value, grads = _value_and_grads(splash)
  ref_value, ref_grads = _reference()
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  for got, want in zip(grads, ref_grads):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_a_sequence_the_blocks_do_not_tile_is_named():
  q, k, v, segments = _inputs()
  with pytest.raises(ValueError, match="sequence length 256 is not a multiple of the query block "
                                       "384"):
    splash_attention(q, k, v, segments, 384, 128, interpret=True)
  with pytest.raises(ValueError, match="blocks of 64 queries by 128 keys; the kernel tiles by "
                                       "multiples of 128"):
    splash_attention(q, k, v, segments, 64, 128, interpret=True)


def test_a_model_with_splash_attention_compiles_for_a_tpu_topology():
  """The kernel lowers through Mosaic for a TPU (libtpu, no TPU attached) inside the train step,
  under remat that keeps its residuals."""
  model = get_preset("tiny", dtype="bfloat16", attention_impl="splash", attention_block=128,
                     remat="minimal_with_context")
  compiled, *_ = aot.compile_train_step(model, common.optimizer(),
                                        aot.topology_devices("v5e:2x2"),
                                        sharding.MeshConfig(fsdp=-1), 4, 256)
  assert "tpu_custom_call" in compiled.as_text()
