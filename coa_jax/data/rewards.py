"""Verifiable rewards for DAPO: a rollout's final answer scored against its task's ground truth.

Scorers, each `(answer, ground truth, ...) -> (score in [0, 1], details)` and never raising (a
failure scores 0.0 with an "error" in details):

- `math_reward`: the last `\\boxed{...}` (or the whole answer) against the gold, by `math_verify`
  when it is installed and can parse both, else by a normalized string/number comparison;
  under a wall-clock timeout that works from any thread.
- `qa_reward`: SQuAD-normalized exact match (score) and token F1; `|`-separated gold parts
  must all be given.
- `code_reward`: the last ```python block run on stdin/stdout tests, or with a test script after
  it (`functional`), in the code sandbox.
- `judge_reward`: a verdict from an LLM judge behind an OpenAI-compatible endpoint (a JSON
  `correct` flag, or a `judgement` of "correct" / "incorrect" as the reference release asks).
- a `python` domain: a user's function by import path that sees the whole trajectory
  (`Response`: answer, every tool call with its result, token counts, the task's data).

`build_rewarder(spec)` maps each task's domain to one of them and turns the result into a
`Reward`: the `correct` / `incorrect` values (DAPO: +1 / -1), minus a format penalty when the
response breaks the CoA format. `Rewarder.sandbox_isolation()` names the weakest isolation its code
domains run programs under (the RL and evaluation summaries' `reward_sandbox_isolation`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import re
import string
import threading
from fractions import Fraction
from typing import Any, Callable, Mapping, Sequence

from coa_jax.data import coa_format
from tools_env.base import ToolFailure, import_object
from tools_env.remote import ChatClient, HttpLimits
from tools_env.sandbox import CodeSandbox, SandboxLimits, extract_program, weakest

KINDS = ("math", "qa", "code", "judge", "python")
QA_METRICS = ("em", "f1")

Scorer = Callable[[str, Mapping[str, Any]], tuple[float, dict[str, Any]]]


def _error(exc: BaseException) -> str:
  return f"{type(exc).__name__}: {exc}"


# --- answers and ground truths -------------------------------------------------------------


def final_answer(response_text: str, tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS
                 ) -> str | None:
  """Returns the stripped content of the response's last `answer` step, or None if there is
  none, it is empty, or it is still open (cut off before `</answer>`)."""
  return _answer_of(coa_format.parse(response_text, tool_tags)[0])


def _answer_of(steps: list[coa_format.Step]) -> str | None:
  answers = [step for step in steps if step.tag == "answer"]
  if not answers or not answers[-1].closed:
    return None
  return answers[-1].content.strip() or None


def gold_answers(ground_truth: Any) -> list[str]:
  """Returns the gold answers of a ground truth: a string, a list of them, a {"target": ...}
  dict, or that dict as a JSON string (the reference release's `reward_model.ground_truth`)."""
  if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
    try:
      decoded = json.loads(ground_truth)
    except json.JSONDecodeError:
      decoded = None
    if isinstance(decoded, dict) and "target" in decoded:
      ground_truth = decoded
  if isinstance(ground_truth, Mapping):
    ground_truth = ground_truth.get("target")
  if ground_truth is None:
    return []
  if isinstance(ground_truth, (list, tuple)):
    return [str(gold) for gold in ground_truth if gold is not None]
  return [str(ground_truth)]


# --- math ----------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_TEXT_RE = re.compile(r"\\(?:text|textrm|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_UNIT_RE = re.compile(r"^(.*?\S)\s*\\(?:text|textrm|mathrm|mbox)\s*\{[^{}]*\}$")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC_RE = re.compile(r"(-?)\\frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))")
_LATEX_REPLACEMENTS = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^{\\circ}", ""),
                       ("^\\circ", ""), ("\\%", ""), ("%", ""), ("\\!", ""), ("\\,", ""),
                       ("\\;", ""), ("\\ ", " "), ("$", ""))


