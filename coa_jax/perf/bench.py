"""Benchmark helpers: the peak a step is measured against, timed train steps and decoding
with tool-style extends, ours and HF transformers' (PyTorch) on the same device kind."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from coa_jax.model import ModelConfig, Transformer, to_hf_config
from coa_jax.runtime import hardware, sharding
from coa_jax.sft.settings import SFTSettings
from coa_jax.train import optimizer
from coa_jax.train.optimizer import OptimizerSettings
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


def progress() -> Callable[[str], None]:
  """Returns a printer of timestamped lines (seconds since this call): a benchmark cut short by
  its time limit shows which stage it was in."""
  start = time.perf_counter()
  return lambda what: print(f"[{time.perf_counter() - start:6.1f} s] {what}", flush=True)


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


def jax_train_step_seconds(config: ModelConfig, optimizer_settings: OptimizerSettings,
                           batch_size: int, seq_len: int, warmup: int, steps: int) -> float:
  """Returns median seconds of our jitted train step (fwd + bwd + AdamW) on one device."""
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  model, tx = Transformer(config), optimizer.make_optimizer(optimizer_settings)
  state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch_size, seq_len + 1))
  batch = sharding.shard_batch(step_lib.next_token_batch(tokens), mesh)
  step = step_lib.jit_train_step(model, tx, mesh)
  holder = [state]

  def run():
    holder[0], metrics = step(holder[0], batch)
    metrics["loss"].block_until_ready()

  return time_calls(run, warmup, steps)


def peak_flops() -> tuple[float, str]:
  """Returns the FLOP/s MFU is measured against on JAX's first device and where it comes
  from: an accelerator's published dense bf16 peak, or on a CPU the faster of JAX's and
  PyTorch's measured float32 2048^3 matmul."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    peaks = matmul_peak_flops()
    return max(peaks.values()), (f"measured float32 matmul: JAX {peaks['jax'] / 1e9:.0f}, "
                                 f"PyTorch {peaks['torch'] / 1e9:.0f} GFLOP/s")
  chip = hardware.chip_for(device.device_kind)
  return chip.peak_bf16_flops, f"{chip.name} dense bf16 peak (spec sheet)"


def memory_bandwidth(size_bytes: int = 512 << 20) -> tuple[float, str]:
  """Returns the bytes/s a decode step is measured against on JAX's first device and where it
  comes from: an accelerator's published HBM bandwidth, or on a CPU the measured rate of a
  jitted sum over a `size_bytes` float32 array (bytes read over the median time)."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    chip = hardware.chip_for(device.device_kind)
    return chip.hbm_bytes_per_s, f"{chip.name} HBM bandwidth (spec sheet)"
  x = jnp.ones((size_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  seconds = time_calls(lambda: total(x).block_until_ready(), warmup=2, steps=7)
  return size_bytes / seconds, f"measured: a jitted sum over {size_bytes >> 20} MiB"


def decode_step_bytes(config: ModelConfig, batch: int, filled_slots: float) -> float:
  """Returns the bytes one decode step of `batch` rows must read from memory at least: every
  weight once in the compute dtype, and the keys and values of each row's filled cache slots
  (`filled_slots`, a row's mean over the steps)."""
  itemsize = jnp.dtype(config.compute_dtype).itemsize
  kv_per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
  return config.num_params() * itemsize + batch * filled_slots * kv_per_slot


def torch_device() -> str:
  """Returns the PyTorch device matching JAX's: "cuda" when JAX runs on a GPU, else "cpu"."""
  return "cuda" if jax.devices()[0].platform == "gpu" else "cpu"


def share_gpu_with_torch() -> None:
  """Lets JAX and PyTorch share one GPU in this process: JAX allocates as it needs instead of
  taking 75% of the GPU at start-up. Call before JAX's first use of a device."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _synchronize(device: str) -> None:
  import torch

  if device == "cuda":
    torch.cuda.synchronize()


def _release(device: str) -> None:
  """Returns PyTorch's cached GPU memory, so that JAX can use it next."""
  import torch

  gc.collect()
  if device == "cuda":
    torch.cuda.empty_cache()


def torch_train_step_seconds(config: ModelConfig, optimizer_settings: OptimizerSettings,
                             batch_size: int, seq_len: int, warmup: int, steps: int) -> float:
  """Returns median seconds of the same step in HF transformers (PyTorch, AdamW): float32
  parameters, computing in the model config's dtype (bf16 autocast when it is bfloat16),
  with SDPA attention (flash kernels on a GPU), on `torch_device()`. A LoRA config
  (lora_rank > 0) trains PEFT's adapters (float32) on a base held in the compute dtype, as
  ours does."""
  import torch
  import transformers

  device = torch_device()
  bf16 = jnp.dtype(config.dtype) == jnp.bfloat16
  hf_config = transformers.AutoConfig.for_model(**to_hf_config(config))
  base_dtype = torch.bfloat16 if config.lora_rank and bf16 else torch.float32
  model = transformers.AutoModelForCausalLM.from_config(
      hf_config, dtype=base_dtype, attn_implementation="sdpa").to(device)
  if config.lora_rank:
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_targets)))
  model.train()
  trained = [p for p in model.parameters() if p.requires_grad]
  adamw = optimizer_settings
  opt = torch.optim.AdamW(trained, lr=adamw.learning_rate, betas=(adamw.b1, adamw.b2),
                          eps=adamw.eps, weight_decay=adamw.weight_decay, fused=device == "cuda")
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch_size, seq_len + 1))
  inputs = torch.as_tensor(tokens[:, :-1], dtype=torch.long, device=device)
  targets = torch.as_tensor(tokens[:, 1:], dtype=torch.long, device=device)

  def run():
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
      logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, adamw.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _synchronize(device)

  seconds = time_calls(run, warmup, steps)
  del run, model, opt
  _release(device)
  return seconds


