"""The OpenAI-compatible HTTP API over the serving engine (FastAPI; run it with uvicorn).

Endpoints: `/v1/chat/completions` and `/v1/completions` (streaming over server-sent events or
not), `/v1/models`, `/health`, `/tokenize` and `/detokenize`. Beyond OpenAI's fields, as vLLM:
`top_k`, and `return_token_ids` (the prompt's ids and each choice's sampled ids in the
response); `/v1/completions` also takes its prompt as token ids. Every error has OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) and its status: 400 a bad request (malformed
JSON, wrong types, a prompt past the context), 404 an unknown model, 429 a full queue, 503 while
shutting down, 500 anything else; no request takes the server down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Literal

import fastapi
import pydantic
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from coa_jax.data.tokenizer import CoATokenizer
from coa_jax.rollout.sampler import SamplingConfig
from coa_jax.serving import chat
from coa_jax.serving.choices import ChatChoices, TextChoices
from coa_jax.serving.engine import Engine
from coa_jax.serving.requests import (CANCELLED, DEADLINE, ERROR, STOP, EngineError, Finished,
                                      Handle, Request, Sample, ShuttingDown)
from coa_jax.serving.sessions import Call, Sessions

# How often a request waiting for the engine checks that its client is still there and that the
# server's shutdown grace has not run out.
POLL_S = 0.5
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


class _Sampling(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="ignore")  # clients send fields we do not use

  model: str
  temperature: float = pydantic.Field(1.0, ge=0.0, le=2.0)
  top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
  top_k: int = pydantic.Field(0, ge=0)
  max_tokens: int | None = pydantic.Field(None, ge=1)
  n: int = pydantic.Field(1, ge=1, le=128)
  stop: str | list[str] | None = None
  seed: int | None = None
  stream: bool = False
  stream_options: dict | None = None
  return_token_ids: bool = False


class ChatRequest(_Sampling):
  messages: list[dict] = pydantic.Field(min_length=1)
  tools: list[dict] | None = None
  # The model decides whether to call a tool (its tags are in its text): "none", "required" or
  # a named function would be a promise this server cannot keep, so they are refused.
  tool_choice: Literal["auto"] | None = None
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
  prompt: str | list[int] = pydantic.Field(min_length=1)
  logprobs: int | None = pydantic.Field(None, ge=0, le=20)
  echo: Literal[False] = False


@dataclasses.dataclass
class Server:
  """What the API serves: the engine, the model's tokenizer and name, the system prompt of a
  request that declares no tools and brings none (the one the model was trained with)."""

  engine: Engine
  tokenizer: CoATokenizer
  model_name: str
  system_prompt: str
  max_observation_tokens: int = 1024
  max_tokens: int = 1024  # a request's default max_tokens (at most what its context leaves)
  transcripts: chat.Transcripts = dataclasses.field(default_factory=chat.Transcripts)
  sessions: Sessions = dataclasses.field(default_factory=Sessions)
  # An RL trainer's sessions (`serving.agent`): the row seed of a session's calls that bring
  # none, the sampling every call uses (the policy the update assumes; None: the request's),
  # and each session's response budget past its first prompt (0: none), as a rollout's.
  session_seeds: dict[str, int] = dataclasses.field(default_factory=dict)
  session_sampling: SamplingConfig | None = None
  session_response_tokens: int = 0
  closing: bool = False  # a signal stopped the server: new requests get 503
  cut: bool = False  # its grace is over: what is still open ends now ("length"), within POLL_S


class ThreadServer:
  """An app served by uvicorn in a thread of this process (an RL trainer's endpoint, tests,
  benchmarks); `port` 0 takes a free one. `url` is its base URL, `close` stops it."""

  def __init__(self, app: fastapi.FastAPI, host: str = "127.0.0.1", port: int = 0, **options):
    self._http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                               **options))
    self._thread = threading.Thread(target=self._http.run, name="http", daemon=True)
    self._thread.start()
    while not self._http.started:
      if not self._thread.is_alive():
        raise RuntimeError(f"the server did not start on {host}:{port}")
      time.sleep(0.01)
    self.url = f"http://{host}:{self._http.servers[0].sockets[0].getsockname()[1]}"

  def close(self, timeout: float = 10) -> None:
    self._http.should_exit = True
    self._thread.join(timeout)


def error(status: int, message: str, code: str | None = None) -> JSONResponse:
  body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                    "param": None, "code": code}}
  return JSONResponse(body, status_code=status)


def create_app(server: Server) -> fastapi.FastAPI:
  app = fastapi.FastAPI(title="coa-jax", docs_url=None, redoc_url=None)
  tokenizer, engine = server.tokenizer, server.engine

  @app.exception_handler(RequestValidationError)
  async def invalid(_, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return error(400, f"{where}: {first.get('msg', 'invalid request')}" if where
                 else first.get("msg", "invalid request"))

  @app.exception_handler(HTTPException)
  async def http_error(_, e: HTTPException):
    return error(e.status_code, str(e.detail))

  @app.exception_handler(EngineError)
  async def refused(_, e: EngineError):
    return error(e.status, str(e))

  @app.exception_handler(Exception)
  async def failed(_, e: Exception):
    return error(500, f"{type(e).__name__}: {e}")

  def check(request: _Sampling) -> None:
    if server.closing:
      raise ShuttingDown("the server is shutting down")
    if request.model != server.model_name:
      raise HTTPException(404, f"the model {request.model!r} does not exist; this server serves "
                               f"{server.model_name!r}")

  @app.get("/health")
  async def health():
    if server.closing or engine.error:
      return error(503, engine.error or "shutting down")
    return {"status": "ok", "in_flight": engine.in_flight}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                        "created": 0, "owned_by": "coa-jax",
                                        "max_model_len": engine.settings.cache_size}]}

  @app.post("/tokenize")
  async def tokenize(body: dict):
    if "messages" in body:
      ids = chat.prompt_ids(tokenizer, body["messages"], body.get("tools"), server.system_prompt,
                            server.transcripts, server.max_observation_tokens).ids
    elif isinstance(body.get("prompt"), str):
      ids = tokenizer.encode(body["prompt"])
    else:
      return error(400, "give `prompt` (a string) or `messages`")
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.settings.cache_size}

  @app.post("/detokenize")
  async def detokenize(body: dict):
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size
                                            for i in ids):
      return error(400, f"`tokens` must be a list of token ids in [0, {tokenizer.vocab_size})")
    return {"prompt": tokenizer.decode(ids)}

  # The completions, also under a session's path (`/sessions/<id>/v1/...`): an agent program
  # whose base URL names its session has every call recorded for RL (`Server.sessions`).
  completions_api = fastapi.APIRouter()

  @completions_api.post("/v1/chat/completions")
  async def chat_completions(body: ChatRequest, http: fastapi.Request):
    check(body)
    session = http.path_params.get("session")
    conversation = chat.prompt_ids(tokenizer, body.messages, body.tools, server.system_prompt,
                                   server.transcripts, server.max_observation_tokens,
                                   session or "")
    top = (body.top_logprobs or 0) if body.logprobs else 0
    job = _Job(server, body, conversation.ids, body.max_completion_tokens or body.max_tokens, top,
               session)
    return await job.respond(http, ChatChoices(server, conversation, body))

  @completions_api.post("/v1/completions")
  async def completions(body: CompletionRequest, http: fastapi.Request):
    check(body)
    ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    job = _Job(server, body, ids, body.max_tokens, body.logprobs or 0,
               http.path_params.get("session"))
    return await job.respond(http, TextChoices(server, body))

  app.include_router(completions_api)
  app.include_router(completions_api, prefix="/sessions/{session}")
  return app


@dataclasses.dataclass
class _Sample(Sample):
  """One choice as it arrives, cut at a stop string; `finish_reason` is the client's once
  streamed ("tool_calls" for a call)."""

  reason: str = ""  # the engine's, or "stop" at a stop string
  sent: int = 0  # tokens already streamed


class _Job:
  """One request's run through the engine: submits it, collects or streams its samples."""

  def __init__(self, server: Server, body: _Sampling, prompt: list[int], max_tokens: int | None,
               top_logprobs: int, session: str | None):
    self.server, self.body, self.prompt, self.session = server, body, prompt, session
    self.stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    # What a stream holds back of an unfinished sample (`choices.new_text`).
    self.hold = max(map(len, self.stops), default=1) - 1
    sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
    self.samples = [_Sample() for _ in range(body.n)]
    self.id = f"{uuid.uuid4().hex[:24]}"
    self.created = int(time.time())
    context = server.engine.settings.cache_size
    room, row_seeds = context - len(prompt), None
    if session:  # an RL trainer's session: its sampling, its row seed, its token budget
      sampling = server.session_sampling or sampling
      seed = server.session_seeds.get(session)
      if seed is not None and body.seed is None and body.n == 1:
        row_seeds = [seed]
      if server.session_response_tokens:
        budget = server.sessions.budget(session, len(prompt), server.session_response_tokens)
        room = min(room, budget - len(prompt))
        if room < 1:  # the conversation has used its budget: it ends here, as a rollout does
          self.prompt, self.request = prompt[:budget], None
          for sample in self.samples:
            sample.reason = "length"
          return
        max_tokens = min(max_tokens or room, room)  # the budget caps what a program asks
    if room < 1 or (max_tokens or 1) > room:
      raise EngineError(f"the prompt's {len(prompt)} tokens and max_tokens={max_tokens} exceed "
                        f"the model's context of {context} tokens")
    self.request = Request(prompt, max_tokens or min(server.max_tokens, room), sampling, body.n,
                           body.seed, top_logprobs=top_logprobs, row_seeds=row_seeds)

  async def respond(self, http: fastapi.Request, choices) -> Any:
    if self.request is None:  # nothing to sample: the session's budget is spent
      response = choices.response(self, None)
      self._record(response)
      if not self.body.stream:
        return response
      end = choices.chunk(self, [choices.delta(self, i) for i in range(self.body.n)])
      return StreamingResponse(iter([_sse(end), "data: [DONE]\n\n"]),
                               media_type="text/event-stream")
    events: asyncio.Queue = asyncio.Queue()
    handle = self.server.engine.submit(self.request, _into(events))
    if self.body.stream:
      return StreamingResponse(self._stream(http, handle, events, choices),
                               media_type="text/event-stream")
    try:
      while self._open() and not self._cut():
        try:
          event = await asyncio.wait_for(events.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
          if await http.is_disconnected():
            handle.cancel()
            return error(499, "the client disconnected")
          continue
        self._take(event, handle)
    finally:
      handle.cancel()  # a no-op once every sample finished
    self._check_failed()
    response = choices.response(self, handle)
    self._record(response)
    return response

  async def _stream(self, http: fastapi.Request, handle: Handle, events: asyncio.Queue,
                    choices) -> AsyncIterator[str]:
    try:
      yield _sse(choices.chunk(self, [choices.first_delta(self, i) for i in range(self.body.n)]))
      while self._open():
        if cut := self._cut():
          yield _sse(choices.chunk(self, [choices.delta(self, i) for i in cut]))
          break
        try:
          event = await asyncio.wait_for(events.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
          continue
        if self._take(event, handle):
          yield _sse(choices.chunk(self, [choices.delta(self, event.sample)]))
      self._check_failed()
      self._record(None)
      if (self.body.stream_options or {}).get("include_usage"):
        yield _sse({**choices.chunk(self, []), "usage": self.usage(handle)})
      yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the client learns why its stream ends
      yield _sse(json.loads(error(500, f"{type(e).__name__}: {e}").body))
    finally:
      handle.cancel()  # the client left mid-stream, or the stream ended: the rows are freed

  def _record(self, response: dict | None) -> None:
    """Records each choice as a call of the request's session (if its path names one), with
    the finish reason the client got."""
    session = self.session
    if not session:
      return
    for index, sample in enumerate(self.samples):
      reason = (response["choices"][index]["finish_reason"] if response else
                sample.finish_reason or sample.reason)
      self.server.sessions.record(session, Call(tuple(self.prompt), tuple(sample.ids),
                                                tuple(sample.logprobs), tuple(sample.versions),
                                                reason))

  def _cut(self) -> list[int]:
    """Once the server's shutdown grace is over, ends the samples still open ("length", as
    the engine's own cut would: it may be busy) and returns their indices; else none."""
    if not self.server.cut:
      return []
    cut = [i for i, sample in enumerate(self.samples) if not sample.reason]
    for i in cut:
      self.samples[i].reason = "length"
    return cut

  def _open(self) -> bool:
    """Whether a sample has not ended here: the loops run until each has its reason (the
    engine's Finished, a stop string, the shutdown's cut), not until the handle is done, which
    it is on the engine's thread before its last event reaches this loop's queue."""
    return any(not sample.reason for sample in self.samples)

  def _take(self, event: Any, handle: Handle) -> bool:
    """Takes an engine event into its sample; returns False for one dropped (its sample had
    ended here at a stop string), which a stream does not send on."""
    sample = self.samples[event.sample]
    if sample.reason:
      return False
    if isinstance(event, Finished):  # cancelled by the shutdown: cut short, as at a deadline
      cut = "length" if self.server.closing else "stop"
      sample.reason = {CANCELLED: cut, DEADLINE: "length"}.get(event.reason, event.reason)
      return True
    sample.ids += event.ids
    sample.logprobs += event.logprobs
    sample.versions += [event.version] * len(event.ids)
    sample.top += event.top
    if self.stops:
      cut = self._stop_at(sample.ids)
      if cut is not None:
        del sample.ids[cut:], sample.logprobs[cut:], sample.versions[cut:], sample.top[cut:]
        sample.reason = STOP
        handle.cancel(event.sample)
    return True

  def _stop_at(self, ids: list[int]) -> int | None:
    """Returns how many tokens a sample keeps when its text holds a stop string: up to the
    token that completes the first one (the text is cut before it); None when none does."""
    text = self.server.tokenizer.decode(ids)
    if not any(stop in text for stop in self.stops):
      return None
    return next(k for k in range(1, len(ids) + 1)
                if any(s in self.server.tokenizer.decode(ids[:k]) for s in self.stops))

  def text(self, ids: list[int]) -> str:
    """The text of ids: the end token dropped, cut before the first stop string."""
    tokenizer = self.server.tokenizer
    if ids and ids[-1] == tokenizer.end_id:
      ids = ids[:-1]
    text = tokenizer.decode(ids)
    cuts = [text.find(s) for s in self.stops if s in text]
    return text[:min(cuts)] if cuts else text

  def _check_failed(self) -> None:
    if any(s.reason == ERROR for s in self.samples):
      raise RuntimeError(f"the engine failed: {self.server.engine.error}")

  def envelope(self, prefix: str, kind: str, choices: list[dict], usage: dict | None = None,
               prompt: bool = True) -> dict:
    """A response (with its `usage`) or a stream chunk around `choices`; with
    `return_token_ids`, the prompt's ids where `prompt` (a response, a stream's first chunk)."""
    out = {"id": f"{prefix}-{self.id}", "object": kind, "created": self.created,
           "model": self.server.model_name, "choices": choices}
    if usage is not None:
      out["usage"] = usage
    if self.body.return_token_ids and prompt:
      out["prompt_token_ids"] = self.prompt
    return out

  def usage(self, handle: Handle | None) -> dict:
    completion = sum(len(s.ids) for s in self.samples)
    return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": handle.cached_tokens if handle else 0}}

  def token_logprobs(self, sample: _Sample, start: int, end: int) -> list[dict]:
    """OpenAI's chat `logprobs.content` entries of tokens [start, end)."""
    tokenizer, out = self.server.tokenizer, []
    for k in range(start, end):
      entry = _token_entry(tokenizer, sample.ids[k], sample.logprobs[k])
      entry["top_logprobs"] = [_token_entry(tokenizer, i, lp) for i, lp in
                               (sample.top[k] if k < len(sample.top) else [])]
      out.append(entry)
    return out


def _token_entry(tokenizer: CoATokenizer, token: int, logprob: float) -> dict:
  text = tokenizer.decode([token])
  return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


def _into(events: asyncio.Queue) -> Callable[[Any], None]:
  """Returns the engine thread's callback that puts its events into `events` on this event
  loop; once the loop has closed (the server stopped), nobody is listening: they are dropped."""
  loop = asyncio.get_running_loop()

  def put(event: Any) -> None:
    try:
      loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:
      if not loop.is_closed():
        raise

  return put
