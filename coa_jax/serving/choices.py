"""The choices of a response, whole or streamed: a chat completion's messages (with tool calls)
or deltas, and a text completion's texts (coa_jax.serving.api builds a `_Job` and hands it one
of these; `server`, `body`, `job` and `sample` are the API's `Server`, request body, `_Job` and
`_Sample`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from coa_jax.serving import chat
from coa_jax.serving.requests import Handle


class ChatChoices:
  """A chat completion's choices: messages with tool calls, or deltas when streamed."""

  def __init__(self, server: Any, conversation: chat.Conversation, body: Any):
    self.server, self.conversation, self.body = server, conversation, body

  def reply(self, job: Any, index: int) -> chat.Reply:
    sample = job.samples[index]
    call_id = f"call_{job.id[:12]}_{index}"
    reply = chat.reply(self.server.tokenizer, sample.ids, sample.reason,
                       self.conversation.functions, call_id)
    if not reply.tool_calls:
      reply = dataclasses.replace(reply, content=job.text(sample.ids))
    key = chat.Transcripts.key(reply.content, reply.tool_calls, job.session or "")
    self.server.transcripts.remember(key, sample.ids)
    return reply

  def response(self, job: Any, handle: Handle) -> dict:
    choices = []
    for index, sample in enumerate(job.samples):
      reply = self.reply(job, index)
      message = {"role": "assistant", "content": reply.content}
      if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
      choice = {"index": index, "message": message, "finish_reason": reply.finish_reason,
                "logprobs": ({"content": job.token_logprobs(sample, 0, len(sample.ids))}
                             if self.body.logprobs else None)}
      if self.body.return_token_ids:
        choice["token_ids"] = sample.ids
      choices.append(choice)
    return job.envelope("chatcmpl", "chat.completion", choices, job.usage(handle))

  def chunk(self, job: Any, choices: list[dict]) -> dict:
    first = bool(choices) and all(c.get("delta", {}).get("role") for c in choices)
    return job.envelope("chatcmpl", "chat.completion.chunk", choices, prompt=first)

  def first_delta(self, job: Any, index: int) -> dict:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}

  def visible(self, job: Any, ids: list[int]) -> str:
    """The text a stream shows of `ids`: up to an opening tool tag (the call is sent whole at
    the end), the end token dropped, cut at a stop string."""
    text, calling = chat.text_until_call(self.server.tokenizer, ids)
    return text if calling else job.text(ids)

  def delta(self, job: Any, index: int) -> dict:
    """The new text of sample `index`, and at its end its tool call and finish reason."""
    sample = job.samples[index]
    start = sample.sent
    sample.sent = len(sample.ids)
    reply = self.reply(job, index) if sample.reason else None
    # Until it ends, a sample shows its text up to an opening tool tag; at its end, its content.
    text = self.visible(job, sample.ids) if reply is None else reply.content or ""
    choice = {"index": index, "delta": {"content": new_text(
        self.visible(job, sample.ids[:start]), text, reply is not None, job.hold)},
              "logprobs": None, "finish_reason": None}
    if self.body.logprobs:
      choice["logprobs"] = {"content": job.token_logprobs(sample, start, len(sample.ids))}
    if self.body.return_token_ids:
      choice["token_ids"] = sample.ids[start:]
    if reply is not None:
      if reply.tool_calls:
        choice["delta"]["tool_calls"] = [{"index": 0, **reply.tool_calls[0]}]
      choice["finish_reason"] = sample.finish_reason = reply.finish_reason
    return choice


def new_text(shown: str, text: str, finished: bool, hold: int = 0) -> str:
  """The part of `text` past what was sent of `shown` (the text of the ids sent before, then
  unfinished); an unfinished sample's text is held back from a broken multi-byte character on
  (the next token completes it), and by its last `hold` characters (a stop string's length less
  one: the next tokens may complete one that starts there, and the text is cut before it)."""
  shown = _sendable(shown, hold)
  if not finished:
    text = _sendable(text, hold)
  return text[len(shown):] if text.startswith(shown) else ""


def _sendable(text: str, hold: int) -> str:
  text = text.rstrip("\ufffd")
  return text[:max(len(text) - hold, 0)]


class TextChoices:
  """A text completion's choices (`/v1/completions`)."""

  def __init__(self, server: Any, body: Any):
    self.server, self.body = server, body

  def logprobs(self, job: Any, sample: Any, start: int, end: int) -> dict | None:
    if self.body.logprobs is None:
      return None
    decode = lambda i: self.server.tokenizer.decode([i])
    tops = []
    for k in range(start, end):
      # As OpenAI's legacy API: the `logprobs` likeliest tokens and the sampled one (up to
      # logprobs + 1 entries; logprobs=0 keeps no top list: the sampled token alone). Where two
      # tokens decode to the same text (a part of a character), the sampled one's entry stays.
      top = {decode(t): value for t, value in (sample.top[k] if k < len(sample.top) else ())}
      top[decode(sample.ids[k])] = sample.logprobs[k]
      tops.append(top)
    return {"tokens": [decode(i) for i in sample.ids[start:end]],
            "token_logprobs": sample.logprobs[start:end], "top_logprobs": tops}

  def response(self, job: Any, handle: Handle) -> dict:
    choices = []
    for index, sample in enumerate(job.samples):
      choice = {"index": index, "text": job.text(sample.ids), "finish_reason": sample.reason,
                "logprobs": self.logprobs(job, sample, 0, len(sample.ids))}
      if self.body.return_token_ids:
        choice["token_ids"] = sample.ids
      choices.append(choice)
    return job.envelope("cmpl", "text_completion", choices, job.usage(handle))

  def chunk(self, job: Any, choices: list[dict]) -> dict:
    return job.envelope("cmpl", "text_completion", choices, prompt=False)

  def first_delta(self, job: Any, index: int) -> dict:
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None}

  def delta(self, job: Any, index: int) -> dict:
    sample = job.samples[index]
    start = sample.sent
    sample.sent = len(sample.ids)
    choice = {"index": index, "text": new_text(job.text(sample.ids[:start]),
                                                job.text(sample.ids), bool(sample.reason),
                                                job.hold),
              "logprobs": self.logprobs(job, sample, start, len(sample.ids)),
              "finish_reason": sample.reason or None}
    if self.body.return_token_ids:
      choice["token_ids"] = sample.ids[start:]
    return choice
