"""Partial rollouts: a token sampled over a KV cache that older weights wrote is off-policy for
every version, and the update's stale mask importance-weights it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.model import build_config
from coa_jax.model.transformer import Transformer
from coa_jax.rl.batch import rollout_batch
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.tool_loop import RolloutRecord
from coa_jax.runtime import sharding
from coa_jax.runtime.sharding import init_params

CONFIG = build_config({"preset": "tiny", "tie_embeddings": False})
PROMPT, CHUNK = [5, 6, 7, 8, 9], 4


@pytest.fixture(scope="module")
def partial_rollout():
  """Returns (record, params by version): one row sampled for a chunk by version 0, then for a
  chunk by version 1 (perturbed weights) over the cache version 0 wrote."""
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  v0 = init_params(Transformer(CONFIG), mesh, jax.random.key(0))
  leaves, tree = jax.tree.flatten(v0)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  v1 = jax.tree.unflatten(tree, [p + 0.02 * jax.random.normal(k, p.shape, p.dtype)
                                 for p, k in zip(leaves, keys)])
  s = Sampler(CONFIG, mesh, batch_size=1, cache_size=32, chunk=CHUNK, stop_ids=(),
              sampling=SamplingConfig(temperature=1.0))
  state = s.prefill_groups(v0, s.init_state(), [([0], PROMPT)], [len(PROMPT) + 2 * CHUNK])
  record = RolloutRecord("t", 0, [], [], [], len(PROMPT))
  record.append(PROMPT, version=0)
  for version, params in enumerate((v0, v1)):
    state, chunk = s.decode_chunk(params, state, jax.random.key(2))
    record.append(np.asarray(chunk.tokens_BxK)[0].tolist(),
                  np.asarray(chunk.logprobs_BxK)[0].tolist(), version)
  return record, (v0, v1)


def teacher_forced(params, ids):
  """Returns log p(ids[t] | ids[:t]) for t >= 1 of a full forward pass (no cache)."""
  logits = Transformer(CONFIG).apply({"params": params}, jnp.asarray([ids]))[0]
  logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
  return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=-1)[:, 0])


def test_a_token_sampled_over_an_older_cache_follows_neither_version(partial_rollout):
  record, (v0, v1) = partial_rollout
  recorded = np.asarray(record.logprobs[1:])
  first, second = slice(len(PROMPT) - 1, len(PROMPT) - 1 + CHUNK), slice(-CHUNK, None)
  # Version 0's own tokens are its policy's (to rounding); version 1's are neither's.
  np.testing.assert_allclose(recorded[first], teacher_forced(v0, record.ids)[first], atol=1e-4)
  for params in (v0, v1):
    assert np.all(np.abs(recorded[second] - teacher_forced(params, record.ids)[second]) > 1e-3)


def test_the_stale_mask_weights_every_token_sampled_over_an_older_cache(partial_rollout):
  record, _ = partial_rollout
  batch = rollout_batch([record], [1.0], [0], seq_len=len(record.ids) - 1, proximal_version=1)
  np.testing.assert_array_equal(batch.stale_mask[0], batch.loss_mask[0])  # both chunks
  assert batch.loss_mask[0].sum() == 2 * CHUNK
