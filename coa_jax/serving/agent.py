"""Agent programs as RL rollouts: each task's group of sessions runs an agent function against
the trainer's own OpenAI-compatible endpoint, and its calls become the samples.

`rl.agent = "module:function"` names the function. It gets a task and an OpenAI client whose
`base_url` is the endpoint under a session of its own (`/sessions/<id>/v1`), runs any agent
program with it, and returns a reward (a number) or None to leave scoring to the configured
rewards (which read the session's last completion as the response). A function that takes a
`context` argument also gets an `AgentContext`: the model's name, the tools the config declares
(to run on the client's side), the rollout limits. An `async def` function gets an
`openai.AsyncOpenAI` client.

`AgentRollout` has the built-in tool loop's interface (`run`, `key`, `params`, `version`,
`before_chunk`, `in_flight`, `sampler`, `tools`), so both trainers take either: `group_size`
sessions per task run concurrently against the current policy, every call is sampled with the
trainer's sampling settings (the policy the update assumes) and each session's sample is built
from its recorded ids (`serving.sessions`). Sessions get the built-in rollout's row seeds
(`sample_seed`) and the run's key: the built-in loop written as an agent function (`coa_loop`)
samples exactly what the built-in rollout samples.

The asynchronous trainer feeds `run` a task source that yields None while its staleness budget
is spent and sessions are in flight; `before_chunk` is then called at least every
`POLL_S` seconds and may swap the weights (`version`, then `params`). A call decoding at the swap
continues with the new weights, and every token keeps the version that sampled it; a session's
next call after a swap prefills its history again with the new weights (the engine drops parked
caches when the weights change).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import inspect
import json
import uuid
from typing import Any, Callable, Iterable, Iterator

import jax
import openai

from coa_jax.data import Task
from coa_jax.data.tokenizer import CoATokenizer
from coa_jax.model import ConfigError, ModelConfig
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.tool_loop import (RolloutConfig, RolloutRecord, call_result, malformed_call,
                                       sample_seed, stop_ids)
from coa_jax.serving.api import Server, ThreadServer, create_app
from coa_jax.serving.engine import Engine, EngineSettings
from coa_jax.serving.sessions import session_record
from tools_env import ToolRegistry, ToolResult, TrajectoryTools


@dataclasses.dataclass(frozen=True)
class AgentContext:
  """What an agent function may need besides its task and client."""

  model: str  # the `model` to put in requests
  tools: ToolRegistry  # the config's tools, for the program to run on its side
  tool_tags: tuple[str, ...]  # the tools the model has tags for (a request may declare them)
  rollout: RolloutConfig  # the limits the built-in rollout keeps (turns, response tokens)
  system_prompt: str
  tool_pool: concurrent.futures.Executor  # `rollout.tool_workers` threads, every session's

  def call_tool(self, session: TrajectoryTools, tag: str, body: str) -> ToolResult:
    """Runs a tool call as the built-in loop does: on the rollout's `tool_workers` threads
    (shared by every session), its error observation for a malformed call (an empty body), a
    tool that raises or one still running `tool_timeout_s` after the call was submitted."""
    if not body:
      return malformed_call(tag)
    future = self.tool_pool.submit(session.call, tag, body)
    timeout = self.rollout.tool_timeout_s
    concurrent.futures.wait([future], timeout)
    return call_result(future, not future.done(), timeout)


def load_agent(spec: str) -> Callable[..., Any]:
  """Returns the function `spec` ("module:function") names; ConfigError when it cannot."""
  module_name, _, name = spec.partition(":")
  if not module_name or not name:
    raise ConfigError(f"rl.agent={spec!r}: expected 'module:function'")
  try:
    function = getattr(importlib.import_module(module_name), name)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"rl.agent={spec!r}: {type(e).__name__}: {e}") from None
  if not callable(function):
    raise ConfigError(f"rl.agent={spec!r} is not a function")
  return function


class AgentRollout:
  """The tool loop's interface over agent programs served by an in-process endpoint."""

  MODEL = "policy"
  POLL_S = 0.05  # the longest wait between `before_chunk` calls while sessions run

  def __init__(self, agent: Callable[..., Any], model_config: ModelConfig, mesh,
               tokenizer: CoATokenizer, tools: ToolRegistry, config: RolloutConfig,
               system_prompt: str, sampling: SamplingConfig, slots: int, chunk: int,
               seed: int = 0, workers: int = 0, sampler: Sampler | None = None):
    self.agent, self.config, self.tokenizer, self.tools = agent, config, tokenizer, tools
    self.sampling = sampling
    self._fork_args = (agent, model_config, mesh, tokenizer, tools, config, system_prompt,
                       sampling, slots, chunk, seed, workers)
    settings = EngineSettings(slots=slots, cache_size=config.cache_size, chunk=chunk,
                              max_queue=max(256, 4 * slots), max_top_logprobs=0, seed=seed)
    self.engine = Engine(model_config, mesh, None, settings, stop_ids(tokenizer),
                         sampler).start()
    self.sampler = self.engine.sampler  # the trainer casts its weights with it
    self.server = Server(self.engine, tokenizer, self.MODEL, system_prompt,
                         config.max_observation_tokens, config.max_response_tokens,
                         session_sampling=sampling,
                         session_response_tokens=config.max_response_tokens)
    self._http = ThreadServer(create_app(self.server))
    self.url = self._http.url
    self._tool_pool = concurrent.futures.ThreadPoolExecutor(config.tool_workers, "agent-tool")
    self.context = AgentContext(self.MODEL, tools, tokenizer.tool_tags, config, system_prompt,
                                self._tool_pool)
    self._takes_context = "context" in inspect.signature(agent).parameters
    self._pool = concurrent.futures.ThreadPoolExecutor(workers or slots, "agent")
    self.key = jax.random.key(seed)
    self.shard = (jax.process_index(), jax.process_count())
    self.version = 0  # the policy version of `params`, tagged on every token it samples
    self.before_chunk: Callable[[], None] | None = None  # may swap params and version
    self.in_flight = 0  # sessions running
    self.tokens_sampled = 0
    self.tool_wait_s = 0.0  # the engine decodes whoever is ready; no wait is the loop's own
    self._params = None

  def fork(self) -> AgentRollout:
    """Returns another rollout of the same agent with an engine (and endpoint) of its own on
    the same devices, sharing this one's compiled programs: the asynchronous trainer's worker
    rolls out on it while the trainer evaluates on this one."""
    return AgentRollout(*self._fork_args, sampler=self.sampler)

  @property
  def params(self) -> Any:
    return self._params

  @params.setter
  def params(self, params: Any) -> None:
    """The sampling weights (version `version`) for the calls from the engine's next round
    on (None between the synchronous trainer's rollouts: nothing is served then)."""
    self._params = params
    if params is not None:
      self.engine.set_params(params, self.version)

  def run(self, tasks: Iterable[Task | None]) -> Iterator[list[RolloutRecord]]:
    """Yields each task's group of samples, in the order the groups finish. A None from `tasks`
    means no task now: it is asked again once a session ends or `POLL_S` has passed."""
    key, self.key = jax.random.split(self.key)
    self.engine.set_key(key)
    run = uuid.uuid4().hex[:8]
    n = self.config.group_size
    pending: dict[concurrent.futures.Future, tuple[int, int]] = {}
    groups: dict[int, list] = {}
    tasks, taken = iter(tasks), 0
    while tasks is not None or pending:
      task = next(tasks, StopIteration) if tasks is not None else None
      if task is StopIteration:
        tasks = None
      elif task is not None:
        number = self.shard[0] + self.shard[1] * taken
        taken += 1
        groups[number] = [[None] * n, 0]
        for sample in range(n):
          session = f"{run}-{number}-{sample}"
          self.server.session_seeds[session] = sample_seed(number, sample, n)
          pending[self._pool.submit(self._session, task, session, sample)] = (number, sample)
        self.in_flight = len(pending)
        continue
      if tasks is None:  # every task is out: only the sessions' ends matter
        done = {next(concurrent.futures.as_completed(pending))}
      else:
        done = concurrent.futures.wait(pending, self.POLL_S,
                                       concurrent.futures.FIRST_COMPLETED)[0]
      if self.before_chunk:
        self.before_chunk()
      for future in done:
        number, sample = pending.pop(future)
        group = groups[number]
        group[0][sample] = record = future.result()
        self.tokens_sampled += sum(record.loss_mask)
        group[1] += 1
        if group[1] == n:
          del groups[number]
          yield group[0]
      self.in_flight = len(pending)

  def _session(self, task: Task, session: str, sample: int) -> RolloutRecord:
    """Runs the agent function once; returns the session's sample. Its client talks plain HTTP
    to this host (`url`): without loading CA certificates (`verify=False`) it starts in about
    5 ms instead of 85, which a step of 32 sessions paid 32 times."""
    base_url = f"{self.url}/sessions/{session}/v1"
    kwargs = {"context": self.context} if self._takes_context else {}
    try:
      if inspect.iscoroutinefunction(self.agent):
        reward = asyncio.run(self._run_async(task, base_url, kwargs))
      else:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=False))
        try:
          reward = self.agent(task, client, **kwargs)
        finally:
          client.close()
      error = ""
    except Exception as e:  # noqa: BLE001 - a failing agent program is a failed sample
      reward, error = 0.0, f"{type(e).__name__}: {e}"
    finally:
      self.server.session_seeds.pop(session, None)
    return self._sample(task, session, sample, reward, error)

  async def _run_async(self, task: Task, base_url: str, kwargs: dict) -> Any:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(verify=False))
    try:
      return await self.agent(task, client, **kwargs)
    finally:
      await client.close()

  def _sample(self, task: Task, session: str, sample: int, reward: Any,
              error: str) -> RolloutRecord:
    record = session_record(self.server.sessions.pop(session), task.id, sample,
                            self.config.cache_size)
    if record is None:  # no call reached the model: an empty response, scored as such
      prompt = self.tokenizer.prompt_ids(self.server.system_prompt, task.question)
      record = RolloutRecord(task.id, sample, [], [], [], len(prompt))
      record.append(prompt)
      error = error or "the agent made no call"
    record.task_data = {**task.data, **record.task_data}
    if error:
      record.finish_reason, record.task_data["error"] = "error", error
    if reward is not None:
      record.reward = float(reward)
    return record

  def close(self) -> None:
    self._http.close()
    self.engine.close(drain=False, timeout=30)
    self._pool.shutdown(wait=False, cancel_futures=True)
    self._tool_pool.shutdown(wait=False, cancel_futures=True)


