"""The paper's benchmarks graded as the paper grades them: every release file loads through the
task reader and its gold answers score 1, wrong ones 0 (math by math-verify, LiveCodeBench by its
tests in the sandbox, GAIA / HLE / BrowseComp by an LLM judge or a named exact-match fallback,
NQ by EM / F1); the judge against a local OpenAI-compatible server; the benchmark command end to
end on a tiny model."""

import http.server
import json
import os
import re
import socket
import threading

import jax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coa_jax.data import benchmark_files, prompts, rewards
from coa_jax.data.benchmark_files import JudgeSettings
from coa_jax.data.tasks import FUNCTIONAL_PRELUDE, release_code_tests
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.evaluation import benchmarks, model_settings
from coa_jax.evaluation.job import Sample
from coa_jax.model import ConfigError, Transformer, build_config
from coa_jax.runtime import hf_checkpoint, sharding
from configs import benchmark as benchmark_config

RELEASE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "benchmarks", "afm")
needs_release = pytest.mark.skipif(not os.path.isdir(RELEASE), reason=(
    f"the release's benchmark files are not in {RELEASE} (docs/benchmarks_eval.md says where "
    f"to get them)"))
WRONG = "certainly not the answer 987654321"


def release_file(name):
  entry = benchmark_files.BENCHMARKS[name]
  if not os.path.isfile(os.path.join(RELEASE, entry.file)):
    pytest.skip(f"{entry.file} is not in {RELEASE}")
  return entry


def response(answer):
  return f"<answer>\n{answer}\n</answer>"


def grade(rewarder, answer, task):
  return rewarder(response(answer), task.data)


# --- the release's files -------------------------------------------------------------------


@needs_release
def test_every_file_of_the_release_folder_is_a_benchmark_of_the_table():
  files = {entry.file for entry in benchmark_files.BENCHMARKS.values()}
  assert set(os.listdir(RELEASE)) - {"LICENSE"} <= files


@needs_release
@pytest.mark.parametrize("name", list(benchmark_files.BENCHMARKS))
def test_a_release_file_loads_through_the_task_reader_with_its_grader(name):
  entry = release_file(name)
  tasks = benchmark_files.load_benchmark(name, RELEASE, limit=3)
  assert len(tasks) == 3
  for task in tasks:
    assert task.data["domain"] == entry.grader and task.data["benchmark"] == name
    assert task.question == f"Question: {task.data['question']}"
    assert "'plan'" not in task.question  # the release's agent prompt (its functions) is cut


@needs_release
def test_the_release_math_rows_keep_only_the_task_and_their_gold():
  release_file("aime25")
  task = benchmark_files.load_benchmark("aime25", RELEASE, limit=1)[0]
  assert task.question == ("Question: Find the sum of all integer bases $b>9$ for which $17_b$ "
                           "is a divisor of $97_b.$")
  assert task.data["ground_truth"] == ["70"]


@needs_release
@pytest.mark.parametrize("name", ["aime24", "aime25", "amc23", "math500", "olympiadbench"])
def test_math_golds_score_one_and_wrong_answers_zero(name):
  release_file(name)
  rewarder = rewards.build_rewarder(benchmark_files.reward_spec("math"))
  for task in benchmark_files.load_benchmark(name, RELEASE, limit=3):
    gold = task.data["ground_truth"][0]
    assert grade(rewarder, f"So the answer is $\\boxed{{{gold}}}$.", task).correct, gold
    assert not grade(rewarder, f"\\boxed{{{WRONG}}}", task).correct, gold


@pytest.fixture(scope="module")
def code_rewarder():
  rewarder = rewards.build_rewarder(benchmark_files.reward_spec("code", code_timeout_s=2.0))
  yield rewarder
  rewarder.scorers["code"].sandbox.close()


def _program(body):
  return f"```py\n{body}\n```"


def _printing_each_expected_output(tests):
  outputs = {test["stdin"]: test["stdout"] for test in tests}
  return _program(f"import sys\nprint({outputs!r}[sys.stdin.read()], end='')")


def _returning_the_expected_value(script, returned=None):
  method = re.search(r"Solution\(\)\.(\w+)\(", script).group(1)
  expected = re.search(r"assert result == (.*), f\"Expected", script).group(1)
  value = expected if returned is None else returned
  return _program(f"class Solution:\n  def {method}(self, *args):\n    return {value}")


