"""The rollout loop: exact ids and masks of scripted episodes, tools between chunks, limits."""

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coa_jax.data import coa_format
from coa_jax.data.tokenize import step_ids
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.model import ConfigError, build_config
from coa_jax.model.transformer import Transformer
from coa_jax.rollout.sampler import Chunk, Sampler, SamplingConfig, token_keys
from coa_jax.rollout.tool_loop import (
  Rollout,
  RolloutConfig,
  Task,
  check_prompt_lengths,
  sample_seed,
  stop_ids,
  summarize,
)
from coa_jax.runtime import sharding
from coa_jax.runtime.sharding import init_params
from tools_env import Tool, ToolRegistry

TOKENIZER = default_tokenizer("plain")
SYSTEM = "You are an agent."
CONFIG = RolloutConfig(group_size=1, max_prompt_tokens=64, max_response_tokens=160,
                       max_turns=4, max_observation_tokens=48, tool_workers=4,
                       tool_timeout_s=5.0)


def steps(*pairs, first=True):
  """Returns the ids the model writes for (tag, content) steps."""
  ids = []
  for i, (tag, content) in enumerate(pairs):
    ids += step_ids(TOKENIZER, coa_format.Step(tag, content), first=first and i == 0)
  return ids


def observation(text):
  return step_ids(TOKENIZER, coa_format.Step(coa_format.OBSERVATION, text), first=False)


@dataclasses.dataclass
class FakeState:
  active_B: np.ndarray


class ScriptedSampler:
  """Stands in for `Sampler` on the host: each task's rows emit a scripted token stream,
  stopping on the same stop ids and budgets; log-probs are -(position / 1000)."""

  def __init__(self, scripts, batch_size=2, chunk=7, stop_ids=(), cache_size=10_000):
    self.scripts, self.batch_size, self.chunk = scripts, batch_size, chunk
    self.stop_ids, self.cache_size = tuple(stop_ids), cache_size
    self.rows, self.max_busy = {}, 0

  def init_state(self):
    return FakeState(np.zeros(self.batch_size, bool))

  def prefill_groups(self, params, state, groups, budgets, seeds=None):
    for (rows, prompt), budget in zip(groups, budgets):
      question = TOKENIZER.decode(prompt).split("\n\n")[1]
      for row in rows:
        self.rows[row] = {"script": list(self.scripts[question]), "total": len(prompt),
                          "budget": budget}
        state.active_B[row] = True
    self.max_busy = max(self.max_busy, len(self.rows))
    return state

  def decode_chunk(self, params, state, key, rows=None):
    # The rollout names the active rows, so that the sampler may decode them alone.
    np.testing.assert_array_equal(rows, np.flatnonzero(state.active_B))
    tokens = np.zeros((self.batch_size, self.chunk), np.int32)
    logprobs = np.zeros((self.batch_size, self.chunk), np.float32)
    counts = np.zeros(self.batch_size, np.int32)
    for row in np.flatnonzero(state.active_B):
      info = self.rows[row]
      while counts[row] < self.chunk and state.active_B[row]:
        token = info["script"].pop(0)
        tokens[row, counts[row]], logprobs[row, counts[row]] = token, -info["total"] / 1000
        counts[row] += 1
        info["total"] += 1
        if token in self.stop_ids or info["total"] >= info["budget"]:
          state.active_B[row] = False
    no_top = np.zeros((self.batch_size, self.chunk, 0))
    return state, Chunk(tokens, logprobs, counts, no_top.astype(np.int32), no_top)

  def extend_rows(self, params, state, appends):
    for row, ids in appends.items():
      self.rows[row]["total"] += len(ids)
      state.active_B[row] = True
    return state


class Echo(Tool):
  """Answers `<tag> says: body`, after an optional delay; 'boom' raises inside the tool."""

  def __init__(self, tag, delay=0.0, padding=0):
    super().__init__()
    self.tag, self.delay, self.padding = tag, delay, padding

  def _run(self, body, goal):
    time.sleep(self.delay)
    if body == "boom":
      raise RuntimeError("tool exploded")
    return f"{self.tag} says: {body}" + " and more" * self.padding, {}


