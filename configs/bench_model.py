"""Train-step and decode benchmarks: coa-jax vs HF transformers (PyTorch) on the same shapes,
on the CPU (make bench, make bench-rollout). configs/bench_model_gpu.py is the GPU variant."""

import ml_collections

from configs import common, pipeline_tiny_cpu


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # ~100M Qwen2-shaped: 12 layers, d=768, GQA 12/4 heads, SwiGLU 2048, 32k tied vocab. Heads
  # of 16 (the tiny preset's, as its published figures were measured; a Qwen2 this wide has 64).
  qwen2_100m = dict(vocab_size=32_000, hidden_size=768, intermediate_size=2048, num_layers=12,
                    num_heads=12, num_kv_heads=4, head_dim=16, max_position_embeddings=4096,
                    attention_impl="blockwise")
  # The main job's model (configs/pipeline_tiny_cpu.py) with its tokenizer's 1,024 ids.
  main_job = dict(pipeline_tiny_cpu.get_config().model, vocab_size=1024)
  config.models = {
      "tiny": common.model("tiny", attention_impl="blockwise", attention_block=32),
      "main_job": common.model(**main_job),
      "qwen2_100m": common.model("tiny", **qwen2_100m),
      # LoRA rank 16 on every projection; HF's side is PEFT's LoRA.
      "qwen2_100m_lora": common.model("tiny", **qwen2_100m, lora_rank=16, lora_alpha=32.0,
                                      lora_dropout=0.05),
  }
  config.batch_size = 8
  config.seq_len = 512
  config.warmup_steps = 2
  config.steps = {"tiny": 20, "main_job": 10, "qwen2_100m": 4, "qwen2_100m_lora": 4}
  config.optimizer = common.optimizer(learning_rate=1e-4, schedule="constant")
  # Decoding (experiments/bench_rollout.py): greedy, for each batch size a prompt, then rounds
  # of new tokens with an observation appended between rounds (a tool's answer).
  config.decode = ml_collections.ConfigDict(dict(
      batches=[1, 8, 64], prompt_len=64, new_tokens=64, rounds=2, observation_len=32))
  config.torch_threads = 0  # 0: all cores
  config.rounds = 3  # each side's fastest of this many alternating runs
  # Also time one layer's attention alone (forward and backward) against PyTorch's SDPA.
  config.attention = True
  config.output = "runs/bench/bench_model.json"
  return config
