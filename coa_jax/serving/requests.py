"""What a serving engine's caller holds: a `Request`, the `Handle` it gets back with the request's
events (`Tokens`, `Finished`) and `Result`, the finish reasons, and the errors of a request the
engine cannot take (coa_jax.serving.engine)."""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any, Callable, Iterator, Sequence

from coa_jax.rollout.sampler import SamplingConfig

STOP, LENGTH, CANCELLED, DEADLINE, ERROR = "stop", "length", "cancelled", "deadline", "error"


class EngineError(Exception):
  """A request the engine cannot take; `status` is the HTTP status a server answers with."""

  status = 400


class QueueFull(EngineError):
  status = 429


class ShuttingDown(EngineError):
  status = 503


@dataclasses.dataclass
class Request:
  """What to generate: `n` samples of at most `max_tokens` after `prompt_ids`. A sample also
  ends at any of `stop_ids` (beyond the engine's own stop tokens), kept as its last token.
  `deadline` is a `time.monotonic()` time after which the request ends (reason "deadline")."""

  prompt_ids: Sequence[int]
  max_tokens: int = 256
  sampling: SamplingConfig = SamplingConfig()
  n: int = 1
  seed: int | None = None
  stop_ids: Sequence[int] = ()
  top_logprobs: int = 0
  deadline: float | None = None
  # The rows' sampling seeds as they are (one a sample), in place of those `seed` derives: an
  # RL session samples with its row seed as the built-in rollout does (`sample_seed`).
  row_seeds: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class Tokens:
  """Tokens one sample of a request received in a round: ids, their log-probs under the
  distribution drawn from, the version of the weights that sampled them, and with
  `top_logprobs` the most likely (id, log-prob) pairs at each step."""

  sample: int
  ids: list[int]
  logprobs: list[float]
  version: int
  top: list[list[tuple[int, float]]]


@dataclasses.dataclass(frozen=True)
class Finished:
  sample: int
  reason: str  # STOP, LENGTH, CANCELLED, DEADLINE or ERROR (the engine failed)


@dataclasses.dataclass
class Sample:
  ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  finish_reason: str = ""


@dataclasses.dataclass
class Result:
  prompt_tokens: int
  cached_tokens: int  # prompt tokens read from a parked row's cache, not prefilled
  samples: list[Sample]


class Handle:
  """A submitted request: its events (`Tokens`, `Finished`) arrive on a queue from the engine's
  thread; `on_event` (if given) is called with each as well, on that thread."""

  def __init__(self, request: Request, on_event: Callable[[Any], None] | None = None):
    self.request = request
    self.events: queue.Queue = queue.Queue()
    self.cached_tokens = 0
    self.submitted = time.monotonic()
    self.first_token: float | None = None  # when its first token left the engine
    self._on_event = on_event
    self._cancelled: set[int] = set()
    self._open = set(range(request.n))

  def cancel(self, sample: int | None = None) -> None:
    """Ends one sample (or all) at the next round: its row is freed, reason "cancelled"."""
    self._cancelled.update(range(self.request.n) if sample is None else [sample])

  @property
  def done(self) -> bool:
    return not self._open

  def _emit(self, event: Any) -> None:
    if isinstance(event, Finished):
      if event.sample not in self._open:
        return
      self._open.discard(event.sample)
    self.events.put(event)
    if self._on_event is not None:
      self._on_event(event)

  def stream(self, timeout: float | None = None) -> Iterator[Any]:
    """Yields the events until every sample finished (blocking; `timeout` per event)."""
    finished = 0
    while finished < self.request.n:
      event = self.events.get(timeout=timeout)
      finished += isinstance(event, Finished)
      yield event

  def result(self, timeout: float | None = None) -> Result:
    """Waits for every sample and returns them."""
    samples = [Sample() for _ in range(self.request.n)]
    for event in self.stream(timeout):
      sample = samples[event.sample]
      if isinstance(event, Tokens):
        sample.ids += event.ids
        sample.logprobs += event.logprobs
        sample.versions += [event.version] * len(event.ids)
        sample.top += event.top
      else:
        sample.finish_reason = event.reason
    return Result(len(self.request.prompt_ids), self.cached_tokens, samples)
