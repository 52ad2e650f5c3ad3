"""The copy probe: which steps are copies, and exact / sampled rates against oracle models."""

import json

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


MIXED = Trajectory("Solve it.", "Question: What is the population of City 2216 *20?", (
    Step("plan", "1. Find the population of City 2216.\n2. Compute it *20 with code."),
    Step("web_search", "population of City 2216"),
    Step("observation", "City 2216 is a city. The population of City 2216 is 99649."),
    Step("code", "```python\nresult = 99649 *20\nprint(result)\n```"),
    Step("observation", "1992980\n"), Step("suggested_answer", "1992980"),
    Step("answer", "1992980")))


def test_a_question_copy_is_a_question_item_a_call_writes_before_an_observation_shows_it():
  example = copy_probe.copy_example(MIXED, TOKENIZER, 512)
  copies = [TOKENIZER.decode(example.input_ids[a:b]) for a, b in example.question_spans]
  # the search copies the name; the code copies the factor (its 99649 is the page's, and
  # City 2216 is on the page by then); the plan is not a tool call
  assert copies == [" City", "2216", "20"]


def test_a_wrong_factor_fails_the_question_copy_and_nothing_else():
  example = copy_probe.copy_example(MIXED, TOKENIZER, 512)
  factor_begin, _ = example.question_spans[-1]
  sure = copy_probe.copy_accuracy(Oracle(100.0), None, [example])
  assert sure["question_exact"] == 1.0 and sure["question_copies"] == 3
  wrong = copy_probe.copy_accuracy(Oracle(100.0, [factor_begin - 1]), None, [example])
  assert wrong["question_exact"] == pytest.approx(2 / 3)
  assert wrong["copy_exact"] == 1.0 and wrong["call_exact"] == 0.5
  assert wrong["question_sampled"] == pytest.approx(2 / 3)
  assert sure["question_unsure"] == 0.0 and wrong["question_unsure"] == pytest.approx(1 / 3)


def test_a_number_from_nowhere_is_named_where_it_first_appears():
  sampled = [Step("plan", "1. Find the population of City 2216.\n2. Compute it *16 with code."),
             *MIXED.steps[1:3], Step("code", "```python\nresult = 99649 *16\nprint(result)\n```")]
  assert copy_probe.invented_numbers(MIXED.question, sampled) == [("plan", "16")]
  wrong_code = [*MIXED.steps[:3], Step("code", "```python\nresult = 99694 *20\n```")]
  assert copy_probe.invented_numbers(MIXED.question, wrong_code) == [("code", "99694")]
  assert copy_probe.invented_numbers(MIXED.question, MIXED.steps) == []
  chained = [Step("plan", "1. Find the mayor of City 2216.\n2. Find the birth year of the result "
                          "of step 1.\n3. Compute it *20 with code.")]
  assert copy_probe.invented_numbers(MIXED.question, chained) == []  # the plan's numbering


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


PAGE = Trajectory("Solve it.", "Question: What is the population of Alpha?", (
    Step("crawl_page", "https://kb.world/alpha"),
    Step("observation", "The population of the province of Alpha is 123. The population of "
                        "Alpha is 456."),
    Step("suggested_answer", "123"), Step("answer", "123")))


class Believer:
  """Logits that put `margin` on the next token of one fixed token sequence, whatever the input."""

  def __init__(self, margin, ids):
    self.margin, self.ids = margin, jnp.asarray(ids)

  def apply(self, variables, ids_BxT):
    del variables
    believed = jnp.zeros(ids_BxT.shape[1], jnp.int32).at[:len(self.ids) - 1].set(self.ids[1:])
    return self.margin * jax.nn.one_hot(jnp.broadcast_to(believed, ids_BxT.shape),
                                        TOKENIZER.vocab_size)


def test_the_near_miss_probe_pairs_the_teachers_figure_with_the_entitys_own():
  near, own = copy_probe.near_miss_pairs(PAGE, TOKENIZER, "123", "456")
  (begin, end), = near.spans
  assert TOKENIZER.decode(near.input_ids[begin:end]) == "123\n</suggested_answer>"
  assert TOKENIZER.decode(own.input_ids[own.spans[0][0]:]) == "456\n</suggested_answer>"
  np.testing.assert_array_equal(near.input_ids[:begin], own.input_ids[:begin])
  assert copy_probe.near_miss_pairs(PAGE, TOKENIZER, "789", "456") is None  # never written


