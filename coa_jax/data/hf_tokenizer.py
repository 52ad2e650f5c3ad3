"""The tokenizer as transformers loads it: the files an HF export holds beside the weights.

`export_files` returns them: tokenizer.json (the CoA tags and declared tool tags as added special
tokens), tokenizer_config.json (`PreTrainedTokenizerFast`, the template's end token as eos, and
a Jinja chat template), generation_config.json (eos and the sampling defaults) and the saved
tag mapping (`tokenizer.TAGS_FILE`). `PreTrainedTokenizerFast.from_pretrained(export)` then
encodes text without tags as `CoATokenizer` does, and so does `AutoTokenizer` except where
transformers imposes its own tokenizer class (a `qwen2` export of a tokenizer other than Qwen's,
below); the chat template renders a CoA trajectory to the ids SFT trained on
(`tokenize.tokenize_trajectory`; tests/test_hf_export.py).

The chat template takes the messages `messages` returns: a system message (the system prompt,
listing the declared tools), the user's question, then the response as assistant messages and
`tool` messages (observations). Every assistant or tool message after the first is one more
step: a newline joins it to the previous one, and a tool message is written
`<observation>\\ncontent\\n</observation>`, as the rollout appends it; an assistant message may
also hold the whole response, observations included (the reference release's text format). The
template's end token follows a final assistant message (`continue_final_message=True` leaves it
open), and `add_generation_prompt=True` after the question opens the response ("chatml":
`<|im_start|>assistant\\n`; "plain" needs nothing). A missing system message is an empty system
prompt.

Two differences are transformers' own. It tokenizes the rendered text with special-token
parsing on, so text that itself contains a tag (`<think>` in a question or an observation) gives
the tag's token there, where coa-jax gives ordinary text tokens (docs/design.md, invariant 2).
And for a `qwen2` model `AutoTokenizer` builds `Qwen2Tokenizer`, which keeps tokenizer.json's
vocabulary and merges but rebuilds Qwen's own normalizer and pre-tokenizer: the same ids for a
Qwen2.5 tokenizer, other ids for `tokenizer.default_tokenizer` (its numbers split into 1-2 digit
chunks); `PreTrainedTokenizerFast.from_pretrained(export)` reads tokenizer.json as it is.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from coa_jax.data import coa_format
from coa_jax.data.coa_format import Trajectory
from coa_jax.data.tokenizer import TAGS_FILE, CoATokenizer

GENERATION_FILE = "generation_config.json"

# The steps of the response, shared by both templates: `ns.open` once the response started.
_RESPONSE = r"""
{%- elif message['role'] in ['assistant', 'tool'] -%}
{{- '\n' if ns.open else header -}}
{%- set ns.open = true -%}
{%- if message['role'] == 'tool' -%}
{{- '<observation>\n' + message['content'] + '\n</observation>' -}}
{%- else -%}
{{- message['content'] -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if messages and messages[-1]['role'] == 'assistant' -%}
{{- end -}}
{%- elif add_generation_prompt and not ns.open -%}
{{- header -}}
{%- endif -%}"""

_PROLOGUE = r"""{%- set ns = namespace(open=false) -%}
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}
"""

# Each template: its system and user parts, the header that opens the response, the end token.
_CHATML = _PROLOGUE + r"""{%- set header = '<|im_start|>assistant\n' -%}
{%- set end = '<|im_end|>' -%}
{{- '<|im_start|>system\n' + system + '<|im_end|>\n' -}}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}
{{- '<|im_start|>user\n' + message['content'] + '<|im_end|>\n' -}}""" + _RESPONSE

_PLAIN = _PROLOGUE + r"""{%- set header = '' -%}
{%- set end = '<|endoftext|>' -%}
{{- system + '\n\n' -}}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}
{{- message['content'] + '\n\n' -}}""" + _RESPONSE

CHAT_TEMPLATES = {"chatml": _CHATML, "plain": _PLAIN}


def chat_template(tokenizer: CoATokenizer) -> str:
  """Returns the Jinja chat template of `tokenizer`'s template (module docstring)."""
  return CHAT_TEMPLATES[tokenizer.template]


def messages(trajectory: Trajectory, tool_messages: bool = True) -> list[dict[str, str]]:
  """Returns a trajectory as chat messages: system, user (the question), then its steps as
  assistant messages, each observation a `tool` message between them (with tool_messages=False,
  the whole response as one assistant message)."""
  out = [{"role": "system", "content": trajectory.system},
         {"role": "user", "content": trajectory.question}]
  if not tool_messages:
    return out + [{"role": "assistant", "content": trajectory.response_text()}]
  written: list[coa_format.Step] = []
  for step in trajectory.steps:
    if step.tag != coa_format.OBSERVATION:
      written.append(step)
      continue
    if written:
      out.append({"role": "assistant", "content": coa_format.render_steps(written)})
      written = []
    out.append({"role": "tool", "content": step.content})
  if written:
    out.append({"role": "assistant", "content": coa_format.render_steps(written)})
  return out


def tokenizer_config(tokenizer: CoATokenizer) -> dict[str, Any]:
  """Returns tokenizer_config.json: every added token as transformers records it, the
  template's end token as eos (and padding), the tags as extra special tokens, the chat
  template."""
  added = json.loads(tokenizer.backend.to_str())["added_tokens"]
  end = tokenizer.decode([tokenizer.end_id])
  return {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in (
          "content", "lstrip", "normalized", "rstrip", "single_word", "special")}
          for t in added},
      "bos_token": None, "eos_token": end, "pad_token": end,
      "extra_special_tokens": [t["content"] for t in added
                               if t["special"] and t["content"] != end],
      "clean_up_tokenization_spaces": False,
      "chat_template": chat_template(tokenizer),
  }


def generation_config(tokenizer: CoATokenizer,
                      sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Returns generation_config.json: eos (and padding) the template's end id, and `sampling`'s
  temperature, top_k and top_p (`rollout.sampler.SamplingConfig`'s fields; missing ones take
  its defaults: 1.0, 0, 1.0); temperature 0 is greedy decoding."""
  given = sampling.to_dict() if hasattr(sampling, "to_dict") else dict(sampling or {})
  sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **given}
  out: dict[str, Any] = {"eos_token_id": tokenizer.end_id, "pad_token_id": tokenizer.end_id,
                         "bos_token_id": None}
  if float(sampling["temperature"]) == 0:
    return {**out, "do_sample": False}
  return {**out, "do_sample": True, "temperature": float(sampling["temperature"]),
          "top_k": int(sampling["top_k"]), "top_p": float(sampling["top_p"])}


def export_files(tokenizer: CoATokenizer,
                 sampling: Mapping[str, Any] | None = None) -> dict[str, str]:
  """Returns {file name: text} of the files an HF export holds beside its weights (module
  docstring), `sampling` the job's sampling settings (None: the defaults)."""
  dump = lambda value: json.dumps(value, indent=2) + "\n"  # noqa: E731
  return {"tokenizer.json": tokenizer.backend.to_str(),
          "tokenizer_config.json": dump(tokenizer_config(tokenizer)),
          GENERATION_FILE: dump(generation_config(tokenizer, sampling)),
          TAGS_FILE: dump(tokenizer.tag_map())}