def attention_seconds(config: ModelConfig, batch_size: int, seq_len: int, warmup: int,
                      steps: int) -> tuple[float, float]:
  """Returns median seconds of one layer's causal self-attention, forward and backward, on the
  model's shapes (float32, one sequence a row): (ours, `config.attention_impl`; PyTorch's
  scaled_dot_product_attention on `torch_device()`)."""
  import torch

  from coa_jax.model.attention import attend

  rng = np.random.default_rng(0)
  shapes = [(batch_size, seq_len, heads, config.head_dim)
            for heads in (config.num_heads, config.num_kv_heads, config.num_kv_heads)]
  q, k, v = (rng.standard_normal(shape, np.float32) for shape in shapes)
  segments = jnp.ones((batch_size, seq_len), jnp.int32)
  impl, block = config.attention_impl, config.attention_block

  def loss(q, k, v):
    out = attend(q, k, v, q_segment_ids_BxT=segments, kv_segment_ids_BxS=segments,
                 is_causal=True, implementation=impl, block=block)
    return jnp.sum(out * 0.01)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  arrays = [jax.device_put(x, jax.devices()[0]) for x in (q, k, v)]
  ours = time_calls(lambda: jax.block_until_ready(grads(*arrays)), warmup, steps)

  device = torch_device()
  tq, tk, tv = (torch.tensor(x, device=device).transpose(1, 2).requires_grad_() for x in (q, k, v))

  def run():
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=True, enable_gqa=config.num_kv_heads != config.num_heads)
    (out.sum() * 0.01).backward()
    _synchronize(device)

  return ours, time_calls(run, warmup, steps)


@dataclasses.dataclass(frozen=True)
class AgentDecode:
  """A tool-using decode: a prompt, then `rounds` of `new_tokens` generated tokens per row,
  with `observation_len` observation tokens appended (a tool's answer) between rounds."""

  prompt_len: int
  new_tokens: int
  rounds: int
  observation_len: int

  @property
  def generated(self) -> int:
    """Tokens generated per row."""
    return self.rounds * self.new_tokens

  @property
  def mean_filled_slots(self) -> float:
    """A row's filled cache slots averaged over its decode steps: the prompt, the earlier
    rounds' tokens and observations, and this round's tokens so far."""
    slots = [self.prompt_len + r * (self.new_tokens + self.observation_len) + t
             for r in range(self.rounds) for t in range(self.new_tokens)]
    return float(np.mean(slots))

  @property
  def length(self) -> int:
    """Tokens of a row at the end: prompt, generations and observations."""
    return self.prompt_len + self.generated + (self.rounds - 1) * self.observation_len

  def inputs(self, batch: int, vocab_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Returns random (prompts BxP, observations Bx(rounds-1)xO) token ids."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocab_size, (batch, self.prompt_len)).astype(np.int32),
            rng.integers(0, vocab_size, (batch, max(self.rounds - 1, 0),
                                         self.observation_len)).astype(np.int32))


def jax_agent_decode(config: ModelConfig, params: Any, mesh, work: AgentDecode,
                     prompts_BxP: np.ndarray, observations_BxRxO: np.ndarray,
                     warmup: int = 1, steps: int = 3,
                     cache_size: int = 0) -> tuple[float, np.ndarray]:
  """Returns (median seconds, generated ids B x rounds*new_tokens) of greedy decoding of
  `work` with our Sampler: one prefill, a decode chunk per round, an extend between rounds;
  a KV cache of `cache_size` slots (default: the bucket that fits the work)."""
  from coa_jax.rollout.sampler import Sampler, SamplingConfig, bucket

  batch = prompts_BxP.shape[0]
  sampler = Sampler(config, mesh, batch_size=batch,
                    cache_size=max(cache_size, work.length + 1) if cache_size else
                    bucket(work.length + 1),
                    chunk=work.new_tokens, stop_ids=(), sampling=SamplingConfig(temperature=0.0))
  params = sampler.sampling_params(params)
  groups = [([row], list(prompt)) for row, prompt in enumerate(prompts_BxP)]
  out = []

  def run():
    state = sampler.prefill_groups(params, sampler.init_state(), groups, [work.length] * batch)
    generated = []
    for r in range(work.rounds):
      if r:
        state = sampler.extend_rows(params, state, {row: list(observations_BxRxO[row, r - 1])
                                                    for row in range(batch)})
      state, chunk = sampler.decode_chunk(params, state, jax.random.key(0))
      generated.append(np.asarray(chunk.tokens_BxK))
      assert (np.asarray(chunk.counts_B) == work.new_tokens).all(), chunk.counts_B
    out[:] = [np.concatenate(generated, axis=1)]

  return time_calls(run, warmup, steps), out[0]


