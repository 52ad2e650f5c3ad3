"""Data: the CoA format, the embedded world and its tasks, rewards, tokenization and packing.

Nothing here depends on a later stage: distillation, SFT, rollouts, RL and evaluation read
these names.
"""

from coa_jax.data import prompts
from coa_jax.data.coa_format import FormatError, Step, Trajectory
from coa_jax.data.importers import DataError, DropCounter, read_trajectories
from coa_jax.data.packing import PipelineConfig, ShardedBatches, load_source
from coa_jax.data.rewards import Reward, Rewarder, build_rewarder
from coa_jax.data.sample_data import SAMPLE_PATH
from coa_jax.data.tasks import Task, load_tasks
from coa_jax.data.tokenize import tokenize_trajectory
from coa_jax.data.tokenizer import (CoATokenizer, TokenizerSettings, default_tokenizer,
                                    from_hf_folder, load_tokenizer)
from coa_jax.data.world import World, WorldConfig, load_tools_spec
