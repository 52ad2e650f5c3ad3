"""Serve the main job's model (after `make pipeline`) behind the OpenAI-compatible API, on a CPU.

`make serve` (or `MODEL=<dir>`: a coa-jax export or a local HF checkpoint folder) reads the
model's shape from its checkpoint and, when the run that trained it saved them there
(`coa_evaluation.json`), its tokenizer, tools, system prompt, sampling and rollout limits.
"""

import ml_collections

from coa_jax.data import prompts
from configs import common
from tools_env import default_spec


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = common.model("tiny")
  config.model.checkpoint = "runs/pipeline_tiny/seed-0/dapo/hf_export"
  config.tokenizer = common.tokenizer("default", "plain")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.system_prompt = prompts.WORLD  # a request that declares no tools and brings no prompt
  config.batch_size = 64  # rows decoded together: requests join and leave between chunks
  config.chunk = 16  # decode steps per round
  config.sampling = common.sampling()
  # A row holds max_prompt_tokens + max_response_tokens (a chat's history and its next turn);
  # a tool result becomes an observation of at most max_observation_tokens.
  config.rollout = common.rollout(
      group_size=1, max_prompt_tokens=512, max_response_tokens=512, max_turns=12,
      max_observation_tokens=256, tool_workers=1, tool_timeout_s=60.0)
  config.tools = default_spec()  # the tool tags a request may declare (run on the client's side)
  config.host, config.port = "127.0.0.1", 8000
  config.model_name = ""  # default: the model folder
  config.max_queue = 256  # waiting requests; one more gets 429
  config.max_top_logprobs = 5
  config.prefix_cache = True  # a chat's next turn reads its history from the cache
  config.max_tokens = 512  # a request's default max_tokens
  config.shutdown_grace_s = 30.0  # on SIGTERM, how long in-flight requests may take to finish
  return config
