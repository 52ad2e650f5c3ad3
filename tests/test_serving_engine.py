"""The serving engine: continuous batching over the sampler, per-request sampling, prefix reuse,
cancellation, deadlines, backpressure and shutdown (coa_jax.serving.engine)."""

import time

import jax
import numpy as np
import pytest

from coa_jax.model.transformer import Transformer
from coa_jax.rollout.sampler import SamplingConfig
from coa_jax.runtime import sharding
from coa_jax.runtime.sharding import init_params
from coa_jax.serving.engine import Engine, EngineSettings
from coa_jax.serving.requests import (CANCELLED, DEADLINE, LENGTH, STOP, EngineError, QueueFull,
                                      Request, ShuttingDown, Tokens)
from test_sampler import CONFIG, full_logits, mesh1, params  # noqa: F401 - the same tiny model

GREEDY = SamplingConfig(temperature=0.0)
HOT = SamplingConfig(temperature=1.0)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def engine(mesh, params, stop_ids=(), **settings):
  settings = {"slots": 4, "cache_size": 96, "chunk": 8, "max_top_logprobs": 3, **settings}
  return Engine(CONFIG, mesh, params, EngineSettings(**settings), stop_ids)


@pytest.fixture(scope="module")
def running(mesh1, params):
  e = engine(mesh1, params).start()
  yield e
  e.close()


def test_greedy_tokens_and_logprobs_are_the_models_own(running, full_logits):
  result = running.generate(Request(PROMPT, max_tokens=12, sampling=GREEDY, top_logprobs=3))
  sample = result.samples[0]
  assert sample.finish_reason == LENGTH and len(sample.ids) == 12
  seq = PROMPT + sample.ids
  logp = np.asarray(jax.nn.log_softmax(full_logits(seq)[len(PROMPT) - 1:-1], axis=-1))
  np.testing.assert_array_equal(sample.ids, logp.argmax(-1))
  np.testing.assert_allclose(sample.logprobs, logp.max(-1), atol=1e-4)
  top_ids = [[i for i, _ in step] for step in sample.top]
  np.testing.assert_array_equal(top_ids, np.argsort(-logp, axis=-1, kind="stable")[:, :3])


def test_top_logprobs_outside_top_k_are_openais_floor(running):
  request = Request(PROMPT, max_tokens=4, sampling=SamplingConfig(1.0, 2, 1.0), top_logprobs=3)
  for step in running.generate(request).samples[0].top:
    assert [lp for _, lp in step][2] == -9999.0 and np.isfinite([lp for _, lp in step]).all()


def test_the_same_seed_gives_the_same_tokens_beside_other_requests(running):
  request = lambda seed: Request(PROMPT, max_tokens=20, sampling=HOT, seed=seed)
  handles = [running.submit(request(3)), running.submit(Request([1, 2, 3], 30, HOT, n=2)),
             running.submit(request(3))]
  first, _, again = [h.result(timeout=60).samples[0].ids for h in handles]
  assert first == again and len(first) == 20
  assert running.generate(request(4)).samples[0].ids != first


def test_n_samples_of_one_request_differ_and_each_has_its_log_probs(running):
  result = running.generate(Request(PROMPT, max_tokens=16, sampling=HOT, n=3, seed=1))
  assert len({tuple(s.ids) for s in result.samples}) == 3
  assert all(len(s.logprobs) == len(s.ids) == 16 for s in result.samples)


def test_more_requests_than_rows_all_finish_as_rows_free_up(running):
  handles = [running.submit(Request(PROMPT[:3 + i % 4], max_tokens=5 + i, sampling=HOT, seed=i))
             for i in range(10)]
  results = [h.result(timeout=120) for h in handles]
  assert [len(r.samples[0].ids) for r in results] == [5 + i for i in range(10)]


def test_a_chats_next_turn_reuses_the_cache_of_its_history(mesh1, params):
  """The second request extends the first's prompt and completion: its history is read from
  the parked row (cached tokens counted), and it samples what a fresh prefill does."""
  reuse, fresh = engine(mesh1, params).start(), engine(mesh1, params, prefix_cache=False).start()
  try:
    first = reuse.generate(Request(PROMPT, max_tokens=10, sampling=GREEDY))
    turn = PROMPT + first.samples[0].ids + [40, 41, 42]
    prefilled = reuse.stats["prefill_tokens"]
    second = reuse.generate(Request(turn, max_tokens=10, sampling=GREEDY))
    assert second.cached_tokens == len(PROMPT) + 10
    assert reuse.stats["prefill_tokens"] - prefilled == 3
    cold = fresh.generate(Request(turn, max_tokens=10, sampling=GREEDY))
    assert cold.cached_tokens == 0
    assert second.samples[0].ids == cold.samples[0].ids
    np.testing.assert_allclose(second.samples[0].logprobs, cold.samples[0].logprobs, atol=1e-5)
  finally:
    reuse.close()
    fresh.close()


