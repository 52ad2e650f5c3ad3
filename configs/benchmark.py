"""The evaluation settings of `experiments/benchmark.py` (the paper's benchmarks on a trained
model): decoding, rollout limits, tools and the system prompt. The command sets the model, each
benchmark's tasks, k, rewards and output folder; any value here is overridable
(--config.rollout.max_response_tokens=16384)."""

import ml_collections

from coa_jax.data import prompts
from configs import common
from tools_env import default_spec


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.system = "model"
  # Numerics only: the architecture is the checkpoint's (config.json of --model).
  config.model = common.model("tiny")
  config.model.checkpoint = ""  # --model
  # "auto": the model folder's tokenizer when it has one (template chatml), else the built-in
  # one (template plain), as the tiny configs train with.
  config.tokenizer = common.tokenizer("auto", "auto")
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  config.tasks = ""  # each benchmark's
  config.max_tasks = 0
  config.copy_probe = ""
  config.k = 1
  config.system_prompt = prompts.AGENT
  config.batch_size = 16  # decode rows (rounded down to whole groups of k)
  config.chunk = 64
  config.sampling = common.sampling()
  config.rollout = common.rollout(
      group_size=1, max_prompt_tokens=4096, max_response_tokens=12288, max_turns=32,
      max_observation_tokens=2048, tool_workers=16, tool_timeout_s=120.0)
  # The embedded search and crawl and the code sandbox: replace the search and crawl with serper
  # and http_crawl (tools_env.registry) for the web benchmarks (GAIA, HLE, BrowseComp).
  config.tools = default_spec()
  config.rewards = ml_collections.ConfigDict()  # each benchmark's grader (benchmark_files)
  config.output_dir = "runs/benchmark"  # --output_dir
  return config