def _code_tasks(kind):
  release_file("lcb_v5")
  tasks = benchmark_files.load_benchmark("lcb_v5", RELEASE)
  return [t for t in tasks if ("functional" in t.data["tests"][0]) == (kind == "functional")][:2]


@needs_release
def test_lcb_a_program_printing_each_expected_output_passes_every_stdin_test(code_rewarder):
  for task in _code_tasks("stdin"):
    reward = grade(code_rewarder, _printing_each_expected_output(task.data["tests"]), task)
    assert reward.correct and reward.details["passed"] == len(task.data["tests"]), task.id


@needs_release
def test_lcb_a_program_printing_something_else_fails(code_rewarder):
  for task in _code_tasks("stdin"):
    reward = grade(code_rewarder, _program("print('wrong')"), task)
    assert not reward.correct
    assert reward.details["first_failure"]["kind"] == rewards.WRONG_ANSWER


@needs_release
def test_lcb_an_endless_program_times_out(code_rewarder):
  task = _code_tasks("stdin")[0]
  reward = grade(code_rewarder, _program("while True:\n  pass"), task)
  assert not reward.correct
  assert reward.details["first_failure"]["kind"] == "timeout"


@needs_release
def test_lcb_functional_tests_pass_the_expected_value_and_fail_another(code_rewarder):
  for task in _code_tasks("functional"):
    script = task.data["tests"][0]["functional"]
    assert grade(code_rewarder, _returning_the_expected_value(script), task).correct, task.id
    wrong = grade(code_rewarder, _returning_the_expected_value(script, "None"), task)
    assert not wrong.correct and wrong.details["first_failure"]["kind"] == "runtime_error"


@needs_release
@pytest.mark.parametrize("name", ["gaia", "hle", "browsecomp", "webwalker"])
def test_judged_golds_score_one_and_wrong_answers_zero_with_the_judge(name, judge_server):
  release_file(name)
  rewarder = rewards.build_rewarder(benchmark_files.reward_spec("judge", judge(judge_server)))
  for task in benchmark_files.load_benchmark(name, RELEASE, limit=3):
    assert grade(rewarder, task.data["ground_truth"], task).correct, task.id
    assert not grade(rewarder, WRONG, task).correct, task.id


@needs_release
@pytest.mark.parametrize("name", ["gaia", "hle", "browsecomp", "webwalker"])
def test_judged_golds_score_one_and_wrong_answers_zero_by_the_fallback(name):
  release_file(name)
  rewarder = rewards.build_rewarder(benchmark_files.reward_spec("judge"))
  for task in benchmark_files.load_benchmark(name, RELEASE, limit=3):
    assert grade(rewarder, task.data["ground_truth"], task).correct, task.id
    assert not grade(rewarder, WRONG, task).correct, task.id


@needs_release
def test_nq_any_alias_scores_one_a_wrong_answer_zero_and_f1_is_beside_it():
  release_file("nq")
  rewarder = rewards.build_rewarder(benchmark_files.reward_spec("qa"))
  task = benchmark_files.load_benchmark("nq", RELEASE, limit=3)[2]
  assert task.data["ground_truth"] == ["Olivia", "MFSK"]
  assert grade(rewarder, "MFSK", task).correct
  reward = grade(rewarder, "Olivia mode", task)
  assert not reward.correct and reward.details["f1"] == pytest.approx(2 / 3)


def test_a_missing_benchmark_file_is_named_with_where_the_release_ships_it(tmp_path):
  with pytest.raises(ConfigError, match=r"aime25.parquet does not exist; it is the reference "
                     r"release's data/code_agent/code_math_benchmarks/aime25.parquet"):
    benchmark_files.load_benchmark("aime25", str(tmp_path))


def test_an_unknown_benchmark_is_named_with_the_known_ones():
  with pytest.raises(ConfigError, match="unknown benchmark 'aime26'; known: aime24, aime25"):
    benchmark_files.benchmark("aime26")


def test_release_data_sources_map_to_their_graders():
  assert [benchmark_files.grader_of_source(s) for s in
          ("aime25", "MATH500", "skywork_livecodebench_v5", "nq", "hotpotqa")] == [
              "math", "math", "code", "qa", None]


def test_the_release_code_ground_truths_become_tests():
  stdin = json.dumps({"stdin": ["1 2\n"], "expected_output": ["3\n"], "question_id": "x"})
  assert release_code_tests(stdin) == [{"stdin": "1 2\n", "stdout": "3\n"}]
  assert release_code_tests(json.dumps({"functional": "assert f() == 1"})) == [
      {"functional": "assert f() == 1", "prelude": FUNCTIONAL_PRELUDE}]
  assert release_code_tests('{"target": "70"}') is None


