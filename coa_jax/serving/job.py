"""The serving job (`make serve`): a trained model behind the OpenAI-compatible API.

`run(config)` builds the typed `ServeSettings` once, loads the policy on the config's mesh
(`rollout.settings.policy`), starts the engine and serves the app with uvicorn. On SIGTERM (or
Ctrl-C) it stops taking requests (a new one gets 503), lets what is in flight finish for up to
`shutdown_grace_s`, then ends the rest at once, even while the engine is busy (each response
gets its last chunk, finish reason "length", and a stream its `[DONE]`), and returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any

import uvicorn

from coa_jax.model import ConfigError
from coa_jax.rollout.settings import AgentSettings, agent_tokenizer, policy
from coa_jax.rollout.tool_loop import stop_ids
from coa_jax.runtime.distributed import say
from coa_jax.runtime.settings import build
from coa_jax.serving.api import Server, create_app
from coa_jax.serving.engine import Engine, EngineSettings

# How long after the grace uvicorn waits before it cancels the connections still open: every
# request ends at the grace's end (`Server.cut`), and its response needs a moment to flush.
CUT_MARGIN_S = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeSettings(AgentSettings):
  """The served policy and its engine: `batch_size` rows decoded together (requests join and
  leave them between chunks of `chunk` tokens), each of `rollout.cache_size` tokens (prompt and
  completion); `max_queue` requests may wait. `model_name` (default: the model folder) is what
  clients put in `model`; `max_tokens` is a request's default."""

  host: str = "127.0.0.1"
  port: int = 8000
  model_name: str = ""
  max_queue: int = 256
  max_top_logprobs: int = 5
  prefix_cache: bool = True
  max_tokens: int = 1024
  shutdown_grace_s: float = 30.0

  def __post_init__(self):
    super().__post_init__()
    if not 0 <= self.port < 65536:
      raise ConfigError(f"port={self.port}: expected 0..65535")
    if self.shutdown_grace_s < 0:
      raise ConfigError(f"shutdown_grace_s={self.shutdown_grace_s}: expected >= 0")
    self.engine  # checks the engine's own values (max_queue, max_top_logprobs)

  @property
  def engine(self) -> EngineSettings:
    return EngineSettings(slots=self.batch_size, cache_size=self.rollout.cache_size,
                          chunk=self.chunk, max_queue=self.max_queue,
                          max_top_logprobs=self.max_top_logprobs,
                          prefix_cache=self.prefix_cache, seed=self.seed)

  @property
  def served_name(self) -> str:
    return self.model_name or self.model.checkpoint or "coa-jax-untrained"


def serve_settings(config: Any) -> ServeSettings:
  """Returns a serving config's settings; raises ConfigError naming a bad key."""
  return build(ServeSettings, config, "serving job")


def server(settings: ServeSettings) -> Server:
  """Returns the API's state over a started engine of the settings' policy."""
  tokenizer = agent_tokenizer(settings)
  model_config, mesh, params = policy(settings, tokenizer)
  engine = Engine(model_config, mesh, params, settings.engine, stop_ids(tokenizer)).start()
  return Server(engine, tokenizer, settings.served_name, settings.system_prompt,
                settings.rollout.max_observation_tokens, settings.max_tokens)


class _Uvicorn(uvicorn.Server):
  """uvicorn, telling the API to refuse new requests (503) the moment a signal stops it, and
  the engine to end what is still in flight `grace_s` later; says where it serves once it
  listens (the port it got, where the settings' is 0)."""

  def __init__(self, config: uvicorn.Config, state: Server, grace_s: float):
    super().__init__(config)
    self.state, self.grace_s = state, grace_s

  async def startup(self, sockets=None):
    await super().startup(sockets)
    if self.started:
      _say_where(self.state, self.config.host, self.servers[0].sockets[0].getsockname()[1])

  def handle_exit(self, sig, frame):
    if not self.state.closing:
      cut = threading.Timer(self.grace_s, self._cut)
      cut.daemon = True
      cut.start()
    self.state.closing = True
    super().handle_exit(sig, frame)

  def _cut(self) -> None:
    """The grace is over: every open request ends now (the API's, within its poll) and the
    engine stops decoding."""
    self.state.cut = True
    self.state.engine.close(drain=False)

  @contextlib.contextmanager
  def capture_signals(self):
    """uvicorn's, less raising the signal again after the shutdown: its default action would
    kill the process before the engine is closed."""
    with super().capture_signals():
      try:
        yield
      finally:
        self._captured_signals.clear()


def _say_where(state: Server, host: str, port: int) -> None:
  url = f"http://{host}:{port}/v1"
  engine = state.engine.settings
  say(f"serving {state.model_name!r} ({engine.slots} rows of {engine.cache_size} tokens) at "
      f"{url}\n"
      f"  curl {url}/chat/completions -H 'Content-Type: application/json' -d "
      f"'{{\"model\": \"{state.model_name}\", \"messages\": [{{\"role\": \"user\", "
      f"\"content\": \"What is the population of City 12?\"}}]}}'\n"
      f"  Python: openai.OpenAI(base_url=\"{url}\", api_key=\"none\")")


def run(config: Any) -> None:
  settings = serve_settings(config)
  state = server(settings)
  http = _Uvicorn(uvicorn.Config(create_app(state), host=settings.host, port=settings.port,
                                 log_level="warning",
                                 timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s)
                                 + CUT_MARGIN_S),
                  state, settings.shutdown_grace_s)
  try:
    http.run()
  finally:
    state.closing = True
    state.engine.close(drain=False, timeout=60)
    say(f"served {state.engine.stats['rounds']} rounds, {state.engine.stats['tokens']} tokens; "
        f"stopped")

