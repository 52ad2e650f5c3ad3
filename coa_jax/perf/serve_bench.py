"""Serving throughput and latency against the offline sampler (`make bench-serve`).

1. **Offline**: the sampler alone, as the evaluation drives it: `sessions` prompts prefilled in
   one batch of as many rows, then decode chunks until every row has `max_tokens` tokens or
   stopped. Tokens per second of wall time, prefill included.
2. **Served**: the same prompts as `sessions` concurrent chat sessions of the official `openai`
   client (`AsyncOpenAI`, streaming) against the server on a local port (the engine with as many
   rows): tokens per second over the whole run, time to first token and the time between a
   session's later tokens (p50 and p99 over sessions).
3. **A session's second turn**: each session sends its history and a tool result back (its
   prompt extends what the row holds); against the same prompts cold (another server, prefix
   reuse off). Prefilled tokens counted by the engine, and time to first token.

The served run pays for HTTP, JSON, scheduling between chunks and detokenizing; the ratio of
its tokens per second to the offline sampler's is what serving costs.

4. **Against the hardware and a peer** (on a GPU, `experiments/device_check.py`): the served
   tokens per second as a fraction of the decode roofline (every weight and each row's filled
   KV slots read once a step at the memory bandwidth, or 2 x params FLOPs a row at the peak,
   whichever binds: `roofline`), and HF transformers `generate` on the same weights, batch,
   prompt length and new tokens (greedy, its static cache: `bench.hf_agent_decode`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import time
from typing import Any

import jax
import numpy as np
import openai

from coa_jax.data.tokenizer import CoATokenizer
from coa_jax.model import ModelConfig
from coa_jax.perf import bench
from coa_jax.rollout.sampler import RowSampling, Sampler, SamplingConfig
from coa_jax.serving.api import Server, ThreadServer, create_app
from coa_jax.serving.engine import Engine, EngineSettings

MODEL = "bench"


@dataclasses.dataclass(frozen=True)
class Work:
  sessions: int = 64
  max_tokens: int = 128
  chunk: int = 16
  cache_size: int = 640
  temperature: float = 0.6


def questions(sessions: int, offset: int = 0) -> list[str]:
  return [f"What is the population of City {100 + offset + i} *{3 + i % 27}?"
          for i in range(sessions)]


def offline(model_config: ModelConfig, mesh, params: Any, tokenizer: CoATokenizer,
            system_prompt: str, work: Work, stop_ids) -> dict[str, float]:
  """Tokens per second of the sampler alone over `work.sessions` prompts in one batch."""
  sampler = Sampler(model_config, mesh, batch_size=work.sessions, cache_size=work.cache_size,
                    chunk=work.chunk, stop_ids=stop_ids, sampling=None)
  rows = RowSampling.of([SamplingConfig(work.temperature)] * work.sessions)
  weights = sampler.sampling_params(params)
  prompts = [tokenizer.prompt_ids(system_prompt, q) for q in questions(work.sessions)]
  key = jax.random.key(0)

  def run() -> int:
    state = sampler.init_state()
    groups = [([i], p) for i, p in enumerate(prompts)]
    state = sampler.prefill_groups(weights, state, groups,
                                   [len(p) + work.max_tokens for p in prompts],
                                   [[i] for i in range(work.sessions)])
    tokens = 0
    while np.asarray(state.active_B).any():
      active = np.flatnonzero(np.asarray(state.active_B))
      state, chunk = sampler.decode_chunk(weights, state, key, rows=active, row_sampling=rows)
      tokens += int(np.asarray(chunk.counts_B).sum())
    return tokens

  run()  # compiles
  start = time.perf_counter()
  tokens = run()
  wall = time.perf_counter() - start
  return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


@contextlib.contextmanager
def serving(model_config: ModelConfig, mesh, params: Any, tokenizer: CoATokenizer,
            system_prompt: str, work: Work, stop_ids, prefix_cache: bool = True):
  """Yields (base URL, server) of the API over an engine of `work.sessions` rows."""
  settings = EngineSettings(slots=work.sessions, cache_size=work.cache_size, chunk=work.chunk,
                            max_queue=4 * work.sessions, max_top_logprobs=0,
                            prefix_cache=prefix_cache)
  engine = Engine(model_config, mesh, params, settings, stop_ids)
  engine.warm_up(prompt_len(tokenizer, system_prompt, work.sessions))
  engine.start()
  server = Server(engine, tokenizer, MODEL, system_prompt, max_tokens=work.max_tokens)
  http = ThreadServer(create_app(server))
  try:
    yield f"{http.url}/v1", server
  finally:
    http.close()
    engine.close(drain=False, timeout=30)


async def _session(client: openai.AsyncOpenAI, messages: list[dict], work: Work,
                   seed: int) -> dict[str, Any]:
  """One streamed chat call: its token count, reply (content and tool call), time to first
  token and time a token after it."""
  start = time.perf_counter()
  stamps, tokens, content, calls = [], 0, "", []
  stream = await client.chat.completions.create(
      model=MODEL, messages=messages, temperature=work.temperature, seed=seed,
      max_tokens=work.max_tokens, stream=True, extra_body={"return_token_ids": True})
  async for chunk in stream:
    if not chunk.choices:
      continue
    choice = chunk.choices[0]
    new = len(choice.model_extra.get("token_ids") or [])
    if new:
      stamps.append(time.perf_counter())
      tokens += new
    content += choice.delta.content or ""
    calls += [c.model_dump() for c in choice.delta.tool_calls or []]
  reply = {"role": "assistant", "content": content}
  if calls:
    for call in calls:
      call.pop("index", None)
    reply["tool_calls"] = calls
  return {"tokens": tokens, "reply": reply,
          "ttft": stamps[0] - start if stamps else float("nan"),
          "per_token": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else float("nan")}


def clients(url: str, conversations: list[list[dict]], work: Work) -> tuple[list, float]:
  """Runs the sessions from a process of their own, as a server's clients are: in the
  server's process, building and parsing 64 requests held the engine's thread off the
  interpreter for 0.7 s before the first one arrived."""
  with concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(_run_sessions, url, conversations, work).result()


def _run_sessions(url: str, conversations: list[list[dict]], work: Work) -> tuple[list, float]:
  return asyncio.run(_all(url, conversations, work))


async def _all(url: str, conversations: list[list[dict]], work: Work) -> tuple[list, float]:
  client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
  await client.models.list()  # the client's lazy imports and first connection, untimed
  start = time.perf_counter()
  results = await asyncio.gather(*(_session(client, messages, work, seed)
                                   for seed, messages in enumerate(conversations)))
  wall = time.perf_counter() - start
  await client.close()
  return results, wall


def served(url: str, server: Server, work: Work, offset: int = 0
           ) -> tuple[dict[str, float], list]:
  """Tokens per second and latencies of `work.sessions` concurrent sessions (a run of other
  questions first compiles what they use: `offset`)."""
  conversations = [[{"role": "user", "content": q}] for q in questions(work.sessions, offset)]
  compiled = server.engine.sampler.compilations()
  server.engine.first_token_s.clear()
  results, wall = clients(url, conversations, work)
  compiled = server.engine.sampler.compilations() - compiled
  engine_ttft = list(server.engine.first_token_s)
  tokens = sum(r["tokens"] for r in results)
  ttft = [r["ttft"] for r in results]
  per_token = [r["per_token"] for r in results if np.isfinite(r["per_token"])]
  return ({"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
           "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
           "engine_ttft_p50_s": float(np.percentile(engine_ttft, 50)),
           "engine_ttft_p99_s": float(np.percentile(engine_ttft, 99)),
           "per_token_p50_s": float(np.percentile(per_token, 50)) if per_token else float("nan"),
           "per_token_p99_s": float(np.percentile(per_token, 99)) if per_token else float("nan"),
           "programs_compiled": compiled},
          [(conv, r) for conv, r in zip(conversations, results)])


def second_turn(url: str, server: Server, cold_url: str, cold: Server, firsts: list,
                work: Work) -> dict[str, float]:
  """Each session's next turn: its history and the reply it got, then a tool result when the
  reply called a tool (else the reply is continued), on the server that holds its rows, against
  the same prompts on a server without prefix reuse: prefilled tokens and time to first
  token."""
  conversations = []
  for conversation, result in firsts:
    turn = conversation + [result["reply"]]
    if "tool_calls" in result["reply"]:
      turn.append({"role": "tool", "content": "4215"})
    conversations.append(turn)
  out = {}
  for name, (base, state) in {"warm": (url, server), "cold": (cold_url, cold)}.items():
    before = state.engine.stats["prefill_tokens"]
    compiled = state.engine.sampler.compilations()
    state.engine.first_token_s.clear()
    results, _ = clients(base, conversations, work)
    out[f"{name}_programs_compiled"] = state.engine.sampler.compilations() - compiled
    out[f"{name}_prefill_tokens"] = state.engine.stats["prefill_tokens"] - before
    out[f"{name}_ttft_p50_s"] = float(np.percentile([r["ttft"] for r in results], 50))
    out[f"{name}_engine_ttft_p50_s"] = float(np.percentile(state.engine.first_token_s, 50))
  return out


def prompt_len(tokenizer: CoATokenizer, system_prompt: str, sessions: int) -> int:
  """The sessions' mean prompt length in tokens."""
  return round(np.mean([len(tokenizer.prompt_ids(system_prompt, q))
                        for q in questions(sessions)]))