def hf_agent_decode(folder: str, dtype: str, work: AgentDecode, prompts_BxP: np.ndarray,
                    observations_BxRxO: np.ndarray, warmup: int = 1, steps: int = 3,
                    cache_size: int = 0) -> tuple[float, np.ndarray]:
  """Returns (median seconds, generated ids) of the same work with HF transformers `generate`
  (greedy, SDPA attention, its static KV cache of `cache_size` slots, default the work's
  length, kept across rounds: each round's call feeds only the last sampled token and the
  observation) on `torch_device()`."""
  import torch
  import transformers

  device = torch_device()
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device)
  model.eval()
  batch = prompts_BxP.shape[0]
  cache = transformers.StaticCache(config=model.config,
                                   max_cache_len=max(cache_size, work.length + 1))
  prompts = torch.as_tensor(prompts_BxP, dtype=torch.long, device=device)
  observations = torch.as_tensor(observations_BxRxO, dtype=torch.long, device=device)
  out = []

  def run():
    cache.reset()
    ids = prompts
    generated = []
    with torch.no_grad():
      for r in range(work.rounds):
        if r:
          ids = torch.cat([ids, observations[:, r - 1]], dim=1)
        start = ids.shape[1]
        ids = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=work.new_tokens, min_new_tokens=work.new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=0)
        generated.append(ids[:, start:])
    _synchronize(device)
    out[:] = [torch.cat(generated, dim=1).cpu().numpy()]
    assert out[0].shape == (batch, work.generated), out[0].shape

  seconds = time_calls(run, warmup, steps)
  del run, model, cache
  _release(device)
  return seconds, out[0]


def measure_config_step(settings: SFTSettings, steps: int, warmup: int = 1) -> dict[str, Any]:
  """Runs an SFT run's train step (its model, optimizer, mesh, batch and micro-batches) on
  this machine's devices, on random weights and full random rows, and returns what the
  compiler predicted beside what the devices did: bytes per device (compiler: arguments +
  unaliased outputs + temporaries; measured: the allocator's peak, where the backend reports
  one), seconds per step, tokens/s and MFU against the device's dense bf16 peak."""
  from coa_jax.perf import aot, flops

  model_config = settings.model.fresh_config()
  devices = jax.devices()
  compiled, mesh, compile_s, _ = aot.compile_train_step(
      model_config, settings.optimizer, devices, settings.mesh, settings.batch_size,
      settings.seq_len, settings.train.micro_batches)
  memory = compiled.memory_analysis()
  model, tx = Transformer(model_config), optimizer.make_optimizer(settings.optimizer)
  state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
  stats = lambda: devices[0].memory_stats() or {}
  after_init = stats()
  tokens = np.random.default_rng(0).integers(0, model_config.vocab_size,
                                             (settings.batch_size, settings.seq_len + 1))
  batch = sharding.shard_batch(step_lib.next_token_batch(tokens), mesh)
  step = step_lib.jit_train_step(model, tx, mesh, micro_batches=settings.train.micro_batches)
  holder, losses = [state], []

  def run():
    holder[0], metrics = step(holder[0], batch)
    losses.append(float(metrics["loss"]))

  seconds = time_calls(run, warmup, steps)
  chip = hardware.chip_for(devices[0].device_kind) if devices[0].platform != "cpu" else None
  model_flops = flops.train_flops(model_config, settings.batch_size, settings.seq_len)
  after = stats()
  return dict(
      device=devices[0].device_kind, devices=len(devices), mesh=dict(mesh.shape),
      params=model_config.num_params(), adapter_params=model_config.lora_params(),
      batch=settings.batch_size, seq_len=settings.seq_len,
      micro_batches=settings.train.micro_batches, compile_seconds=compile_s,
      compiler_peak_bytes=(memory.argument_size_in_bytes + memory.output_size_in_bytes -
                           memory.alias_size_in_bytes + memory.temp_size_in_bytes),
      compiler_argument_bytes=memory.argument_size_in_bytes,
      compiler_temp_bytes=memory.temp_size_in_bytes,
      measured_in_use_after_init=after_init.get("bytes_in_use"),
      measured_peak_after_init=after_init.get("peak_bytes_in_use"),
      measured_peak_bytes=after.get("peak_bytes_in_use"),
      device_bytes_limit=after.get("bytes_limit"),
      step_seconds=seconds, tokens_per_s=settings.batch_size * settings.seq_len / seconds,
      model_flops=model_flops,
      mfu=None if chip is None else model_flops / len(devices) / seconds / chip.peak_bf16_flops,
      losses=losses)
