"""The host-side rollout loop: decode in chunks, run tool calls between them, record samples.

`Rollout.run(tasks)` keeps a `Sampler`'s B rows busy with groups of `group_size` samples per
task (one prefill per task) and yields each group's `RolloutRecord`s as soon as all its samples
have finished; the freed rows are refilled with the next tasks (continuous batching).

Between decode chunks, rows that stopped on a closing tool tag have their call parsed (with
the total parser) and dispatched to a thread pool, so slow tools overlap each other and the
decoding of the rows still active; when a result is back, its observation is tokenized once
and appended to the row with `extend`, and the row resumes. A malformed call, an unknown
tool, a tool that raises or one that outlives `tool_timeout_s` becomes an error observation.
Rows finish on `</answer>` (answer), the template's end token (eos), a tool call past
`max_turns` (max_turns), the response budget (length; an observation that would overflow it
is cut to fit and the row finished), or a prompt that cannot fit (error).

A long-running caller (asynchronous RL, `coa_jax.rl.async_trainer`) may swap the weights while
a run is under way: `before_chunk` is called before every fill and decode chunk and may set
`params` and `version`. Unfinished rows then continue with the new weights (partial rollouts):
their KV cache, computed by the older weights, is kept, and every token is tagged with the
version that sampled it (or encoded it, for prompt and observation tokens). The task source of
such a run may yield None when it has no task for now (see `run`).

Randomness: each run splits a key off `key`; row r of the i-th task taken from the source
samples with the seed (shard index + shard count x i) x group_size + r (`sample_seed`), its row
number in the source every host shares (`shard`), so no two rows of a run share a seed (a task
drawn again gets a new number), and a sample does not depend on its slot or the host split.

Records are token in, token out: the ids the sampler produced and consumed, with the loss
mask (1 on sampled tokens; 0 on prompt and observation tokens, tags included) and the
sampler's log-probabilities (0 where the mask is 0).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from coa_jax.data import coa_format
from coa_jax.data.tasks import Task
from coa_jax.data.tokenize import step_ids
from coa_jax.data.tokenizer import CoATokenizer
from coa_jax.model.config import ConfigError
from coa_jax.rollout.sampler import Sampler, bucket
from tools_env import ToolRegistry, ToolResult, TrajectoryTools

ANSWER, EOS, MAX_TURNS, LENGTH, ERROR = "answer", "eos", "max_turns", "length", "error"
_END = object()  # the end of a task source
FINISH_REASONS = (ANSWER, EOS, MAX_TURNS, LENGTH, ERROR)


def call_body(tokenizer: CoATokenizer, ids: list[int], tag: str) -> str | None:
  """Returns the body of the tool call that `ids` (what was sampled since the last observation)
  end with, closing `tag`; None when the call is malformed (not a closed `tag` step, or empty)."""
  steps, _ = coa_format.parse(tokenizer.decode(ids), tokenizer.tool_tags)
  call = steps[-1] if steps else None
  if call is None or call.tag != tag or not call.closed or not call.content.strip():
    return None
  return call.content


def malformed_call(tag: str) -> ToolResult:
  """The observation of a malformed call of `tag` (the tool is not run)."""
  return ToolResult(f"Error: malformed tool call: write {coa_format.opening(tag)}..."
                    f"{coa_format.closing(tag)} with a non-empty body", False, "bad_request")


def call_result(future: concurrent.futures.Future, timed_out: bool,
                timeout_s: float) -> ToolResult:
  """The observation of a submitted tool call: its result; an error observation when it raised,
  or when it is still running past `timeout_s` (`timed_out`; it is cancelled if not started)."""
  if not future.done() and timed_out:
    future.cancel()
    return ToolResult(f"Error: the tool did not answer within {timeout_s:g} s", False, "timeout")
  try:
    return future.result()
  except Exception as e:  # noqa: BLE001 - a failing tool becomes an observation
    return ToolResult(f"Error: the tool failed: {type(e).__name__}: {e}", False, "tool_error")


def observation_bucket(cap: int) -> int:
  """Returns the padded length of the longest extend: an observation of `cap` tokens plus its
  tags."""
  return bucket(cap + 16)


def stop_ids(tokenizer: CoATokenizer) -> list[int]:
  """Returns the token ids that freeze a row: the declared tools' closing tags, `</answer>`, the
  end token."""
  return ([tokenizer.tag_id(tag, close=True) for tag in tokenizer.tool_tags] +
          [tokenizer.tag_id("answer", close=True), tokenizer.end_id])


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Limits of one rollout; the sampler's batch and cache size follow from them."""

  group_size: int = 1  # samples per task, sharing one prefill
  max_prompt_tokens: int = 1024  # longer prompts finish at once with reason "error"
  max_response_tokens: int = 4096  # sampled + observation tokens per sample
  max_turns: int = 16  # tool calls per sample; the next one finishes it (max_turns)
  max_observation_tokens: int = 1024  # an observation's text is cut to this many tokens
  tool_workers: int = 8  # tool calls running at once (per host)
  tool_timeout_s: float = 120.0  # a call still running after this gets an error observation

  def __post_init__(self):
    for name in ("group_size", "max_prompt_tokens", "max_response_tokens", "max_turns",
                 "max_observation_tokens", "tool_workers"):
      if getattr(self, name) < 1:
        raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
    if self.tool_timeout_s <= 0:
      raise ValueError(f"rollout.tool_timeout_s must be > 0, got {self.tool_timeout_s}")

  @property
  def observation_bucket(self) -> int:
    """Returns the padded length of the longest extend (an observation plus its tags)."""
    return observation_bucket(self.max_observation_tokens)

  @property
  def cache_size(self) -> int:
    """Returns the KV-cache slots a row needs: its prompt and response (an extend's padding
    past the last slot is dropped)."""
    return self.max_prompt_tokens + self.max_response_tokens