class Registry(ToolRegistry):
  """A registry whose `code` entry raises out of the registry itself for the body 'crash'."""

  def call(self, tag, body, goal=""):
    if body == "crash":
      raise OSError("registry crashed")
    return super().call(tag, body, goal)


def rollout(scripts, tools=None, config=CONFIG, batch_size=2):
  tools = tools or Registry({"code": Echo("code"), "web_search": Echo("web_search")})
  sampler = ScriptedSampler(scripts, batch_size, stop_ids=stop_ids(TOKENIZER))
  return Rollout(sampler, None, TOKENIZER, tools, config, SYSTEM)


def run(scripts, **kwargs):
  engine = rollout(scripts, **kwargs)
  groups = list(engine.run([Task(q, q) for q in scripts]))
  return {g[0].task_id: g[0] for g in groups}, engine


def test_scripted_tool_episode_has_exact_ids_and_masks():
  think = steps(("think", "I should compute."))
  call = steps(("code", "```python\nprint(6 * 7)\n```"), first=False)
  answer = steps(("answer", "42"), first=False)
  record = run({"q1": think + call + answer})[0]["q1"]
  prompt = TOKENIZER.prompt_ids(SYSTEM, "q1")
  obs = observation("code says: ```python\nprint(6 * 7)\n```")
  assert record.ids == prompt + think + call + obs + answer
  assert record.loss_mask == ([0] * len(prompt) + [1] * len(think + call) + [0] * len(obs) +
                              [1] * len(answer))
  # The scripted sampler's log-prob of a token is -(its position) / 1000: each sampled token
  # keeps its own, and the prompt and observation tokens, which no policy sampled, have 0.
  np.testing.assert_allclose(record.logprobs, [-p / 1000 if m else 0.0
                                               for p, m in enumerate(record.loss_mask)], rtol=1e-6)
  assert (record.finish_reason, record.turns, record.tool_calls) == ("answer", 1, {"code": 1})
  assert TOKENIZER.decode(obs).startswith("\n<observation>\n")


def test_tool_failures_become_error_observations():
  bad = {
      "unknown": steps(("wiki_search", "Everest")) + steps(("answer", "x"), first=False),
      "raises": steps(("code", "boom")) + steps(("answer", "x"), first=False),
      "crash": steps(("code", "crash")) + steps(("answer", "x"), first=False),
      "malformed": TOKENIZER.encode("no tag here") + [TOKENIZER.tag_id("code", close=True)] +
                   steps(("answer", "x"), first=False),
  }
  records, _ = run(bad, batch_size=4)
  expected = {"unknown": ("unknown_tool", "unknown tool 'wiki_search'"),
              "raises": ("tool_error", "RuntimeError: tool exploded"),
              "crash": ("tool_error", "OSError: registry crashed"),
              "malformed": ("bad_request", "malformed tool call")}
  for task, (kind, text) in expected.items():
    record = records[task]
    assert record.finish_reason == "answer" and record.tool_errors == {kind: 1}, task
    observed = TOKENIZER.decode([t for t, m in zip(record.ids, record.loss_mask)
                                 if not m][record.prompt_len:])
    assert text in observed, (task, observed)


def test_a_hanging_tool_times_out_without_holding_the_rollout():
  config = dataclasses.replace(CONFIG, tool_timeout_s=0.3)
  tools = ToolRegistry({"code": Echo("code", delay=30.0)})
  start = time.monotonic()
  records, _ = run({"q": steps(("code", "x")) + steps(("answer", "y"), first=False)},
                   tools=tools, config=config)
  assert time.monotonic() - start < 15  # did not wait for the 30 s call
  assert records["q"].tool_errors == {"timeout": 1} and records["q"].finish_reason == "answer"


