"""Every shipped config loads, and the real (pod and GPU-node) ones split their batches over
their meshes; every SFT and distillation config builds its typed settings, command-line
overrides reach them, and a bad value is an error naming its key."""

import importlib
import os

import pytest
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from coa_jax.model import ConfigError, ModelSettings, build_config
from coa_jax.runtime import cli, hardware, load_model, sharding
from coa_jax.distill.job import distill_settings
from coa_jax.sft.settings import sft_settings
from configs import distill_tiny, pipeline_tiny_cpu, sft_tiny_cpu

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
    load_model(ModelSettings.from_section(config.model), None, mesh)  # the folder: next


def test_config_paths_through_python_keywords_parse_on_the_command_line():
  argv = ["prog", "--config.rl.async.staleness=2", "--config.rl.eps_high=0.3", "--seeds=3"]
  assert cli.config_argv(argv) == ["prog", "--config.rl['async'].staleness=2",
                                   "--config.rl.eps_high=0.3", "--seeds=3"]
  assert config_path.split("rl['async'].staleness") == ("rl", "async", "staleness")


SFT = [n for n in NAMES if n.startswith("sft_")]


@pytest.mark.parametrize("name", SFT)
def test_every_sft_config_builds_its_settings(name):
  settings = sft_settings(importlib.import_module(f"configs.{name}").get_config())
  assert settings.train.steps > 0 and settings.model.preset


@pytest.mark.parametrize("name", ["pipeline_tiny_cpu", "pipeline_sql_cpu",
                                  "pipeline_distractors_cpu"])
def test_every_pipeline_builds_its_stages_settings(name):
  recipe = importlib.import_module(f"configs.{name}")
  stage_configs = getattr(recipe, "stage_configs", pipeline_tiny_cpu.stage_configs)
  for config in (recipe.get_config(), pipeline_tiny_cpu.quick(recipe.get_config())):
    stages = stage_configs(config)
    assert sft_settings(stages["sft"]).seq_len > 0
    assert distill_settings(stages["distill"]).workers > 0


def test_the_distill_config_builds_its_settings():
  assert distill_settings(distill_tiny.get_config()).world.entities == 300


def test_command_line_overrides_reach_the_sft_settings():
  argv = ["experiments/sft.py", f"--config={sft_tiny_cpu.__file__}",
          "--config.optimizer.warmup_steps=7", "--config.data.upsample_by=family",
          "--config.model.num_layers=3"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  settings = sft_settings(values.config)
  assert (settings.optimizer.warmup_steps, settings.data.upsample_by) == (7, "family")
  assert settings.model.fresh_config().num_layers == 3


@pytest.mark.parametrize("key,value,message", [
    ("optimizer.warmup_step", 7, r"sft\.optimizer: unknown key\(s\) sft\.optimizer\.warmup_step"),
    ("batch_size", "8", r"sft\.batch_size='8': expected an integer"),
    ("data.overlong", "wrap", r"sft\.data: overlong='wrap': expected one of"),
    ("model.num_layerz", 3, r"sft\.model: unknown key\(s\) sft\.model\.num_layerz"),
    ("model.num_heads", 3, r"sft\.model: num_heads=3 is not a multiple of num_kv_heads=2"),
])
def test_a_bad_sft_value_is_an_error_naming_its_key(key, value, message):
  with pytest.raises(ConfigError, match=message):
    sft_settings(_with(sft_tiny_cpu.get_config(), key, value))


@pytest.mark.parametrize("key,value,message", [
    ("world.entitys", 3, r"distill\.world: unknown key\(s\) distill\.world\.entitys"),
    ("workers", 2.5, r"distill\.workers=2\.5: expected an integer"),
    ("teacher.misread_rate", 2.0, r"distill\.teacher: teacher\.misread_rate must be in \[0, 1\]"),
])
def test_a_bad_distill_value_is_an_error_naming_its_key(key, value, message):
  with pytest.raises(ConfigError, match=message):
    distill_settings(_with(distill_tiny.get_config(), key, value))


def _with(config, key: str, value):
  """Returns `config` with the dotted `key` set to `value`, whatever its type."""
  section, names = config, key.split(".")
  for name in names[:-1]:
    section = section[name]
  with section.ignore_type():
    section[names[-1]] = value
  return config