def roofline(model_config: ModelConfig, sessions: int, prompt: int, work: Work,
             bandwidth: float, peak: float) -> dict[str, Any]:
  """Returns the decode roofline of `sessions` rows generating `work.max_tokens` after prompts
  of `prompt` tokens: tokens/s at the binding limit, and which binds."""
  filled = prompt + work.max_tokens / 2  # a row's filled slots, averaged over its steps
  bounds = {"memory": bench.decode_step_bytes(model_config, sessions, filled) / bandwidth,
            "compute": 2 * model_config.num_params() * sessions / peak}
  bound = max(bounds, key=bounds.get)
  return {"roofline_tokens_per_s": sessions / bounds[bound], "bound": bound}


def hf_generate(folder: str, model_config: ModelConfig, sessions: int, prompt: int,
                work: Work) -> float:
  """Tokens/s of HF transformers `generate` on the checkpoint in `folder`: `sessions` random
  prompts of `prompt` tokens, `work.max_tokens` new tokens each, greedy."""
  decode = bench.AgentDecode(prompt_len=prompt, new_tokens=work.max_tokens, rounds=1,
                             observation_len=0)
  prompts, observations = decode.inputs(sessions, model_config.vocab_size)
  seconds, _ = bench.hf_agent_decode(folder, model_config.dtype, decode, prompts, observations,
                                     warmup=1, steps=1)
  return sessions * work.max_tokens / seconds
