"""Tasks: a question and its data (the ground truth, tests, ...), read from task files.

Task files (local only), by extension and fields:
- JSONL of {"question", ...} (ours; answers in `answer` / `metadata.ground_truth`), including
  the reference release's plain QA JSONL ({"question", "answer": str | list, "data_source"});
- parquet rows of the reference release's RL files ({"prompt": [messages],
  "reward_model": {"ground_truth": '{"target": ...}'}, "data_source", "extra_info"});
- benchmark files (AIME, MATH500, GAIA text, HLE, BrowseComp, WebWalker) as JSONL or parquet
  whose question and answer sit under any of the usual names (`problem`, `Question`, ...);
- LiveCodeBench rows ({"question_content", "public_test_cases": JSON of stdin tests}), and the
  reference release's LiveCodeBench parquet rows (a ground truth of JSON {"stdin": [...],
  "expected_output": [...]} or {"functional": a test script}, `release_code_tests`), scored by
  the code reward;
- prepared TFDS datasets (`tfds:trivia_qa/rc.nocontext:validation`,
  `tfds:natural_questions_open:validation`), when the `tfds` extra is installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable

from coa_jax.data import importers, rewards
from coa_jax.model import ConfigError

_QUESTION_KEYS = ("question", "Question", "problem", "Problem", "question_content", "prompt",
                  "query", "input")
_ANSWER_KEYS = ("answer", "Answer", "Final answer", "final_answer", "ground_truth", "solution",
                "target", "gold")


@dataclasses.dataclass(frozen=True)
class Task:
  """A question to roll out; `data` (e.g. the ground truth) travels with its records."""

  id: str
  question: str
  data: dict[str, Any] = dataclasses.field(default_factory=dict)

  def record(self) -> dict[str, Any]:
    """Returns the task as a teacher reads it: {"id", "question", "metadata": its other data}."""
    return {"id": self.id, "question": self.question,
            "metadata": {k: v for k, v in self.data.items() if k not in ("id", "question")}}


def _rows(path: str) -> Iterable[Any]:
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
  return importers.read_records(path)


# What the release's LeetCode-style tests may use without importing it, as LeetCode's own judge
# allows: put before the program of a functional test.
FUNCTIONAL_PRELUDE = ("from typing import *\nfrom collections import *\n"
                      "import bisect, collections, functools, heapq, itertools, math, re, string\n")


def release_code_tests(ground_truth: Any) -> list[dict[str, str]] | None:
  """Returns the code tests of a reference-release ground truth that holds them, or None: JSON
  {"stdin": [...], "expected_output": [...]} gives one {"stdin", "stdout"} test per pair;
  {"functional": script} one {"functional", "prelude"} test (the program, then the script's
  asserts; `FUNCTIONAL_PRELUDE` first). Raises ValueError for tests that do not pair up."""
  if not isinstance(ground_truth, str) or not ground_truth.lstrip().startswith("{"):
    return None
  try:
    truth = json.loads(ground_truth)
  except json.JSONDecodeError:
    return None
  if not isinstance(truth, dict):
    return None
  if isinstance(truth.get("functional"), str):
    return [{"functional": truth["functional"], "prelude": FUNCTIONAL_PRELUDE}]
  if "stdin" not in truth and "expected_output" not in truth:
    return None
  stdin, expected = truth.get("stdin"), truth.get("expected_output")
  if not isinstance(stdin, list) or not isinstance(expected, list) or not stdin or \
      len(stdin) != len(expected):
    raise ValueError("its code tests need equally long, non-empty stdin and expected_output "
                     "lists")
  return [{"stdin": str(i), "stdout": str(o)} for i, o in zip(stdin, expected)]


def task_from_row(row: dict[str, Any], number: int, require_answer: bool = True) -> Task:
  """Returns the Task of one task-file row in any of the supported layouts; without
  `require_answer`, a row may have no answer (tasks that are only rolled out). The row's
  fields and its `metadata`'s, lifted beside them, are the task's data: what every stage's
  reward sees as `response.task`."""
  data = {k: v for k, v in row.items() if k not in ("steps", "system", "metadata")}
  metadata = row.get("metadata") or {}
  if not isinstance(metadata, dict):
    raise ConfigError(f"task {number}: metadata must be a JSON object, got "
                      f"{type(metadata).__name__}")
  data.update(metadata)
  prompt = row.get("prompt")
  if isinstance(prompt, (list, tuple)):  # the reference RL rows: chat messages
    reward_model = row.get("reward_model") or {}
    if not all(isinstance(m, dict) for m in (*prompt, reward_model)):
      raise ConfigError(f"task {number}: prompt messages and reward_model must be JSON objects")
    question = next((m.get("content") for m in reversed(prompt) if m.get("role") == "user"), None)
    truth = reward_model.get("ground_truth")
    try:
      tests = release_code_tests(truth)
    except ValueError as e:
      raise ConfigError(f"task {number}: {e}") from None
    if tests is not None:  # the release's LiveCodeBench rows: code run on tests
      data.update(domain="code", ground_truth="tests", tests=tests)
    else:
      data["ground_truth"] = rewards.gold_answers(truth)
  else:
    question = next((row[k] for k in _QUESTION_KEYS if isinstance(row.get(k), str)), None)
    if row.get("public_test_cases"):  # LiveCodeBench: stdin/stdout tests
      try:
        cases = row["public_test_cases"]
        cases = json.loads(cases) if isinstance(cases, str) else cases
        data.update(domain="code", ground_truth="tests", tests=[
            {"stdin": c["input"], "stdout": c["output"]} for c in cases
            if c.get("testtype", "stdin") == "stdin"])
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"task {number}: public_test_cases: expected a list of "
                          f"{{input, output}} objects ({type(e).__name__}: {e})") from None
      if not data["tests"]:
        raise ConfigError(f"task {number}: no stdin test cases (functional tests are not run)")
    if "ground_truth" not in data:
      answer = next((row[k] for k in _ANSWER_KEYS if row.get(k) is not None), None)
      data["ground_truth"] = answer
  if not isinstance(question, str) or not question.strip():
    raise ConfigError(f"task {number}: no question under any of {_QUESTION_KEYS} or prompt "
                      f"messages")
  if require_answer and data.get("ground_truth") in (None, [], ""):
    raise ConfigError(f"task {number}: no answer under any of {_ANSWER_KEYS} or "
                      f"reward_model.ground_truth")
  if not question.lstrip().startswith("Question:"):
    question = f"Question: {question.strip()}"
  return Task(str(row.get("id", row.get("task_id", number))), question, data)


def _text(value: Any) -> str:
  return value.decode() if isinstance(value, bytes) else str(value)


def load_tfds_tasks(name: str, split: str, limit: int = 0,
                    data_dir: str | None = None) -> list[Task]:
  """Returns QA / math tasks from a prepared TFDS dataset read with `tfds.data_source` (no
  TensorFlow needed): `question` plus an `answer` that is text (a `#### n` tail is the math
  answer, as in GSM8K), a list of texts (natural_questions_open) or a dict of `aliases` /
  `value` (trivia_qa)."""
  import tensorflow_datasets as tfds

  source = tfds.data_source(name, split=split, data_dir=data_dir)
  tasks = []
  for index in range(min(len(source), limit or len(source))):
    example = source[index]
    answer, domain = example["answer"], "qa"
    if isinstance(answer, dict):
      golds = [_text(a) for a in answer.get("aliases", [])] or [_text(answer.get("value", ""))]
    elif isinstance(answer, (str, bytes)):
      text = _text(answer)
      golds, domain = ([text.rsplit("####", 1)[1].strip()], "math") if "####" in text else (
          [text], "qa")
    else:
      golds = [_text(a) for a in answer]
    tasks.append(Task(f"{name}:{split}:{index}", f"Question: {_text(example['question'])}",
                      {"domain": domain, "ground_truth": golds, "data_source": name}))
  if not tasks:
    raise ConfigError(f"TFDS {name}:{split} has no examples")
  return tasks


def load_tasks(path: str, limit: int = 0, require_answer: bool = True) -> list[Task]:
  """Returns the tasks of a local task file (JSONL or parquet, see the module docstring), or
  of a prepared TFDS dataset named `tfds:<name>:<split>`. Raises ConfigError naming the first
  bad row; every task must have an answer unless require_answer=False."""
  if path.startswith("tfds:"):
    _, name, split = path.split(":", 2)
    return load_tfds_tasks(name, split, limit)
  if not os.path.isfile(path):
    raise ConfigError(f"task file {path!r} does not exist")
  tasks, lines = [], {}
  for number, row in enumerate(_rows(path) if os.path.getsize(path) else [], 1):
    if not isinstance(row, dict):
      raise ConfigError(f"{path}:{number}: not a JSON object"
                        f"{' (not JSON)' if row is importers.BAD_JSON else ''}")
    try:
      task = task_from_row(row, number, require_answer)
    except ConfigError as e:
      raise ConfigError(f"{path}: {e}") from None
    if task.id in lines:  # samples are filed by id: two tasks would become one
      raise ConfigError(f"{path}:{number}: task id {task.id!r} is also row {lines[task.id]}'s")
    lines[task.id] = number
    tasks.append(task)
    if limit and len(tasks) == limit:
      break
  if not tasks:
    raise ConfigError(f"task file {path!r} has no tasks")
  return tasks
