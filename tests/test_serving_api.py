"""The OpenAI-compatible API, driven by the official `openai` client against a server on a free
local port (coa_jax.serving.api): chat, streaming, n, stop, seeds, log-probs, token ids, tool
calls, concurrency, prefix reuse and the error matrix."""

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from coa_jax.model.transformer import Transformer
from coa_jax.serving import chat
from coa_jax.serving.engine import Engine, EngineSettings
from coa_jax.serving.requests import Request
from serving_server import CONFIG, MODEL, SYSTEM, TOKENIZER, params, served

QUESTION = "What is the population of City 12?"
MESSAGES = [{"role": "user", "content": QUESTION}]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def server():
  with served() as (url, server):
    yield url, server


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      return response.status, json.load(response)
  except urllib.error.HTTPError as e:
    return e.code, json.load(e)


def test_a_chat_returns_the_models_own_tokens_and_log_probs(client):
  out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                       max_tokens=12, logprobs=True, top_logprobs=3,
                                       extra_body=IDS)
  prompt = out.model_extra["prompt_token_ids"]
  assert prompt == TOKENIZER.prompt_ids(SYSTEM, QUESTION)
  choice = out.choices[0]
  ids = choice.model_extra["token_ids"]
  assert len(ids) == out.usage.completion_tokens == 12 and choice.finish_reason == "length"
  weights, _ = params()
  logits = Transformer(CONFIG).apply({"params": weights}, jnp.asarray([prompt + ids]))[0]
  logp = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1], axis=-1))
  np.testing.assert_array_equal(ids, logp.argmax(-1))
  entries = choice.logprobs.content
  np.testing.assert_allclose([e.logprob for e in entries], logp.max(-1), atol=1e-4)
  assert [e.token for e in entries] == [TOKENIZER.decode([i]) for i in ids]
  assert [len(e.top_logprobs) for e in entries] == [3] * 12
  assert choice.message.content == TOKENIZER.decode(ids)


@pytest.mark.parametrize("top", [0, 2])
def test_a_completions_top_logprobs_hold_its_likeliest_tokens_and_the_sampled_one(client, top):
  out = client.completions.create(model=MODEL, prompt=QUESTION, temperature=1.0, seed=5,
                                  max_tokens=8, logprobs=top).choices[0].logprobs
  assert len(out.tokens) == len(out.top_logprobs) == 8
  for token, logprob, entries in zip(out.tokens, out.token_logprobs, out.top_logprobs):
    assert entries[token] == logprob and len(entries) <= top + 1
    if top and "\ufffd" not in entries:  # (no two tokens decoding to the same part character)
      assert len(entries) >= top


def test_streaming_gives_the_same_text_as_a_whole_response(client):
  kwargs = dict(model=MODEL, messages=MESSAGES, temperature=1.0, seed=7, max_tokens=20)
  whole = client.chat.completions.create(**kwargs)
  chunks = list(client.chat.completions.create(stream=True, **kwargs))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == whole.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seeds_fix_the_samples_and_n_samples_differ(client):
  kwargs = dict(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=16)
  a = client.chat.completions.create(seed=3, n=3, **kwargs)
  b = client.chat.completions.create(seed=3, n=3, **kwargs)
  texts = [c.message.content for c in a.choices]
  assert texts == [c.message.content for c in b.choices] and len(set(texts)) == 3
  assert client.chat.completions.create(seed=4, **kwargs).choices[0].message.content != texts[0]


def test_a_stop_string_cuts_the_text_and_ends_the_choice(client):
  kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16)
  text = client.chat.completions.create(**kwargs).choices[0].message.content
  stop = text[5:7]
  cut = client.chat.completions.create(stop=[stop], **kwargs).choices[0]
  assert cut.message.content == text[:text.index(stop)] and cut.finish_reason == "stop"


def test_a_streamed_choice_cut_at_a_stop_string_is_the_whole_ones_and_ends_once(client):
  kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16)
  ids = client.chat.completions.create(extra_body=IDS, **kwargs).choices[0].model_extra[
      "token_ids"]
  stops = [TOKENIZER.decode(ids[a:a + 2]) for a in range(0, 12, 4)]  # some across a chunk's end
  stops = [stop for stop in stops if stop.strip() and "\ufffd" not in stop]
  assert stops
  for stop in stops:
    whole = client.chat.completions.create(stop=[stop], **kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stop=[stop], stream=True, **kwargs))
    ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ends == ["stop"], (stop, ends)  # the engine's late events are not sent on
    # Nothing a stop string later cuts was sent: the stream's text is the whole response's.
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_token_ids_in_and_out(client, server):
  status, tokens = post(server[0] + "/tokenize", {"prompt": QUESTION})
  assert status == 200 and tokens["tokens"] == TOKENIZER.encode(QUESTION)
  status, text = post(server[0] + "/detokenize", {"tokens": tokens["tokens"]})
  assert text["prompt"] == QUESTION
  ids = TOKENIZER.prompt_ids(SYSTEM, QUESTION)
  by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8,
                                     extra_body=IDS)
  by_chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                           max_tokens=8, extra_body=IDS)
  assert by_ids.choices[0].model_extra["token_ids"] == by_chat.choices[0].model_extra["token_ids"]
  assert client.models.list().data[0].id == MODEL


