"""Ahead-of-time TPU compile on this CPU (needs libtpu, installed by the `tpu` extra)."""

import pytest

from coa_jax.model import get_preset
from coa_jax.perf import aot, pod_fit, roofline
from coa_jax.rl.settings import rl_settings
from coa_jax.runtime import hardware, sharding, xla_flags
from coa_jax.sft.settings import sft_settings
from coa_jax.train.optimizer import OptimizerSettings

TINY = get_preset("tiny", num_layers=4, dtype="bfloat16", remat="full")


def _scaled_down(model):
  """A large preset's shape (heads, kv heads, head_dim, LoRA, dtypes) at 2 layers of width 512."""
  return model.replace(num_layers=2, hidden_size=512, head_dim=128, intermediate_size=1024,
                       vocab_size=4096, attention_block=128)  # splash's smallest tile


@pytest.fixture(scope="module")
def report():
  return aot.aot_report("tiny", TINY, OptimizerSettings(), "v5e:2x2",
                        sharding.MeshConfig(data=2, fsdp=2, tensor=1), batch_size=8, seq_len=64)


def test_tiny_model_compiles_for_a_tpu_topology_and_reports_memory(report):
  assert report.device_kind == "TPU v5 lite" and report.num_devices == 4
  assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 1}
  assert report.argument_bytes > 0 and report.peak_bytes >= report.argument_bytes
  assert report.hbm_bytes == 16 * hardware.GIB and report.fits
  assert report.compiler_seconds > 0 and 0 < report.implied_mfu
  text = report.format()
  assert "FITS" in text and "TPU v5 lite" in text and "implied MFU" in text


def test_extrapolated_compiler_flops_match_a_fully_unrolled_compile(report):
  devices = aot.topology_devices("v5e:2x2")
  unrolled, _, _, _ = aot.compile_train_step(
      TINY.replace(scan_unroll=TINY.num_layers), OptimizerSettings(), devices,
      sharding.MeshConfig(data=2, fsdp=2, tensor=1), 8, 64)
  flops, _ = aot._cost(unrolled)
  assert abs(report.compiler_flops - flops) / flops < 0.02


def test_unknown_topology_is_named():
  with pytest.raises(ValueError, match="cannot describe TPU topology 'v9z:1x1'"):
    aot.topology_devices("v9z:1x1")


def test_batch_not_splitting_over_the_mesh_is_named():
  with pytest.raises(ValueError, match="batch_size=6 in 1 micro-batch.* does not split over "
                                       "data x fsdp = 4"):
    aot.compile_train_step(TINY, OptimizerSettings(), aot.topology_devices("v5e:2x2"),
                           sharding.MeshConfig(data=1, fsdp=4, tensor=1), 6, 64)


def test_topology_chip_counts():
  assert hardware.chips_in_topology("v5p:2x2x1") == 4
  assert hardware.chips_in_topology("v6e:4x4") == 16
  with pytest.raises(ValueError, match="not of the form"):
    hardware.chips_in_topology("v5p-8")


def test_the_7b_sft_config_compiles_scaled_down_with_its_state_split_over_every_chip():
  from configs import sft_qwen2_5_7b

  settings = sft_settings(sft_qwen2_5_7b.get_config())
  model = _scaled_down(settings.model.fresh_config())
  compiled, mesh, _, _ = aot.compile_train_step(
      model, settings.optimizer, aot.topology_devices("v5e:2x2"), settings.mesh,
      batch_size=16, seq_len=128, micro_batches=settings.train.micro_batches)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
  # float32 weights and AdamW's two moments, a quarter on each chip (the batch and the
  # replicated norm scales are the rest)
  state = 12 * model.num_params() / 4
  assert compiled.memory_analysis().argument_size_in_bytes == pytest.approx(state, rel=0.01)