def test_a_functional_code_test_passes_when_the_programs_asserts_hold(code_rewarder):
  tests = release_code_tests(json.dumps({"functional": "assert Solution().twice(21) == 42"}))
  task = {"domain": "code", "tests": tests}
  method = "class Solution:\n  def twice(self, n: List[int]) -> int:\n    return {}"
  assert code_rewarder(response(_program(method.format("2 * n"))), task).correct
  assert not code_rewarder(response(_program(method.format("n"))), task).correct


# --- math equivalences ---------------------------------------------------------------------


@pytest.mark.parametrize("answer, gold", [
    ("\\frac{1}{2}", "0.5"),
    ("The answer is \\boxed{\\dfrac{3}{4}}.", "0.75"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3, \\frac{\\pi}{2})"),
    ("$\\boxed{70}$", "70"),
])
def test_equivalent_math_answers_score_one(answer, gold):
  score, details = rewards.math_reward(answer, gold)
  assert (score, details["method"]) == (1.0, "math_verify")


def test_a_different_math_answer_scores_zero():
  assert rewards.math_reward("\\boxed{71}", "70")[0] == 0.0


# --- the LLM judge -------------------------------------------------------------------------


class JudgeHandler(http.server.BaseHTTPRequestHandler):
  """An OpenAI-compatible judge: "correct" when the predicted answer equals the labeled one
  (case and spaces aside); /malformed answers without a verdict, /not-json with a body that is
  not JSON."""

  def do_POST(self):  # noqa: N802 - http.server's name
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.server.requests.append(body)
    if self.path.startswith("/not-json"):
      return self._send(b"<html>oops</html>")
    prompt = body["messages"][-1]["content"]
    gold = re.search(r"Labeled answer: (.*)\n", prompt).group(1)
    predicted = re.search(r"Predicted answer: (.*)\n", prompt).group(1)
    same = gold.strip().lower() == predicted.strip().lower()
    content = json.dumps({"rationale": "compared", "judgement": "correct" if same else
                          "incorrect"})
    if self.path.startswith("/malformed"):
      content = "I cannot tell."
    self._send(json.dumps({"choices": [{"message": {"role": "assistant",
                                                    "content": content}}]}).encode())

  def _send(self, data):
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


@pytest.fixture(scope="module")
def judge_server():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler)
  server.requests = []
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield server
  server.shutdown()
  server.server_close()


def judge(server, path="/v1"):
  return JudgeSettings(f"http://127.0.0.1:{server.server_address[1]}{path}", "judge-model",
                       api_key_env=None, timeout_s=2.0, retries=0)


def judged(settings, answer, gold="Paris", question="Capital of France?"):
  rewarder = rewards.build_rewarder(benchmark_files.reward_spec("judge", settings))
  return rewarder(response(answer), {"question": question, "ground_truth": gold,
                                     "domain": "judge"})


def test_the_judge_says_correct_and_sees_the_question_gold_and_answer(judge_server):
  reward = judged(judge(judge_server), "paris")
  assert reward.correct and reward.details["method"] == "judge"
  request = judge_server.requests[-1]
  assert request["model"] == "judge-model"
  assert ("Question: Capital of France?\nLabeled answer: Paris\nPredicted answer: paris\n"
          in request["messages"][-1]["content"])


def test_the_judge_says_incorrect(judge_server):
  reward = judged(judge(judge_server), "Lyon")
  assert not reward.correct and reward.details["method"] == "judge"
  assert "error" not in reward.details


def test_a_judge_that_is_down_scores_zero_with_an_error(judge_server):
  with socket.socket() as s:  # a port that nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  settings = JudgeSettings(f"http://127.0.0.1:{port}/v1", "judge-model", None, timeout_s=2.0,
                           retries=0)
  reward = judged(settings, "Paris")
  assert not reward.correct and reward.details["error_kind"] == "http_error"
  assert "cannot reach" in reward.details["error"]


def test_a_judge_reply_without_a_verdict_scores_zero_with_an_error(judge_server):
  reward = judged(judge(judge_server, "/malformed/v1"), "Paris")
  assert not reward.correct
  assert (reward.details["error"], reward.details["reply"]) == (
      "malformed judge reply", "I cannot tell.")


def test_a_judge_reply_that_is_not_json_scores_zero_with_an_error(judge_server):
  reward = judged(judge(judge_server, "/not-json/v1"), "Paris")
  assert not reward.correct and reward.details["error_kind"] == "bad_response"


