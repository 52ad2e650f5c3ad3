"""A worked example of an agent program nobody here wrote: the SQL shop's agent built with the
OpenAI Agents SDK (`openai-agents`), served and trained through coa-jax's endpoint.

The agent is the SDK's `Agent` with one function tool, `sql`, that runs a read-only query on
the shop's database (`sqlite_shop.Sql`, on the program's side), over the SDK's Chat Completions
model pointed at whatever client it is given. coa-jax maps the SDK's function calling onto the
model's CoA tool steps (docs/serving.md): the model writes `<sql>...</sql>`, the SDK sees a call
of `sql(query=...)`, runs it and sends the rows back as a tool message, an observation.

- Against `make serve` (a shop model): `python -m tools_env.examples.shop_agents_sdk
  --base_url=http://127.0.0.1:8000/v1 --tasks=runs/pipeline_sql/distill/world/heldout.jsonl`
  (`--max_tasks=0 --k=3 --out=FILE`: every task three times, pass@1 into a JSON file).
- Trained with DAPO through the trainer's own endpoint: `rl.agent =
  "tools_env.examples.shop_agents_sdk:solve"` (`solve` is the RL agent function: a task, an
  `AsyncOpenAI` client, the context; it returns the reward, 1 for the right total).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from typing import Any

ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)


def final_answer(text: str | None) -> str | None:
  """Returns the CoA answer step's content in the agent's final output, if it wrote one."""
  match = ANSWER.search(text or "")
  return match.group(1) if match else None


async def run_agent(question: str, client: Any, model: str, instructions: str | None, sql: Any,
                    max_turns: int) -> str | None:
  """Runs the SDK agent on one question; returns its answer (None when it gave none). Without
  `instructions` the server gives the model the system prompt it was trained with."""
  from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
  from agents import set_tracing_disabled
  from agents.exceptions import AgentsException

  set_tracing_disabled(True)  # no traces leave the machine

  @function_tool(name_override="sql")  # the model's tool tag
  def query(query: str) -> str:
    """Runs one read-only SQLite query on orders(customer, product, quantity, price)."""
    return sql(query, question).observation

  agent = Agent(name="shop", instructions=instructions, tools=[query],
                model=OpenAIChatCompletionsModel(model=model, openai_client=client))
  try:
    result = await Runner.run(agent, question, max_turns=max_turns)
  except AgentsException:  # out of turns, or a reply the SDK cannot take: no answer
    return None
  return final_answer(result.final_output)


async def solve(task: Any, client: Any, context: Any) -> float:
  """The RL agent function (`rl.agent`): 1.0 when the agent's answer is the task's total."""
  answer = await run_agent(task.question, client, context.model, context.system_prompt,
                           context.tools.tools["sql"], context.rollout.max_turns + 1)
  return float(answer is not None and answer == str(task.data.get("ground_truth", "")).strip())


async def evaluate(client: Any, model: str, tasks: list[dict], sql: Any, k: int,
                   concurrency: int, max_turns: int = 5) -> list[list[bool]]:
  """Runs the agent `k` times on each task (at most `concurrency` sessions at once); returns
  whether each answer was the task's total, and prints progress every 10% of the runs."""
  gate, done, start = asyncio.Semaphore(concurrency), [0], time.perf_counter()
  total = len(tasks) * k

  async def one(task: dict) -> bool:
    async with gate:
      answer = await run_agent(task["question"], client, model, None, sql, max_turns)
    done[0] += 1
    if done[0] % max(total // 10, 1) == 0 or done[0] == total:
      rate = done[0] / (time.perf_counter() - start)
      print(f"{done[0]}/{total} sessions, {rate:.2f}/s, ETA {(total - done[0]) / rate:.0f} s",
            flush=True)
    return answer == str(task["metadata"]["ground_truth"]).strip()

  return await asyncio.gather(*(asyncio.gather(*(one(task) for _ in range(k)))
                                for task in tasks))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
  parser.add_argument("--tasks", required=True, help="a shop task file (JSONL)")
  parser.add_argument("--max_tasks", type=int, default=20, help="the first tasks (0: all)")
  parser.add_argument("--k", type=int, default=1, help="runs of the agent per task")
  parser.add_argument("--concurrency", type=int, default=16, help="sessions at once")
  parser.add_argument("--out", default="", help="a JSON file for pass@1 and every outcome")
  args = parser.parse_args()
  import openai

  from tools_env.examples.sqlite_shop import Sql

  client = openai.AsyncOpenAI(base_url=args.base_url, api_key="none", timeout=600)
  tasks = [json.loads(line) for line in open(args.tasks)][:args.max_tasks or None]
  database = json.load(open(os.path.join(os.path.dirname(args.tasks), "tools.json")))

  async def run() -> list[list[bool]]:
    model = (await client.models.list()).data[0].id
    return await evaluate(client, model, tasks, Sql(**database["sql"]["options"]), args.k,
                          args.concurrency)

  outcomes = asyncio.run(run())
  right = sum(map(sum, outcomes))
  pass_at_1 = right / (len(tasks) * args.k)
  print(f"{right} of {len(tasks) * args.k} right (pass@1 {pass_at_1:.3f})")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"pass@1": pass_at_1, "k": args.k, "tasks": args.tasks,
                 "outcomes": {t["id"]: o for t, o in zip(tasks, outcomes)}}, f, indent=1)


if __name__ == "__main__":
  main()