def check_prompt_lengths(tokenizer: CoATokenizer, system_prompt: str, tasks: Iterable[Task],
                         max_prompt_tokens: int) -> None:
  """Raises ConfigError when a task's prompt (system prompt included) exceeds
  max_prompt_tokens: checked before a job starts, since such a task is never rolled out."""
  lengths = [len(tokenizer.prompt_ids(system_prompt, task.question)) for task in tasks]
  too_long = [n for n in lengths if n > max_prompt_tokens]
  if too_long:
    raise ConfigError(f"{len(too_long)} of {len(lengths)} tasks have prompts longer than "
                      f"rollout.max_prompt_tokens={max_prompt_tokens} (the longest: "
                      f"{max(too_long)} tokens with the system prompt): raise it or shorten "
                      f"the system prompt")


@dataclasses.dataclass
class RolloutRecord:
  """One sample: what DAPO trains on (ids, mask, log-probs) and what happened."""

  task_id: str
  sample: int
  ids: list[int]  # prompt + response (sampled and observation tokens)
  loss_mask: list[int]  # 1 on sampled tokens, 0 elsewhere
  logprobs: list[float]  # the sampler's, on sampled tokens; 0 elsewhere
  prompt_len: int
  versions: list[int] = dataclasses.field(default_factory=list)  # each token's policy version
  finish_reason: str = ""
  turns: int = 0
  tool_calls: dict[str, int] = dataclasses.field(default_factory=dict)
  tool_errors: dict[str, int] = dataclasses.field(default_factory=dict)
  decode_s: float = 0.0
  tool_s: float = 0.0
  task_data: dict[str, Any] = dataclasses.field(default_factory=dict)
  reward: float | None = None  # an agent program's own score (`serving.agent`); None: the rewards'
  # Lengths of the samples packed in `ids` one after another (an agent session's calls that do
  # not extend each other, `serving.sessions`); the update keeps them apart. Empty: one.
  segments: list[int] = dataclasses.field(default_factory=list)

  def append(self, ids: list[int], logprobs: list[float] | None = None, version: int = 0) -> None:
    """Appends sampled tokens (with their log-probs: mask 1) or given ones (mask 0), tagged
    with the version of the policy that sampled them (or encoded them into the KV cache)."""
    self.ids.extend(ids)
    self.loss_mask.extend([0 if logprobs is None else 1] * len(ids))
    self.logprobs.extend([0.0] * len(ids) if logprobs is None else logprobs)
    self.versions.extend([version] * len(ids))

  @property
  def first_version(self) -> int:
    """Returns the oldest policy version among its tokens, its prompt's (versions only grow)."""
    return self.versions[0] if self.versions else 0

  @property
  def response_len(self) -> int:
    return len(self.ids) - self.prompt_len

  def response_text(self, tokenizer: CoATokenizer) -> str:
    """Returns the response decoded to text (for transcripts and rewards, never for training)."""
    return tokenizer.decode(self.ids[self.prompt_len:])

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "response_len": self.response_len}


