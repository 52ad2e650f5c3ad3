"""Train-step and decode benchmarks on one GPU: a Qwen2.5-1.5B-shaped model (1.54B parameters)
in bf16 with float32 master weights, cuDNN attention, against HF transformers in PyTorch (bf16
autocast, SDPA attention; `generate` with its static KV cache) on the same GPU; and its LoRA
step against PEFT's.

  python experiments/bench_model.py --config=configs/bench_model_gpu.py
  python experiments/bench_rollout.py --config=configs/bench_model_gpu.py --skip_tools
"""

import ml_collections

from configs import bench_model, common


def get_config() -> ml_collections.ConfigDict:
  config = bench_model.get_config()
  # Batch 2 x 2048 without remat. 4 x 2048 (59.9 GiB per H100 by an ahead-of-time compile)
  # ran out of memory beside PyTorch's leftovers in the same process (docs/benchmarks.md).
  # Layers unrolled, as the GPU presets: the layer scan's slicing and stacking of weights,
  # activations and gradients was a third of the step's HBM bytes (docs/benchmarks.md).
  full = dict(dtype="bfloat16", param_dtype="float32", attention_impl="cudnn", scan_unroll=28)
  config.models = {
      "qwen2_5_1_5b": common.model("qwen2_5_1_5b", **full),
      # LoRA rank 16 on every projection, the base frozen in bf16; HF's side is PEFT's LoRA.
      "qwen2_5_1_5b_lora": common.model("qwen2_5_1_5b", **full, lora_rank=16, lora_alpha=32.0,
                                        lora_dropout=0.05)}
  config.batch_size = 2
  config.seq_len = 2048
  config.warmup_steps = 3
  config.steps = {"qwen2_5_1_5b": 10, "qwen2_5_1_5b_lora": 10}
  config.decode = ml_collections.ConfigDict(dict(
      batches=[1, 16, 128], prompt_len=512, new_tokens=128, rounds=4, observation_len=128))
  # One run of each side (JAX keeps the GPU memory it allocated, which PyTorch's next run
  # would need), and no attention-alone row.
  config.rounds, config.attention = 1, False
  config.output = "runs/bench/bench_model_gpu.json"
  return config