class Gathering(Echo):
  """Answers once `parties` calls are in flight together; calls made one at a time never meet,
  and the rollout's tool timeout turns them into errors."""

  def __init__(self, tag, parties):
    super().__init__(tag)
    self.barrier = threading.Barrier(parties, timeout=60)

  def _run(self, body, goal):
    self.barrier.wait()
    return super()._run(body, goal)


def test_slow_tools_overlap_other_rows_decoding():
  slow = steps(("web_search", "a")) + steps(("answer", "y"), first=False)
  scripts = {f"q{i}": slow for i in range(4)}
  tools = ToolRegistry({"web_search": Gathering("web_search", parties=4)})
  records, engine = run(scripts, tools=tools, batch_size=4)
  assert all(r.finish_reason == "answer" and not r.tool_errors for r in records.values())


def test_finished_rows_are_refilled_from_the_pending_tasks():
  short = steps(("answer", "1"))
  long = steps(("think", "a long thought " * 8)) + short
  scripts = {"long": long, "s1": short, "s2": short, "s3": short}
  engine = rollout(scripts)
  order = [g[0].task_id for g in engine.run([Task(q, q) for q in scripts])]
  assert order[-1] == "long" and sorted(order[:-1]) == ["s1", "s2", "s3"]
  assert engine.sampler.max_busy == 2


def test_group_samples_share_the_task():
  config = dataclasses.replace(CONFIG, group_size=2)
  engine = rollout({"q": steps(("answer", "1"))}, config=config)
  (group,) = list(engine.run([Task("q", "q", {"answer": "1"})]))
  assert [r.sample for r in group] == [0, 1] and group[0].task_data == {"answer": "1"}


def test_prompt_longer_than_the_budget_finishes_with_an_error():
  records, _ = run({"q " * 100: steps(("answer", "1"))})
  (record,) = records.values()
  assert record.finish_reason == "error" and "max_prompt_tokens" in record.task_data["error"]
  assert record.response_len == 0


def test_jobs_check_prompt_lengths_before_they_start():
  tasks = [Task("short", "q?"), Task("long", "q " * 100)]
  check_prompt_lengths(TOKENIZER, "SYS", tasks[:1], max_prompt_tokens=64)
  with pytest.raises(ConfigError, match=r"1 of 2 tasks .*max_prompt_tokens=64 \(the longest"):
    check_prompt_lengths(TOKENIZER, "SYS", tasks, max_prompt_tokens=64)


def test_half_open_tag_at_the_budget_finishes_on_length():
  script = steps(("think", "x")) + [TOKENIZER.tag_id("code")] + TOKENIZER.encode("y " * 400)
  records, _ = run({"q": script})
  record = records["q"]
  assert record.finish_reason == "length"
  assert record.response_len == CONFIG.max_response_tokens


def test_a_call_closed_by_the_budgets_last_token_is_not_run():
  first, second = steps(("code", "x")), steps(("code", "y"), first=False)
  budget = len(first) + len(observation("code says: x")) + len(second)
  # Its last turn: run, it would end as max_turns, which the overlong filter and the critic do
  # not read as truncated, after holding the rollout for the tool's 3 s.
  config = dataclasses.replace(CONFIG, max_response_tokens=budget, max_turns=1)
  tools = Registry({"code": Echo("code", delay=3.0)})
  record = run({"q": first + second + steps(("answer", "1"), first=False)}, tools=tools,
               config=config)[0]["q"]
  assert record.finish_reason == "length" and record.turns == 1
  assert record.tool_calls == {"code": 1} and record.tool_s < 4.0  # the first call only
  assert record.response_len == budget and record.ids[-len(second):] == second


def test_max_turns_finishes_the_sample():
  calls = sum((steps((tag, f"{tag} {i}"), first=i == 0)
               for i, tag in enumerate(["code", "web_search"] * 3)), [])
  records, _ = run({"q": calls})
  record = records["q"]
  assert record.finish_reason == "max_turns" and record.turns == CONFIG.max_turns