def extract_boxed(text: str) -> str | None:
  """Returns the content of the last `\\boxed{...}` (braces may nest; `\\boxed 5` also counts),
  or None if there is none or its braces never close."""
  matches = list(_BOXED_RE.finditer(text))
  if not matches:
    return None
  rest = text[matches[-1].end():]
  if not rest.lstrip().startswith("{"):
    token = re.match(r"\s+([^\s$]+)", rest)
    return token.group(1) if token else None
  start = rest.index("{")
  depth = 0
  for i in range(start, len(rest)):
    depth += {"{": 1, "}": -1}.get(rest[i], 0)
    if depth == 0:
      return rest[start + 1:i].strip()
  return None


def _boxed_or_whole(text: str) -> str:
  boxed = extract_boxed(text)
  return text.strip() if boxed is None else boxed


def normalize_math(text: str) -> str:
  """Returns the canonical string of a math answer that the fallback comparison uses: no `$`,
  `\\left`/`\\right`, spacing, percent or degree signs, trailing unit `\\text{...}`, leading
  `x =`, spaces, trailing period or thousands separators; `\\dfrac` read as `\\frac`."""
  s = text
  for old, new in _LATEX_REPLACEMENTS:
    s = s.replace(old, new)
  s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s).strip()
  s = _TEXT_RE.sub(r"\1", _UNIT_RE.sub(r"\1", s))
  s = re.sub(r"^[A-Za-z]\s*=\s*(?=\S)", "", s)
  s = re.sub(r"\s+", "", s).rstrip(".")
  return s.replace(",", "") if _THOUSANDS_RE.fullmatch(s) else s


def _to_number(s: str) -> Fraction | None:
  """Returns the exact value of a normalized integer, decimal, `a/b` or `\\frac{a}{b}`."""
  frac = _FRAC_RE.fullmatch(s)
  if frac:
    sign, num, den = frac.group(1), frac.group(2) or frac.group(3), frac.group(4) or frac.group(5)
  elif s.count("/") == 1:
    sign, (num, den) = "", s.split("/")
  else:
    sign, num, den = "", s, "1"
  try:
    value = Fraction(num) / Fraction(den)
  except (ValueError, ZeroDivisionError):
    return None
  return -value if sign else value


def fallback_equal(predicted: str, gold: str) -> bool:
  """Returns whether two answers agree as normalized strings or as exact numbers."""
  a, b = normalize_math(predicted), normalize_math(gold)
  if a and a == b:
    return True
  value = _to_number(a)
  return value is not None and value == _to_number(b)


@functools.cache
def _math_verify():
  """Returns the `math_verify` module, or None if it is not installed."""
  try:
    import math_verify
  except ImportError:
    return None
  # It warns on every call that its own (signal-based) timeouts are off; ours is on.
  for name in ("math_verify", "math_verify.grader", "math_verify.parser"):
    logging.getLogger(name).setLevel(logging.ERROR)
  return math_verify


def _math_verify_equal(predicted: str, gold: str) -> bool | None:
  """Returns math_verify's verdict, or None if it cannot parse one side. Its signal-based
  timeouts are disabled (they only work in the main thread); the caller enforces one."""
  mv = _math_verify()
  parsed_gold = mv.parse(f"${gold.replace('$', '')}$", parsing_timeout=None)
  parsed = mv.parse(f"${predicted.replace('$', '')}$", parsing_timeout=None)
  if not parsed_gold or not parsed:
    return None
  return bool(mv.verify(parsed_gold, parsed, timeout_seconds=None))


def math_equivalent(predicted: str, gold: str,
                    use_math_verify: bool = True) -> tuple[bool, dict[str, Any]]:
  """Returns whether two extracted answers are equal, and details naming the method that
  decided: math_verify when available and able to parse both, else the fallback."""
  details: dict[str, Any] = {}
  if use_math_verify and _math_verify() is not None:
    try:
      verdict = _math_verify_equal(predicted, gold)
    except Exception as e:  # noqa: BLE001 - the fallback decides instead
      verdict, details["math_verify_error"] = None, _error(e)
    if verdict is not None:
      return verdict, {"method": "math_verify"}
  return fallback_equal(predicted, gold), {**details, "method": "fallback"}


