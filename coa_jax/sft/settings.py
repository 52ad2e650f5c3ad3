"""The SFT job's settings, typed: `sft_settings(config)` checks a config (configs/sft_tiny_cpu.py
shows every key) once, at the job's top; below it the job reads these, never the config."""

from __future__ import annotations

import dataclasses
from typing import Any

from coa_jax.data.packing import DataSettings
from coa_jax.data.tokenizer import TokenizerSettings
from coa_jax.model import ConfigError, ModelSettings
from coa_jax.runtime.checkpointing import CheckpointSettings
from coa_jax.runtime.settings import build
from coa_jax.runtime.sharding import MeshConfig
from coa_jax.train.loop import TrainSettings
from coa_jax.train.optimizer import OptimizerSettings


@dataclasses.dataclass(frozen=True)
class SFTSettings:
  """Everything an SFT run reads. `batch_size` rows of `seq_len` tokens a step over the whole
  mesh; `checkpoint` None: no checkpoints, no resume; `export_dir` "": no HF export; `sampling`:
  the export's generation defaults (None: the project's); `tools`: the tool spec whose tags a
  fresh tokenizer numbers (None: the four CoA tools); `topology` (experiments/aot_compile.py)
  and `xla_flags` (applied by the entry script before JAX starts) are read outside the job."""

  model: ModelSettings
  data: DataSettings
  batch_size: int
  seq_len: int
  optimizer: OptimizerSettings
  train: TrainSettings
  workdir: str
  seed: int = 0
  tokenizer: TokenizerSettings = TokenizerSettings()
  mesh: MeshConfig = MeshConfig()
  checkpoint: CheckpointSettings | None = None
  export_dir: str = ""
  export_dtype: str = "bfloat16"
  sampling: dict[str, Any] | None = None
  tools: dict[str, Any] | None = None
  topology: str = ""
  xla_flags: str = ""

  def __post_init__(self):
    if self.batch_size < 1 or self.seq_len < 1:
      raise ConfigError(f"batch_size={self.batch_size}, seq_len={self.seq_len}: expected >= 1")
    if self.export_dtype not in ("float32", "bfloat16", "float16"):
      raise ConfigError(f"export_dtype={self.export_dtype!r}: expected float32, bfloat16 or "
                        f"float16")


def sft_settings(config: Any, where: str = "sft") -> SFTSettings:
  """Returns an SFT config's settings; raises ConfigError naming `where`.key for an unknown key,
  a wrong type or a bad value."""
  return build(SFTSettings, config, where)