def _drive(e, handles):
  while not all(h.done for h in handles):
    e.step()
  return [h.result() for h in handles]


def test_next_turns_arriving_together_resume_their_rows_beside_new_prompts(mesh1, params):
  """Four chats' next turns arrive behind two new prompts, every row parked: the new prompts
  take the rows nobody's history is in, the four resume theirs in one round, and each samples
  what a fresh prefill does."""
  e = engine(mesh1, params, slots=6)
  prompts = [PROMPT[:3 + i] for i in range(6)]  # chats 0-3, then two that end
  firsts = _drive(e, [e.submit(Request(p, max_tokens=6, sampling=GREEDY)) for p in prompts])
  turns = [p + r.samples[0].ids + [40 + i] for i, (p, r) in enumerate(zip(prompts, firsts))][:4]
  handles = [e.submit(Request([60 + i, 61, 62], max_tokens=4, sampling=GREEDY))
             for i in range(2)] + [e.submit(Request(t, max_tokens=6, sampling=GREEDY))
                                   for t in turns]
  results = _drive(e, handles)
  assert [r.cached_tokens for r in results] == [0, 0] + [len(t) - 1 for t in turns]
  fresh = engine(mesh1, params, prefix_cache=False)
  colds = _drive(fresh, [fresh.submit(Request(t, max_tokens=6, sampling=GREEDY)) for t in turns])
  assert [r.samples[0].ids for r in results[2:]] == [r.samples[0].ids for r in colds]


def test_a_request_stops_at_its_own_stop_token_and_at_the_engines(mesh1, params, running):
  greedy = running.generate(Request(PROMPT, max_tokens=12, sampling=GREEDY)).samples[0].ids
  stop = greedy[4]
  own = running.generate(Request(PROMPT, max_tokens=12, sampling=GREEDY, stop_ids=[stop]))
  assert own.samples[0].ids == greedy[:greedy.index(stop) + 1]
  assert own.samples[0].finish_reason == STOP
  e = engine(mesh1, params, stop_ids=[stop]).start()
  try:
    sample = e.generate(Request(PROMPT, max_tokens=12, sampling=GREEDY)).samples[0]
    assert sample.ids == greedy[:greedy.index(stop) + 1] and sample.finish_reason == STOP
  finally:
    e.close()


def test_cancelling_frees_the_row_within_a_round(mesh1, params):
  e = engine(mesh1, params, slots=2, chunk=4)  # driven here, round by round
  long = e.submit(Request(PROMPT, max_tokens=80, sampling=HOT))
  e.step()
  assert isinstance(long.events.get_nowait(), Tokens)
  long.cancel()
  e.step()
  assert long.done and e.in_flight == 0
  assert [ev.reason for ev in long.stream(timeout=1) if not isinstance(ev, Tokens)] == [CANCELLED]
  assert len(_drive(e, [e.submit(Request(PROMPT, 5, HOT, n=2))])[0].samples) == 2


def test_a_request_past_its_deadline_ends_waiting_or_decoding(mesh1, params):
  e = engine(mesh1, params, slots=1, chunk=2)  # driven here: the deadline passes between rounds
  deadline = time.monotonic() + 2.0
  slow = e.submit(Request(PROMPT, max_tokens=80, sampling=HOT, deadline=deadline))
  late = e.submit(Request(PROMPT, max_tokens=4, deadline=time.monotonic() - 1.0))
  e.step()  # the late request ends waiting; the slow one takes the row and decodes a chunk
  assert late.done and late.result(timeout=1).samples[0].finish_reason == DEADLINE
  time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
  (result,) = _drive(e, [slow])
  assert result.samples[0].finish_reason == DEADLINE and 0 < len(result.samples[0].ids) < 80


def test_bad_requests_a_full_queue_and_shutdown_are_refused_with_their_status(mesh1, params):
  e = engine(mesh1, params, slots=1, max_queue=2)  # not started: nothing leaves the queue
  for bad in [Request([]), Request(PROMPT, max_tokens=0), Request(PROMPT, max_tokens=95),
              Request(PROMPT, n=2), Request(PROMPT, top_logprobs=4), Request([CONFIG.vocab_size])]:
    with pytest.raises(EngineError) as refused:
      e.submit(bad)
    assert refused.value.status == 400
  handles = [e.submit(Request(PROMPT, max_tokens=3)) for _ in range(2)]
  with pytest.raises(QueueFull) as full:
    e.submit(Request(PROMPT, max_tokens=3))
  assert full.value.status == 429
  e.start()
  e.close(drain=True, timeout=120)
  assert all(h.result(timeout=1).samples[0].finish_reason == LENGTH for h in handles)
  with pytest.raises(ShuttingDown) as closed:
    e.submit(Request(PROMPT, max_tokens=3))
  assert closed.value.status == 503


