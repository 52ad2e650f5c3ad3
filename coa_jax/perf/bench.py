"""Benchmark helpers: the CPU's measured matmul peak and timed train steps (ours and HF's)."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from coa_jax.model import ModelConfig, Transformer, to_hf_config
from coa_jax.runtime import sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib


def time_calls(fn: Callable[[], Any], warmup: int, steps: int) -> float:
  """Returns the median seconds per call of `fn` after `warmup` untimed calls."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def matmul_peak_flops(n: int = 2048) -> dict[str, float]:
  """Returns the measured float32 FLOP/s of an n x n matmul in JAX and in PyTorch."""
  return matmul_flops(n, n, n)


def matmul_flops(m: int, k: int, n: int) -> dict[str, float]:
  """Returns the measured float32 FLOP/s of an (m, k) x (k, n) matmul in JAX and PyTorch."""
  import torch

  a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  jax_s = time_calls(lambda: matmul(a, b).block_until_ready(), 2, 10)
  ta, tb = torch.ones(m, k), torch.ones(k, n)
  torch_s = time_calls(lambda: ta @ tb, 2, 10)
  return {"jax": 2 * m * k * n / jax_s, "torch": 2 * m * k * n / torch_s}


def jax_train_step_seconds(config: ModelConfig, optimizer_config: Any, batch_size: int,
                           seq_len: int, warmup: int, steps: int) -> float:
  """Returns median seconds of our jitted train step (fwd + bwd + AdamW) on one device."""
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  model, tx = Transformer(config), optimizer.make_optimizer(optimizer_config)
  state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch_size, seq_len + 1))
  batch = sharding.shard_batch(step_lib.next_token_batch(tokens), mesh)
  step = step_lib.jit_train_step(model, tx, mesh)
  holder = [state]

  def run():
    holder[0], metrics = step(holder[0], batch)
    metrics["loss"].block_until_ready()

  return time_calls(run, warmup, steps)


def torch_train_step_seconds(config: ModelConfig, optimizer_config: Any, batch_size: int,
                             seq_len: int, warmup: int, steps: int) -> float:
  """Returns median seconds of the same step in HF transformers (PyTorch, float32, AdamW)."""
  import torch
  import transformers

  hf = to_hf_config(config)
  hf_config = transformers.AutoConfig.for_model(**hf)
  model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=optimizer_config.learning_rate,
                          betas=(optimizer_config.b1, optimizer_config.b2),
                          eps=optimizer_config.eps, weight_decay=optimizer_config.weight_decay)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch_size, seq_len + 1))
  inputs = torch.as_tensor(tokens[:, :-1], dtype=torch.long)
  targets = torch.as_tensor(tokens[:, 1:], dtype=torch.long)

  def run():
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), optimizer_config.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)

  return time_calls(run, warmup, steps)