def test_an_observation_overflowing_the_budget_is_cut_and_finishes_the_row():
  config = dataclasses.replace(CONFIG, max_response_tokens=40, max_observation_tokens=200)
  record = run({"q": steps(("code", "x")) + steps(("answer", "1"), first=False)},
               tools=ToolRegistry({"code": Echo("code", padding=100)}), config=config)[0]["q"]
  assert record.finish_reason == "length"
  assert len(record.ids) == record.prompt_len + config.max_response_tokens
  call = steps(("code", "x"))  # then the observation up to the budget, none of it trained
  cut = config.max_response_tokens - len(call)
  assert record.ids[record.prompt_len:] == call + observation(
      "code says: x" + " and more" * 100)[:cut]
  assert record.loss_mask[record.prompt_len:] == [1] * len(call) + [0] * cut


def test_repeated_calls_get_a_notice():
  call = steps(("web_search", "same query"))
  script = call + steps(("web_search", "same  QUERY"), first=False) + \
      steps(("answer", "1"), first=False)
  record = run({"q": script})[0]["q"]
  assert record.tool_errors == {"repeated": 1}
  assert summarize([record])["tool_calls"] == {"web_search": 2}


# --- the real sampler ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
  config = build_config({"preset": "tiny", "vocab_size": TOKENIZER.vocab_size,
                         "tie_embeddings": False})
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  params = init_params(Transformer(config), mesh, jax.random.key(0))
  rollout_config = dataclasses.replace(CONFIG, max_response_tokens=96, group_size=2)
  sampler = Sampler(config, mesh, batch_size=4, chunk=16,
                    cache_size=rollout_config.cache_size,
                    stop_ids=stop_ids(TOKENIZER), sampling=SamplingConfig(temperature=1.0))
  tools = ToolRegistry({"code": Echo("code"), "web_search": Echo("web_search")})
  engine = Rollout(sampler, params, TOKENIZER, tools, rollout_config, SYSTEM, seed=3)
  apply = jax.jit(lambda ids: Transformer(config).apply({"params": params}, ids))
  return engine, lambda seq: np.asarray(apply(jnp.asarray([seq]))[0])


def test_real_rollout_records_are_token_exact_and_do_not_recompile(real):
  engine, full_logits = real
  tasks = [Task(f"t{i}", f"What is {i} + {i}?") for i in range(9)]
  # Five tasks in two group slots: the warm-up fills two groups and one at a time, whichever
  # finish first.
  first = [r for g in engine.run(tasks[:5]) for r in g]
  warm = engine.sampler.compilations()
  second = [r for g in engine.run(tasks[5:]) for r in g]
  assert engine.sampler.compilations() == warm
  records = first + second
  assert sum(r.turns for r in records) > 0  # the random policy did call tools
  for record in records:
    assert len(record.ids) == len(record.loss_mask) == len(record.logprobs)
    assert record.finish_reason in ("answer", "eos", "max_turns", "length")
    logp = jax.nn.log_softmax(full_logits(record.ids)[:-1], axis=-1)
    for position in np.flatnonzero(record.loss_mask):
      np.testing.assert_allclose(record.logprobs[position],
                                 logp[position - 1, record.ids[position]], atol=1e-4)


