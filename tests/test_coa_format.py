"""The CoA format: rendering round trips, a total parser, and the transition rules."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coa_jax.data import coa_format as cf
from coa_jax.data.coa_format import Step

GOOD = [
    Step("plan", "1. search\n2. answer"),
    Step("web_search", "capital of France"),
    Step("observation", "Paris is the capital. <think> is just text here </think>"),
    Step("think", "It is Paris."),
    Step("code", "```python\nprint(1 + 1)\n```"),
    Step("observation", "2"),
    Step("suggested_answer", "Paris"),
    Step("double_check", "Score: 4"),
    Step("answer", "Paris"),
]


def kinds(errors):
  return sorted({e.kind for e in errors})


def test_render_then_parse_round_trips_with_no_errors():
  text = cf.render_steps(GOOD)
  steps, errors = cf.parse_and_validate(text)
  assert steps == GOOD and errors == []


def test_observation_is_opaque_up_to_its_closing_tag():
  steps, errors = cf.parse("<web_search>\nq\n</web_search>\n<observation>\na <answer> b "
                           "</code>\n</observation>")
  assert errors == []
  assert steps[1] == Step("observation", "a <answer> b </code>")


@pytest.mark.parametrize("text,expected", [
    ("<think>\nno end", [cf.UNCLOSED_TAG, cf.MISSING_ANSWER]),
    ("<think>\na <plan>\nb\n</plan> c\n</think>\n<answer>\nx\n</answer>", [cf.NESTED_TAG]),
    ("</answer>\n<answer>\nx\n</answer>", [cf.TAG_IN_FREE_TEXT]),
    ("hello\n<answer>\nx\n</answer>", [cf.STRAY_TEXT]),
    ("<observation>\nx\n</observation>\n<answer>\ny\n</answer>", [cf.OBSERVATION_WITHOUT_TOOL]),
    ("<think>\na\n</think>\n<observation>\nx\n</observation>\n<answer>\ny\n</answer>",
     [cf.OBSERVATION_WITHOUT_TOOL]),
    ("<web_search>\nq\n</web_search>\n<answer>\ny\n</answer>", [cf.MISSING_OBSERVATION]),
    ("<suggested_answer>\na\n</suggested_answer>\n<think>\nb\n</think>\n<answer>\na\n</answer>",
     [cf.ILLEGAL_TRANSITION]),
    ("<answer>\na\n</answer>\n<think>\nmore\n</think>", [cf.ILLEGAL_TRANSITION]),
    ("<think>\na\n</think>", [cf.MISSING_ANSWER]),
    ("<code>\nprint(1)\n</code>\n<observation>\n1\n</observation>\n<answer>\n1\n</answer>",
     [cf.MALFORMED_TOOL_CALL]),
    ("", [cf.EMPTY]),
])
def test_malformed_trajectories_report_the_right_error_kinds(text, expected):
  _, errors = cf.parse_and_validate(text)
  assert kinds(errors) == sorted(expected)


def test_a_rollout_cut_at_a_tool_call_is_valid_when_incomplete():
  steps, errors = cf.parse("<think>\nlook it up\n</think>\n<web_search>\nq\n</web_search>")
  assert errors == [] and cf.validate(steps, complete=False) == []
  assert kinds(cf.validate(steps, complete=True)) == [cf.MISSING_ANSWER, cf.MISSING_OBSERVATION]


def test_an_open_step_at_the_end_is_kept_unclosed():
  steps, errors = cf.parse("<think>\nhalf a thou")
  assert steps == [Step("think", "half a thou", closed=False)]
  assert kinds(errors) == [cf.UNCLOSED_TAG]


def test_extract_code_reads_the_fenced_python_block():
  assert cf.extract_code("run this:\n```python\nx = 1\nprint(x)\n```\n") == "x = 1\nprint(x)\n"
  assert cf.extract_code("no fence here") is None


_PIECES = [cf.opening(t) for t in cf.ALL_TAGS] + [cf.closing(t) for t in cf.ALL_TAGS] + [
    "\n", " ", "text", "<", ">", "</", "<<think>>", "```python\n", "```", "\x00", "é", "<thin"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=8)), max_size=40))
def test_parser_never_raises_on_arbitrary_strings(pieces):
  text = "".join(pieces)
  steps, errors = cf.parse_and_validate(text)
  assert all(s.tag in cf.ALL_TAGS for s in steps)
  assert all(e.kind and 0 <= e.position <= max(len(text), len(steps)) for e in errors)


def test_parser_never_raises_on_non_strings_and_long_adversarial_input():
  assert cf.parse(None)[1][0].kind == cf.EMPTY  # type: ignore[arg-type]
  rng = random.Random(0)
  text = "".join(rng.choice(_PIECES) for _ in range(20_000))
  cf.parse_and_validate(text)