def test_sixty_four_concurrent_sessions_all_finish(server):
  async def main():
    client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
    calls = [client.chat.completions.create(model=MODEL, temperature=1.0, seed=i, max_tokens=12,
                                            messages=[{"role": "user", "content": f"Task {i}"}])
             for i in range(64)]
    return await asyncio.gather(*calls)

  results = asyncio.run(main())
  # Each ran to its length, or sampled the end token (a random model does now and then).
  assert all(r.usage.completion_tokens == 12 if r.choices[0].finish_reason == "length" else
             r.choices[0].finish_reason == "stop" for r in results)
  assert server[1].engine.in_flight == 0


def test_a_chats_next_request_reads_its_history_from_the_cache(client):
  """The assistant message the client got comes back (to be continued): its sampled ids are
  reused, not its text tokenized again, and none of the history is prefilled again; greedy,
  the two requests give what one request of their total length does."""
  kwargs = dict(model=MODEL, temperature=0, extra_body=IDS)
  first = client.chat.completions.create(messages=MESSAGES, max_tokens=10, **kwargs)
  history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content}]
  second = client.chat.completions.create(messages=history, max_tokens=4, **kwargs)
  first_ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
  assert second.model_extra["prompt_token_ids"] == first_ids
  assert second.usage.prompt_tokens_details.cached_tokens == len(first_ids)
  whole = client.chat.completions.create(messages=MESSAGES, max_tokens=14, **kwargs)
  assert (first.choices[0].model_extra["token_ids"] + second.choices[0].model_extra["token_ids"]
          == whole.choices[0].model_extra["token_ids"])


def test_the_error_matrix_answers_in_openais_shape_and_the_server_keeps_going(server):
  url = server[0] + "/v1/chat/completions"
  base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
  cases = [(b"{not json", 400), ({**base, "temperature": "hot"}, 400),
           ({**base, "messages": []}, 400), ({**base, "model": "gpt-9"}, 404),
           ({**base, "messages": [{"role": "user", "content": "x " * 400}]}, 400),
           ({**base, "max_tokens": 10_000}, 400),
           ({**base, "messages": [{"role": "assistant", "content": "hi"}]}, 400),
           ({**base, "tools": [{"type": "function", "function": {"name": "rm_rf"}}]}, 400),
           ({**base, "top_logprobs": 7, "logprobs": True}, 400),
           ({**base, "tool_choice": "none"}, 400),
           ({**base, "tool_choice": {"type": "function", "function": {"name": "code"}}}, 400)]
  for body, status in cases:
    got, answer = post(url, body)
    assert got == status, (body, answer)
    assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
  assert post(url, base)[0] == 200


