"""A serving engine over the JAX sampler: requests join and leave one decode batch between chunks.

The engine owns a `Sampler` built for per-row sampling settings (`sampling=None`) and one
`DecodeState` of `slots` rows. A thread of its own runs rounds: each round ends what was cancelled
or is past its deadline, admits waiting requests into free rows (a prefill, or an extend of a
row whose cache holds the request's prefix), decodes one chunk of the active rows and hands each
request the tokens its rows sampled. Nothing else touches the device state, so callers on any
thread only `submit` requests and read their `Handle`s.

- **Sampling per request.** Temperature, top-k and top-p are per row (`RowSampling`); a
  request's seed gives its rows their sampling seeds, and a row's tokens depend on the engine's
  key, its seed and its own tokens only (`rollout.sampler`), not on what else is in the batch
  (up to a kernel's rounding for another batch shape): the same request with the same seed gives
  the same tokens (tested beside other requests, and on 8 devices against one).
- **Prefix reuse.** A row that ended on the device (a stop token, or its budget) is parked with
  its sequence (prompt and completion) in its cache. A later request of one sample whose prompt
  extends a parked sequence (or is it) takes that row and only the new tokens are fed
  (`extend`, the round's resumed rows in one call): a chat's next turn does not prefill its
  history again. Parked rows are taken back when no row is free, least recently used first
  and those a waiting request extends last; all are dropped when the weights change.
- **Latency.** New prompts are prefilled `prefill_batch` at a time (one program for any
  arrival pattern), the round after requests join decodes `first_chunk` steps (their first
  tokens sooner), and `warm_up` compiles the prefill and every decode window before the first
  request. `first_token_s` keeps each request's time from arrival to its first token.
- **Backpressure.** At most `max_queue` requests wait; `submit` then raises `QueueFull`. After
  `close` it raises `ShuttingDown`; `close(drain=True)` lets what is in flight finish.
- **Weights.** `set_params` swaps the weights at the next round (an RL trainer serving its current
  policy); every token records the version of the weights that sampled it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from coa_jax.model.config import ConfigError, ModelConfig
from coa_jax.rollout.sampler import RowSampling, Sampler, SamplingConfig
from coa_jax.serving.requests import (CANCELLED, DEADLINE, ERROR, LENGTH, STOP, EngineError,
                                      Finished, Handle, QueueFull, Request, Result, ShuttingDown,
                                      Tokens)

# What a chat's next turn adds to its parked row (padded to a power of two) that `warm_up`
# compiles an extend for: a tool result and the chat template's few tokens around it.
EXTEND_BUCKETS = (8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
  """The engine's shape: `slots` rows of `cache_size` tokens (prompt and completion) decoded
  `chunk` tokens a round; requests join and leave between rounds."""

  slots: int = 64
  cache_size: int = 2048
  chunk: int = 16
  max_queue: int = 256  # waiting requests; one more is refused (QueueFull)
  max_top_logprobs: int = 5  # the most top_logprobs a request may ask for (a static shape)
  # Requests prefilled in one call, padded to this count: one program for every arrival
  # pattern (a count of its own for each arrival count compiled mid-run, 3.4 s on a CPU).
  prefill_batch: int = 8
  # Steps of the round after requests joined (unless the round before was such a one): their
  # first tokens leave after this many steps instead of a whole chunk (the same tokens).
  first_chunk: int = 1
  prefix_cache: bool = True
  seed: int = 0  # the engine's sampling key; a request's seed picks its rows' seeds

  def __post_init__(self):
    for name in ("slots", "cache_size", "chunk", "max_queue", "prefill_batch", "first_chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: expected a positive integer")
    if not 0 <= self.max_top_logprobs <= 20:
      raise ConfigError(f"max_top_logprobs={self.max_top_logprobs!r}: expected 0..20")


LOGPROB_FLOOR = -9999.0  # what OpenAI's API reports for a token the sampling cannot draw


@dataclasses.dataclass
class _Row:
  """A row of the decode batch: free, serving a sample of a request, or parked with `ids` (its
  sequence) in its cache."""

  handle: Handle | None = None
  sample: int = 0
  ids: list[int] = dataclasses.field(default_factory=list)
  parked: bool = False
  used: float = 0.0
  version: int = 0  # the weights its cache was started with (a parked row's: the current ones)


class Engine:
  """Continuous batching over one `Sampler`; see the module docstring."""

  def __init__(self, model_config: ModelConfig, mesh: Mesh, params: Any,
               settings: EngineSettings, stop_ids: Sequence[int],
               sampler: Sampler | None = None):
    """`sampler`: another engine's, to share its compiled programs (the same settings)."""
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
      raise ConfigError("the serving engine decodes on one process's devices (each host of an "
                        "RL job serves on its own decode mesh)")
    self.settings = settings
    self.sampler = sampler or Sampler(model_config, mesh, batch_size=settings.slots,
                                      cache_size=settings.cache_size, chunk=settings.chunk,
                                      stop_ids=stop_ids, sampling=None,
                                      top_logprobs=settings.max_top_logprobs)
    self.stop_ids = frozenset(int(i) for i in stop_ids)
    # None: nothing is decoded until `set_params` (an RL trainer's weights arrive per step).
    self._params = None if params is None else self.sampler.sampling_params(params)
    self._next_params: tuple[Any, int] | None = None
    self._next_key: jax.Array | None = None
    self.version = 0
    self._state = self.sampler.init_state()
    self._key = jax.random.key(settings.seed)
    self._rows = [_Row() for _ in range(settings.slots)]
    self._sampling = RowSampling.of([SamplingConfig()] * settings.slots)
    self._waiting: collections.deque[Handle] = collections.deque()
    self._lock = threading.Condition()
    self._closing = False
    self._drain = True
    self._seeds = itertools.count(1)
    self._short = False  # the last round decoded first_chunk steps
    self.stats = collections.Counter()
    # Seconds from each request's arrival to its first token leaving the engine (the latest).
    self.first_token_s: collections.deque[float] = collections.deque(maxlen=4096)
    self.error = ""  # the engine's own failure, once it stopped on one
    self._thread: threading.Thread | None = None

  # --- callers' side (any thread) ---------------------------------------------------------

  def submit(self, request: Request, on_event: Callable[[Any], None] | None = None) -> Handle:
    """Queues `request`; raises EngineError (bad request), QueueFull or ShuttingDown."""
    self._check(request)
    handle = Handle(request, on_event)
    with self._lock:
      if self._closing:
        raise ShuttingDown("the server is shutting down")
      if len(self._waiting) >= self.settings.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (serve.max_queue="
                        f"{self.settings.max_queue}); retry later")
      self._waiting.append(handle)
      self._lock.notify()
    return handle

  def generate(self, request: Request, timeout: float | None = None) -> Result:
    """Submits `request` and waits for its result (the engine must be running)."""
    return self.submit(request).result(timeout)

  def set_params(self, params: Any, version: int) -> None:
    """Serves `params` (version `version`) from the next round on."""
    with self._lock:
      self._next_params = (params, version)

  def set_key(self, key: jax.Array) -> None:
    """Samples with `key` from the next round on (a row's tokens depend on the key, its seed
    and its tokens: an RL run gives each run of rollouts a key of its own)."""
    with self._lock:
      self._next_key = key

  def warm_up(self, prompt_tokens: int) -> int:
    """Compiles, before the engine starts, the programs that serving one-sample requests of
    about `prompt_tokens` prompt tokens calls: their prefill, and a decode chunk at every
    window from theirs to the cache size, of the whole batch and of each row count decoded
    alone. Which of them a run needs depends on when its requests arrive; a program compiled
    mid-run holds every row's next tokens (3-5 s on a CPU). And the extend of a chat's next
    turn for each of `EXTEND_BUCKETS` new tokens (a longer one compiles when it comes). Returns
    the programs compiled."""
    if self._thread is not None or self._params is None:
      raise RuntimeError("warm_up runs with weights, before start")
    sampler, before = self.sampler, self.sampler.compilations()
    size = self._call_rows
    prefill = lambda state: sampler.prefill_groups(  # rows past the batch are padding
        self._params, state, [([self.settings.slots], [0] * prompt_tokens)] * size,
        [prompt_tokens + 1] * size, pad_to=size)
    state = prefill(self._state)
    window = sampler.window_for(prompt_tokens)
    alone = [r for r in (2**i for i in range(3, 16)) if 2 * r <= self.settings.slots]
    while True:
      for rows in [None, *(list(range(r)) for r in alone)]:
        state, _ = sampler.decode_chunk(self._params, state, self._key, window=window,
                                        rows=rows, row_sampling=self._sampling)
      if window >= self.settings.cache_size:
        break
      window = min(2 * window, self.settings.cache_size)
    # A fresh state and one a decode chunk returned are placed apart: one program each.
    state = prefill(state)
    for tokens in EXTEND_BUCKETS:  # a chat's next turn: what it adds to its parked row
      state = sampler.extend_rows(self._params, state, {self.settings.slots: [0] * tokens},
                                  window=self.settings.cache_size, pad_to=size)
    self._state = jax.block_until_ready(state)
    return sampler.compilations() - before

  @property
  def _call_rows(self) -> int:
    """Requests (prefills) or rows (extends) in one call, padded to it."""
    return min(self.settings.prefill_batch, self.settings.slots)

  def start(self) -> Engine:
    self._thread = threading.Thread(target=self._loop, name="serving-engine", daemon=True)
    self._thread.start()
    return self

  def close(self, drain: bool = True, timeout: float | None = None) -> None:
    """Stops taking requests; with `drain`, what is in flight and waiting finishes first, else
    it ends now (reason "cancelled"). Returns when the engine's thread has stopped."""
    with self._lock:
      self._closing, self._drain = True, drain
      self._lock.notify()
    if self._thread is not None:
      self._thread.join(timeout)

  @property
  def in_flight(self) -> int:
    """Requests waiting or decoding."""
    with self._lock:
      waiting = len(self._waiting)
    return waiting + len({id(r.handle) for r in self._rows if r.handle is not None})

  def _check(self, request: Request) -> None:
    s, n = self.settings, len(request.prompt_ids)
    if n < 1:
      raise EngineError("the prompt is empty")
    if not isinstance(request.n, int) or not 1 <= request.n <= s.slots:
      raise EngineError(f"n={request.n!r}: expected 1..{s.slots} samples")
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
      raise EngineError(f"max_tokens={request.max_tokens!r}: expected a positive integer")
    if n + request.max_tokens > s.cache_size:
      raise EngineError(f"the prompt's {n} tokens and max_tokens={request.max_tokens} exceed the "
                        f"model's context of {s.cache_size} tokens")
    if request.row_seeds is not None and (
        len(request.row_seeds) != request.n or not all(0 <= int(x) < 2**31
                                                       for x in request.row_seeds)):
      raise EngineError(f"row_seeds: expected {request.n} seeds in [0, 2**31)")
    if not 0 <= request.top_logprobs <= s.max_top_logprobs:
      raise EngineError(f"top_logprobs={request.top_logprobs!r}: expected 0..{s.max_top_logprobs} "
                        f"(the server's max_top_logprobs setting, at most 20)")
    vocab = self.sampler.config.vocab_size
    if any(not 0 <= int(i) < vocab for i in [*request.prompt_ids, *request.stop_ids]):
      raise EngineError(f"token ids must lie in [0, {vocab})")

  # --- the engine's thread ----------------------------------------------------------------

  def _loop(self) -> None:
    while True:
      with self._lock:
        idle = not self._waiting and all(r.handle is None for r in self._rows)
        if idle and self._closing:
          return
        if idle:
          self._lock.wait(timeout=0.5)
          continue
        if self._closing and not self._drain:
          for handle in [*self._waiting, *(r.handle for r in self._rows if r.handle)]:
            handle.cancel()
      try:
        self.step()
      except Exception as e:  # noqa: BLE001 - every request learns of it; the engine stops
        self._fail(e)
        return

  def _fail(self, error: Exception) -> None:
    """Ends every request with reason "error" after the engine's own failure (a device error):
    none is left waiting for tokens that will not come."""
    self.error = f"{type(error).__name__}: {error}"
    with self._lock:
      self._closing = True
      handles = [*self._waiting, *(r.handle for r in self._rows if r.handle)]
      self._waiting.clear()
    for handle in handles:
      for sample in range(handle.request.n):
        handle._emit(Finished(sample, ERROR))

  def step(self) -> None:
    """One round: swap weights, end cancelled and late samples, admit, decode a chunk."""
    with self._lock:
      swap, self._next_params = self._next_params, None
      if self._next_key is not None:
        self._key, self._next_key = self._next_key, None
    if swap is not None:
      self._params, self.version = self.sampler.sampling_params(swap[0]), swap[1]
      for row in self._rows:  # their caches hold the old weights' keys and values
        row.parked = False
    self._end_early()
    if self._params is None:  # no weights yet: requests wait
      with self._lock:
        self._lock.wait(timeout=0.05)
      return
    joined = self._admit()
    active = [i for i, r in enumerate(self._rows) if r.handle is not None]
    if not active:
      return
    # Short only after a whole chunk: joiners arriving every round (an agent's next turns) do
    # not make every round a short one.
    short = bool(joined) and not self._short and self.settings.first_chunk < self.settings.chunk
    self._short = short
    steps = self.settings.first_chunk if short else None
    self._state, chunk = self.sampler.decode_chunk(self._params, self._state, self._key,
                                                   rows=active, row_sampling=self._sampling,
                                                   steps=steps)
    self._deliver(active, jax.tree.map(np.asarray, chunk), np.asarray(self._state.active_B))

  def _end_early(self) -> None:
    """Frees the rows of cancelled samples and of requests past their deadline."""
    now = time.monotonic()
    with self._lock:
      late = [h for h in self._waiting if h._cancelled or self._late(h, now)]
      for handle in late:
        self._waiting.remove(handle)
    for handle in late:
      for sample in range(handle.request.n):
        handle._emit(Finished(sample, CANCELLED if sample in handle._cancelled else DEADLINE))
    ended = []
    for index, row in enumerate(self._rows):
      handle = row.handle
      if handle is None:
        continue
      if row.sample in handle._cancelled or self._late(handle, now):
        ended.append(index)
        self._free(index, CANCELLED if row.sample in handle._cancelled else DEADLINE)
    if ended:
      self._state = self.sampler.set_rows(self._state, False, ended)

  @staticmethod
  def _late(handle: Handle, now: float) -> bool:
    return handle.request.deadline is not None and now > handle.request.deadline

  def _free(self, index: int, reason: str, park: bool = False) -> None:
    row = self._rows[index]
    row.handle._emit(Finished(row.sample, reason))
    row.handle = None
    # Not a row whose cache older weights began: its keys and values are not these weights'.
    row.parked = park and self.settings.prefix_cache and row.version == self.version
    row.used = time.monotonic()

  def _admit(self) -> int:
    """Moves waiting requests into rows while rows last (a request takes all its n or waits):
    a request whose prompt extends a parked row's sequence resumes that row, the others are
    prefilled. Returns how many requests joined."""
    prefills: dict[int, list[tuple[Handle, list[int]]]] = collections.defaultdict(list)
    resumes: list[tuple[Handle, int, list[int]]] = []
    while True:
      with self._lock:
        if not self._waiting:
          break
        handle = self._waiting[0]
        rows = self._take_rows(handle.request)
        if rows is None:
          break
        self._waiting.popleft()
      new = self._extension(handle.request, rows[0])
      self._install(handle, rows)  # the rows are taken before the next request picks
      if new is not None:
        resumes.append((handle, rows[0], new))
      else:
        prefills[handle.request.n].append((handle, rows))
    self._resume(resumes)
    size = self._call_rows
    for requests in prefills.values():  # calls of `size` requests of one sample count
      for start in range(0, len(requests), size):
        group = requests[start:start + size]
        prompts = [(rows, list(handle.request.prompt_ids)) for handle, rows in group]
        budgets = [len(handle.request.prompt_ids) + handle.request.max_tokens
                   for handle, _ in group]
        seeds = [self._row_seeds(handle) for handle, _ in group]
        self._state = self.sampler.prefill_groups(self._params, self._state, prompts, budgets,
                                                  seeds, pad_to=size)
        self.stats["prefill_tokens"] += sum(len(p) for _, p in prompts)
    return len(resumes) + sum(map(len, prefills.values()))

  def _take_rows(self, request: Request) -> list[int] | None:
    """Returns n rows for `request` (free rows first, then the least recently used parked
    ones, those whose sequence a waiting request extends last; for one sample, a parked row
    holding its prompt's longest prefix first), or None."""
    free = [i for i, r in enumerate(self._rows) if r.handle is None and not r.parked]
    parked = sorted((i for i, r in enumerate(self._rows) if r.parked),
                    key=lambda i: self._rows[i].used)
    if request.n == 1 and self.settings.prefix_cache:
      prefix = self._longest_prefix(request.prompt_ids, parked)
      if prefix is not None:
        return [prefix]
    if len(free) >= request.n:
      return free[:request.n]
    if len(free) + len(parked) < request.n:
      return None
    claimed = {self._longest_prefix(h.request.prompt_ids, parked)
               for h in self._waiting if h.request.n == 1} if self.settings.prefix_cache else ()
    parked.sort(key=lambda i: i in claimed)  # stable: least recently used first in each part
    return (free + parked)[:request.n]

  def _longest_prefix(self, prompt: Sequence[int], parked: list[int]) -> int | None:
    best, best_len = None, 0
    for index in parked:
      ids = self._rows[index].ids
      if best_len < len(ids) <= len(prompt) and list(prompt[:len(ids)]) == ids:
        best, best_len = index, len(ids)
    return best

  def _extension(self, request: Request, index: int) -> list[int] | None:
    """The ids `request`'s prompt adds to what parked row `index` held, or None when the row
    was not parked or its sequence is not a prefix of the prompt."""
    row, prompt = self._rows[index], list(request.prompt_ids)
    if request.n != 1 or not row.parked or prompt[:len(row.ids)] != row.ids:
      return None
    return prompt[len(row.ids):]

  def _resume(self, resumes: list[tuple[Handle, int, list[int]]]) -> None:
    """Resumes parked rows, each with the rest of its request's prompt: rows with nothing new
    resume as they are (their last token is pending, not in the cache yet), the others get
    their new ids, `prefill_batch` rows an extend reading the whole cache."""
    if not resumes:
      return
    for as_is in (True, False):
      group = [(handle, index) for handle, index, new in resumes if (not new) == as_is]
      if group:
        self._state = self.sampler.set_rows(
            self._state, as_is, [index for _, index in group],
            [len(h.request.prompt_ids) + h.request.max_tokens for h, _ in group],
            [seed for h, _ in group for seed in self._row_seeds(h)])
    appends = [(index, new) for _, index, new in resumes if new]
    size = self._call_rows
    for start in range(0, len(appends), size):  # one program a token bucket, as `warm_up`'s
      self._state = self.sampler.extend_rows(self._params, self._state,
                                             dict(appends[start:start + size]),
                                             window=self.settings.cache_size, pad_to=size)
    for handle, _, new in resumes:
      handle.cached_tokens = len(handle.request.prompt_ids) - len(new)
      self.stats["cached_tokens"] += handle.cached_tokens
      self.stats["prefill_tokens"] += len(new)

  def _install(self, handle: Handle, rows: list[int]) -> None:
    request = handle.request
    for sample, index in enumerate(rows):
      self._rows[index] = _Row(handle, sample, list(request.prompt_ids), version=self.version)
      self._sampling.temperature_B[index] = request.sampling.temperature
      self._sampling.top_k_B[index] = request.sampling.top_k
      self._sampling.top_p_B[index] = request.sampling.top_p

  def _row_seeds(self, handle: Handle) -> list[int]:
    """The rows' sampling seeds: from the request's seed (the same seed, the same samples), or
    fresh ones."""
    if handle.request.row_seeds is not None:
      return [int(s) for s in handle.request.row_seeds]
    seed = handle.request.seed
    if seed is None:
      seed = next(self._seeds) * 7919 + (time.monotonic_ns() & 0xFFFF)
    return [(int(seed) * 1_000_003 + i) % (2**31 - 1) for i in range(handle.request.n)]

  def _deliver(self, active: list[int], chunk, still_active: np.ndarray) -> None:
    """Hands each active row's sampled tokens to its request and ends the rows that stopped."""
    frozen = []
    for index in active:
      row = self._rows[index]
      count = int(chunk.counts_B[index])
      ids = chunk.tokens_BxK[index, :count].tolist()
      logprobs = chunk.logprobs_BxK[index, :count].tolist()
      stops = row.handle.request.stop_ids
      extra = [k for k, i in enumerate(ids) if i in stops] if stops else []
      if extra:  # a request's own stop token: the row is ended here, on the host
        count = extra[0] + 1
        ids, logprobs = ids[:count], logprobs[:count]
      top = []
      want = row.handle.request.top_logprobs
      if want:  # outside top-k / top-p a token's log-prob is -inf: OpenAI's floor, JSON's
        top = [list(zip(chunk.top_ids_BxKxN[index, k, :want].tolist(),
                        np.maximum(chunk.top_logprobs_BxKxN[index, k, :want],
                                   LOGPROB_FLOOR).tolist()))
               for k in range(count)]
      row.ids += ids
      self.stats["tokens"] += count
      if ids:
        if row.handle.first_token is None:
          row.handle.first_token = time.monotonic()
          self.first_token_s.append(row.handle.first_token - row.handle.submitted)
        row.handle._emit(Tokens(row.sample, ids, logprobs, self.version, top))
      if extra:
        frozen.append(index)
        self._free(index, STOP)
      elif not still_active[index]:
        self._free(index, STOP if ids and ids[-1] in self.stop_ids else LENGTH, park=True)
    if frozen:
      self._state = self.sampler.set_rows(self._state, False, frozen)
    self.stats["rounds"] += 1