class RecordingSampler(ScriptedSampler):
  """A ScriptedSampler that records the params of every decode chunk and the seeds of every
  prefill."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.decoded_with, self.seeds, self.task_seeds = [], [], {}

  def prefill_groups(self, params, state, groups, budgets, seeds=None):
    self.seeds += [list(s) for s in seeds]
    for (_, prompt), s in zip(groups, seeds):
      self.task_seeds[TOKENIZER.decode(prompt).split("\n\n")[1]] = list(s)
    return super().prefill_groups(params, state, groups, budgets, seeds)

  def decode_chunk(self, params, state, key, rows=None):
    self.decoded_with.append(params)
    return super().decode_chunk(params, state, key, rows)


def _recording_rollout(scripts, batch_size=1, config=CONFIG):
  sampler = RecordingSampler(scripts, batch_size, stop_ids=stop_ids(TOKENIZER))
  tools = ToolRegistry({"code": Echo("code")})
  return Rollout(sampler, "v0", TOKENIZER, tools, config, SYSTEM), sampler


def test_weights_swapped_between_chunks_continue_the_sample_and_tag_its_tokens():
  think = steps(("think", "a long enough thought to span chunks"))  # > 7 tokens: two chunks
  call = steps(("code", "```python\nprint(1)\n```"), first=False)
  answer = steps(("answer", "1"), first=False)
  engine, sampler = _recording_rollout({"q": think + call + answer})
  calls = []

  def swap():  # new weights arrive after the first chunk
    calls.append(1)
    if len(calls) == 2:
      engine.params, engine.version = "v1", 1

  engine.before_chunk = swap
  (record,), = list(engine.run([Task("q", "q")]))
  prompt_len, chunk = record.prompt_len, sampler.chunk
  assert sampler.decoded_with[0] == "v0" and set(sampler.decoded_with[1:]) == {"v1"}
  assert record.versions == [0] * (prompt_len + chunk) + [1] * (len(record.ids) - prompt_len -
                                                                 chunk)
  assert record.first_version == 0
  assert record.ids == TOKENIZER.prompt_ids(SYSTEM, "q") + think + call + observation(
      "code says: ```python\nprint(1)\n```") + answer  # the sample went on where it was


def test_a_source_may_have_no_task_for_now():
  scripts = {q: steps(("answer", q)) for q in ("q1", "q2")}
  engine, _ = _recording_rollout(scripts)
  groups = list(engine.run(iter([Task("q1", "q1"), None, None, Task("q2", "q2")])))
  assert [g[0].task_id for g in groups] == ["q1", "q2"]
  assert all(g[0].finish_reason == "answer" for g in groups)


def test_a_task_drawn_again_in_one_run_gets_fresh_sampling_seeds():
  engine, sampler = _recording_rollout({"q": steps(("answer", "q"))})
  list(engine.run([Task("q", "q"), Task("q", "q")]))
  first, second = sampler.seeds
  assert first != second


def test_row_seeds_number_the_rows_of_the_source_every_host_shares():
  scripts = {f"q{i}": steps(("answer", f"q{i}")) for i in range(5)}
  tasks = [Task(q, q) for q in scripts]
  pairs = dataclasses.replace(CONFIG, group_size=2)
  one, sampler = _recording_rollout(scripts, batch_size=4, config=pairs)
  list(one.run(tasks))
  assert sampler.task_seeds == {f"q{i}": [2 * i, 2 * i + 1] for i in range(5)}
  for host in range(2):  # two hosts, each its share tasks[host::2]: the same seeds
    engine, part = _recording_rollout(scripts, batch_size=4, config=pairs)
    engine.shard = (host, 2)
    list(engine.run(tasks[host::2]))
    assert part.task_seeds == {q: sampler.task_seeds[q] for q in list(scripts)[host::2]}


def test_distinct_rows_never_share_a_sampling_key():
  tasks, group = 1 << 14, 16  # 262,144 rows of one run, at two cache positions each
  seeds = np.array([sample_seed(t, i, group) for t in range(tasks) for i in range(group)])
  assert len(np.unique(seeds)) == tasks * group
  keys = [jax.random.key_data(token_keys(jax.random.key(0), jnp.asarray(seeds),
                                         jnp.full(seeds.shape, t))) for t in (5, 6)]
  bits = np.concatenate([np.asarray(k) for k in keys]).view(np.uint64)
  assert len(np.unique(bits)) == 2 * tasks * group


def test_a_run_past_2_31_rows_is_refused_rather_than_reusing_seeds():
  assert sample_seed((2**31 - 1) // 16, 15, 16) == 2**31 - 1
  with pytest.raises(ValueError, match="2\\*\\*31 rows"):
    sample_seed(2**31 // 16, 0, 16)