def test_the_32b_lora_sft_config_compiles_scaled_down_holding_bf16_base_and_f32_adapters():
  from configs import sft_qwen2_5_32b_lora

  settings = sft_settings(sft_qwen2_5_32b_lora.get_config())
  model = _scaled_down(settings.model.fresh_config())
  compiled, mesh, _, _ = aot.compile_train_step(
      model, settings.optimizer, aot.topology_devices(settings.topology), settings.mesh,
      batch_size=8, seq_len=128, micro_batches=2)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}  # one v5p host
  # Per chip: the frozen base in bf16 over fsdp; the adapters with their two AdamW moments in
  # float32, over fsdp where an adapter has the embed axis (A of q, k, v, gate, up; B of o,
  # down), else replicated (their rank x heads or mlp sides; tensor is 1). Norm scales and the
  # batch are the rest.
  r, f = model.lora_rank, model.intermediate_size
  q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
  replicated = model.num_layers * r * (q + 2 * kv + q + 3 * f)
  state = (2 * model.num_params() + 12 * (model.lora_params() - replicated)) / 4 + 12 * replicated
  assert compiled.memory_analysis().argument_size_in_bytes == pytest.approx(state, rel=0.01)


def test_the_32b_dapo_update_compiles_scaled_down():
  from configs import dapo_qwen2_5_32b

  settings = rl_settings(dapo_qwen2_5_32b.get_config())
  model = _scaled_down(settings.model.fresh_config())
  compiled, mesh, _, _ = aot.compile_train_step(
      model, settings.optimizer, aot.topology_devices("v5e:2x2"),
      sharding.MeshConfig(data=1, fsdp=2, tensor=2), batch_size=8, seq_len=128, micro_batches=2,
      loss_config=settings.rl.policy_loss())
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
  assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_the_32b_rollout_programs_fit_one_v5p_host_and_update_the_kv_cache_in_place():
  """The pod-fit row of dapo_qwen2_5_32b's rollout, compiled at full size as one host of the
  slice runs it: the cache and the weights split as its decode mesh says, and a guard: a program
  that copies the cache (a layout change at the call or for the attention at every token, a
  write not in place, an extend gathering rows) shows a copy of a layer's cache or temporaries
  of the cache's size. It holds at the real shapes only: scaled down to a width of 512, the
  compiler lays the cache out otherwise on v5p and copies it."""
  from coa_jax.model import build_config
  from configs import dapo_qwen2_5_32b

  model = build_config(dapo_qwen2_5_32b.get_config().model)
  report = aot.decode_report("qwen2_5_32b", model, "v5p:4x4x4", tensor=4, rows=32,
                             cache_size=16384, chunk=64, prefill=(2, 2048), extend=(32, 4096))
  assert report.host_devices == 4 and report.mesh == {"data": 1, "fsdp": 1, "tensor": 4}
  # K and V: layers x rows x cache x kv heads x head dim, bf16, split over the host's 4 devices
  kv = 2 * 64 * 32 * 16384 * model.num_kv_heads * model.head_dim * 2
  assert report.cache_bytes == kv // 4 == 32 * hardware.GIB
  # bf16 weights split over tensor (the embedding's and the heads' sides): a quarter on each
  assert report.param_bytes == pytest.approx(model.num_params() * 2 / 4, rel=0.01)
  assert set(report.temp_bytes) == {"decode", "prefill", "extend"}
  assert report.cache_copies == 0, report.format()
  assert max(report.temp_bytes.values()) < report.cache_bytes, report.format()
  assert report.argument_bytes >= report.param_bytes + report.cache_bytes
  assert report.peak_bytes <= 80 * hardware.GIB and report.fits, report.format()
  assert report.compiler_seconds > report.step_seconds > 0  # the roofline is a lower bound
  assert "KV cache 16384 tokens" in report.format()


def test_a_malformed_gpu_topology_is_named():
  with pytest.raises(ValueError, match="GPU topology h100:8x is not of the form 'h100:GPUS' or "
                                       "'h100:NODESxGPUS'"):
    aot.topology_devices("h100:8x")


