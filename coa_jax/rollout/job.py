"""The rollout job: a policy from a checkpoint, tools from the config, tasks from a file.

`run(config)` writes `records.jsonl` (one RolloutRecord per sample, token in, token out),
`transcripts.txt` (the first few samples as readable text) and `summary.json` (with
`sandbox_isolation`: the weakest isolation any host's code tool ran under) under
config.output_dir, printing progress with rate and ETA. On several hosts, each decodes its share
of the tasks on its own devices and writes `records-<host>.jsonl`; the summary covers all.
`interactive(config)` reads questions from stdin and streams each step of the agent as it is
decoded.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from typing import Any, TextIO

import jax

from coa_jax.data import coa_format
from coa_jax.data.tasks import Task, load_tasks
from coa_jax.data.tokenizer import tokenizer_of
from coa_jax.model import ConfigError, ModelSettings, Transformer
from coa_jax.rollout import tool_loop as rollout
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, RolloutRecord, summarize
from coa_jax.runtime import distributed, sharding
from coa_jax.runtime.paths import local
from coa_jax.runtime.distributed import say
from coa_jax.runtime.hf_checkpoint import load_model
from coa_jax.runtime.sharding import init_params, param_shardings
from tools_env import registry as tools_registry
from tools_env import sandbox


def build(config: Any, tokenizer: Any = None) -> tuple[Rollout, Any]:
  """Returns (the Rollout engine, the tokenizer) that `config` describes (`tokenizer`: the one
  already loaded from it). On several hosts, the engine decodes on this host's devices with
  config.batch_size / hosts rows."""
  tokenizer = tokenizer or distributed.agreed(lambda: tokenizer_of(config),
                                              "loading the tokenizer")
  mesh = sharding.make_mesh(sharding.MeshConfig(**config.mesh))
  if config.batch_size % jax.process_count():
    raise ConfigError(f"batch_size={config.batch_size} does not split over "
                      f"{jax.process_count()} hosts")
  model = ModelSettings.from_section(config.model)
  model_config, params = distributed.agreed(lambda: load_model(model, tokenizer, mesh),
                                           "loading the model")
  if params is None:
    say("model.checkpoint is empty: rolling out a freshly initialized (untrained) model")
    params = init_params(Transformer(model_config), mesh, jax.random.key(config.seed))
  host = sharding.host_mesh(mesh)
  params = sharding.to_host_mesh(params, mesh, host,
                                 param_shardings(Transformer(model_config), host))
  rollout_config = RolloutConfig(**config.rollout)
  sampler = Sampler(model_config, host, batch_size=config.batch_size // jax.process_count(),
                    cache_size=rollout_config.cache_size,
                    chunk=config.chunk, stop_ids=rollout.stop_ids(tokenizer),
                    sampling=SamplingConfig(**config.sampling))
  tools = distributed.agreed(lambda: rollout.callable_tools(
      tools_registry.build_registry(config.tools.to_dict()), tokenizer), "building the tools")
  engine = Rollout(sampler, sampler.sampling_params(params), tokenizer, tools, rollout_config,
                   config.system_prompt, seed=config.seed)
  return engine, tokenizer


def transcript(record: RolloutRecord, tokenizer) -> str:
  """Returns a readable transcript of one sample."""
  head = (f"=== task {record.task_id} sample {record.sample}: {record.finish_reason}, "
          f"{record.response_len} tokens, {record.turns} tool calls {record.tool_calls}")
  prompt = tokenizer.decode(record.ids[:record.prompt_len])
  return f"{head}\n--- prompt\n{prompt}\n--- response\n{record.response_text(tokenizer)}\n"


def run(config: Any) -> dict[str, Any]:
  """Rolls out the tasks of config.tasks; returns the summary it also writes."""
  tasks = load_tasks(config.tasks, config.max_tasks, require_answer=False)
  engine, tokenizer = build(config)
  hosts, host = jax.process_count(), jax.process_index()
  os.makedirs(local(config.output_dir, "output_dir"), exist_ok=True)
  paths = {name: os.path.join(config.output_dir, name)
           for name in ("records.jsonl", "transcripts.txt", "summary.json")}
  if hosts > 1:
    paths["records.jsonl"] = os.path.join(config.output_dir, f"records-{host}.jsonl")
    paths["transcripts.txt"] = os.path.join(config.output_dir, f"transcripts-{host}.txt")
  say(f"rolling out {len(tasks)} tasks x {engine.config.group_size} samples "
      f"({config.batch_size} rows, chunks of {config.chunk}) -> {config.output_dir}")
  start = time.perf_counter()
  mine = tasks[host::hosts]
  # On the host's own devices, writing its own files: agreed, so one host's failure (a tool
  # set-up, a stalled rollout, a full disk) ends every host instead of leaving them in the
  # gathers below.
  try:
    records = distributed.agreed(
        lambda: _roll_out(engine, tokenizer, mine, config, paths, start), "rollouts")
  finally:
    engine.tools.close()  # MCP servers stop with the job
  fields = ("finish_reason", "tool_calls", "tool_errors", "response_len", "turns")
  every = [types.SimpleNamespace(**row) for part in distributed.gather_json(
      [{f: getattr(r, f) for f in fields} for r in records]) for row in part]
  isolation = distributed.gather_json(sandbox.isolation_of(engine.tools.tools))
  summary = {**summarize(every), "wall_s": time.perf_counter() - start,
             "decode_s": engine.decode_s, "tool_wait_s": engine.tool_wait_s,
             "chunks": engine.chunks, "compilations": engine.sampler.compilations(),
             "sandbox_isolation": sandbox.weakest(isolation)}
  if host == 0:
    with open(paths["summary.json"], "w") as f:
      json.dump(summary, f, indent=2)
  say(json.dumps(summary))
  return summary


def _roll_out(engine: Any, tokenizer: Any, tasks: list, config: Any, paths: dict[str, str],
              start: float) -> list[RolloutRecord]:
  """Rolls out `tasks`, writing each record and the first transcripts as they finish, with
  progress lines; returns the records."""
  records: list[RolloutRecord] = []
  last = start
  hosts = jax.process_count()
  with open(paths["records.jsonl"], "w") as out, open(paths["transcripts.txt"], "w") as text:
    for done, group in enumerate(engine.run(tasks), 1):
      for record in group:
        out.write(json.dumps(record.to_json()) + "\n")
        if len(records) < config.transcripts:
          text.write(transcript(record, tokenizer) + "\n")
        records.append(record)
      now = time.perf_counter()
      if now - last > 5 or done == len(tasks):
        tokens = sum(r.response_len for r in records)
        say(f"{'host 0: ' if hosts > 1 else ''}"
            f"{progress_line(done, len(tasks), tokens, now - start)}")
        last = now
  return records


def progress_line(done: int, total: int, tokens: int, seconds: float) -> str:
  """Returns a progress line: tasks done of total, tasks and tokens per second, and the ETA."""
  rate = done / seconds if seconds > 0 else 0.0
  eta = f"{(total - done) / rate:,.0f}s" if rate > 0 else "?"
  return (f"tasks {done}/{total}  {rate:.2f} tasks/s  "
          f"{tokens / seconds if seconds > 0 else 0.0:,.0f} tokens/s  ETA {eta}")


def interactive(config: Any, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
  """Reads questions line by line and prints each step of the agent as soon as it is closed."""
  config.rollout.group_size = 1
  engine, tokenizer = build(config)
  shown = [0]

  def show(record: RolloutRecord) -> None:
    steps, _ = coa_format.parse(record.response_text(tokenizer), tokenizer.tool_tags)
    closed = [step for step in steps if step.closed]
    for step in closed[shown[0]:]:
      stdout.write(coa_format.render_step(step) + "\n")
    stdout.flush()
    shown[0] = len(closed)

  engine.listener = show
  stdout.write("Type a question (an empty line or Ctrl-D quits).\n> ")
  stdout.flush()
  for line in stdin:
    if not line.strip():
      break
    shown[0] = 0
    for (record,) in engine.run([Task("interactive", line.strip())]):
      stdout.write(f"[{record.finish_reason}: {record.response_len} tokens, "
                   f"{record.turns} tool calls]\n> ")
      stdout.flush()
