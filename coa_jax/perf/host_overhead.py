"""The sampler's host overhead: its real decode loop against the decode step alone.

Four loops that generate the same tokens from the same prefilled state, and the rollout loop,
timed interleaved (the rollout's runs between theirs):

- floor: one jitted decode step (the model on the pending tokens, the row keys, sampling) with
  the state donated, called in a tight Python loop, synchronised once at the end; each step
  reads the cache window its chunk reads in the sampler (`Sampler.window_for`);
- floor_on_device: the same step run `tokens` times inside one program (no host at all);
- chunks: `Sampler.decode_chunk` called in a tight loop, nothing fetched (the chunk's own
  bookkeeping on device: stop checks, budgets, the token and log-prob buffers);
- sampler: `Sampler.decode_chunk` a chunk at a time as the rollout loop drives it: the chunk's
  tokens, log-probs, counts and the rows still active fetched to the host after every chunk, and
  the stop checks (on device, and the host's look at the rows that stopped);
- rollout: `Rollout.run` on tasks, prefills, tool calls (answered at once) and refills included,
  per sampled token and per decode step the device ran.

Host overhead is sampler / floor - 1, as the ratio of medians and as the median of the ratios
of runs timed back to back (steadier on a shared machine). One more, instrumented, sampler run
splits a chunk's host time: dispatch (until decode_chunk returns), waiting for the device,
fetching the outputs once they are ready, and the host's checks. The sampler's stop ids lie past
the vocabulary, so the comparison in the device loop runs but never fires and every row
generates `tokens` tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from coa_jax.model import ModelConfig, Transformer
from coa_jax.rollout.sampler import Sampler, SamplingConfig, sample_tokens, token_keys
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, stop_ids
from coa_jax.runtime import sharding
from tools_env import ToolRegistry


@dataclasses.dataclass(frozen=True)
class DecodeWork:
  """`batch` rows with `prompt_len`-token prompts, each generating `tokens` tokens in chunks."""

  batch: int = 16
  prompt_len: int = 32
  tokens: int = 256
  chunk: int = 32
  repeats: int = 15


def decode_step(sampler: Sampler, key: jax.Array) -> Callable[[Any, Any, int], Any]:
  """Returns the (params, state, window) -> state step that samples one token per row reading
  the cache slots [0, window) (0: all): the decode chunk's per-token work without its
  bookkeeping."""

  def step(params, state, window=0):
    cache = state.cache
    logits_BxTxV, cache = sampler._run(params, cache, state.pending_B[:, None],
                                       cache.lengths_B[:, None], model=sampler.decode_model,
                                       window=window)
    keys_B = token_keys(key, state.seed_B, cache.lengths_B)
    token_B, _ = sample_tokens(logits_BxTxV[:, -1], keys_B, sampler.sampling)
    return state.replace(cache=cache.replace(lengths_B=cache.lengths_B + 1), pending_B=token_B)

  return step


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
  """Returns the wall and the process CPU seconds of fn() and its device work."""
  start, cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn())
  return time.perf_counter() - start, time.process_time() - cpu


def _chunks_loop(sampler: Sampler, params, state, key, chunks: int):
  """Decodes `chunks` chunks back to back, fetching nothing; returns the last chunk."""
  for _ in range(chunks):
    state, chunk = sampler.decode_chunk(params, state, key)
  return chunk


def _sampler_loop(sampler: Sampler, params, state, key, chunks: int,
                  split: dict[str, float] | None = None):
  """Decodes `chunks` chunks as the rollout loop does; returns the last chunk's tokens. With
  `split`, adds the seconds of each part of a chunk's host time to it (see the module doc)."""
  clock = time.perf_counter
  for _ in range(chunks):
    start = clock()
    state, chunk = sampler.decode_chunk(params, state, key)
    if split is not None:
      dispatched = clock()
      jax.block_until_ready((state.active_B, chunk))
      ready = clock()
    tokens_BxK, _, counts_B, still_B = map(np.asarray, (
        chunk.tokens_BxK, chunk.logprobs_BxK, chunk.counts_B, state.active_B))
    fetched = clock()
    if not still_B.all():
      raise RuntimeError(f"a row stopped early: counts {counts_B}")
    if split is not None:
      for part, seconds in (("dispatch", dispatched - start), ("device_wait", ready - dispatched),
                            ("fetch", fetched - ready), ("checks", clock() - fetched)):
        split[part] = split.get(part, 0.0) + seconds
  return tokens_BxK


