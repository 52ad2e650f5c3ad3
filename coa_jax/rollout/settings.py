"""What every job that runs the agent reads (rollout, evaluation, RL), typed, and the builders
those jobs share: the tokenizer, a model's parameters on this host's decode devices, the
sampler, the tools, the rollout engine.

`AgentSettings` holds the keys configs/rollout_tiny_cpu.py shows beside the job's own; each
job's settings extend it (`RolloutSettings` here, `coa_jax.evaluation.settings`,
`coa_jax.rl.settings`) and are built once, at the job's top, with `runtime.settings.build`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import Mesh

from coa_jax.data.tokenizer import CoATokenizer, TokenizerSettings, load_tokenizer
from coa_jax.model import ConfigError, ModelConfig, ModelSettings, Transformer
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, callable_tools, stop_ids
from coa_jax.runtime import distributed, sharding
from coa_jax.runtime.distributed import say
from coa_jax.runtime.hf_checkpoint import load_model
from coa_jax.runtime.settings import build
from coa_jax.runtime.sharding import MeshConfig
from tools_env.registry import ToolRegistry, build_registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentSettings:
  """The policy (`model`, `tokenizer`), the devices (`mesh`), the decode (`batch_size` rows over
  every host, `chunk` decode steps per device call, `sampling`), a rollout's limits
  (`rollout`), the tools (`tools`: tag -> {"kind": ..., options}, `tools_env.registry`), the
  system prompt and the seed. `topology` (experiments/aot_compile.py) and `xla_flags` (applied
  by the entry script before JAX starts) are read outside the job."""

  model: ModelSettings
  system_prompt: str
  batch_size: int
  tools: dict[str, Any]
  seed: int = 0
  tokenizer: TokenizerSettings = TokenizerSettings()
  mesh: MeshConfig = MeshConfig()
  chunk: int = 32
  sampling: SamplingConfig = SamplingConfig()
  rollout: RolloutConfig = RolloutConfig()
  topology: str = ""
  xla_flags: str = ""

  def __post_init__(self):
    if self.batch_size < 1 or self.chunk < 1:
      raise ConfigError(f"batch_size={self.batch_size}, chunk={self.chunk}: expected >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSettings(AgentSettings):
  """The rollout job's settings: the tasks (`tasks`, a JSONL file; the first `max_tasks`, 0:
  all), where the records go (`output_dir`) and how many samples are also written as text
  (`transcripts`)."""

  tasks: str
  output_dir: str
  max_tasks: int = 0
  transcripts: int = 4


def rollout_settings(config: Any, where: str = "rollout job") -> RolloutSettings:
  """Returns a rollout config's settings; raises ConfigError naming the key for an unknown key,
  a wrong type or a bad value."""
  return build(RolloutSettings, config, where)


# --- builders --------------------------------------------------------------------------------


def agent_tokenizer(settings: AgentSettings) -> CoATokenizer:
  """Returns the policy's tokenizer: the tags its checkpoint saved, else the declared tools'
  (agreed: a host that cannot load it stops every host)."""
  return distributed.agreed(lambda: load_tokenizer(settings.tokenizer, settings.model.checkpoint,
                                                   settings.tools), "loading the tokenizer")


def tools(settings: AgentSettings, tokenizer: CoATokenizer) -> ToolRegistry:
  """Returns the settings' tools, each one the model can call (agreed)."""
  return distributed.agreed(lambda: callable_tools(build_registry(settings.tools), tokenizer),
                            "building the tools")


def sampler(settings: AgentSettings, model_config: ModelConfig, host: Mesh,
            tokenizer: CoATokenizer, rollout: RolloutConfig | None = None) -> Sampler:
  """Returns the sampler of this host's decode mesh `host`: batch_size / hosts rows, the
  rollout's cache (`rollout`, default the settings'), stopping at the tool tags' ends.

  Jobs in one process that decode alike share one sampler (`shared_sampler`)."""
  _check_hosts(settings)
  rollout = rollout or settings.rollout
  return shared_sampler(model_config, host, settings.batch_size // jax.process_count(),
                        rollout.cache_size, settings.chunk, tuple(stop_ids(tokenizer)),
                        settings.sampling)


@functools.lru_cache(maxsize=4)
def shared_sampler(model_config: ModelConfig, host: Mesh, batch_size: int, cache_size: int,
                   chunk: int, stops: tuple[int, ...], sampling: SamplingConfig) -> Sampler:
  """Returns one `Sampler` per model, mesh, shapes, stops and sampling in this process: its
  jitted programs are traced and compiled once for all who decode alike (the main job's
  evaluation after DAPO runs the programs of the one after SFT; an experiment's evaluations
  over cells and seeds run each other's). With a fresh sampler, a run through the compilation
  cache still traced and lowered every program again: 11.4 s against 2.4 s for the same five
  tool-loop tasks on the tiny model (tests/test_rollout.py's; one run, beside another job). A sampler holds no arrays and
  no state between calls; its `compilations()` count every program it compiled for anyone."""
  return Sampler(model_config, host, batch_size=batch_size, cache_size=cache_size, chunk=chunk,
                 stop_ids=stops, sampling=sampling)


def _check_hosts(settings: AgentSettings) -> None:
  """Raises ConfigError unless the decode rows split evenly over the hosts."""
  if settings.batch_size % jax.process_count():
    raise ConfigError(f"batch_size={settings.batch_size} does not split over "
                      f"{jax.process_count()} hosts")


def engine(settings: AgentSettings, tokenizer: CoATokenizer,
           rollout: RolloutConfig | None = None) -> Rollout:
  """Returns the rollout engine of a trained policy (`settings.model.checkpoint`; empty: a
  freshly initialized model), its parameters on this host's devices; `rollout` replaces the
  settings' limits (the evaluation's k samples a task)."""
  rollout = rollout or settings.rollout
  _check_hosts(settings)  # before the model loads
  model_config, host, params = policy(settings, tokenizer)
  decode = sampler(settings, model_config, host, tokenizer, rollout)
  return Rollout(decode, decode.sampling_params(params), tokenizer, tools(settings, tokenizer),
                 rollout, settings.system_prompt, seed=settings.seed)


def policy(settings: AgentSettings, tokenizer: CoATokenizer) -> tuple[ModelConfig, Mesh, Any]:
  """Returns a trained policy (`settings.model.checkpoint`; empty: a freshly initialized model):
  its config, this host's decode mesh and its parameters there."""
  mesh = sharding.make_mesh(settings.mesh)
  model_config, params = distributed.agreed(lambda: load_model(settings.model, tokenizer, mesh),
                                           "loading the model")
  if params is None:
    say("model.checkpoint is empty: a freshly initialized (untrained) model")
    params = sharding.init_params(Transformer(model_config), mesh, jax.random.key(settings.seed))
  host = sharding.host_mesh(mesh)
  params = sharding.to_host_mesh(params, mesh, host,
                                 sharding.param_shardings(Transformer(model_config), host))
  return model_config, host, params
