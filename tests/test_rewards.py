"""Rewards: final answers, the math / QA / code / judge scorers, and the spec-built rewarder."""

import http.server
import json
import re
import threading

import pytest

from coa_jax.data import rewards
from coa_jax.data.rewards import Reward, build_rewarder, math_scorer
from tools_env.remote import HttpLimits
from tools_env.sandbox import CodeSandbox, SandboxLimits

FAST = HttpLimits(timeout_s=5.0, retries=2, backoff_s=0.01, max_response_bytes=2**16)
CHECKERS = [pytest.param(True, id="math_verify"), pytest.param(False, id="fallback")]


def response(answer, before="<think>\nsolve it\n</think>\n"):
  return f"{before}<answer>\n{answer}\n</answer>"


# --- final answers -------------------------------------------------------------------------


def test_final_answer_is_the_stripped_content_of_the_last_answer_step():
  text = "<answer>\n1\n</answer>\n<think>\nno, wait\n</think>\n<answer>\n  42 \n</answer>"
  assert rewards.final_answer(text) == "42"


@pytest.mark.parametrize("text", [
    "<think>\nno answer yet\n</think>",
    "<answer>\n1\n</answer>\n<answer>\n2",  # the last answer was cut off
    "<answer>\n \n</answer>",
    "<code>\n```python\nprint(1)\n```\n</code>\n<observation>\n<answer>7</answer>\n</observation>",
])
def test_final_answer_is_none_without_a_closed_nonempty_answer_step(text):
  assert rewards.final_answer(text) is None


def test_gold_answers_reads_strings_lists_target_dicts_and_their_json():
  assert rewards.gold_answers("Paris") == ["Paris"]
  assert rewards.gold_answers(["Paris", 7]) == ["Paris", "7"]
  assert rewards.gold_answers({"target": "Paris"}) == ["Paris"]
  assert rewards.gold_answers('{"target": ["Paris", "Lutetia"]}') == ["Paris", "Lutetia"]
  assert rewards.gold_answers("{not json}") == ["{not json}"]
  assert rewards.gold_answers(None) == []


# --- math ----------------------------------------------------------------------------------


def test_extract_boxed_takes_the_last_box_with_nested_braces():
  text = r"first \boxed{1}, then \boxed{\frac{1}{\sqrt{2}}}."
  assert rewards.extract_boxed(text) == r"\frac{1}{\sqrt{2}}"
  assert rewards.extract_boxed(r"so \boxed 5$") == "5"
  assert rewards.extract_boxed(r"\boxed{\frac{1}{2}") is None
  assert rewards.extract_boxed("no box") is None


