"""The reference release's benchmark files: which file holds each benchmark, how its rows read as
tasks, and the grader the paper scores it with.

Graders, by benchmark:
- math (aime24, aime25, amc23, math500, olympiadbench): `rewards.math_reward`, math-verify;
- code (lcb_v4, lcb_v5): `rewards.code_reward`, each test's stdin run in the code sandbox and
  its stdout compared (a functional test: its asserts), with a time limit per test;
- judge (gaia, hle, browsecomp, webwalker): an LLM judge behind an OpenAI-compatible endpoint
  says "correct" or "incorrect" (`JUDGE_PROMPT`, the release's protocol); without one, exact
  match, which every table names as a fallback (`FALLBACK_LABEL`);
- qa (nq): exact match over the gold aliases (pass@1), token F1 beside it.

Rows load through the task reader (`tasks.task_from_row`, every layout it knows); the release's
parquet rows carry its whole agent prompt in their user message, of which a task keeps what
follows the last `Task:` (the model gets its own system prompt). `load_benchmark` returns the
tasks, each with its grader as its `domain`; `reward_spec` the rewards config that grades them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Any

from coa_jax.data.tasks import Task, load_tasks
from coa_jax.model import ConfigError

GRADERS = ("math", "code", "judge", "qa")
DEFAULT_DATA_DIR = "../shared/benchmarks/afm"  # relative to the repository root
_CODE_MATH = "data/code_agent/code_math_benchmarks"
_WEB = "data/web_agent/test_benchmarks"
_MHQA = "data/mhqa_agent/test_benchmarks"

# The judge's question, in the release's protocol: semantic equivalence to the labeled answer,
# a rationale and a judgement of "correct" or "incorrect" as JSON (`rewards.parse_verdict`).
JUDGE_PROMPT = (
    "Is the predicted answer below semantically equivalent to the labeled answer of the "
    "question? Differences of wording, formatting or capitalization that keep the meaning do "
    "not matter.\n\nQuestion: {question}\nLabeled answer: {gold}\nPredicted answer: "
    "{predicted}\n\nReply with only a JSON object: {{\"rationale\": \"why, in a sentence or "
    "two\", \"judgement\": \"correct\" or \"incorrect\"}}")
FALLBACK_LABEL = "exact match (fallback: no judge)"


@dataclasses.dataclass(frozen=True)
class BenchmarkFile:
  """A benchmark of the release: its name in commands, its file, the paper's name for it, its
  grader (one of GRADERS) and the release's folder that ships the file."""

  name: str
  file: str
  title: str
  grader: str
  release_folder: str


BENCHMARKS: dict[str, BenchmarkFile] = {b.name: b for b in (
    BenchmarkFile("aime24", "aime24.parquet", "AIME24", "math", _CODE_MATH),
    BenchmarkFile("aime25", "aime25.parquet", "AIME25", "math", _CODE_MATH),
    BenchmarkFile("amc23", "amc23.parquet", "AMC23", "math", _CODE_MATH),
    BenchmarkFile("math500", "math500.parquet", "MATH500", "math", _CODE_MATH),
    BenchmarkFile("olympiadbench", "OlympiadBench.parquet", "OlympiadBench", "math", _CODE_MATH),
    BenchmarkFile("lcb_v4", "livecodebench_v4.parquet", "LiveCodeBench v4", "code", _CODE_MATH),
    BenchmarkFile("lcb_v5", "livecodebench_v5.parquet", "LiveCodeBench v5", "code", _CODE_MATH),
    BenchmarkFile("gaia", "gaia_dev_103.json", "GAIA (text-only, 103)", "judge", _WEB),
    BenchmarkFile("hle", "hle_test.json", "HLE (500)", "judge", _WEB),
    BenchmarkFile("browsecomp", "browsecomp.json", "BrowseComp", "judge", _WEB),
    BenchmarkFile("webwalker", "webwalker_main.json", "WebWalkerQA", "judge", _WEB),
    BenchmarkFile("nq", "nq_full.jsonl", "NQ", "qa", _MHQA),
)}

# The `data_source` values of the release's rows (lowercase, without a `skywork_` prefix), by
# grader: a row whose source names another grader than its file's is refused.
SOURCE_GRADERS = {"aime24": "math", "aime25": "math", "amc23": "math", "math500": "math",
                  "olympiadbench": "math", "livecodebench_v4": "code", "livecodebench_v5": "code",
                  "gaia": "judge", "hle": "judge", "browsecomp": "judge", "webwalker": "judge",
                  "nq": "qa"}


def grader_of_source(data_source: str) -> str | None:
  """Returns the grader of a release row's `data_source` (e.g. "MATH500" -> "math",
  "skywork_livecodebench_v5" -> "code"), or None for a source the table does not know."""
  name = data_source.strip().lower()
  return SOURCE_GRADERS.get(name[len("skywork_"):] if name.startswith("skywork_") else name)


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
  """An LLM judge behind an OpenAI-compatible endpoint (`base_url` ends before
  /chat/completions); `api_key_env` names the variable holding its key (None: no key)."""

  base_url: str
  model: str
  api_key_env: str | None = "OPENAI_API_KEY"
  max_tokens: int = 1024
  timeout_s: float = 60.0
  retries: int = 2

  def __post_init__(self):
    if not self.base_url.startswith(("http://", "https://")):
      raise ConfigError(f"judge url {self.base_url!r}: expected an http(s):// URL of an "
                        f"OpenAI-compatible endpoint (e.g. http://host:8000/v1)")
    if not self.model:
      raise ConfigError(f"judge at {self.base_url}: name its model (--judge_model)")