@dataclasses.dataclass
class _Row:
  record: RolloutRecord
  session: TrajectoryTools  # this sample's tools: repeated-call notices, counters
  call_start: int  # index in ids where the text of the next tool call begins
  future: concurrent.futures.Future | None = None
  submitted: float = 0.0
  done: bool = False


def callable_tools(tools: ToolRegistry, tokenizer: CoATokenizer) -> ToolRegistry:
  """Returns `tools` when the model can call each of them (its tokenizer has every tool's tag,
  fixed at SFT); else closes them and raises ConfigError naming the others."""
  unknown = sorted(set(tools.tools) - set(tokenizer.tool_tags))
  if unknown:
    tools.close()
    raise ConfigError(f"tools {unknown} are not among the model's tool tags "
                      f"{list(tokenizer.tool_tags)} (fixed at SFT, coa_tags.json)")
  return tools


class Rollout:
  """Runs rollouts of one policy: `run(tasks)` yields each task's group of records."""

  def __init__(self, sampler: Sampler, params: Any, tokenizer: CoATokenizer,
               tools: ToolRegistry, config: RolloutConfig, system_prompt: str, seed: int = 0):
    if sampler.batch_size % config.group_size:
      raise ValueError(f"sampler batch_size={sampler.batch_size} is not a multiple of "
                       f"group_size={config.group_size}")
    missing = set(stop_ids(tokenizer)) - set(sampler.stop_ids)
    if missing:
      raise ValueError(f"the sampler does not stop on {sorted(missing)}; build it with "
                       f"stop_ids=rollout.stop_ids(tokenizer)")
    if sampler.cache_size < config.cache_size:
      raise ValueError(f"sampler cache_size={sampler.cache_size} < {config.cache_size} needed "
                       f"by the rollout limits")
    self.sampler, self.params, self.tokenizer = sampler, params, tokenizer
    self.tools, self.config, self.system_prompt = tools, config, system_prompt
    self.key = jax.random.key(seed)
    # (index, count): this host's source is tasks[index::count] of one that `count` hosts share
    # (as every job splits its tasks); rows are numbered in the shared source (`sample_seed`).
    self.shard = (jax.process_index(), jax.process_count())
    self.listener: Callable[[RolloutRecord], None] | None = None  # sees every record update
    self.before_chunk: Callable[[], None] | None = None  # may swap params and version
    self.version = 0  # the policy version of `params`, tagged on every token appended
    # Name the active rows to the sampler, which then may decode them alone (Sampler docs).
    self.decode_active_rows = True
    self.in_flight = 0  # rows holding a sample (decoding, waiting for a tool or done)
    self.chunks = self.tokens_sampled = 0
    self.decode_s = self.tool_wait_s = 0.0
    self._tool_stop = {tokenizer.tag_id(tag, close=True): tag for tag in tokenizer.tool_tags}
    self._answer_id, self._end_id = tokenizer.tag_id("answer", close=True), tokenizer.end_id

  # --- the loop --------------------------------------------------------------------------

  def run(self, tasks: Iterable[Task | None]) -> Iterator[list[RolloutRecord]]:
    """Yields the records of each task's group, in the order the groups finish.

    `tasks` may yield None for "no task now": the free rows stay free until the next fill. A
    source must block rather than yield None while `in_flight` is 0, or the loop spins."""
    cfg, n = self.config, self.config.group_size
    tasks = iter(tasks)
    exhausted = False
    rows: dict[int, _Row] = {}
    free = list(range(0, self.sampler.batch_size, n))
    # One key per run: a sample depends on it, its row number and its tokens only (module doc).
    key, self.key = jax.random.split(self.key)
    self._taken = 0
    state = self.sampler.init_state()
    pool = concurrent.futures.ThreadPoolExecutor(cfg.tool_workers, "rollout-tool")
    try:
      while True:
        if self.before_chunk:
          self.before_chunk()
        self.in_flight = len(rows)
        state, rejected, ended = self._fill(state, rows, free, tasks)
        exhausted = exhausted or ended
        yield from rejected
        if not rows:
          if exhausted:
            return
          continue
        active = np.array(state.active_B)  # a copy: decoding changes the state
        if active.any():
          state = self._decode(state, rows, active, pool, key)
        elif not any(row.future for row in rows.values()) and not any(
            row.done for row in rows.values()):
          raise RuntimeError("rollout stalled: no row is decoding, waiting for a tool or done")
        state = self._collect_tools(state, rows, waiting_only=not active.any())
        for start in sorted({r - r % n for r in rows}):
          group = [rows.get(start + i) for i in range(n)]
          if all(row is not None and row.done for row in group):
            for i in range(n):
              del rows[start + i]
            free.append(start)
            yield [row.record for row in group]
    finally:
      self.in_flight = 0
      # A tool that hangs past its timeout must not hold the rollout: do not wait for it.
      pool.shutdown(wait=False, cancel_futures=True)

  def _fill(self, state, rows, free, tasks):
    """Prefills free group slots with the next tasks; returns (state, rejected groups, whether
    the source has ended)."""
    cfg, n = self.config, self.config.group_size
    groups, budgets, seeds, rejected = [], [], [], []
    ended = False
    while free:
      task = next(tasks, _END)
      ended = task is _END
      if task is None or ended:
        break
      number = self.shard[0] + self.shard[1] * self._taken
      self._taken += 1
      prompt = self.tokenizer.prompt_ids(self.system_prompt, task.question)
      records = [RolloutRecord(task.id, i, [], [], [], len(prompt), task_data=dict(task.data))
                 for i in range(n)]
      for record in records:
        record.append(prompt, version=self.version)
      if len(prompt) > cfg.max_prompt_tokens:
        for record in records:
          record.finish_reason = ERROR
          record.task_data["error"] = (f"prompt of {len(prompt)} tokens > max_prompt_tokens="
                                       f"{cfg.max_prompt_tokens}")
        rejected.append(records)
        continue
      start = free.pop(0)
      for i, record in enumerate(records):
        rows[start + i] = _Row(record, TrajectoryTools(self.tools, task.question), len(prompt))
      self.in_flight = len(rows)
      groups.append((list(range(start, start + n)), prompt))
      budgets.append(len(prompt) + cfg.max_response_tokens)
      # A task drawn again within one run (a long-running source) has a new number.
      seeds.append([sample_seed(number, i, n) for i in range(n)])
    if groups:
      state = self.sampler.prefill_groups(self.params, state, groups, budgets, seeds)
    return state, rejected, ended

  def _decode(self, state, rows, active, pool, key):
    """Decodes one chunk; routes every row that stopped to its finish or its tool call."""
    start = time.perf_counter()
    named = np.flatnonzero(active) if self.decode_active_rows else None
    state, chunk = self.sampler.decode_chunk(self.params, state, key, rows=named)
    tokens, logprobs, counts, still = map(np.asarray, (chunk.tokens_BxK, chunk.logprobs_BxK,
                                                      chunk.counts_B, state.active_B))
    elapsed = time.perf_counter() - start
    self.chunks += 1
    self.tokens_sampled += int(counts.sum())
    self.decode_s += elapsed
    for index in np.flatnonzero(active):
      row = rows.get(int(index))
      if row is None:
        continue
      record, count = row.record, int(counts[index])
      record.append(tokens[index, :count].tolist(), logprobs[index, :count].tolist(),
                    self.version)
      record.decode_s += elapsed
      if self.listener:
        self.listener(record)
      if still[index]:
        continue
      last = record.ids[-1] if count else None
      # A call closed by the budget's last token has no room for its observation: not run.
      full = len(record.ids) >= record.prompt_len + self.config.max_response_tokens
      if last == self._answer_id:
        self._finish(row, ANSWER)
      elif last == self._end_id:
        self._finish(row, EOS)
      elif last in self._tool_stop and not full:
        self._start_tool(row, self._tool_stop[last], pool)
      else:
        self._finish(row, LENGTH)
    return state

  def _finish(self, row: _Row, reason: str) -> None:
    row.record.finish_reason, row.done = reason, True

  def _start_tool(self, row: _Row, tag: str, pool) -> None:
    """Parses the call the row just closed and submits it, or finishes the row."""
    record = row.record
    if record.turns >= self.config.max_turns:
      return self._finish(row, MAX_TURNS)
    record.turns += 1
    record.tool_calls[tag] = record.tool_calls.get(tag, 0) + 1
    body = call_body(self.tokenizer, record.ids[row.call_start:], tag)
    if body is None:
      row.future = concurrent.futures.Future()
      row.future.set_result(malformed_call(tag))
    else:
      row.future = pool.submit(row.session.call, tag, body)
    row.submitted = time.perf_counter()

  def _collect_tools(self, state, rows, waiting_only: bool):
    """Extends every row whose tool result is in (waiting for one if nothing else runs)."""
    waiting = {i: row for i, row in rows.items() if row.future is not None}
    if not waiting:
      return state
    if waiting_only:
      deadline = min(row.submitted for row in waiting.values()) + self.config.tool_timeout_s
      start = time.perf_counter()
      concurrent.futures.wait([row.future for row in waiting.values()],
                              timeout=max(0.0, deadline - time.perf_counter()),
                              return_when=concurrent.futures.FIRST_COMPLETED)
      self.tool_wait_s += time.perf_counter() - start
    appends = {}
    now = time.perf_counter()
    for index, row in waiting.items():
      timed_out = now - row.submitted > self.config.tool_timeout_s
      if not row.future.done() and not timed_out:
        continue
      result = call_result(row.future, timed_out, self.config.tool_timeout_s)
      row.future = None
      record = row.record
      record.tool_s += now - row.submitted
      if not result.ok:
        kind = result.error_kind or "tool_error"
        record.tool_errors[kind] = record.tool_errors.get(kind, 0) + 1
      ids = self._observation_ids(result.observation)
      room = record.prompt_len + self.config.max_response_tokens - len(record.ids)
      # An overflowing observation fills the budget exactly.
      record.append(ids[:room], version=self.version)
      if len(ids) >= room:  # and leaves no room to sample: the sample ends
        self._finish(row, LENGTH)
        continue
      row.call_start = len(record.ids)
      appends[index] = ids
      if self.listener:
        self.listener(record)
    if appends:
      state = self.sampler.extend_rows(self.params, state, appends)
    return state

  def _observation_ids(self, text: str) -> list[int]:
    return observation_ids(self.tokenizer, text, self.config.max_observation_tokens)


