"""The copy probe: which steps are copies, and exact / sampled rates against oracle models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.data.coa_format import Step, Trajectory
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.evaluation import copy_probe

TOKENIZER = default_tokenizer("plain")
TRAJECTORY = Trajectory("Solve it.", "Question: What is 29 * 94 + 67?", (
    Step("code", "```python\nprint(29 * 94 + 67)\n```"), Step("observation", "2793\n"),
    Step("suggested_answer", "2793"), Step("double_check", "Printed. Score: 4"),
    Step("answer", "2793")))


class Oracle:
  """Logits that put `margin` on the true next token, except at the positions in `wrong`."""

  def __init__(self, margin, wrong=()):
    self.margin, self.wrong = margin, wrong

  def apply(self, variables, ids_BxT):
    del variables
    targets = jnp.roll(ids_BxT, -1, axis=1)
    for t in self.wrong:
      targets = targets.at[:, t].set((targets[:, t] + 1) % TOKENIZER.vocab_size)
    return self.margin * jax.nn.one_hot(targets, TOKENIZER.vocab_size)


def test_a_copy_step_is_an_answer_found_in_an_earlier_observation():
  example = copy_probe.copy_example(TRAJECTORY, TOKENIZER, 512)
  (begin, end), = example.spans
  assert TOKENIZER.decode(example.input_ids[begin:end]) == "\n2793\n</suggested_answer>"
  (call_begin, call_end), = example.call_spans
  assert TOKENIZER.decode(example.input_ids[call_begin:call_end]).startswith("\n```python")
  guessed = Trajectory("Solve it.", "Question: ?", (Step("suggested_answer", "12"),
                                                    Step("answer", "12")))
  assert copy_probe.copy_example(guessed, TOKENIZER, 512) is None


def test_rates_of_a_sure_oracle_a_wrong_token_and_an_unsure_oracle():
  example = copy_probe.copy_example(TRAJECTORY, TOKENIZER, 512)
  (begin, end), = example.spans
  sure = copy_probe.copy_accuracy(Oracle(100.0), None, [example])
  assert sure["copy_exact"] == sure["call_exact"] == 1.0
  assert sure["copy_sampled"] == pytest.approx(1.0)
  wrong = copy_probe.copy_accuracy(Oracle(100.0, [begin]), None, [example])
  assert wrong["copy_exact"] == 0.0 and wrong["call_exact"] == 1.0
  assert wrong["copy_token_accuracy"] == pytest.approx((end - begin - 1) / (end - begin))
  # margin m at temperature 1: each token has probability e^m / (e^m + V - 1)
  unsure = copy_probe.copy_accuracy(Oracle(5.0), None, [example],
                                    temperature=1.0)
  p = np.exp(5.0) / (np.exp(5.0) + TOKENIZER.vocab_size - 1)
  assert unsure["copy_exact"] == 1.0
  assert unsure["copy_sampled"] == pytest.approx(p ** (end - begin), rel=1e-4)
