"""Evaluation metrics on scripted outcomes, and the task-file loaders."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coa_jax.data.tasks import load_tasks
from coa_jax.evaluation import job as evaluate
from coa_jax.evaluation.job import Sample, pass_at_k, summarize
from coa_jax.model import ConfigError


@pytest.mark.parametrize("n,c,k,expected", [(5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 0, 3, 0.0),
                                            (5, 4, 2, 1.0), (4, 1, 4, 1.0)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
  assert pass_at_k(n, c, k) == pytest.approx(expected)


def _s(correct, answer, tokens=10, calls=None, errors=0, reason="answer"):
  return Sample(correct, answer, tokens, calls or {}, errors, reason)


def test_summary_metrics_equal_hand_computed_values():
  outcomes = {
      "a": [_s(True, "5", 10, {"code": 1}), _s(False, "6", 20), _s(True, "5", 30)],
      "b": [_s(False, "x", 40, {"web_search": 2}), _s(False, "y", 50, errors=1),
            _s(False, None, 60, reason="length")],
      "c": [_s(False, "7"), _s(True, "8"), _s(False, "7")],  # the majority is wrong
  }
  m = summarize(outcomes, k=3)
  assert m["pass@1"] == pytest.approx((2 / 3 + 0 + 1 / 3) / 3)
  assert m["avg@3"] == pytest.approx(m["pass@1"])
  assert m["pass@3"] == pytest.approx((1 + 0 + 1) / 3)
  assert m["maj@3"] == pytest.approx(1 / 3)
  assert m["tokens_per_task"] == pytest.approx((10 + 20 + 30 + 40 + 50 + 60 + 30) / 9)
  assert m["tool_calls_per_task"] == pytest.approx(3 / 9)
  assert m["tool_calls_by_kind"] == pytest.approx({"code": 1 / 9, "web_search": 2 / 9})
  assert m["format_error_rate"] == pytest.approx(1 / 9)
  assert m["finish_reasons"] == {"answer": 8, "length": 1}


def test_pass_at_1_by_group_averages_each_groups_tasks():
  outcomes = {"a": [_s(True, "5"), _s(False, "6")], "b": [_s(True, "1"), _s(True, "1")],
              "c": [_s(False, "7"), _s(False, "7")], "d": [_s(True, "2"), _s(True, "2")]}
  by_family = evaluate.pass_at_1_by(outcomes, {"a": "lookup", "b": "lookup", "c": "mixed"})
  assert by_family == pytest.approx({"lookup": (0.5 + 1.0) / 2, "mixed": 0.0})


def test_invented_number_rates_count_samples_per_family():
  from coa_jax.data.tasks import Task

  mixed = Task("m", "Question: What is the population of City 2216 *20?", {"family": "mixed"})
  arithmetic = Task("a", "Question: What is 29 * 94 + 67?", {"family": "arithmetic"})
  code = lambda body: Sample(False, None, 10, {}, 0, text=f"<code>\n{body}\n</code>")
  outcomes = {"m": [code("print(99649 *16)"), code("print(2216 *20)")],
              "a": [code("print(29 * 94 + 67)"), code("print(29 * 94 + 76)")]}
  rates = evaluate.invented_number_rates(outcomes, [mixed, arithmetic], ("code",))
  assert rates == pytest.approx({"all": 0.5, "arithmetic": 0.5, "mixed": 0.5})


def test_majority_vote_normalizes_answers_and_breaks_ties_by_first_seen():
  assert evaluate.majority_correct([_s(True, "Paris"), _s(False, "Rome"), _s(True, "paris.")])
  assert not evaluate.majority_correct([_s(False, "Rome"), _s(True, "Paris")])
  assert not evaluate.majority_correct([_s(False, None)])


def test_a_vote_never_merges_answers_the_grader_tells_apart():
  # Under a math grader -1/2 is right and 1/2 wrong; the text normalization makes both "frac12".
  samples = [_s(False, "\\frac{1}{2}"), _s(True, "-\\frac{1}{2}"), _s(True, "-\\frac{1}{2}"),
             _s(False, "3")]
  assert evaluate.majority_correct(samples)
  assert summarize({"t": samples}, 4)["maj@4"] == 1.0


def test_task_files_in_every_layout_load(tmp_path):
  ours = tmp_path / "ours.jsonl"
  ours.write_text(json.dumps({"id": "t1", "question": "Question: 2+2?",
                              "metadata": {"domain": "math", "ground_truth": "4"}}) + "\n")
  qa = tmp_path / "qa.jsonl"
  qa.write_text(json.dumps({"question": "Capital of France?", "answer": ["Paris", "paris"],
                            "data_source": "nq"}) + "\n")
  bench = tmp_path / "aime.jsonl"
  bench.write_text(json.dumps({"problem": "Find x.", "solution": "12"}) + "\n")
  rl = tmp_path / "rl.parquet"
  pq.write_table(pa.Table.from_pylist([{
      "prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Who?"}],
      "reward_model": {"ground_truth": json.dumps({"target": ["Ada"]})},
      "data_source": "hotpotqa", "extra_info": {"index": 3}}]), rl)
  (t1,), (t2,), (t3,), (t4,) = (load_tasks(str(p)) for p in (ours, qa, bench, rl))
  assert (t1.id, t1.question, t1.data["ground_truth"]) == ("t1", "Question: 2+2?", "4")
  assert t2.question == "Question: Capital of France?" and t2.data["ground_truth"] == [
      "Paris", "paris"]
  assert t3.data["ground_truth"] == "12" and t3.question == "Question: Find x."
  assert t4.question == "Question: Who?" and t4.data["ground_truth"] == ["Ada"]
  assert t4.data["data_source"] == "hotpotqa"


def test_a_task_without_an_answer_is_named(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"question": "Why?"}) + "\n")
  with pytest.raises(ConfigError, match="task 1: no answer"):
    load_tasks(str(path))


def test_a_task_id_given_twice_is_named(tmp_path):
  path = tmp_path / "twice.jsonl"
  path.write_text("".join(json.dumps({"id": "t1", "question": q, "answer": "1"}) + "\n"
                          for q in ("One?", "Two?")))
  with pytest.raises(ConfigError) as raised:
    load_tasks(str(path))
  assert str(raised.value) == f"{path}:2: task id 't1' is also row 1's"


@pytest.mark.parametrize("row, message", [
    ({"prompt": ["What?"]}, "prompt messages and reward_model must be JSON objects"),
    ({"prompt": [{"role": "user", "content": "What?"}], "reward_model": "4"},
     "prompt messages and reward_model must be JSON objects"),
    ({"question": "q", "public_test_cases": "[{bad"}, "public_test_cases: expected a list"),
    ({"question": "q", "public_test_cases": [{"stdin": "1"}]}, "public_test_cases: expected"),
])
def test_a_malformed_task_row_is_named_with_its_file(tmp_path, row, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(row) + "\n")
  with pytest.raises(ConfigError) as raised:
    load_tasks(str(path))
  assert str(raised.value).startswith(f"{path}: task 1: {message}")


def test_a_missing_task_file_is_named(tmp_path):
  path = tmp_path / "nowhere.jsonl"
  with pytest.raises(ConfigError) as raised:
    load_tasks(str(path))
  assert str(raised.value) == f"task file {str(path)!r} does not exist"


def test_an_empty_task_file_is_named(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_text("")
  with pytest.raises(ConfigError) as raised:
    load_tasks(str(path))
  assert str(raised.value) == f"task file {str(path)!r} has no tasks"


def test_livecodebench_rows_become_code_tasks(tmp_path):
  path = tmp_path / "lcb.jsonl"
  cases = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
           {"input": "f(1)", "output": "2", "testtype": "functional"}]
  path.write_text(json.dumps({"question_id": "abc1", "question_content": "Add two numbers.",
                              "public_test_cases": json.dumps(cases)}) + "\n")
  (task,) = load_tasks(str(path))
  assert task.data["domain"] == "code" and task.data["tests"] == [
      {"stdin": "1 2\n", "stdout": "3\n"}]


@pytest.mark.parametrize("name,split", [("trivia_qa/rc.nocontext", "validation"),
                                        ("natural_questions_open", "validation")])
def test_tfds_datasets_load_offline_from_mock_data(name, split):
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=3):
    tasks = load_tasks(f"tfds:{name}:{split}", limit=2)
  assert len(tasks) == 2
  for task in tasks:
    assert task.question.startswith("Question: ") and task.data["domain"] == "qa"
    assert task.data["ground_truth"] and all(isinstance(g, str) for g in task.data["ground_truth"])


def test_tasks_to_roll_out_need_no_answer(tmp_path):
  path = tmp_path / "questions.jsonl"
  path.write_text('{"id": "a", "question": "Question: why?"}\n')
  (task,) = load_tasks(str(path), require_answer=False)
  assert (task.id, task.question) == ("a", "Question: why?")
  with pytest.raises(ConfigError, match="no answer"):
    load_tasks(str(path))
