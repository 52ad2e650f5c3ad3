"""The pod-fit view of a shipped config: its run's settings (`run_settings`), compiled ahead of
time for its topology (`config_reports`: the train step or RL update, PPO's critic update, one
host's rollout decode), and the rows of docs/tpu.md's pod-fit table (`pod_fit_rows`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from coa_jax.data.tokenizer import TAG_TOKENS
from coa_jax.model import ModelConfig, ModelSettings
from coa_jax.perf.aot import (aot_report, decode_report, topology_devices,
                              train_state_bytes)
from coa_jax.rl.settings import RLSettings, rl_settings
from coa_jax.rollout.sampler import bucket
from coa_jax.runtime import hardware, sharding
from coa_jax.runtime.settings import build
from coa_jax.sft.settings import SFTSettings, sft_settings
from coa_jax.train.loop import TrainSettings
from coa_jax.train.optimizer import OptimizerSettings


@dataclasses.dataclass(frozen=True)
class CompileSettings:
  """A train step to compile alone (configs/aot_train.py): the model, optimizer, topology, mesh
  and batch shape an SFT run would have; `report_json`: also write the report there."""

  model: ModelSettings
  topology: str
  batch_size: int
  seq_len: int
  optimizer: OptimizerSettings = OptimizerSettings()
  mesh: sharding.MeshConfig = sharding.MeshConfig()
  train: TrainSettings = TrainSettings(steps=1)
  xla_flags: str = ""
  report_json: str = ""


def run_settings(config: Any) -> CompileSettings | SFTSettings | RLSettings:
  """Returns the settings of a config to compile: an RL run's (it has an rl block), an SFT
  run's (a data block), else a lone train step's."""
  if "rl" in config:
    return rl_settings(config)
  return sft_settings(config) if "data" in config else build(CompileSettings, config, "aot")


def config_reports(settings: CompileSettings | SFTSettings | RLSettings) -> dict[str, Any]:
  """Compiles a shipped SFT or RL run (`run_settings`: its `topology`, mesh and shapes) and
  returns {"train": AotReport} plus, for RL, "decode": the DecodeReport of one host's rollout,
  and for PPO (rl.advantage = "gae") "critic": the critic's update ("train" is then the
  actor's, each with the other's state resident)."""
  rl = getattr(settings, "rl", None)
  loss_config = critic = None
  if rl is None:
    batch_size, seq_len = settings.batch_size, settings.seq_len
    micro_batches = settings.train.micro_batches
  else:  # an RL run: one mini-batch of whole prompt groups
    rollout = settings.rollout
    batch_size, seq_len = rl.mini_batch_groups * rollout.group_size, rollout.cache_size
    micro_batches, loss_config = rl.micro_batches, rl.policy_loss()
    critic = rl.critic_settings() if rl.uses_critic else None
  model = with_tag_rows(settings.model.fresh_config())
  shape = (settings.model.preset, model, settings.optimizer, settings.topology, settings.mesh,
           batch_size, seq_len, micro_batches)
  reports = {"train": aot_report(*shape, loss_config, critic, settings.xla_flags)}
  if critic is not None:
    reports["critic"] = aot_report(*shape, None, critic, settings.xla_flags)
  if rl is not None:
    hosts = len({d.process_index for d in topology_devices(settings.topology)})
    rows = settings.batch_size // hosts
    # Synchronous RL decodes beside the train states; asynchronous on devices of its own.
    resident = 0 if rl.async_.enabled else train_state_bytes(
        model, settings.optimizer, settings.topology, settings.mesh, critic)
    reports["decode"] = decode_report(
        settings.model.preset, model, settings.topology, settings.mesh.tensor, rows,
        rollout.cache_size, settings.chunk,
        prefill=(bucket(rows // rollout.group_size, 1), bucket(rollout.max_prompt_tokens)),
        extend=(bucket(rows, 1), rollout.observation_bucket), resident_bytes=resident)
  return reports


def with_tag_rows(config: ModelConfig) -> ModelConfig:
  """Returns a LoRA model's config with the token rows that train beside its adapters when its
  run starts from a base checkpoint whose tokenizer lacks the CoA tags, as Qwen2.5's does
  (`hf_checkpoint.with_trained_token_ids`; the pod fit reads no tokenizer): one row per tag
  token, at the top of the vocabulary (which ids does not change a byte)."""
  if (not config.lora_rank or config.lora_train_embeddings != "added_tokens"
      or config.lora_trained_token_ids):
    return config
  top = config.vocab_size
  return config.replace(lora_trained_token_ids=tuple(range(top - len(TAG_TOKENS), top)))


POD_FIT_HEADER = (
    "| config | program | topology | mesh (data x fsdp x tensor) | shape | per-chip memory "
    "(compiler) | fits | FLOPs per chip (executed) | HBM bytes per chip | roofline time "
    "| projected MFU / throughput | compiler's estimate |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|")


def pod_fit_rows(config_name: str, reports: dict[str, Any]) -> list[str]:
  """Returns the pod-fit table's markdown rows of one config's reports (`config_reports`)."""
  gib = lambda b: f"{b / hardware.GIB:.1f}"
  mesh = lambda m: f"{m['data']}x{m['fsdp']}x{m['tensor']}"
  def maybe(seconds: float, text: str, device_kind: str) -> str:
    if not math.isnan(seconds):
      return text
    return ("none (XLA:GPU without a device)" if device_kind.startswith("NVIDIA") else
            "none (XLA gave no time for the 1- and 2-layer compiles)")

  rows = []
  programs = {"train": "DAPO update (one mini-batch)" if "decode" in reports else "SFT step"}
  if "critic" in reports:
    programs = {"train": "PPO actor update (one mini-batch; critic state resident)",
                "critic": "PPO critic update (one mini-batch; actor state resident)"}
  for key, program in programs.items():
    train = reports[key]
    chips = hardware.chips_in_topology(train.topology)
    rows.append(
        f"| `{config_name}` | {program} | {train.topology} ({chips} chips) | "
        f"{mesh(train.mesh)} | {train.batch_size} x {train.seq_len:,} | "
        f"{gib(train.peak_bytes)} of {gib(train.hbm_bytes)} GiB | "
        f"{'yes' if train.fits else 'NO'} | {train.roofline.flops:.2e} | "
        f"{train.roofline.hbm_bytes:.2e} | {train.roofline.seconds:.2f} s "
        f"({train.roofline.bound}) | {train.projected_mfu:.0%} | "
        + maybe(train.compiler_seconds,
                f"{train.compiler_seconds:.2f} s (MFU {train.implied_mfu:.0%})",
                train.device_kind) + " |")
  if "decode" in reports:
    d = reports["decode"]
    temps = max(d.temp_bytes.values())
    rows.append(
        f"| `{config_name}` | rollout decode, one host | {d.topology} ({d.host_devices} "
        f"devices) | {mesh(d.mesh)} | {d.rows} rows x {d.cache_size:,} slots | "
        f"{gib(d.peak_bytes)} of {gib(d.hbm_bytes)} GiB (params {gib(d.param_bytes)}, KV "
        f"{gib(d.cache_bytes)}, temporaries {gib(temps)}, train state "
        f"{gib(d.resident_bytes)}) | {'yes' if d.fits else 'NO'} | "
        f"{d.roofline.flops:.2e} per token step | {d.roofline.hbm_bytes:.2e} | "
        f"{d.step_seconds * 1e3:.1f} ms ({d.roofline.bound}) | "
        f"{d.rows / d.step_seconds:,.0f} tokens/s per host | "
        + maybe(d.compiler_seconds, f"{d.compiler_seconds * 1e3:.1f} ms", d.device_kind) + " |")
  return rows