def coa_loop(task: Task, client: openai.OpenAI, context: AgentContext) -> None:
  """The built-in tool loop (`rollout.tool_loop.Rollout`) as an agent program: asks the model,
  runs the tool it calls on this side as the built-in loop runs it (`AgentContext.call_tool`),
  sends the result back, until the model answers or stops, a call past `max_turns`, or the
  session's response budget runs out (the endpoint ends it). Leaves scoring to the configured
  rewards."""
  tools = [{"type": "function", "function": {"name": tag, "parameters": {
      "type": "object", "properties": {"body": {"type": "string"}}}}} for tag in context.tool_tags]
  messages = [{"role": "system", "content": context.system_prompt},
              {"role": "user", "content": task.question}]
  session = TrajectoryTools(context.tools, task.question)
  for turn in range(context.rollout.max_turns + 1):
    choice = client.chat.completions.create(model=context.model, messages=messages,
                                            tools=tools).choices[0]
    if choice.finish_reason != "tool_calls" or turn == context.rollout.max_turns:
      return None
    call = choice.message.tool_calls[0]
    name, body = call.function.name, json.loads(call.function.arguments)["body"]
    result = context.call_tool(session, name, body)
    messages += [{"role": "assistant", "content": choice.message.content,
                  "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result.observation}]
  return None