def _wait_for(condition, timeout_s: float = 60.0) -> bool:
  """Returns whether `condition()` holds within `timeout_s` (polled)."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.05)
  return True


def test_a_full_queue_answers_429_and_shutdown_503(server):
  # An engine that is never started: nothing leaves its queue of one.
  weights, mesh = params()
  idle = Engine(CONFIG, mesh, weights, EngineSettings(slots=1, cache_size=64, max_queue=1), [])
  with served(idle) as (url, state):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    waiting = idle.submit(Request(TOKENIZER.prompt_ids(SYSTEM, QUESTION), max_tokens=4))
    status, answer = post(url + "/v1/chat/completions", body)
    assert status == 429 and answer["error"]["type"] == "rate_limit_error"
    state.closing = True
    assert post(url + "/v1/chat/completions", body)[0] == 503
    waiting.cancel()


def test_what_is_open_when_the_shutdown_grace_ends_finishes_with_length_at_once():
  # An engine that is never started stands for one still busy (compiling) at the grace's end.
  weights, mesh = params()
  idle = Engine(CONFIG, mesh, weights, EngineSettings(slots=2, cache_size=64, max_queue=2), [])
  with served(idle) as (url, state):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    ask = lambda stream: client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                        max_tokens=4, stream=stream)
    ends = {}
    asks = {"whole": lambda: ask(False).choices[0].finish_reason,
            "stream": lambda: [c.choices[0].finish_reason for c in ask(True) if c.choices][-1]}
    threads = [threading.Thread(target=lambda k=k: ends.update({k: asks[k]()})) for k in asks]
    for thread in threads:
      thread.start()
    assert _wait_for(lambda: idle.in_flight == 2)  # both queued before the grace ends
    state.closing = state.cut = True
    for thread in threads:
      thread.join(60)
  assert ends == {"whole": "length", "stream": "length"}


def test_a_client_that_leaves_mid_stream_frees_its_rows(server, client):
  stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0,
                                          max_tokens=140, stream=True)
  next(iter(stream))
  stream.close()
  engine = server[1].engine
  assert _wait_for(lambda: engine.in_flight == 0)  # (a round may compile a longer window first)


def test_a_completion_that_closes_a_tool_tag_is_a_tool_call():
  tools = [chat.Function("code", {"type": "object", "properties": {"source": {"type": "string"}}})]
  think = [TOKENIZER.tag_id("think")] + TOKENIZER.encode("\nadd\n") + [
      TOKENIZER.tag_id("think", close=True)]
  call = TOKENIZER.encode("\n") + [TOKENIZER.tag_id("code")] + TOKENIZER.encode(
      "\nprint(1)\n") + [TOKENIZER.tag_id("code", close=True)]
  reply = chat.reply(TOKENIZER, think + call, "stop", tools, "c1")
  assert reply.finish_reason == "tool_calls" and reply.content == TOKENIZER.decode(think + call[:1])
  assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"source": "print(1)"}
  # Sent back without its ids remembered, the message is tokenized to the same ids.
  messages = MESSAGES + [{"role": "assistant", "content": reply.content,
                          "tool_calls": reply.tool_calls},
                         {"role": "tool", "content": "1"}]
  tool_specs = [{"type": "function", "function": {"name": "code",
                                                  "parameters": tools[0].parameters}}]
  conversation = chat.prompt_ids(TOKENIZER, messages, tool_specs, SYSTEM, chat.Transcripts(), 64)
  response = conversation.ids[conversation.response_start:]
  assert response[:len(think + call)] == think + call
  assert TOKENIZER.decode(response[len(think + call):]) == "\n<observation>\n1\n</observation>"


def test_a_sessions_calls_are_recorded_with_the_ids_the_client_got(server):
  url, state = server
  client = openai.OpenAI(base_url=url + "/sessions/s1/v1", api_key="none", max_retries=0)
  # seeded: an unseeded sample may end on a stop token before its 6th (a CI run drew one at 2)
  kwargs = dict(model=MODEL, temperature=1.0, seed=0, max_tokens=6, extra_body=IDS)
  first = client.chat.completions.create(messages=MESSAGES, **kwargs)
  history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content}]
  streamed = list(client.chat.completions.create(messages=history, stream=True, **kwargs))
  calls = state.sessions.pop("s1")
  assert [len(c.completion_ids) for c in calls] == [6, 6] and state.sessions.pop("s1") == []
  assert list(calls[0].prompt_ids) == first.model_extra["prompt_token_ids"]
  assert list(calls[0].completion_ids) == first.choices[0].model_extra["token_ids"]
  assert list(calls[1].completion_ids) == [i for c in streamed if c.choices
                                           for i in c.choices[0].model_extra.get("token_ids", [])]
  assert calls[1].prompt_ids == calls[0].prompt_ids + calls[0].completion_ids
  assert calls[0].finish_reason == first.choices[0].finish_reason
  assert set(calls[0].versions) == {0} and len(calls[0].logprobs) == 6


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096 / 2**20


def test_a_thousand_requests_one_in_ten_bad_leak_nothing(server):
  """Rows, threads and memory stay flat over 1,000 requests of which 100 are bad (malformed,
  unknown model, too long), 50 at a time; the server answers every one."""
  url, state = server
  good = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
  bad = [b"{", {**good, "model": "x"}, {**good, "max_tokens": 10_000},
         {**good, "messages": [{"role": "tool", "content": "1"}]}]

  async def main():
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    loop = asyncio.get_running_loop()

    async def one(i):
      if i % 10 == 9:
        return (await loop.run_in_executor(None, post, url + "/v1/chat/completions",
                                           bad[i % len(bad)]))[0]
      await client.chat.completions.create(**good)
      return 200

    statuses = []
    for start in range(0, 1000, 50):
      statuses += await asyncio.gather(*(one(i) for i in range(start, start + 50)))
      if start == 100:  # warm: every program compiled, every pool started
        baseline = (threading.active_count(), _rss_mb())
    return statuses, baseline

  statuses, (threads, rss) = asyncio.run(main())
  assert statuses.count(200) == 900 and statuses.count(400) + statuses.count(404) == 100
  assert state.engine.in_flight == 0 and threading.active_count() <= threads
  assert _rss_mb() - rss < 50, (_rss_mb(), rss)
  assert post(url + "/v1/chat/completions", good)[0] == 200


def test_a_session_past_its_response_budget_ends_with_length_streamed_or_not(server):
  url, state = server
  state.session_response_tokens = 4
  try:
    client = openai.OpenAI(base_url=url + "/sessions/b1/v1", api_key="none", max_retries=0)
    kwargs = dict(model=MODEL, temperature=0, extra_body=IDS)
    first = client.chat.completions.create(messages=MESSAGES, max_tokens=50, **kwargs)
    # The budget caps what the program asked for.
    assert first.usage.completion_tokens == 4 and first.choices[0].finish_reason == "length"
    history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content}]
    again = client.chat.completions.create(messages=history, **kwargs)
    assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 0
    chunks = list(client.chat.completions.create(messages=history, stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "length"
  finally:
    state.session_response_tokens = 0
    state.sessions.pop("b1")