@pytest.mark.parametrize("use_math_verify", CHECKERS)
@pytest.mark.parametrize("answer, gold", [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    ("0.5", "1/2"),
    (r"\frac12", "0.5"),
    (r"$\dfrac{3}{4}$", "0.75"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"The answer is \boxed{ 42 }", "42"),
    (r"5 \text{ cm}", "5"),
    ("5.", "5"),
    ("1,000", "1000"),
    ("x = 3", "3"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{7} or rather \boxed{1}", "1"),
    (r"\boxed 5", "5"),
])
def test_math_accepts_equivalent_answers(answer, gold, use_math_verify):
  score, details = rewards.math_reward(answer, gold, use_math_verify=use_math_verify)
  assert score == 1.0, details
  assert details["method"] == ("math_verify" if use_math_verify else "fallback")


@pytest.mark.parametrize("use_math_verify", CHECKERS)
@pytest.mark.parametrize("answer, gold", [
    ("3", "4"),
    ("-5", "5"),
    (r"\frac{1}{3}", "0.33"),
    (r"\boxed{2}", r"\frac{1}{2}"),
    (r"\boxed{7} or rather \boxed{1}", "7"),
    (r"\sqrt{2}", "2"),
    ("1, 200", "1200"),  # a list, not a number with a thousands separator
])
def test_math_rejects_wrong_answers(answer, gold, use_math_verify):
  assert rewards.math_reward(answer, gold, use_math_verify=use_math_verify)[0] == 0.0


def test_math_verify_proves_equivalences_the_fallback_cannot():
  pytest.importorskip("math_verify")
  answer, gold = r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"
  assert rewards.math_reward(answer, gold) == (1.0, {
      "predicted": r"\frac{\sqrt{2}}{2}", "golds": [gold], "method": "math_verify",
      "matched": gold})
  assert rewards.math_reward(answer, gold, use_math_verify=False) == (0.0, {
      "predicted": r"\frac{\sqrt{2}}{2}", "golds": [gold], "method": "fallback"})


def test_math_falls_back_when_math_verify_raises(monkeypatch):
  pytest.importorskip("math_verify")

  def broken(predicted, gold):
    raise RecursionError("deep")

  monkeypatch.setattr(math_scorer, "_math_verify_equal", broken)
  assert rewards.math_reward("0.5", r"\frac{1}{2}") == (1.0, {
      "predicted": "0.5", "golds": [r"\frac{1}{2}"], "math_verify_error": "RecursionError: deep",
      "method": "fallback", "matched": r"\frac{1}{2}"})


def test_math_without_math_verify_installed_uses_the_fallback(monkeypatch):
  monkeypatch.setattr(math_scorer, "_math_verify", lambda: None)
  assert rewards.math_reward(r"\boxed{\frac12}", "0.5") == (1.0, {
      "predicted": r"\frac12", "golds": ["0.5"], "method": "fallback", "matched": "0.5"})


def test_math_matches_any_gold_of_a_json_target():
  score, details = rewards.math_reward(r"\boxed{6}", '{"target": ["5", "6"]}')
  assert (score, details["golds"], details["matched"]) == (1.0, ["5", "6"], "6")


def test_math_times_out_with_zero_and_says_so(monkeypatch):
  release = threading.Event()

  def stuck(predicted, gold, use_math_verify=True):
    release.wait(10)
    return True, {"method": "stuck"}

  monkeypatch.setattr(math_scorer, "math_equivalent", stuck)
  score, details = rewards.math_reward("1", "1", timeout_s=0.1)
  release.set()  # a reward that waited for the check would have scored 1.0
  assert (score, details) == (0.0, {"predicted": "1", "golds": ["1"], "error": "timeout"})


def test_math_without_ground_truth_scores_zero():
  assert rewards.math_reward("1", None) == (0.0, {"predicted": "1", "golds": [],
                                                  "error": "no ground truth"})


# --- question answering --------------------------------------------------------------------


def test_qa_exact_match_normalizes_case_punctuation_articles_and_spaces():
  assert rewards.qa_reward("The  Eiffel Tower!", "eiffel tower") == (
      1.0, {"em": 1.0, "f1": 1.0, "golds": ["eiffel tower"]})


def test_qa_partial_answer_fails_exact_match_and_gets_token_f1():
  assert rewards.qa_reward("Paris France", "Paris") == (
      0.0, {"em": 0.0, "f1": pytest.approx(2 / 3), "golds": ["Paris"]})
  assert rewards.qa_reward("Paris France", "Paris", metric="f1")[0] == pytest.approx(2 / 3)


def test_qa_matches_any_gold_of_a_list_or_json_target():
  assert rewards.qa_reward("lutetia", ["Paris", "Lutetia"])[0] == 1.0
  assert rewards.qa_reward("Paris", '{"target": "paris"}')[0] == 1.0
  assert rewards.qa_reward("Lyon", '{"target": ["Paris", "Lutetia"]}')[0] == 0.0


@pytest.mark.parametrize("answer, em", [("Bob | Alice", 1.0), ("alice|bob|", 1.0),
                                        ("Alice", 0.0), ("Alice | Bob | Carol", 0.0)])
def test_qa_multi_answer_gold_needs_every_part(answer, em):
  assert rewards.qa_reward(answer, "Alice|Bob")[0] == em


def test_qa_unknown_metric_scores_zero_with_an_error():
  score, details = rewards.qa_reward("a", "a", metric="bleu")
  assert score == 0.0 and "unknown QA metric 'bleu'" in details["error"]


# --- code ----------------------------------------------------------------------------------

ADD_TESTS = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 7", "stdout": "12  \n\n"}]


def program(source):
  return f"Here it is:\n```python\n{source}\n```"


@pytest.fixture(scope="module")
def sandbox():
  return CodeSandbox(SandboxLimits(wall_timeout_s=10, cpu_time_s=1), workers=4)


def test_code_passing_every_test_scores_one(sandbox):
  answer = program("a, b = map(int, input().split())\nprint(a + b)")
  assert rewards.code_reward(answer, ADD_TESTS, sandbox) == (1.0, {"passed": 2, "total": 2})


def test_code_runs_the_last_python_block(sandbox):
  answer = program("print('draft')") + "\n" + program("print(sum(map(int, input().split())))")
  assert rewards.code_reward(answer, ADD_TESTS, sandbox)[0] == 1.0


def test_code_wrong_output_reports_the_first_failing_test(sandbox):
  assert rewards.code_reward(program("print(3)"), ADD_TESTS, sandbox) == (0.0, {
      "passed": 1, "total": 2,
      "first_failure": {"test": 1, "kind": "wrong_answer", "observation": "3\n"}})


def test_code_crash_is_a_runtime_error(sandbox):
  score, details = rewards.code_reward(program("print(1 // 0)"), ADD_TESTS, sandbox)
  assert (score, details["passed"], details["first_failure"]["kind"]) == (0.0, 0, "runtime_error")
  assert "ZeroDivisionError" in details["first_failure"]["observation"]


def test_code_hanging_program_times_out(sandbox):
  score, details = rewards.code_reward(program("while True:\n  pass"), ADD_TESTS[:1], sandbox)
  assert (score, details["first_failure"]["kind"]) == (0.0, "timeout")


ADD_FUNCTIONAL = [{"functional": "assert add(1, 2) == 3\nprint('checked')", "prelude": ""}]


def test_code_functional_tests_pass_once_their_asserts_ran(sandbox):
  answer = program("def add(a, b):\n  return a + b")
  assert rewards.code_reward(answer, ADD_FUNCTIONAL, sandbox) == (1.0, {"passed": 1, "total": 1})


@pytest.mark.parametrize("exit_call", ["exit()", "import sys\nsys.exit(0)",
                                       "import os\nos._exit(0)"])
def test_code_exiting_before_a_functional_tests_asserts_scores_zero(sandbox, exit_call):
  # The program exits without error; the test script's asserts never run.
  answer = program(f"def add(a, b):\n  return 0\n{exit_call}")
  score, details = rewards.code_reward(answer, ADD_FUNCTIONAL, sandbox)
  assert (score, details["first_failure"]["kind"]) == (0.0, rewards.EXITED_EARLY)


def test_the_code_reward_compares_stdout_alone():
  rewarder = build_rewarder({"domains": {"code": {"kind": "code", "workers": 1}},
                             "default_domain": "code", "correct": 1.0, "incorrect": 0.0})
  answer = program("import sys\na, b = map(int, input().split())\n"
                   "print('debugging', a, b, file=sys.stderr)\nprint(a + b)")
  with rewarder.scorers["code"].sandbox:
    assert rewarder.scorers["code"](answer, {"tests": ADD_TESTS})[0] == 1.0


def test_code_without_a_python_block_scores_zero(sandbox):
  assert rewards.code_reward("print(3)", ADD_TESTS, sandbox) == (
      0.0, {"error": "no python block in the answer", "passed": 0, "total": 2})


def test_code_output_comparison_ignores_only_trailing_whitespace():
  assert rewards.normalize_output("1 2  \n3\n\n") == "1 2\n3"
  assert rewards.normalize_output(" 1") != rewards.normalize_output("1")


# --- LLM judge -----------------------------------------------------------------------------

JUDGE_REPLIES = {
    "/right": '{"correct": true}',
    "/wrong": 'Verdict:\n```json\n{"correct": false}\n```',
    "/rambling": "I am not sure about this one.",
    "/flaky": '{"correct": true}',
}


class JudgeServer(http.server.ThreadingHTTPServer):
  """An OpenAI-style chat endpoint under each path of JUDGE_REPLIES; /flaky fails once."""

  def __init__(self):
    super().__init__(("127.0.0.1", 0), JudgeHandler)
    self.hits = {}
    self.prompts = []

  def url(self, path):
    return f"http://127.0.0.1:{self.server_address[1]}{path}"


class JudgeHandler(http.server.BaseHTTPRequestHandler):

  def log_message(self, *args):
    pass

  def do_POST(self):
    route = self.path.removesuffix("/chat/completions")
    self.server.hits[route] = self.server.hits.get(route, 0) + 1
    payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.server.prompts.append(payload["messages"][0]["content"])
    failing = route not in JUDGE_REPLIES or (route == "/flaky" and self.server.hits[route] == 1)
    body = json.dumps({"choices": [{"message": {"content": JUDGE_REPLIES.get(route, "")}}]})
    data = (b"{}" if failing else body.encode())
    self.send_response(500 if failing else 200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)


@pytest.fixture(scope="module")
def judge_server():
  server = JudgeServer()
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield server
  server.shutdown()
  server.server_close()


def judge(server, path, limits=FAST):
  return rewards.JudgeClient(server.url(path), "judge-model", api_key_env=None, limits=limits)


def test_judge_correct_verdict_scores_one_and_sees_question_gold_and_answer(judge_server):
  score, details = rewards.judge_reward("Capital of France?", "paris, france",
                                        '{"target": "Paris"}', judge(judge_server, "/right"))
  assert (score, details) == (1.0, {"method": "judge", "reply": '{"correct": true}'})
  prompt = judge_server.prompts[-1]
  assert ("Question: Capital of France?" in prompt and "Gold answer: Paris" in prompt
          and "Predicted answer: paris, france" in prompt)


def test_judge_incorrect_verdict_in_a_fence_scores_zero(judge_server):
  score, details = rewards.judge_reward("q", "Lyon", "Paris", judge(judge_server, "/wrong"))
  assert (score, details["method"]) == (0.0, "judge")


def test_judge_malformed_reply_scores_zero_with_the_reply(judge_server):
  assert rewards.judge_reward("q", "Lyon", "Paris", judge(judge_server, "/rambling")) == (
      0.0, {"error": "malformed judge reply", "reply": "I am not sure about this one."})


def test_judge_retries_a_500_then_succeeds(judge_server):
  assert rewards.judge_reward("q", "Paris", "Paris", judge(judge_server, "/flaky"))[0] == 1.0
  assert judge_server.hits["/flaky"] == 2


def test_judge_server_failure_scores_zero_with_the_error_kind(judge_server):
  no_retry = HttpLimits(timeout_s=2.0, retries=0)
  score, details = rewards.judge_reward("q", "a", "a", judge(judge_server, "/down", no_retry))
  assert (score, details["error_kind"]) == (0.0, "http_error")
  assert "HTTP 500" in details["error"]


@pytest.mark.parametrize("reply, verdict", [
    ('{"correct": true}', True),
    ('The answer matches. {"correct": false} Done.', False),
    ('```json\n{"correct": "yes"}\n```', True),
    ("Incorrect.", False),
    ("correct", True),
    ("It is not correct", None),
    ('{"verdict": true}', None),
])
def test_parse_verdict_is_lenient_but_never_guesses(reply, verdict):
  assert rewards.parse_verdict(reply) is verdict


# --- format --------------------------------------------------------------------------------


def test_format_penalty_applies_only_when_the_format_is_broken():
  assert rewards.format_penalty(response("4"), 0.5) == (
      0.0, {"format_errors": 0, "format_kinds": []})
  assert rewards.format_penalty("Sure! " + response("4"), 0.5) == (
      0.5, {"format_errors": 1, "format_kinds": ["stray_text"]})


# --- the rewarder --------------------------------------------------------------------------

SPEC = {"domains": {"math": {"kind": "math"}, "qa": {"kind": "qa", "metric": "em"}},
        "default_domain": "qa", "sources": {"aime25": "math"}}


def test_rewarder_gives_plus_one_and_minus_one_by_default():
  rewarder = build_rewarder(SPEC)
  task = {"domain": "math", "answer": "0.5"}
  right = rewarder(response(r"\boxed{\frac{1}{2}}"), task)
  assert (right.score, right.correct, right.details["domain"]) == (1.0, True, "math")
  wrong = rewarder(response(r"\boxed{2}"), task)
  assert (wrong.score, wrong.correct) == (-1.0, False)


def test_rewarder_uses_the_configured_correct_and_incorrect_values():
  rewarder = build_rewarder({**SPEC, "correct": 1.0, "incorrect": 0.0})
  task = {"domain": "qa", "answer": "Paris"}
  assert [rewarder(response(a), task).score for a in ("Paris", "Lyon")] == [1.0, 0.0]


def test_rewarder_subtracts_the_format_penalty():
  rewarder = build_rewarder({**SPEC, "format_penalty": 0.5})
  reward = rewarder("Sure! " + response("Paris"), {"answer": "Paris"})
  assert (reward.score, reward.correct, reward.details["format_errors"]) == (0.5, True, 1)


def test_rewarder_without_a_final_answer_is_incorrect_and_says_why():
  reward = build_rewarder(SPEC)("<think>\nhmm\n</think>", {"answer": "Paris"})
  assert (reward.score, reward.correct) == (-1.0, False)
  assert reward.details["error"].startswith("no final answer")


def test_rewarder_maps_data_sources_and_unknown_domains():
  rewarder = build_rewarder(SPEC)
  assert rewarder.domain_of({"data_source": "aime25"}) == "math"
  assert rewarder.domain_of({"domain": "chemistry"}) == "qa"
  assert rewarder.domain_of({}) == "qa"


def test_rewarder_reads_the_reference_ground_truth_field():
  task = {"data_source": "hotpotqa", "reward_model": {"ground_truth": '{"target": ["Paris"]}'}}
  assert build_rewarder(SPEC)(response("paris"), task) == Reward(1.0, True)


def test_rewarder_f1_metric_scores_between_incorrect_and_correct():
  rewarder = build_rewarder({"domains": {"qa": {"kind": "qa", "metric": "f1"}},
                             "default_domain": "qa"})
  reward = rewarder(response("Paris France"), {"answer": "Paris"})
  assert reward.score == pytest.approx(-1 + 2 * 2 / 3) and not reward.correct


def test_rewarder_runs_code_tasks_in_the_sandbox():
  rewarder = build_rewarder({"domains": {"code": {"kind": "code", "limits": {"wall_timeout_s": 2}}},
                             "default_domain": "code", "correct": 1.0, "incorrect": 0.0})
  task = {"tests": json.dumps(ADD_TESTS)}
  reward = rewarder(response(program("print(sum(map(int, input().split())))")), task)
  assert (reward.score, reward.details["passed"]) == (1.0, 2)


def test_rewarder_names_the_isolation_its_code_domain_runs_under():
  rewarder = build_rewarder({"domains": {"qa": {"kind": "qa"}, "code": {"kind": "code"}},
                             "default_domain": "qa"})
  assert rewarder.sandbox_isolation() == CodeSandbox().isolation  # "auto": the strongest here
  assert build_rewarder(SPEC).sandbox_isolation() is None  # no code domain


def test_rewarder_with_several_code_domains_names_the_weakest_isolation(monkeypatch):
  # Each sandbox takes the mode it is asked for, whatever this machine offers.
  monkeypatch.setattr(CodeSandbox, "_choose_isolation", lambda self, requested: requested)
  rewarder = build_rewarder({"domains": {"a": {"kind": "code", "isolation": "bwrap"},
                                         "b": {"kind": "code", "isolation": "unshare"},
                                         "c": {"kind": "code", "isolation": "bwrap"}},
                             "default_domain": "a"})
  assert rewarder.sandbox_isolation() == "unshare"


def test_rewarder_asks_the_judge_for_judge_domains(judge_server):
  spec = {"domains": {"judge": {"kind": "judge", "base_url": judge_server.url("/wrong"),
                                "model": "m", "api_key_env": None, "http": {"backoff_s": 0.01}}},
          "default_domain": "judge"}
  reward = build_rewarder(spec)(response("Lyon"), {"question": "Capital?", "answer": "Paris"})
  assert (reward.score, reward.correct) == (-1.0, False)
  assert "Question: Capital?" in judge_server.prompts[-1]


@pytest.mark.parametrize("spec, message", [
    ({"domains": {"geo": {"kind": "map"}}, "default_domain": "geo"},
     "rewards.domains.geo: unknown kind 'map'; valid kinds: math, qa, code, judge"),
    ({**SPEC, "default_domain": "code"}, "rewards.default_domain = 'code' is not a domain"),
    ({**SPEC, "sources": {"aime25": "algebra"}}, "rewards.sources.aime25 = 'algebra'"),
    ({**SPEC, "timeout_s": 0}, "rewards.timeout_s must be > 0"),
    ({**SPEC, "format_penalty": -1}, "rewards.format_penalty must be >= 0"),
    ({**SPEC, "correct": 0.0, "incorrect": 0.0}, "must exceed rewards.incorrect"),
    ({"domains": {"qa": {"kind": "qa", "metric": "bleu"}}, "default_domain": "qa"},
     "rewards.domains.qa.metric must be one of ('em', 'f1'), got 'bleu'"),
    ({"domains": {"qa": {"kind": "qa", "metrc": "em"}}, "default_domain": "qa"},
     "rewards.domains.qa (qa): unknown options ['metrc']; expected some of ['metric']"),
    ({"domains": {"code": {"kind": "code", "limits": {"wall_timeout": 1}}},
      "default_domain": "code"}, "rewards.domains.code (code): "),
    ({**SPEC, "timeout": 5}, "unknown rewards fields ['timeout']"),
    ({"domains": SPEC["domains"]}, "rewards.default_domain is missing"),
])
def test_bad_spec_is_a_value_error_that_names_the_problem(spec, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    build_rewarder(spec)