def observation_ids(tokenizer: CoATokenizer, text: str, cap: int) -> list[int]:
  """Returns `\\n<observation>\\n text \\n</observation>`, the text cut to `cap` tokens (its
  middle replaced by a marker), and the whole at most `observation_bucket(cap)` long."""
  ids = tokenizer.encode(text)
  if len(ids) > cap:
    marker = tokenizer.encode("\n...[observation cut]...\n")
    head = (cap - len(marker)) // 2
    tail = cap - len(marker) - head
    text = tokenizer.decode(ids[:head] + marker + ids[len(ids) - tail:])
  ids = step_ids(tokenizer, coa_format.Step(coa_format.OBSERVATION, text), first=False)
  limit = observation_bucket(cap)  # the longest extend the sampler pads to
  if len(ids) > limit:  # re-tokenizing around the cut can add a few tokens
    ids = ids[:limit - 1] + [tokenizer.tag_id(coa_format.OBSERVATION, close=True)]
  return ids


def sample_seed(number: int, sample: int, group_size: int) -> int:
  """Returns the sampling seed of the sample-th sample of a run's task `number`: its row number
  in the run, distinct for every (task, sample) and a non-negative int32."""
  seed = number * group_size + sample
  if not 0 <= sample < group_size or not 0 <= seed < 2**31:
    raise ValueError(f"no int32 seed for sample {sample} of task {number} in groups of "
                     f"{group_size}: start a new run (a new key) before 2**31 rows")
  return seed


def summarize(records: Iterable[RolloutRecord]) -> dict[str, Any]:
  """Returns counts of finish reasons, tool calls and errors, and mean lengths and turns."""
  records = list(records)
  reasons = collections.Counter(r.finish_reason for r in records)
  calls, errors = collections.Counter(), collections.Counter()
  for r in records:
    calls.update(r.tool_calls)
    errors.update(r.tool_errors)
  count = max(len(records), 1)
  return {"samples": len(records), "finish_reasons": dict(reasons), "tool_calls": dict(calls),
          "tool_errors": dict(errors),
          "mean_response_len": sum(r.response_len for r in records) / count,
          "mean_turns": sum(r.turns for r in records) / count}


def progress_line(done: int, total: int, tokens: int, seconds: float) -> str:
  """Returns a progress line: tasks done of total, tasks and tokens per second, and the ETA."""
  rate = done / seconds if seconds > 0 else 0.0
  eta = f"{(total - done) / rate:,.0f}s" if rate > 0 else "?"
  return (f"tasks {done}/{total}  {rate:.2f} tasks/s  "
          f"{tokens / seconds if seconds > 0 else 0.0:,.0f} tokens/s  ETA {eta}")