def benchmark(name: str) -> BenchmarkFile:
  """Returns the table's entry of a benchmark name; raises ConfigError naming the known ones."""
  if name not in BENCHMARKS:
    raise ConfigError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
  return BENCHMARKS[name]


def benchmark_path(name: str, folder: str) -> str:
  """Returns the path of a benchmark's file in `folder`; raises ConfigError naming the file and
  where the release ships it when it is not there."""
  entry = benchmark(name)
  path = os.path.join(folder, entry.file)
  if not os.path.isfile(path):
    raise ConfigError(f"{entry.title}: {path} does not exist; it is the reference release's "
                      f"{entry.release_folder}/{entry.file} (docs/benchmarks_eval.md)")
  return path


def task_text(user_message: str) -> str:
  """Returns the task of a release prompt: the text after its last `Task:` (the whole message
  when there is none)."""
  _, marker, task = user_message.rpartition("Task:")
  return task.strip() if marker else user_message.strip()


def load_benchmark(name: str, folder: str = DEFAULT_DATA_DIR, limit: int = 0) -> list[Task]:
  """Returns the first `limit` (0: all) tasks of a benchmark's file in `folder`, read by the
  task reader, each with its grader as `domain`, the benchmark's name as `benchmark` and its
  question text (without the release's agent prompt) as `question`. Raises ConfigError."""
  entry = benchmark(name)
  tasks = []
  for task in load_tasks(benchmark_path(name, folder), limit):
    data = dict(task.data)
    prompt = data.pop("prompt", None)
    if isinstance(prompt, (list, tuple)):  # the release's RL rows: its agent prompt + the task
      text = task_text(next(m["content"] for m in reversed(prompt) if m.get("role") == "user"))
      for key in ("reward_model", "extra_info", "ability"):
        data.pop(key, None)
    else:
      text = task.question.removeprefix("Question:").strip()
    source = data.get("data_source")
    if isinstance(source, str) and grader_of_source(source) not in (None, entry.grader):
      raise ConfigError(f"{entry.title} task {task.id}: its data_source {source!r} is graded as "
                        f"{grader_of_source(source)}, not {entry.grader}: is {entry.file} the "
                        f"release's file?")
    if entry.grader == "code" and not data.get("tests"):
      raise ConfigError(f"{entry.title} task {task.id}: no code tests in its ground truth")
    data.update(question=text, domain=entry.grader, benchmark=name)
    tasks.append(Task(task.id, f"Question: {text}", data))
  return tasks


def task_rows(tasks: list[Task]) -> list[dict[str, Any]]:
  """Returns task-file rows that `load_tasks` reads back to the same questions, ground truths,
  tests and domains."""
  keep = ("data_source", "domain", "benchmark", "ground_truth", "tests")
  return [{"id": task.id, "question": task.data["question"],
           **{key: task.data[key] for key in keep if key in task.data}} for task in tasks]


def reward_spec(grader: str, judge: JudgeSettings | None = None,
                code_timeout_s: float = 6.0) -> dict[str, Any]:
  """Returns the rewards config (`rewards.RewardSpec` fields) that grades one benchmark's tasks
  (domain `grader`; 1 correct, 0 not): math-verify; the code sandbox with `code_timeout_s`
  seconds per test; the judge, or exact match without one; QA exact match."""
  if grader not in GRADERS:
    raise ConfigError(f"unknown grader {grader!r}; expected one of {GRADERS}")
  domain: dict[str, Any] = {"kind": "qa", "metric": "em"}
  if grader == "math":
    domain = {"kind": "math"}
  elif grader == "code":
    domain = {"kind": "code", "limits": {
        "wall_timeout_s": float(code_timeout_s), "cpu_time_s": math.ceil(code_timeout_s),
        "max_output_chars": 1_000_000}}
  elif grader == "judge" and judge is not None:
    domain = {"kind": "judge", "base_url": judge.base_url, "model": judge.model,
              "api_key_env": judge.api_key_env, "max_tokens": judge.max_tokens,
              "prompt": JUDGE_PROMPT,
              "http": {"timeout_s": judge.timeout_s, "retries": judge.retries}}
  return {"domains": {grader: domain}, "default_domain": grader, "correct": 1.0,
          "incorrect": 0.0}


def grader_label(grader: str, judge: JudgeSettings | None = None,
                 code_timeout_s: float = 6.0) -> str:
  """Returns how a benchmark's answers are graded, as its table's grader column says it."""
  if grader == "math":
    if importlib.util.find_spec("math_verify") is None:
      return "math (normalized match: math-verify not installed)"
    return "math (math-verify)"
  if grader == "code":
    return f"code tests in the sandbox ({code_timeout_s:g} s per test)"
  if grader == "judge":
    return FALLBACK_LABEL if judge is None else f"LLM judge ({judge.model})"
  return "exact match (F1 beside it)"