def test_pod_fit_row_and_json_of_a_report(report):
  import json

  (row,) = pod_fit.pod_fit_rows("tiny_config", {"train": report})
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert len(cells) == pod_fit.POD_FIT_HEADER.splitlines()[0].count("|") - 1
  assert cells[:3] == ["`tiny_config`", "SFT step", "v5e:2x2 (4 chips)"] and cells[6] == "yes"
  assert cells[10] == f"{report.projected_mfu:.0%}"
  out = json.loads(json.dumps(aot.report_json(report)))
  assert out["fits"] and out["roofline"]["seconds"] == report.roofline.seconds


def test_ppo_updates_compile_scaled_down_with_the_other_models_state_resident():
  from configs import ppo_qwen2_5_7b

  settings = rl_settings(ppo_qwen2_5_7b.get_config())
  model = _scaled_down(settings.model.fresh_config())
  critic = settings.rl.critic
  shape = (model, settings.optimizer, aot.topology_devices("v5e:2x2"),
           sharding.MeshConfig(data=1, fsdp=2, tensor=2), 8, 128, 2)
  actor, _, _, critic_state = aot.compile_train_step(*shape, settings.rl.policy_loss(), critic)
  value, _, _, actor_state = aot.compile_train_step(*shape, None, critic)
  # The states differ by their heads: the LM head (embed over fsdp, vocab over tensor) against
  # the value head (embed over fsdp), each with AdamW's two moments, float32.
  heads = 3 * 4 * (4096 * 512 // 4 - 512 // 2)
  assert actor_state - critic_state == heads
  assert value.memory_analysis().temp_size_in_bytes < actor.memory_analysis().temp_size_in_bytes


def test_pod_fit_rows_of_a_ppo_config_name_both_updates(report):
  rows = pod_fit.pod_fit_rows("ppo_config", {"train": report, "critic": report})
  programs = [[c.strip() for c in row.strip("|").split("|")][1] for row in rows]
  assert programs == ["PPO actor update (one mini-batch; critic state resident)",
                      "PPO critic update (one mini-batch; actor state resident)"]


def test_cost_compiles_reach_the_tpu_compiler_without_windowed_einsums(monkeypatch):
  """The options of `xla_flags.COUNTED_MATMULS` go to the cost compiles alone (an option the
  compiler does not know fails the compile that gets it)."""
  monkeypatch.setattr(xla_flags, "COUNTED_MATMULS", {"xla_no_such_option": "false"})
  shape = (TINY, OptimizerSettings(), aot.topology_devices("v5e:2x2"),
           sharding.MeshConfig(fsdp=-1), 4, 16)
  aot.compile_train_step(*shape)
  with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):
    aot.compile_train_step(*shape, for_cost=True)


def test_the_compilers_estimate_adds_the_splash_kernels_it_cannot_cost():
  """XLA costs a Pallas kernel only by the estimate the kernel declares, and splash declares
  none: the report adds the kernels' time at the chip's peak, and says so."""
  model = TINY.replace(attention_impl="splash", remat="minimal_with_context")
  splash = aot.aot_report("tiny", model, OptimizerSettings(), "v5e:2x2",
                          sharding.MeshConfig(fsdp=-1), batch_size=4, seq_len=256)
  peak = hardware.chip_for(splash.device_kind).peak_bf16_flops
  kernels = roofline.attention_kernel_seconds(model, 4, 256, 4, peak)
  assert splash.kernel_seconds == kernels > 0 and splash.compiler_seconds > kernels
  assert "splash attention kernels at peak FLOP/s, which XLA cannot cost" in splash.format()


def test_offloading_remat_keeps_the_activations_in_host_memory_on_tpu():
  compiled, *_ = aot.compile_train_step(TINY.replace(remat="offload"), OptimizerSettings(),
                                        aot.topology_devices("v5e:2x2"),
                                        sharding.MeshConfig(fsdp=-1), 4, 64)
  assert "S(5)" in compiled.as_text()  # XLA's memory space of pinned host memory
  assert compiled.memory_analysis().host_temp_size_in_bytes > 0
