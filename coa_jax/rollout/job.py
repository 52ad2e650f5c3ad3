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

import dataclasses
import json
import os
import sys
import time
import types
from typing import Any, TextIO

import jax

from coa_jax.data import coa_format
from coa_jax.data.tasks import Task, load_tasks
from coa_jax.rollout import settings as agent
from coa_jax.rollout.settings import rollout_settings
from coa_jax.rollout.tool_loop import Rollout, RolloutRecord, progress_line, summarize
from coa_jax.runtime import distributed
from coa_jax.runtime.distributed import say
from coa_jax.runtime.paths import local
from tools_env import sandbox


def transcript(record: RolloutRecord, tokenizer) -> str:
  """Returns a readable transcript of one sample."""
  head = (f"=== task {record.task_id} sample {record.sample}: {record.finish_reason}, "
          f"{record.response_len} tokens, {record.turns} tool calls {record.tool_calls}")
  prompt = tokenizer.decode(record.ids[:record.prompt_len])
  return f"{head}\n--- prompt\n{prompt}\n--- response\n{record.response_text(tokenizer)}\n"


def run(config: Any) -> dict[str, Any]:
  """Rolls out the tasks of config.tasks (a ConfigDict, checked by `rollout_settings`, or
  RolloutSettings); returns the summary it also writes."""
  settings = rollout_settings(config)
  output_dir = settings.output_dir

  def prepare() -> list:  # agreed: a host that cannot read the tasks would stop alone
    os.makedirs(local(output_dir, "output_dir"), exist_ok=True)
    return load_tasks(settings.tasks, settings.max_tasks, require_answer=False)

  tasks = distributed.agreed(prepare, f"reading {settings.tasks}")
  tokenizer = agent.agent_tokenizer(settings)
  engine = agent.engine(settings, tokenizer)
  hosts, host = jax.process_count(), jax.process_index()
  paths = {name: os.path.join(output_dir, name)
           for name in ("records.jsonl", "transcripts.txt", "summary.json")}
  if hosts > 1:
    paths["records.jsonl"] = os.path.join(output_dir, f"records-{host}.jsonl")
    paths["transcripts.txt"] = os.path.join(output_dir, f"transcripts-{host}.txt")
  say(f"rolling out {len(tasks)} tasks x {engine.config.group_size} samples "
      f"({settings.batch_size} rows, chunks of {settings.chunk}) -> {output_dir}")
  start = time.perf_counter()
  mine = tasks[host::hosts]
  # On the host's own devices, writing its own files: agreed, so one host's failure (a tool
  # set-up, a stalled rollout, a full disk) ends every host instead of leaving them in the
  # gathers below.
  try:
    records = distributed.agreed(
        lambda: _roll_out(engine, tokenizer, mine, settings.transcripts, paths, start), "rollouts")
  finally:  # MCP servers stop with the job; agreed, as a gather follows
    distributed.agreed(engine.tools.close, "closing the tools")
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


def _roll_out(engine: Rollout, tokenizer: Any, tasks: list, transcripts: int,
              paths: dict[str, str], start: float) -> list[RolloutRecord]:
  """Rolls out `tasks`, writing each record and the first `transcripts` as text as they finish,
  with progress lines; returns the records."""
  records: list[RolloutRecord] = []
  last = start
  hosts = jax.process_count()
  with open(paths["records.jsonl"], "w") as out, open(paths["transcripts.txt"], "w") as text:
    for done, group in enumerate(engine.run(tasks), 1):
      for record in group:
        out.write(json.dumps(record.to_json()) + "\n")
        if len(records) < transcripts:
          text.write(transcript(record, tokenizer) + "\n")
        records.append(record)
      now = time.perf_counter()
      if now - last > 5 or done == len(tasks):
        tokens = sum(r.response_len for r in records)
        say(f"{'host 0: ' if hosts > 1 else ''}"
            f"{progress_line(done, len(tasks), tokens, now - start)}")
        last = now
  return records


def interactive(config: Any, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
  """Reads questions line by line and prints each step of the agent as soon as it is closed."""
  settings = rollout_settings(config)
  tokenizer = agent.agent_tokenizer(settings)
  engine = agent.engine(settings, tokenizer, dataclasses.replace(settings.rollout, group_size=1))
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
