"""Every shipped config loads, and the real (pod and GPU-node) ones split their batches over
their meshes; every job's config builds its typed settings (every stage of every pipeline
too), command-line overrides reach them, and a bad value is an error naming its key."""

import importlib
import os

import pytest
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from coa_jax.distill.job import distill_settings
from coa_jax.evaluation.settings import evaluation_settings
from coa_jax.model import ConfigError, ModelSettings, build_config
from coa_jax.perf import pod_fit
from coa_jax.pipeline import Stages
from coa_jax.rl.settings import rl_settings
from coa_jax.rollout.settings import rollout_settings
from coa_jax.runtime import cli, hardware, load_model, sharding
from coa_jax.runtime.settings import build, to_section
from coa_jax.serving.job import serve_settings
from coa_jax.sft.settings import sft_settings
from coa_jax.train import lm_demo
from configs import (aot_train, dapo_tiny_cpu, demo_tiny, distill_tiny, evaluate_tiny,
                     pipeline_tiny_cpu, rollout_tiny_cpu, serve_tiny_cpu, sft_tiny_cpu)

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


# Each job's configs, by the prefix of their names, and the job's settings builder.
JOBS = {"sft_": sft_settings, "dapo_": rl_settings, "ppo_": rl_settings,
        "rollout_": rollout_settings, "evaluate_": evaluation_settings,
        "distill_": distill_settings, "aot_": pod_fit.run_settings,
        "demo_": lm_demo.demo_settings, "serve_": serve_settings}
JOB_CONFIGS = [(n, job) for n in NAMES for prefix, job in JOBS.items() if n.startswith(prefix)]


@pytest.mark.parametrize("name,job", JOB_CONFIGS, ids=[n for n, _ in JOB_CONFIGS])
def test_every_job_config_builds_its_settings(name, job):
  """... and the settings turned back into a section (`to_section`) build the same again."""
  settings = job(importlib.import_module(f"configs.{name}").get_config())
  assert build(type(settings), to_section(settings), name) == settings


@pytest.mark.parametrize("name", ["pipeline_tiny_cpu", "pipeline_sql_cpu",
                                  "pipeline_distractors_cpu", "copy_guard_cpu"])
def test_every_pipeline_builds_its_stages_settings(name):
  recipe = importlib.import_module(f"configs.{name}")
  stage_configs = getattr(recipe, "stage_configs", pipeline_tiny_cpu.stage_configs)
  for config in (recipe.get_config(), pipeline_tiny_cpu.quick(recipe.get_config())):
    stages = Stages(config, stage_configs).of(seed=1)
    assert set(stages) == {"distill", "sft", "dapo", "ppo", "eval_teacher", "eval_sft",
                           "eval_dapo"}
    assert stages["sft"].seed == stages["dapo"].seed == stages["eval_sft"].seed == 1
    assert stages["ppo"].rl.uses_critic and not stages["dapo"].rl.uses_critic


def test_the_distill_config_builds_its_settings():
  assert distill_settings(distill_tiny.get_config()).world.entities == 300


def _command_line(script: str, config_file: str, *overrides: str):
  """Returns the config a job's entry script reads from `overrides` on its command line."""
  argv = cli.config_argv([script, f"--config={config_file}", *overrides])
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  return values.config


def test_command_line_overrides_reach_the_sft_settings():
  settings = sft_settings(_command_line(
      "experiments/sft.py", sft_tiny_cpu.__file__, "--config.optimizer.warmup_steps=7",
      "--config.data.upsample_by=family", "--config.model.num_layers=3"))
  assert (settings.optimizer.warmup_steps, settings.data.upsample_by) == (7, "family")
  assert settings.model.fresh_config().num_layers == 3


def test_command_line_overrides_reach_the_rl_settings():
  settings = rl_settings(_command_line(
      "experiments/dapo.py", dapo_tiny_cpu.__file__, "--config.rl.eps_high=0.3",
      "--config.rl.async.staleness=2", "--config.rl.critic.gamma=0.99",
      "--config.rollout.max_turns=3", "--config.sampling.top_p=0.9"))
  assert (settings.rl.eps_high, settings.rl.async_.staleness) == (0.3, 2)
  assert settings.rl.policy_loss().eps_high == 0.3 and settings.rl.critic.gamma == 0.99
  assert (settings.rollout.max_turns, settings.sampling.top_p) == (3, 0.9)