def _loops(sampler: Sampler, params, key, work: DecodeWork) -> dict[str, Callable[[Any], Any]]:
  """Returns the four ways to decode `work.tokens` tokens from a state (see the module doc)."""
  step = decode_step(sampler, key)
  chunks = work.tokens // work.chunk
  # The window each chunk reads in the sampler: every row holds prompt_len - 1 tokens at first.
  windows = [sampler.window_for(work.prompt_len - 1 + i * work.chunk) for i in range(chunks)]
  jit_step = sharding.bind_mesh(jax.jit(step, donate_argnums=1, static_argnums=2), sampler.mesh)

  def all_steps(p, s):
    for window in windows:
      s = jax.lax.fori_loop(0, work.chunk, lambda _, s: step(p, s, window), s)
    return s

  on_device = sharding.bind_mesh(jax.jit(all_steps, donate_argnums=1), sampler.mesh)

  def floor(state):
    for window in windows:
      for _ in range(work.chunk):
        state = jit_step(params, state, window)
    return state

  return {"floor": floor, "floor_on_device": lambda state: on_device(params, state),
          "chunks": lambda state: _chunks_loop(sampler, params, state, key, chunks),
          "sampler": lambda state: _sampler_loop(sampler, params, state, key, chunks)}


def sampler_vs_step(config: ModelConfig, params: Any, work: DecodeWork,
                    sampling: SamplingConfig = SamplingConfig(),
                    rollout: tuple[Rollout, list[Any]] | None = None) -> dict[str, Any]:
  """Returns the per-step seconds (median, min, max) and tokens/s of each loop of the module
  doc on one device, run interleaved, the overheads between them, a chunk's host time split
  and the sampler's compilations after warm-up; with `rollout` = (engine, tasks), also the
  rollout loop's figures (`rollout_loop`), its runs interleaved with the others."""
  if work.tokens % work.chunk:
    raise ValueError(f"tokens={work.tokens} is not a multiple of chunk={work.chunk}")
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  stops = range(config.vocab_size, config.vocab_size + 6)  # checked, never sampled
  sampler = Sampler(config, mesh, work.batch, work.prompt_len + work.tokens, work.chunk, stops,
                    sampling)
  params = sampler.sampling_params(params)
  key = jax.random.key(0)
  prompts_BxP = np.random.default_rng(0).integers(0, config.vocab_size,
                                                  (work.batch, work.prompt_len))
  groups = [([row], list(ids)) for row, ids in enumerate(prompts_BxP)]
  budget = [work.prompt_len + work.tokens + 1] * work.batch
  fresh = lambda: jax.block_until_ready(sampler.prefill_groups(params, sampler.init_state(),
                                                               groups, budget))
  runs = _loops(sampler, params, key, work)
  for run in runs.values():  # warm-up: compile everything
    _timed(lambda: run(fresh()))
  rollouts = RolloutRuns(*rollout) if rollout else None
  warm = sampler.compilations()
  seconds = {name: [] for name in runs}
  for _ in range(work.repeats):
    for name, run in runs.items():
      state = fresh()
      seconds[name].append(_timed(lambda: run(state)))
    if rollouts:
      rollouts.run()
  chunks, split = work.tokens // work.chunk, {}
  _sampler_loop(sampler, params, fresh(), key, chunks, split)
  out = dict(dataclasses.asdict(work), device=jax.devices()[0].device_kind,
             params=config.num_params(), cache_size=sampler.cache_size,
             compilations_after_warmup=sampler.compilations() - warm,
             host_split_per_chunk_s={part: t / chunks for part, t in split.items()})
  out.update(_overheads(seconds, work))
  if rollouts:
    out["rollout"] = rollouts.figures()
    floor = [w / work.tokens for w, _ in seconds["floor"]]
    out["rollout_overhead_paired"] = _paired(rollouts.device_step_s, floor)
  return out


def _overheads(seconds: dict[str, list[tuple[float, float]]],
               work: DecodeWork) -> dict[str, Any]:
  """Returns each loop's figures and the overheads between loops (module doc), in wall time
  and, steadier on a shared machine, in the process's CPU time."""
  wall = {name: [w for w, _ in times] for name, times in seconds.items()}
  cpu = {name: [c for _, c in times] for name, times in seconds.items()}
  out = {name: dict(_figures(wall[name], work.tokens, work.batch * work.tokens),
                    cpu_step_s=float(np.median(cpu[name])) / work.tokens) for name in seconds}
  for name, top, base in (("host_overhead", "sampler", "floor"),
                          ("overhead_vs_on_device", "sampler", "floor_on_device"),
                          ("chunk_bookkeeping", "chunks", "floor_on_device"),
                          ("fetch_and_checks", "sampler", "chunks")):
    out[name] = out[top]["step_s"] / out[base]["step_s"] - 1
    out[name + "_paired"] = _paired(wall[top], wall[base])
    out[name + "_cpu"] = _paired(cpu[top], cpu[base])
  return out


