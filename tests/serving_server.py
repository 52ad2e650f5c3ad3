"""A served tiny model for the API tests: a random-weight model over the project's tokenizer,
its engine and the OpenAI-compatible app in a uvicorn thread on a free local port."""

import contextlib

import jax

from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.model import build_config
from coa_jax.model.transformer import Transformer
from coa_jax.runtime import sharding
from coa_jax.serving.api import Server, ThreadServer, create_app
from coa_jax.serving.engine import Engine, EngineSettings

TOKENIZER = default_tokenizer("plain")
CONFIG = build_config({"preset": "tiny", "vocab_size": TOKENIZER.vocab_size,
                       "tie_embeddings": False})
MODEL = "tiny-coa"
SYSTEM = "Solve the question with tools: web_search, crawl_page, code."


def params(mesh=None):
  mesh = mesh or sharding.make_mesh(devices=jax.devices()[:1])
  return sharding.init_params(Transformer(CONFIG), mesh, jax.random.key(0)), mesh


@contextlib.contextmanager
def served(engine=None, **settings):
  """Yields (base_url, server) of an app over `engine` (default: a started engine with
  `settings`); stops both on exit."""
  if engine is None:
    weights, mesh = params()
    settings = {"slots": 16, "cache_size": 192, "chunk": 8, "max_top_logprobs": 5, **settings}
    engine = Engine(CONFIG, mesh, weights, EngineSettings(**settings),
                    stop_ids=[TOKENIZER.end_id]).start()
  server = Server(engine, TOKENIZER, MODEL, SYSTEM, max_observation_tokens=64, max_tokens=16)
  http = ThreadServer(create_app(server), timeout_graceful_shutdown=5)
  try:
    yield http.url, server
  finally:
    http.close()
    engine.close(drain=False, timeout=30)