def test_the_release_judgement_field_is_a_verdict():
  assert rewards.parse_verdict('{"rationale": "same city", "judgement": "correct"}') is True
  assert rewards.parse_verdict('```json\n{"judgement": "incorrect"}\n```') is False


def test_a_judge_prompt_with_another_field_is_refused_naming_its_domain():
  spec = benchmark_files.reward_spec("judge", JudgeSettings("http://127.0.0.1:9/v1", "m", None))
  spec["domains"]["judge"]["prompt"] = "Is {predicted} right? {answer}"
  with pytest.raises(ValueError, match=r"rewards.domains.judge \(judge\): prompt 'Is "):
    rewards.build_rewarder(spec)


def test_without_a_judge_the_grader_is_named_as_the_exact_match_fallback():
  assert benchmark_files.grader_label("judge") == "exact match (fallback: no judge)"
  assert benchmark_files.reward_spec("judge")["domains"]["judge"] == {"kind": "qa",
                                                                        "metric": "em"}


# --- the benchmark command -----------------------------------------------------------------


def _write_tiny_release(folder):
  """Two AIME25 rows in the release's parquet layout and two GAIA rows in its JSON layout."""
  os.makedirs(folder)
  agent = "Solve the task with the functions think, plan, code and answer.\n\nTask:\n"
  rows = [{"data_source": "aime25", "ability": "math",
           "prompt": [{"role": "user", "content": f"{agent}What is {a} + {b}?"}],
           "reward_model": {"ground_truth": str(a + b), "style": "rule"},
           "extra_info": {"index": str(i), "split": "test"}}
          for i, (a, b) in enumerate([(2, 3), (40, 2)])]
  pq.write_table(pa.Table.from_pylist(rows), os.path.join(folder, "aime25.parquet"))
  gaia = [{"id": 1, "task_id": "a", "question": "Which city is the capital of France?",
           "answer": "Paris", "Level": 1},
          {"id": 2, "task_id": "b", "question": "How many legs has a spider?", "answer": "8",
           "Level": 1}]
  with open(os.path.join(folder, "gaia_dev_103.json"), "w") as f:
    json.dump(gaia, f)


def _tiny_model(folder):
  tokenizer = default_tokenizer()
  config = build_config({"preset": "tiny", "vocab_size": tokenizer.vocab_size})
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = sharding.init_params(Transformer(config), mesh, jax.random.key(0))
  hf_checkpoint.save_checkpoint(folder, config, params, dtype="float32")


def test_the_benchmark_command_writes_the_table_of_every_benchmark(tmp_path, capsys):
  _write_tiny_release(str(tmp_path / "data"))
  _tiny_model(str(tmp_path / "model"))
  config = benchmark_config.get_config()
  config.batch_size, config.chunk, config.system_prompt = 8, 16, prompts.WORLD
  config.rollout.update(max_prompt_tokens=128, max_response_tokens=32, max_turns=2,
                        max_observation_tokens=32)
  settings = benchmarks.BenchmarkSettings(
      model=str(tmp_path / "model"), benchmarks=("aime25", "gaia"),
      data_dir=str(tmp_path / "data"), output_dir=str(tmp_path / "out"), k=2, max_tasks=1)
  results = benchmarks.run(config, settings)
  saved = json.load(open(tmp_path / "out" / "results.json"))
  assert saved["rows"] == results["rows"]
  assert [row["name"] for row in saved["rows"]] == ["aime25", "gaia"]
  assert [row["grader"] for row in saved["rows"]] == ["math (math-verify)",
                                                      "exact match (fallback: no judge)"]
  for row in saved["rows"]:
    assert {"benchmark", "grader", "tasks", "pass@1", "avg@2", "tokens_per_task",
            "tool_calls_per_task", "judge_errors"} <= set(row)
    assert (row["tasks"], row["k"]) == (1, 2)
  table = open(tmp_path / "out" / "results.md").read()
  assert ("| benchmark | grader | tasks | pass@1 (%) | avg@2 (%) | tokens / task | "
          "tool calls / task | judge errors | F1 (%) |") in table
  assert "| GAIA (text-only, 103) | exact match (fallback: no judge) | 1 |" in table
  assert os.path.getsize(tmp_path / "out" / "results.png") > 0
  for name in ("aime25", "gaia"):
    assert os.path.isfile(tmp_path / "out" / name / "samples.jsonl")
  tasks = [json.loads(line) for line in open(tmp_path / "out" / "aime25" / "tasks.jsonl")]
  assert [(t["question"], t["ground_truth"]) for t in tasks] == [("What is 2 + 3?", ["5"])]
  out = capsys.readouterr().out
  assert "benchmark 1/2: AIME25, 1 tasks x 2 samples, graded by math (math-verify)" in out
  assert re.search(r"tasks 1/1 .* tasks/s .* ETA", out)