def _paired(top: list[float], base: list[float]) -> dict[str, float]:
  """Returns the median, min and max of top[i] / base[i] - 1 over runs timed back to back."""
  ratios = np.asarray(top) / np.asarray(base) - 1
  return dict(median=float(np.median(ratios)), min=float(ratios.min()), max=float(ratios.max()))


def _figures(times: list[float], steps: int, generated: int) -> dict[str, float]:
  """Returns per-step seconds (median, min, max) and tokens/s of runs of `steps` steps."""
  median = float(np.median(times))
  return dict(step_s=median / steps, min_step_s=min(times) / steps,
              max_step_s=max(times) / steps, tokens_per_s=generated / median, runs=len(times))


def rollout_engine(config: ModelConfig, params: Any, work: DecodeWork, tokenizer: Any,
                   sampling: SamplingConfig = SamplingConfig()) -> Rollout:
  """Returns a `Rollout` of `work.batch` rows (groups of one) and chunk `work.chunk`, each
  sample allowed `work.tokens` response tokens, whose tool calls are answered at once (an
  empty registry: an unknown-tool error observation)."""
  limits = RolloutConfig(max_prompt_tokens=work.prompt_len, max_response_tokens=work.tokens,
                         max_turns=4, max_observation_tokens=16)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  sampler = Sampler(config, mesh, work.batch, limits.cache_size, work.chunk, stop_ids(tokenizer),
                    sampling)
  return Rollout(sampler, sampler.sampling_params(params), tokenizer, ToolRegistry({}), limits,
                 "You are an agent.", seed=0)


class RolloutRuns:
  """Timed runs of `engine.run(tasks)` (after a warm-up run) and their figures."""

  def __init__(self, engine: Rollout, tasks: list[Any]):
    self.engine, self.tasks = engine, tasks
    list(engine.run(tasks))
    self.warm = engine.sampler.compilations()
    self.token_step_s, self.device_step_s, self.cpu_step_s, self.counts = [], [], [], []

  def run(self) -> None:
    """Times one run: per decode step's worth of sampled tokens (batch tokens) and per decode
    step the device ran (a chunk runs as many steps as its longest row sampled)."""
    engine, batch = self.engine, self.engine.sampler.batch_size
    tokens, chunks, decode_s = engine.tokens_sampled, engine.chunks, engine.decode_s
    (wall, cpu), records, steps = _timed_run(engine, self.tasks)
    tokens = engine.tokens_sampled - tokens
    self.token_step_s.append(wall * batch / tokens)
    self.device_step_s.append(wall / steps)
    self.cpu_step_s.append(cpu / steps)
    self.counts.append((tokens, steps, engine.chunks - chunks, sum(r.turns for r in records),
                        (engine.decode_s - decode_s) / wall))

  def figures(self) -> dict[str, Any]:
    """Returns medians (and the spread) over the runs, and the compilations after warm-up."""
    step, batch = float(np.median(self.token_step_s)), self.engine.sampler.batch_size
    tokens, steps, chunks, calls, _ = (int(np.median(c)) for c in zip(*self.counts))
    return dict(step_s=step, min_step_s=min(self.token_step_s),
                max_step_s=max(self.token_step_s), tokens_per_s=batch / step,
                runs=len(self.counts), device_step_s=float(np.median(self.device_step_s)),
                cpu_step_s=float(np.median(self.cpu_step_s)), tasks=len(self.tasks),
                tokens_per_run=tokens, device_steps_per_run=steps,
                rows_busy=tokens / (steps * batch), chunks_per_run=chunks,
                tool_calls_per_run=calls,
                decode_share=float(np.median([c[-1] for c in self.counts])),
                compilations_after_warmup=self.engine.sampler.compilations() - self.warm)


def _timed_run(engine: Rollout, tasks: list[Any]) -> tuple[tuple[float, float], list[Any], int]:
  """Returns ((wall, CPU) seconds, records, decode steps the device ran) of one
  `engine.run(tasks)`: a chunk runs as many steps as its longest row sampled."""
  sampler, records, counts = engine.sampler, [], []
  decode = sampler.decode_chunk

  def counted(params, state, key):
    state, chunk = decode(params, state, key)
    counts.append(chunk.counts_B)
    return state, chunk

  sampler.decode_chunk = counted
  try:
    seconds = _timed(lambda: records.extend(r for group in engine.run(tasks) for r in group))
  finally:
    sampler.decode_chunk = decode
  return seconds, records, sum(int(np.max(c)) for c in counts)