def test_close_without_drain_cancels_what_is_in_flight(mesh1, params):
  e = engine(mesh1, params, slots=1, chunk=2).start()
  handles = [e.submit(Request(PROMPT, max_tokens=80, sampling=HOT)) for _ in range(3)]
  handles[0].events.get(timeout=60)
  e.close(drain=False, timeout=60)
  reasons = [h.result(timeout=1).samples[0].finish_reason for h in handles]
  assert reasons == [CANCELLED] * 3


def test_new_weights_serve_from_the_next_round_and_drop_parked_caches(mesh1, params):
  e = engine(mesh1, params).start()
  try:
    first = e.generate(Request(PROMPT, max_tokens=6, sampling=GREEDY))
    other = init_params(Transformer(CONFIG), mesh1, jax.random.key(9))
    e.set_params(other, version=1)
    turn = PROMPT + first.samples[0].ids + [40]
    second = e.generate(Request(turn, max_tokens=6, sampling=GREEDY))
    assert second.cached_tokens == 0 and set(second.samples[0].versions) == {1}
  finally:
    e.close()


def test_a_row_decoding_across_new_weights_is_not_parked(mesh1, params):
  e = engine(mesh1, params)  # driven round by round
  other = init_params(Transformer(CONFIG), mesh1, jax.random.key(9))
  first = e.submit(Request(PROMPT, max_tokens=12, sampling=GREEDY))
  e.step()  # prefilled and a first chunk with version 0
  e.set_params(other, version=1)
  sample = _drive(e, [first])[0].samples[0]
  assert sample.versions[0] == 0 and sample.versions[-1] == 1
  # Its cache mixes both weights: the next turn is prefilled afresh, by version 1 alone.
  turn = e.submit(Request(PROMPT + sample.ids + [40], max_tokens=6, sampling=GREEDY))
  second = _drive(e, [turn])[0]
  assert second.cached_tokens == 0 and set(second.samples[0].versions) == {1}


def test_sharded_serving_on_eight_devices_gives_the_one_device_tokens(params, running):
  mesh8 = sharding.make_mesh(sharding.MeshConfig(data=4, fsdp=1, tensor=2))
  sharded = jax.device_put(params, sharding.param_shardings(Transformer(CONFIG), mesh8))
  e = engine(mesh8, sharded).start()
  try:
    request = Request(PROMPT, max_tokens=12, sampling=HOT, seed=5, n=2)
    eight = e.generate(request, timeout=120)
    one = running.generate(request, timeout=120)
    assert [s.ids for s in eight.samples] == [s.ids for s in one.samples]
  finally:
    e.close()


def test_a_warmed_up_engine_compiles_nothing_while_serving_and_samples_alike(mesh1, params,
                                                                            running):
  """Requests arriving alone, then together, decoding past two windows: every program was
  compiled before the first one, and the tokens are those of an engine that was not warmed."""
  e = engine(mesh1, params, cache_size=300, prefill_batch=2)
  assert e.warm_up(len(PROMPT)) >= 4  # a prefill and the decode chunk at windows 128, 256, 300
  before = e.sampler.compilations()
  e.start()
  try:
    request = lambda seed: Request(PROMPT, max_tokens=40 + 70 * (seed % 3), sampling=HOT,
                                   seed=seed)
    first = e.generate(request(0), timeout=120)
    handles = [e.submit(request(seed)) for seed in (1, 2, 3)]
    results = [h.result(timeout=120) for h in handles]
    assert e.sampler.compilations() == before
    assert [len(r.samples[0].ids) for r in results] == [110, 180, 40]
    cold = running.generate(Request(PROMPT, max_tokens=40, sampling=HOT, seed=0), timeout=120)
    assert first.samples[0].ids == cold.samples[0].ids
  finally:
    e.close()


def test_the_round_after_a_request_joins_is_short_and_samples_the_same_tokens(mesh1, params):
  def events(first_chunk):
    e, seen = engine(mesh1, params, first_chunk=first_chunk), []
    handle = e.submit(Request(PROMPT, max_tokens=20, sampling=HOT, seed=9), seen.append)
    _drive(e, [handle])
    return [event.ids for event in seen if isinstance(event, Tokens)]
  short, whole = events(1), events(8)
  assert [len(ids) for ids in short] == [1, 8, 8, 3]
  assert [len(ids) for ids in whole] == [8, 8, 4]
  assert sum(short, []) == sum(whole, [])
