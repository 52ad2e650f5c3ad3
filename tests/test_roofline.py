"""Analytic FLOPs and rooflines: exact values worked out by hand for the tiny model."""

import pytest

from coa_jax.model import get_preset
from coa_jax.perf import flops, roofline
from coa_jax.runtime import hardware

# vocab 512, d 64, ffn 128, 2 layers, 4 heads of 16, 2 kv heads, qkv bias, tied embeddings
TINY = get_preset("tiny", dtype="bfloat16")
MATMUL_PARAMS = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 512 * 64


def test_matmul_params_count_every_projection_and_the_lm_head():
  assert flops.matmul_params(TINY) == MATMUL_PARAMS == 106_496


def test_train_flops_count_causal_attention_pairs():
  # 6 x matmul params x 16 tokens, plus 12 x layers x heads x head_dim per (query, key) pair,
  # 8 x 9 / 2 = 36 pairs in each of the 2 rows
  assert flops.train_flops(TINY, batch_size=2, seq_len=8) == (
      6 * MATMUL_PARAMS * 16 + 12 * 2 * 4 * 16 * 36 * 2)


def test_full_remat_executes_exactly_one_more_forward_pass():
  forward = 2 * MATMUL_PARAMS * 16 + 4 * 2 * 4 * 16 * 8 * 8 * 2  # dense attention: the square
  none = roofline.train_flops_executed(TINY, 2, 8)
  full = roofline.train_flops_executed(TINY.replace(remat="full"), 2, 8)
  assert none == 3 * forward and full == 4 * forward


def test_lora_training_skips_the_frozen_weights_gradients():
  lora = TINY.replace(lora_rank=2)
  # rank x (in + out) per projection: q 64+64, k and v 64+32, o 64+64, gate/up/down 64+128
  adapters = 2 * 2 * (128 + 96 + 96 + 128 + 3 * 192)
  assert lora.lora_params() == adapters == 4096
  assert flops.train_flops(lora, batch_size=2, seq_len=8) == (
      (4 * MATMUL_PARAMS + 6 * adapters) * 16 + 12 * 2 * 4 * 16 * 36 * 2)
  weights, lora_mm = 2 * MATMUL_PARAMS * 16, 2 * adapters * 16
  attention = 4 * 2 * 4 * 16 * 8 * 8 * 2
  # forward; backward: the input's gradient through the frozen weights, both through the rest
  assert roofline.train_flops_executed(lora, 2, 8) == (
      weights + lora_mm + attention + weights + 2 * (lora_mm + attention))
  mesh = {"data": 1, "fsdp": 2, "tensor": 1}
  full = roofline.train_roofline(TINY, 2, 8, mesh, 1, 1e12, 1e12)
  line = roofline.train_roofline(lora, 2, 8, mesh, 1, 1e12, 1e12)
  # bf16 reads of frozen and trained weights (forward, backward); float32 gradients and AdamW
  # (7 reads and writes of 4 bytes over the fsdp shard) of the adapters only. (The adapters'
  # rank-wide activations are not counted.)
  gone = 2 * 4 * TINY.num_params() + 7 * 4 * TINY.num_params() / 2
  added = 2 * 2 * adapters + 2 * 4 * adapters + 7 * 4 * adapters / 2
  assert line.hbm_bytes == pytest.approx(full.hbm_bytes - gone + added)


def test_blockwise_attention_computes_the_blocks_on_and_below_the_diagonal():
  blockwise = TINY.replace(attention_impl="blockwise", attention_block=4)
  assert roofline._computed_fraction(blockwise, 8) == 3 / 4  # 3 of 2 x 2 blocks
  assert roofline._computed_fraction(TINY, 8) == 1.0


def test_decode_roofline_reads_the_weights_and_the_cache_once_per_step():
  mesh = {"data": 2, "fsdp": 1, "tensor": 2}
  line = roofline.decode_roofline(TINY, rows=4, cache_size=32, mesh=mesh, peak_flops=1e12,
                                  hbm_bytes_per_s=1e9, cache_itemsize=2)
  weights = TINY.num_params() * 2 / 2  # bf16, split over tensor
  cache = 2 * 2 * (4 / 2) * 32 * (2 * 16 / 2) * 2  # K and V x layers x rows x slots x kv dims
  logits = (4 / 2) * (512 / 2) * 4  # float32 logits of the device's rows and vocab shard
  assert line.hbm_bytes == weights + cache + logits == 117_312
  assert line.flops == (2 * MATMUL_PARAMS + 4 * 2 * 4 * 16 * 32) * 4 / 4
  assert line.bound == "HBM" and line.seconds == pytest.approx(117_312 / 1e9)


def test_projected_mfu_is_model_flops_over_the_roofline_time_at_peak():
  line = roofline.Roofline(flops=4e12, hbm_bytes=1e9, peak_flops=1e12, hbm_bytes_per_s=1e12)
  assert line.bound == "compute" and line.seconds == 4.0
  assert line.mfu(3e12) == 0.75


@pytest.mark.parametrize("kind, name", [("NVIDIA H100 80GB HBM3", "H100 SXM"),
                                        ("NVIDIA H100 PCIe", "H100 PCIe"),
                                        ("NVIDIA H200", "H200"),
                                        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
                                        ("TPU v5", "v5p")])
def test_chips_are_found_by_device_kind(kind, name):
  assert hardware.chip_for(kind).name == name


def test_an_unknown_device_kind_is_named():
  with pytest.raises(ValueError, match="no chip figures for device kind 'NVIDIA GeForce"):
    hardware.chip_for("NVIDIA GeForce RTX 4090")
