"""Benchmark helpers: the decode with tool-style extends does the same work on both sides."""

import jax
import numpy as np

from coa_jax.model import Transformer, get_preset
from coa_jax.perf import bench
from coa_jax.runtime import hf_checkpoint, sharding


def test_agent_decode_generates_the_same_greedy_tokens_as_hf_generate_across_extends(tmp_path):
  """Ours (prefill, a chunk per round, extends) and HF `generate` with its static cache kept
  across rounds, float32 on the CPU, same weights: the same tokens, so the same work."""
  config = get_preset("tiny", attention_impl="xla")
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = sharding.init_params(Transformer(config), mesh, jax.random.key(3))
  hf_checkpoint.save_checkpoint(str(tmp_path), config, params, dtype="float32")
  work = bench.AgentDecode(prompt_len=12, new_tokens=6, rounds=3, observation_len=5)
  assert work.generated == 18 and work.length == 12 + 18 + 2 * 5
  prompts, observations = work.inputs(3, config.vocab_size)
  _, ours = bench.jax_agent_decode(config, params, mesh, work, prompts, observations, 0, 1)
  _, theirs = bench.hf_agent_decode(str(tmp_path), "float32", work, prompts, observations, 0, 1)
  assert ours.shape == theirs.shape == (3, 18)
  np.testing.assert_array_equal(ours, theirs)
  assert len(np.unique(ours)) > 3  # the observations changed what the model generates
