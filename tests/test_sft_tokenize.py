"""SFT tokenization: the loss mask is exact to the token, before and after truncation."""

import numpy as np
import pytest

from coa_jax.data import coa_format, sample_data
from coa_jax.data import tokenizer as tk
from coa_jax.data.tokenize import DroppedExample, tokenize_trajectory


@pytest.fixture(scope="module", params=["plain", "chatml"])
def tok(request):
  base = tk.default_tokenizer()
  return tk.CoATokenizer(tk.tokenizers.Tokenizer.from_str(base.backend.to_str()), request.param)


def _observation_blocks(trajectory):
  return "".join("\n" + coa_format.render_step(s) for s in trajectory.steps
                 if s.tag == coa_format.OBSERVATION)


def _without_observations(trajectory):
  return coa_format.render_steps(s for s in trajectory.steps
                                 if s.tag != coa_format.OBSERVATION)


@pytest.mark.parametrize("index", [1, 2, 3])  # lookup (1 obs), definition (2 obs), math
def test_mask_selects_exactly_the_assistant_text_without_observations(tok, index):
  trajectory = sample_data.make_trajectories(6)[index]
  example = tokenize_trajectory(trajectory, tok, max_len=4096)
  ids, mask, start = example.input_ids, example.loss_mask, example.response_start
  assert not mask[:start].any()  # the prompt is never a target
  response_ids, response_mask = ids[start:], mask[start:]
  trained = tok.decode(response_ids[response_mask == 1])
  assert trained == _without_observations(trajectory) + tok.decode([tok.end_id])
  assert tok.decode(response_ids[response_mask == 0]) == _observation_blocks(trajectory)


def test_truncation_keeps_every_observation_token_masked(tok):
  trajectory = sample_data.make_trajectories(3)[2]  # two observations
  full = tokenize_trajectory(trajectory, tok, max_len=4096)
  obs_positions = np.flatnonzero((full.loss_mask == 0) &
                                 (np.arange(len(full)) >= full.response_start))
  for cut in (obs_positions[0] + 3, obs_positions[-1] - 2, len(full) - 1):
    short = tokenize_trajectory(trajectory, tok, max_len=int(cut))
    np.testing.assert_array_equal(short.input_ids, full.input_ids[:cut])
    np.testing.assert_array_equal(short.loss_mask, full.loss_mask[:cut])


def test_overlong_examples_are_dropped_with_a_reason_when_asked(tok):
  trajectory = sample_data.make_trajectories(1)[0]
  with pytest.raises(DroppedExample) as info:
    tokenize_trajectory(trajectory, tok, max_len=20, overlong="drop")
  assert info.value.reason == "too_long"
  with pytest.raises(DroppedExample) as info:
    tokenize_trajectory(trajectory, tok, max_len=20)  # the prompt alone fills it
  assert info.value.reason == "no_targets"
