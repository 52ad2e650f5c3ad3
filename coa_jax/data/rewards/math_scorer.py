"""The `math` scorer: the last `\\boxed{...}` (or the whole answer) against the gold, by
`math_verify` when it is installed and can parse both, else by a normalized string/number
comparison; under a wall-clock timeout that works from any thread."""

from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction
from typing import Any, Callable

from coa_jax.data.rewards.answers import error_text, gold_answers

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
  thousands = _THOUSANDS_RE.fullmatch(s.strip().rstrip("."))  # "1, 200" is a list: not 1200
  s = re.sub(r"\s+", "", s).rstrip(".")
  return s.replace(",", "") if thousands else s


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
      verdict, details["math_verify_error"] = None, error_text(e)
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
    return 0.0, {**details, "error": error_text(e)}