def test_the_near_miss_probe_gives_each_figures_chance_under_the_model():
  near, own = copy_probe.near_miss_pairs(PAGE, TOKENIZER, "123", "456")
  (begin, end), = near.spans
  v = TOKENIZER.vocab_size
  # a model sure of the teacher's trajectory: each of the near figure's tokens has probability
  # e^m / (e^m + V - 1), the own figure's first token (where the two part) 1 / (e^m + V - 1)
  chance = copy_probe.near_miss_chance(Believer(5.0, near.input_ids), None, [(near, own)])
  assert chance["near_log10"] == pytest.approx((end - begin) * np.log10(
      np.exp(5.0) / (np.exp(5.0) + v - 1)), rel=1e-4)
  assert chance["own_log10"] < chance["near_log10"] and chance["own_likelier"] == 0.0
  believes_own = copy_probe.near_miss_chance(Believer(5.0, own.input_ids), None, [(near, own)])
  assert believes_own["own_likelier"] == 1.0


def test_the_diagnosis_splits_probes_and_numbers_from_nowhere_by_family(tmp_path):
  import dataclasses
  import json

  from coa_jax.data.tasks import Task
  from coa_jax.evaluation import diagnosis

  mixed = dataclasses.replace(MIXED, metadata={"family": "mixed"})
  arithmetic = dataclasses.replace(TRAJECTORY, metadata={"family": "arithmetic"})
  probe = diagnosis.probe_by_family(Oracle(100.0), None, [mixed, arithmetic], TOKENIZER, 512, 0.6)
  assert set(probe) == {"all", "arithmetic", "mixed"}
  assert probe["mixed"]["question_copies"] == 3 and probe["all"]["question_exact"] == 1.0

  tasks = {"m": Task("m", MIXED.question, {"family": "mixed"})}
  right = "\n".join(f"<{s.tag}>\n{s.content}\n</{s.tag}>" for s in MIXED.steps)
  wrong = right.replace("*20", "*16")  # the plan invents the factor, the code repeats it
  with open(tmp_path / "samples.jsonl", "w") as f:
    f.write(json.dumps({"task_id": "m", "samples": [{"text": right, "correct": True},
                                                    {"text": wrong, "correct": False}]}))
  invented = diagnosis.invented_by_step(str(tmp_path / "samples.jsonl"), tasks,
                                        TOKENIZER.tool_tags)
  assert invented["mixed"] == {"samples": 2, "invented": 0.5, "failed_with_invented": 1.0,
                               "first_in_plan": 0.5}


def test_question_copies_are_bucketed_by_how_far_into_the_response_they_stand():
  from coa_jax.evaluation import diagnosis

  example = copy_probe.copy_example(MIXED, TOKENIZER, 512)
  factor_begin, _ = example.question_spans[-1]
  far = diagnosis.question_copies_by_distance(Oracle(100.0, [factor_begin - 1]), None, [MIXED],
                                              TOKENIZER, 512)
  assert far == {"0+": {"exact": 2 / 3, "copies": 3}}  # the whole response is short


def test_the_probes_say_how_many_trajectories_they_could_not_read(tmp_path, capsys):
  from coa_jax import evaluation

  path = tmp_path / "heldout_trajectories.jsonl"
  path.write_text(json.dumps(TRAJECTORY.to_json()) + "\n{not json\n")
  assert evaluation.probe_trajectories(str(path), TOKENIZER.tool_tags) == [TRAJECTORY]
  assert f"probe data {path}: kept 1 of 2 examples; dropped 1 (bad_json: 1)" in (
      capsys.readouterr().out)


def test_a_long_number_from_nowhere_is_traced_to_a_garbled_copy_or_a_training_figure(tmp_path):
  from coa_jax.data.tasks import Task
  from coa_jax.evaluation import diagnosis

  assert diagnosis.edits("99649", "99169") == 2 and diagnosis.edits("99649", "12305") == 5
  assert diagnosis.edits("", "12") == 2 and diagnosis.edits("1234", "234") == 1
  tasks = {"m": Task("m", MIXED.question, {"family": "mixed"})}
  right = "\n".join(f"<{s.tag}>\n{s.content}\n</{s.tag}>" for s in MIXED.steps)
  samples = [right.replace("= 99649", "= 99169"),  # the page's figure, two digits garbled
             right.replace("= 99649", "= 31337"),  # nothing seen is near it; training has it
             right.replace("*20", "*16")]  # short: not counted
  with open(tmp_path / "samples.jsonl", "w") as f:
    f.write(json.dumps({"task_id": "m", "samples": [
        {"text": text, "correct": False} for text in samples]}))
  (tmp_path / "train.jsonl").write_text(json.dumps({"text": "population 31337 and 99169"}))
  origins = diagnosis.invented_origins(str(tmp_path / "samples.jsonl"), tasks,
                                       TOKENIZER.tool_tags, str(tmp_path / "train.jsonl"))
  # the training text holds two of the 90,000 five-digit numbers
  assert origins == {"numbers": 2, "near_seen": 0.5, "in_training": 1.0,
                     "in_training_by_chance": pytest.approx(2 / 90000)}
