"""Every shipped config loads, and the real (pod and GPU-node) ones split their batches over
their meshes."""

import importlib
import os

import pytest
from ml_collections.config_flags import config_path

from coa_jax.model import ConfigError, build_config
from coa_jax.runtime import cli, hardware, load_model, sharding

NAMES = sorted(f[:-3] for f in os.listdir(os.path.join(os.path.dirname(__file__), "..",
                                                       "configs"))
               # experiments.py: the named sweeps over the main job's config (test_experiments)
               if f.endswith(".py") and f not in ("__init__.py", "common.py", "experiments.py"))
REAL = [n for n in NAMES if "qwen" in n]


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_and_its_models_build(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  models = [config.model] if "model" in config else list(config.get("models", {}).values())
  assert models or "world" in config
  for model in models:
    assert build_config(model).num_params() > 0


@pytest.mark.parametrize("name", REAL)
def test_real_config_batches_split_over_its_mesh(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  devices = hardware.chips_in_topology(config.topology)  # h100:8 is 8 GPUs, v5p:2x2x1 4 chips
  data, fsdp, _ = sharding.MeshConfig(**config.mesh).resolve(devices)
  if "rl" in config:
    rows, micro = config.rl.mini_batch_groups * config.rollout.group_size, config.rl.micro_batches
  else:
    rows, micro = config.batch_size, config.train.micro_batches
  assert rows % micro == 0 and (rows // micro) % (data * fsdp) == 0
  if name.endswith("_gpu"):
    assert config.model.attention_impl == "cudnn"


def test_a_gpu_preset_on_cpu_fails_before_the_checkpoint_loads():
  config = importlib.import_module("configs.sft_qwen2_5_7b_gpu").get_config()
  mesh = sharding.make_mesh(sharding.MeshConfig(**config.mesh))
  with pytest.raises(ConfigError, match="'cudnn' needs a GPU backend, but the model runs on 'cpu'"):
    load_model(config, None, mesh)  # the checkpoint folder would be read next


def test_config_paths_through_python_keywords_parse_on_the_command_line():
  argv = ["prog", "--config.rl.async.staleness=2", "--config.rl.eps_high=0.3", "--seeds=3"]
  assert cli.config_argv(argv) == ["prog", "--config.rl['async'].staleness=2",
                                   "--config.rl.eps_high=0.3", "--seeds=3"]
  assert config_path.split("rl['async'].staleness") == ("rl", "async", "staleness")
