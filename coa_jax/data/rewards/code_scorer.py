"""The `code` scorer: the answer's last ```python block run on stdin/stdout tests, or with a
test script after it (`functional`), in the code sandbox."""

from __future__ import annotations

import json
import secrets
from typing import Any, Mapping

from coa_jax.data.rewards.answers import error_text
from tools_env.base import ToolFailure
from tools_env.sandbox import CodeSandbox, extract_program

WRONG_ANSWER = "wrong_answer"
EXITED_EARLY = "exited_early"
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


def _failure_of(result: Any, expected: str, functional: bool) -> dict[str, Any] | None:
  """Returns the failure of one test's ToolResult (kind and observation), or None if it
  passed: it ran without error and printed `expected`, or for a functional test printed the
  line `expected` (the token its script prints once its asserts have run)."""
  if not result.ok:
    return {"kind": result.error_kind, "observation": result.observation[:500]}
  output = "" if result.observation == _NO_OUTPUT else result.observation
  if functional:
    if expected in output.split("\n"):
      return None
    return {"kind": EXITED_EARLY, "observation": "the program ended before the test script's "
            "asserts ran (an exit() in the answer?): " + output[-300:]}
  if result.truncated:
    return {"kind": WRONG_ANSWER, "observation": "output longer than the sandbox keeps"}
  if normalize_output(output) != normalize_output(expected):
    return {"kind": WRONG_ANSWER, "observation": output[:500]}
  return None


def _test_case(source: str, test: Mapping[str, Any]) -> tuple[str, str, bool]:
  """Returns (the `code` call, the expected output, whether functional) of one test:
  {"stdin", "stdout"}, or {"functional": a script run after the program (with `prelude`
  before it), passing when the whole exits without error having reached the script's end}.
  The end prints a token drawn for this call: a program that exits before the asserts run
  (`exit()`, `os._exit(0)`) exits without error, but never prints it."""
  if test.get("functional") is not None:
    token = f"coa-test-passed-{secrets.token_hex(16)}"
    program = (f"{test.get('prelude') or ''}{source}\n\n{test['functional']}\n"
               f"print({token!r}, flush=True)")
    return _test_body(program, ""), token, True
  return _test_body(source, str(test.get("stdin") or "")), str(test.get("stdout") or ""), False


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
    failures = [_failure_of(result, expected, functional) for result, (_, expected, functional)
                in zip(sandbox.map([body for body, _, _ in cases]), cases)]
    details: dict[str, Any] = {"passed": failures.count(None), "total": len(tests)}
    first = next(((i, f) for i, f in enumerate(failures) if f is not None), None)
    if first is not None:
      details["first_failure"] = {"test": first[0], **first[1]}
    return float(first is None), details
  except Exception as e:  # noqa: BLE001 - a reward never raises
    return 0.0, {"error": error_text(e)}


class CodeScorer:
  """A code domain's scorer: `code_reward` on the task's tests in its own sandbox."""

  def __init__(self, sandbox: CodeSandbox):
    self.sandbox = sandbox

  def __call__(self, answer: str, task: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    return code_reward(answer, task.get("tests"), self.sandbox)

