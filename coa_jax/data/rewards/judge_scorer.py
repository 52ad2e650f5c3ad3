"""The `judge` scorer: a verdict from an LLM judge behind an OpenAI-compatible endpoint (a JSON
`correct` flag, or a `judgement` of "correct" / "incorrect" as the reference release asks)."""

from __future__ import annotations

import json
import re
import string
from typing import Any

from coa_jax.data.rewards.answers import error_text, gold_answers
from tools_env.base import ToolFailure
from tools_env.remote import ChatClient, HttpLimits


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
    return 0.0, {"error": error_text(e)}
  verdict = parse_verdict(reply)
  if verdict is None:
    return 0.0, {"error": "malformed judge reply", "reply": reply[:500]}
  return float(verdict), {"method": "judge", "reply": reply[:500]}