METRICS = {"tasks": 3, "pass@1": 0.5, "avg@1": 0.5, "tokens_per_task": 10.0,
           "tool_calls_per_task": 1.0, "format_error_rate": 0.0}


def _sample(correct, answer, grading):
  return Sample(correct, answer, 10, {}, 0, grading=grading)


def test_a_judged_row_counts_the_answers_the_judge_could_not_grade():
  samples = [_sample(True, "a", {"method": "judge"}),
             _sample(False, "b", {"error": "malformed judge reply"}),
             _sample(False, None, {"error": "no final answer"})]  # the model's, not the judge's
  row = benchmarks.benchmark_row("gaia", "LLM judge (m)", METRICS, samples, 1)
  assert (row["judge_errors"], row["f1"]) == (1, None)


def test_a_qa_row_averages_f1_over_every_sample():
  samples = [_sample(True, "a", {"em": 1.0, "f1": 1.0}), _sample(False, "b", {"f1": 0.5}),
             _sample(False, None, {"error": "no final answer"})]
  row = benchmarks.benchmark_row("nq", "exact match (F1 beside it)", METRICS, samples, 1)
  assert (row["f1"], row["judge_errors"]) == (0.5, None)


def test_benchmark_settings_name_an_unknown_benchmark(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ConfigError, match="unknown benchmark 'gaia2'"):
    benchmarks.BenchmarkSettings(model=str(tmp_path), benchmarks=("aime25", "gaia2"))


def test_benchmark_settings_refuse_a_judge_without_its_model(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ConfigError, match="name its model"):
    benchmarks.BenchmarkSettings(model=str(tmp_path), benchmarks=("gaia",),
                                 judge_url="http://127.0.0.1:9/v1")


def test_the_commands_evaluation_config_grades_judged_benchmarks_by_the_judge(judge_server,
                                                                              tmp_path):
  (tmp_path / "config.json").write_text("{}")
  settings = benchmarks.BenchmarkSettings(
      model=str(tmp_path), benchmarks=("gaia",), judge_url=judge(judge_server).base_url,
      judge_model="judge-model", judge_api_key_env="")
  config, _ = benchmarks.evaluation_config(benchmark_config.get_config(), settings, "gaia",
                                          "t.jsonl")
  rewarder = rewards.build_rewarder(config.rewards.to_dict())
  task = {"question": "Capital?", "ground_truth": "Paris", "domain": "judge"}
  assert rewarder(response("paris"), task).details["method"] == "judge"
  assert benchmark_files.grader_label("judge", settings.judge) == "LLM judge (judge-model)"


def test_the_model_folders_own_tokenizer_is_used_with_the_chatml_template(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "tokenizer.json").write_text("{}")
  settings = benchmarks.BenchmarkSettings(model=str(tmp_path), benchmarks=("aime25",))
  config, _ = benchmarks.evaluation_config(benchmark_config.get_config(), settings, "aime25",
                                          "t")
  assert (config.tokenizer.path, config.tokenizer.template) == (str(tmp_path), "chatml")
  assert config.model.checkpoint == str(tmp_path)


def test_the_models_saved_tools_and_prompt_are_used_with_the_benchmarks_rollout_limits(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  saved = {"system_prompt": "Saved prompt.", "tools": {"code": {"kind": "sandbox"}},
           "rollout": {"group_size": 3, "max_prompt_tokens": 128, "max_response_tokens": 512,
                       "max_turns": 12, "max_observation_tokens": 256, "tool_workers": 8,
                       "tool_timeout_s": 30.0}}
  (tmp_path / model_settings.FILE).write_text(json.dumps(saved))
  settings = benchmarks.BenchmarkSettings(model=str(tmp_path), benchmarks=("aime25",))
  defaults = benchmark_config.get_config()
  config, source = benchmarks.evaluation_config(defaults, settings, "aime25", "t")
  assert (config.system_prompt, config.tools.to_dict()) == ("Saved prompt.", saved["tools"])
  assert config.rollout.to_dict() == defaults.rollout.to_dict()
  assert model_settings.FILE in source