def _within(timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
  """Returns fn(*args) run in a daemon thread; raises TimeoutError if it is not done after
  `timeout_s` (the thread is abandoned, still running) and re-raises what fn raised."""
  box: dict[str, Any] = {}

  def target():
    try:
      box["value"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
      box["error"] = e

  thread = threading.Thread(target=target, name="coa-reward-check", daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise TimeoutError(f"not done after {timeout_s:g} s")
  if "error" in box:
    raise box["error"]
  return box["value"]


def _math_match_any(predicted: str, golds: list[str],
                    use_math_verify: bool) -> tuple[bool, dict[str, Any]]:
  details: dict[str, Any] = {}
  for gold in golds:
    equal, details = math_equivalent(predicted, gold, use_math_verify)
    if equal:
      return True, {**details, "matched": gold}
  return False, details


def math_reward(answer: str, ground_truth: Any, timeout_s: float = 10.0,
                use_math_verify: bool = True) -> tuple[float, dict[str, Any]]:
  """Returns (1.0 if the answer's last boxed expression, or the whole answer, equals a gold
  answer, else 0.0; details), deciding within `timeout_s` seconds (else 0.0, "timeout")."""
  details: dict[str, Any] = {}
  try:
    predicted = _boxed_or_whole(answer)
    golds = [_boxed_or_whole(gold) for gold in gold_answers(ground_truth)]
    details.update(predicted=predicted, golds=golds)
    if not golds:
      return 0.0, {**details, "error": "no ground truth"}
    if not predicted:
      return 0.0, {**details, "error": "empty answer"}
    equal, found = _within(timeout_s, _math_match_any, predicted, golds, use_math_verify)
    return float(equal), {**details, **found}
  except TimeoutError:
    return 0.0, {**details, "error": "timeout"}
  except Exception as e:  # noqa: BLE001 - a reward never raises
    return 0.0, {**details, "error": _error(e)}


# --- question answering --------------------------------------------------------------------

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_text(text: str) -> str:
  """Returns the SQuAD normalization: lowercase, no punctuation, no a/an/the, single spaces."""
  text = text.lower().translate(_PUNCTUATION)
  return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _tokens(text: str) -> list[str]:
  return normalize_text(text.replace("|", " ")).split()


def token_f1(prediction: str, gold: str) -> float:
  """Returns the F1 of the normalized tokens of `prediction` against `gold` (`|` separates
  tokens too)."""
  predicted, expected = _tokens(prediction), _tokens(gold)
  if not predicted or not expected:
    return float(predicted == expected)
  common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(predicted), common / len(expected)
  return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> bool:
  """Returns whether the normalized strings are equal; for a gold with `|`-separated parts,
  whether the prediction's `|`-separated parts are the same set."""
  if "|" not in gold:
    return normalize_text(prediction) == normalize_text(gold)
  return _answer_parts(prediction) == _answer_parts(gold)


def _answer_parts(text: str) -> set[str]:
  return {normalize_text(part) for part in text.split("|")} - {""}


def qa_reward(answer: str, ground_truth: Any, metric: str = "em") -> tuple[float, dict[str, Any]]:
  """Returns (exact match 1.0/0.0, or token F1 with metric="f1", best over the gold answers;
  details with both)."""
  try:
    if metric not in QA_METRICS:
      return 0.0, {"error": f"unknown QA metric {metric!r}; expected one of {QA_METRICS}"}
    golds = gold_answers(ground_truth)
    if not golds:
      return 0.0, {"error": "no ground truth"}
    em = max(float(exact_match(answer, gold)) for gold in golds)
    f1 = max(token_f1(answer, gold) for gold in golds)
    return (em if metric == "em" else f1), {"em": em, "f1": f1, "golds": golds}
  except Exception as e:  # noqa: BLE001 - a reward never raises
    return 0.0, {"error": _error(e)}


# --- code ----------------------------------------------------------------------------------

WRONG_ANSWER = "wrong_answer"
_NO_OUTPUT = "(no output)"  # what the sandbox reports for a program that printed nothing


def normalize_output(text: str) -> str:
  """Returns program output with trailing whitespace stripped from each line and the end."""
  return "\n".join(line.rstrip() for line in text.rstrip().split("\n"))


def _fenced(lang: str, text: str) -> str:
  return f"```{lang}\n{text}" + ("" if text.endswith("\n") else "\n") + "```"


def _test_body(source: str, stdin: str) -> str:
  """Returns the `code` call that runs `source` with `stdin` on its standard input."""
  if "```" in stdin:
    raise ValueError("test input contains ``` and cannot be passed to the sandbox")
  return _fenced("python", source) + ("\n" + _fenced("sh", stdin) if stdin else "")


def _failure_of(result: Any, expected: str | None) -> dict[str, Any] | None:
  """Returns the failure of one test's ToolResult (kind and observation), or None if it
  passed: it ran without error and, unless `expected` is None (a functional test), printed
  `expected`."""
  if not result.ok:
    return {"kind": result.error_kind, "observation": result.observation[:500]}
  if expected is None:
    return None
  output = "" if result.observation == _NO_OUTPUT else result.observation
  if result.truncated:
    return {"kind": WRONG_ANSWER, "observation": "output longer than the sandbox keeps"}
  if normalize_output(output) != normalize_output(expected):
    return {"kind": WRONG_ANSWER, "observation": output[:500]}
  return None


def _test_case(source: str, test: Mapping[str, Any]) -> tuple[str, str | None]:
  """Returns (the `code` call, the expected output or None) of one test: {"stdin", "stdout"},
  or {"functional": a script run after the program (with `prelude` before it), passing when
  the whole exits without error}."""
  if test.get("functional") is not None:
    program = f"{test.get('prelude') or ''}{source}\n\n{test['functional']}"
    return _test_body(program, ""), None
  return _test_body(source, str(test.get("stdin") or "")), str(test.get("stdout") or "")


def code_reward(answer: str, tests: Any, sandbox: CodeSandbox) -> tuple[float, dict[str, Any]]:
  """Returns (1.0 if the answer's last python block passes every test in the sandbox, each
  {"stdin", "stdout"} or {"functional", "prelude"} (see `_test_case`), else 0.0; details with
  the passed count and the first failure)."""
  try:
    tests = json.loads(tests) if isinstance(tests, str) else tests
    if not tests:
      return 0.0, {"error": "no tests"}
    try:
      source, _ = extract_program(answer)
    except ToolFailure:
      return 0.0, {"error": "no python block in the answer", "passed": 0, "total": len(tests)}
    cases = [_test_case(source, test) for test in tests]
    failures = [_failure_of(result, expected) for result, (_, expected)
                in zip(sandbox.map([body for body, _ in cases]), cases)]
    details: dict[str, Any] = {"passed": failures.count(None), "total": len(tests)}
    first = next(((i, f) for i, f in enumerate(failures) if f is not None), None)
    if first is not None:
      details["first_failure"] = {"test": first[0], **first[1]}
    return float(first is None), details
  except Exception as e:  # noqa: BLE001 - a reward never raises
    return 0.0, {"error": _error(e)}


# --- LLM judge -----------------------------------------------------------------------------


class JudgeClient:
  """Asks a model behind an OpenAI-compatible /chat/completions endpoint whether a predicted
  answer matches the gold answer."""

  PROMPT = ("Judge whether the predicted answer to the question below is correct, taking the "
            "gold answer as the truth (when several gold answers are listed, one "
            "suffices). Ignore differences of formatting, capitalization and wording that do "
            "not change the meaning. Reply with only a JSON object: {{\"correct\": true}} or "
            "{{\"correct\": false}}.\n\nQuestion: {question}\n\nGold answer: {gold}\n\n"
            "Predicted answer: {predicted}")

  def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
               limits: HttpLimits | None = None, max_tokens: int = 256,
               prompt: str | None = None):
    self.prompt = self.PROMPT if prompt is None else prompt
    try:
      self.prompt.format(question="", gold="", predicted="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"prompt {self.prompt!r:.60}...: expected a format string whose only "
                       f"fields are {{question}}, {{gold}} and {{predicted}} (literal braces "
                       f"doubled); {type(e).__name__}: {e}") from None
    self.client = ChatClient(base_url, model, api_key_env, limits, max_tokens, what="judge")

  def __call__(self, question: str, gold: str, predicted: str) -> str:
    """Returns the judge's reply text; raises ToolFailure."""
    prompt = self.prompt.format(question=question, gold=gold, predicted=predicted)
    return self.client.complete([{"role": "user", "content": prompt}])


_VERDICT_WORDS = {"true": True, "yes": True, "correct": True,
                  "false": False, "no": False, "incorrect": False}


def _json_objects(text: str) -> list[str]:
  """Returns candidate JSON object texts: the whole reply, fenced blocks, then `{...}` spans."""
  fenced = re.findall(r"```(?:json)?\s*\n?(.*?)```", text, re.DOTALL)
  return [text, *fenced, *re.findall(r"\{[^{}]*\}", text)]


_VERDICT_FIELDS = ("correct", "judgement", "judgment")


def parse_verdict(reply: str) -> bool | None:
  """Returns the judge's verdict: the "correct" (or the reference release's "judgement")
  field of a JSON object in the reply (bare, fenced or amid text), else a reply that is only a
  verdict word; None if there is none."""
  for candidate in _json_objects(reply):
    try:
      obj = json.loads(candidate)
    except json.JSONDecodeError:
      continue
    field = next((f for f in _VERDICT_FIELDS if isinstance(obj, dict) and f in obj), None)
    if field is not None:
      value = obj[field]
      if isinstance(value, bool):
        return value
      return _VERDICT_WORDS.get(str(value).strip().lower())
  return _VERDICT_WORDS.get(reply.strip().strip(string.punctuation + " \n").lower())


def judge_reward(question: str, answer: str, ground_truth: Any,
                 client: JudgeClient) -> tuple[float, dict[str, Any]]:
  """Returns (1.0 if the judge says the answer is correct, else 0.0; details with its reply)."""
  try:
    golds = gold_answers(ground_truth)
    if not golds:
      return 0.0, {"error": "no ground truth"}
    reply = client(question or "", "; ".join(golds), answer)
  except ToolFailure as e:
    return 0.0, {"error": str(e), "error_kind": e.kind}
  except Exception as e:  # noqa: BLE001 - a reward never raises
    return 0.0, {"error": _error(e)}
  verdict = parse_verdict(reply)
  if verdict is None:
    return 0.0, {"error": "malformed judge reply", "reply": reply[:500]}
  return float(verdict), {"method": "judge", "reply": reply[:500]}


# --- format --------------------------------------------------------------------------------


def format_penalty(response_text: str, penalty: float,
                   tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS
                   ) -> tuple[float, dict[str, Any]]:
  """Returns (`penalty` if the response breaks the CoA format, else 0.0; details with the
  error count and kinds)."""
  _, errors = coa_format.parse_and_validate(response_text, True, tool_tags)
  return _penalty(errors, penalty)


def _penalty(errors: list[coa_format.FormatError], penalty: float
             ) -> tuple[float, dict[str, Any]]:
  kinds = sorted({error.kind for error in errors})
  return (penalty if errors else 0.0), {"format_errors": len(errors), "format_kinds": kinds}


# --- the rewarder --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reward:
  """A response's reward: the shaped score, whether the answer is correct, and why."""

  score: float
  correct: bool
  details: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One tool call of a response: its tag, its body and the observation that answered it (None
  when none came: the response ended first)."""

  tag: str
  body: str
  result: str | None


@dataclasses.dataclass(frozen=True)
class Response:
  """What a `python` reward function sees: one whole response to a task.

  `task` is the task's data (`question`, the ground truth under `answer` / `ground_truth`, any
  other field of its row); `answer` the final answer (None without a closed, non-empty
  `answer` step); token counts are None where the caller has none (a teacher's trace)."""

  text: str
  steps: tuple[coa_format.Step, ...]
  answer: str | None
  tool_calls: tuple[ToolCall, ...]
  task: Mapping[str, Any]
  response_tokens: int | None = None  # sampled and observation tokens after the prompt
  sampled_tokens: int | None = None  # the model's own


def tool_calls_of(steps: list[coa_format.Step]) -> tuple[ToolCall, ...]:
  """Returns the tool calls of parsed steps, each with the observation right after it."""
  calls = []
  for i, step in enumerate(steps):
    if step.is_tool:
      after = steps[i + 1] if i + 1 < len(steps) else None
      answered = after is not None and after.tag == coa_format.OBSERVATION
      calls.append(ToolCall(step.tag, step.content, after.content if answered else None))
  return tuple(calls)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Which scorer judges each domain, and how a verdict becomes a score.

  `domains`: {name: {"kind": one of KINDS, **options}}; options: qa `metric` ("em" or "f1");
  math `use_math_verify`; code `limits` (SandboxLimits fields), `isolation`, `workers`; judge
  `base_url`, `model`, `api_key_env`, `max_tokens`, `http` (HttpLimits fields), `prompt` (a
  format string with {question}, {gold} and {predicted}; default `JudgeClient.PROMPT`); python
  `function` (an import path: `function(response: Response, **options)` returns a score in
  [0, 1], or (score, details)) and `options`. `sources` maps a task's `data_source` (e.g.
  "hotpotqa") to a domain.
  """

  domains: Mapping[str, Mapping[str, Any]]
  default_domain: str
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
  correct: float = 1.0
  incorrect: float = -1.0
  format_penalty: float = 0.0  # subtracted when the response breaks the CoA format
  timeout_s: float = 10.0  # the math checker's wall-clock limit

  def __post_init__(self):
    if not self.domains:
      raise ValueError("rewards.domains is empty; give at least one {name: {'kind': ...}}")
    for name, config in self.domains.items():
      if config.get("kind") not in KINDS:
        raise ValueError(f"rewards.domains.{name}: unknown kind {config.get('kind')!r}; "
                         f"valid kinds: {', '.join(KINDS)}")
    for where, domain in [("default_domain", self.default_domain),
                          *((f"sources.{k}", v) for k, v in self.sources.items())]:
      if domain not in self.domains:
        raise ValueError(f"rewards.{where} = {domain!r} is not a domain; domains: "
                         f"{sorted(self.domains)}")
    if not self.timeout_s > 0:
      raise ValueError(f"rewards.timeout_s must be > 0, got {self.timeout_s!r}")
    if not self.format_penalty >= 0:
      raise ValueError(f"rewards.format_penalty must be >= 0, got {self.format_penalty!r}")
    if not self.correct > self.incorrect:
      raise ValueError(f"rewards.correct ({self.correct!r}) must exceed rewards.incorrect "
                       f"({self.incorrect!r})")

  @classmethod
  def from_dict(cls, spec: Mapping[str, Any]) -> RewardSpec:
    """Returns the spec a config mapping describes; raises ValueError on unknown fields."""
    fields = {field.name for field in dataclasses.fields(cls)}
    unknown = set(spec) - fields
    if unknown:
      raise ValueError(f"unknown rewards fields {sorted(unknown)}; expected some of "
                       f"{sorted(fields)}")
    if "default_domain" not in spec:
      raise ValueError("rewards.default_domain is missing")
    values = dict(spec)
    values["domains"] = {name: dict(config)
                         for name, config in dict(spec.get("domains") or {}).items()}
    values["sources"] = dict(spec.get("sources") or {})
    return cls(**values)


def ground_truth_of(task_data: Mapping[str, Any]) -> Any:
  """Returns the task's ground truth: `answer`, `ground_truth` or `reward_model.ground_truth`."""
  for key in ("answer", "ground_truth"):
    if task_data.get(key) is not None:
      return task_data[key]
  reward_model = task_data.get("reward_model")
  return reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None


def _options(name: str, config: Mapping[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
  options = {key: value for key, value in config.items() if key != "kind"}
  unknown = set(options) - set(allowed)
  if unknown:
    raise ValueError(f"rewards.domains.{name} ({config['kind']}): unknown options "
                     f"{sorted(unknown)}; expected some of {list(allowed)}")
  return options


def _build_scorer(name: str, config: Mapping[str, Any], spec: RewardSpec) -> Scorer:
  """Returns the (answer, task_data) -> (score, details) function of one domain (a `python`
  domain's: a PythonScorer, called with the whole Response)."""
  kind = config["kind"]
  if kind == "math":
    use_mv = _options(name, config, ("use_math_verify",)).get("use_math_verify", True)
    return lambda answer, task: math_reward(answer, ground_truth_of(task), spec.timeout_s, use_mv)
  if kind == "qa":
    metric = _options(name, config, ("metric",)).get("metric", "em")
    if metric not in QA_METRICS:
      raise ValueError(f"rewards.domains.{name}.metric must be one of {QA_METRICS}, "
                       f"got {metric!r}")
    return lambda answer, task: qa_reward(answer, ground_truth_of(task), metric)
  if kind == "python":
    options = _options(name, config, ("function", "options"))
    if "function" not in options:
      raise ValueError(f"rewards.domains.{name} (python): `function` (an import path) is missing")
    function = import_object(str(options["function"]), f"rewards.domains.{name}.function")
    if not callable(function):
      raise ValueError(f"rewards.domains.{name}.function: {options['function']!r} is not callable")
    return PythonScorer(function, dict(options.get("options") or {}))
  try:
    if kind == "code":
      options = _options(name, config, ("limits", "isolation", "workers", "persistent"))
      return CodeScorer(CodeSandbox(SandboxLimits(**dict(options.pop("limits", {}))), **options))
    options = _options(name, config, ("base_url", "model", "api_key_env", "max_tokens", "http",
                                      "prompt"))
    if "http" in options:
      options["limits"] = HttpLimits(**dict(options.pop("http")))
    try:
      client = JudgeClient(**options)
    except ValueError as e:
      raise ValueError(f"rewards.domains.{name} (judge): {e}") from None
    return lambda answer, task: judge_reward(task.get("question", ""), answer,
                                             ground_truth_of(task), client)
  except TypeError as e:
    raise ValueError(f"rewards.domains.{name} ({kind}): {e}") from None


class CodeScorer:
  """A code domain's scorer: `code_reward` on the task's tests in its own sandbox."""

  def __init__(self, sandbox: CodeSandbox):
    self.sandbox = sandbox

  def __call__(self, answer: str, task: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    return code_reward(answer, task.get("tests"), self.sandbox)


class PythonScorer:
  """A `python` domain's scorer: the user's function on the whole Response; a result that is
  not a number in [0, 1] (or such a number and a dict) is an error."""

  def __init__(self, function: Callable[..., Any], options: Mapping[str, Any]):
    self.function, self.options = function, options

  def __call__(self, response: Response) -> tuple[float, dict[str, Any]]:
    result = self.function(response, **self.options)
    value, details = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1
        or not isinstance(details, dict)):
      raise ValueError(f"a python reward must return a score in [0, 1] or (score, dict), got "
                       f"{result!r:.200}")
    return float(value), details


class Rewarder:
  """Scores a response against its task with the scorer of the task's domain. `tool_tags`: the
  declared tools' tags (the response is parsed with them)."""

  def __init__(self, spec: RewardSpec, tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS):
    self.spec, self.tool_tags = spec, tuple(tool_tags)
    self.scorers = {name: _build_scorer(name, config, spec)
                    for name, config in spec.domains.items()}

  def sandbox_isolation(self) -> str | None:
    """Returns the weakest isolation mode the code domains' sandboxes run programs under (None
    without a code domain)."""
    return weakest([scorer.sandbox.isolation for scorer in self.scorers.values()
                    if isinstance(scorer, CodeScorer)])

  def domain_of(self, task_data: Mapping[str, Any]) -> str:
    """Returns the task's domain: its `domain` or `data_source`, through `sources`, else the
    default domain."""
    name = task_data.get("domain") or task_data.get("data_source")
    if not isinstance(name, str):
      return self.spec.default_domain
    if name in self.spec.domains:
      return name
    return self.spec.sources.get(name, self.spec.default_domain)

  def __call__(self, response_text: str, task_data: Mapping[str, Any],
               response_tokens: int | None = None, sampled_tokens: int | None = None) -> Reward:
    """Returns the reward of a response; never raises. Token counts go to `python` domains."""
    spec = self.spec
    steps, errors = coa_format.parse_and_validate(response_text, True, self.tool_tags)
    penalty, details = _penalty(errors, spec.format_penalty)
    domain = self.domain_of(task_data)
    scorer = self.scorers[domain]
    answer = _answer_of(steps)
    details.update(domain=domain, answer=answer)
    try:
      if isinstance(scorer, PythonScorer):
        value, found = scorer(Response(response_text, tuple(steps), answer, tool_calls_of(steps),
                                       task_data, response_tokens, sampled_tokens))
      elif answer is None:
        value, found = 0.0, {"error": "no final answer (no closed, non-empty <answer> step)"}
      else:
        value, found = scorer(answer, task_data)
    except Exception as e:  # noqa: BLE001 - a reward never raises
      value, found = 0.0, {"error": _error(e)}
    score = spec.incorrect + value * (spec.correct - spec.incorrect) - penalty
    return Reward(score, value >= 1.0, {**details, **found})

  def check(self, tasks: Sequence[Any]) -> None:  # Tasks (coa_jax.data.tasks)
    """Raises ValueError before the first step when a task names a domain that is not one, or
    a `python` domain's function raises or returns a bad score on the first task of its domain
    (scored as an empty response)."""
    checked = set()
    for task in tasks:
      named = task.data.get("domain")
      if named is not None and named not in self.spec.domains and named not in self.spec.sources:
        raise ValueError(f"task {task.id}: domain {named!r} is not a rewards domain; domains: "
                         f"{sorted(self.spec.domains)}")
      domain = self.domain_of(task.data)
      scorer = self.scorers[domain]
      if isinstance(scorer, PythonScorer) and domain not in checked:
        checked.add(domain)
        try:
          scorer(Response("", (), None, (), task.data, 0, 0))
        except Exception as e:  # noqa: BLE001 - reported as a config error
          raise ValueError(f"rewards.domains.{domain}: the reward function fails on task "
                           f"{task.id} (an empty response): {_error(e)}") from None


def build_rewarder(spec: Mapping[str, Any] | RewardSpec,
                   tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> Rewarder:
  """Returns the rewarder a config describes (see `RewardSpec`), parsing responses with the
  declared `tool_tags`; raises ValueError."""
  return Rewarder(spec if isinstance(spec, RewardSpec) else RewardSpec.from_dict(spec), tool_tags)