# (job, its config, a key, a bad value, the error it must raise): unknown keys, wrong types and
# values the settings refuse, each named as the command line writes it.
BAD_VALUES = [
    (sft_settings, sft_tiny_cpu, "optimizer.warmup_step", 7,
     r"sft\.optimizer: unknown key\(s\) sft\.optimizer\.warmup_step"),
    (sft_settings, sft_tiny_cpu, "batch_size", "8", r"sft\.batch_size='8': expected an integer"),
    (sft_settings, sft_tiny_cpu, "data.overlong", "wrap",
     r"sft\.data: overlong='wrap': expected one of"),
    (sft_settings, sft_tiny_cpu, "model.num_layerz", 3,
     r"sft\.model: unknown key\(s\) sft\.model\.num_layerz"),
    (sft_settings, sft_tiny_cpu, "model.num_heads", 3,
     r"sft\.model: num_heads=3 is not a multiple of num_kv_heads=2"),
    (distill_settings, distill_tiny, "world.entitys", 3,
     r"distill\.world: unknown key\(s\) distill\.world\.entitys"),
    (distill_settings, distill_tiny, "workers", 2.5, r"distill\.workers=2\.5: expected an integer"),
    (distill_settings, distill_tiny, "teacher.misread_rate", 2.0,
     r"distill\.teacher: teacher\.misread_rate must be in \[0, 1\]"),
    (rl_settings, dapo_tiny_cpu, "rl.eps_hgh", 0.3,
     r"dapo\.rl: unknown key\(s\) dapo\.rl\.eps_hgh"),
    (rl_settings, dapo_tiny_cpu, "rl.batch_groups", "4",
     r"dapo\.rl\.batch_groups='4': expected an integer"),
    (rl_settings, dapo_tiny_cpu, "rl.mini_batch_groups", 3,
     r"batch_groups=4 is not a multiple of mini_batch_groups=3"),
    (rl_settings, dapo_tiny_cpu, "rl.eps_low", 1.5, r"dapo\.rl: clip ratios must satisfy"),
    (rl_settings, dapo_tiny_cpu, "rl.advantage", "median",
     r"advantage normalize='median': expected one of"),
    (rl_settings, dapo_tiny_cpu, "rl.async.staleness", -1, r"dapo\.rl\.async: staleness=-1"),
    (rl_settings, dapo_tiny_cpu, "rl.critic.truncation", "drop",
     r"rl\.critic\.truncation='drop'"),
    (rl_settings, dapo_tiny_cpu, "sampling.temperature", 0.0, r"DAPO needs sampled rollouts"),
    (rl_settings, dapo_tiny_cpu, "optimizer.schedule", "linear",
     r"dapo\.optimizer: optimizer\.schedule='linear'"),
    (rollout_settings, rollout_tiny_cpu, "transcript", 4,
     r"rollout job: unknown key\(s\) rollout job\.transcript"),
    (rollout_settings, rollout_tiny_cpu, "chunk", "32",
     r"rollout job\.chunk='32': expected an integer"),
    (rollout_settings, rollout_tiny_cpu, "rollout.group_size", 0,
     r"rollout\.group_size must be >= 1"),
    (rollout_settings, rollout_tiny_cpu, "tools", "bm25",
     r"rollout job\.tools='bm25': expected a mapping"),
    (evaluation_settings, evaluate_tiny, "system", "human",
     r"evaluation: system='human': expected one of"),
    (evaluation_settings, evaluate_tiny, "k", 0, r"evaluation: k=0: expected >= 1"),
    (evaluation_settings, evaluate_tiny, "teacher.misread_rate", 2.0,
     r"evaluation\.teacher: teacher\.misread_rate must be in"),
    (evaluation_settings, evaluate_tiny, "copy_probes", "",
     r"evaluation: unknown key\(s\) evaluation\.copy_probes"),
    (lm_demo.demo_settings, demo_tiny, "steps", 0, r"demo: steps=0, .*: expected >= 1"),
    (pod_fit.run_settings, aot_train, "seq_len", "4k", r"aot\.seq_len='4k': expected an integer"),
    (serve_settings, serve_tiny_cpu, "port", 70000, r"port=70000: expected 0\.\.65535"),
    (serve_settings, serve_tiny_cpu, "max_queu", 8, r"serving job: unknown key\(s\) serving job\.max_queu"),
]


@pytest.mark.parametrize("job,config,key,value,message", BAD_VALUES,
                         ids=[f"{job.__name__}-{key}" for job, _, key, _, _ in BAD_VALUES])
def test_a_bad_value_is_an_error_naming_its_key(job, config, key, value, message):
  with pytest.raises(ConfigError, match=message):
    job(_with(config.get_config(), key, value))


def test_a_bad_stage_value_of_a_pipeline_is_named_before_any_stage_runs():
  config = pipeline_tiny_cpu.get_config()
  config.dapo.rl.eps_low = 1.5  # the pipeline's dapo block moves the dapo and ppo stages
  with pytest.raises(ConfigError, match=r"dapo\.rl: clip ratios"):
    Stages(config, pipeline_tiny_cpu.stage_configs).of()


def _with(config, key: str, value):
  """Returns `config` with the dotted `key` set to `value`, whatever its type."""
  section, names = config, key.split(".")
  for name in names[:-1]:
    section = section[name]
  with section.ignore_type():
    section[names[-1]] = value
  return config
