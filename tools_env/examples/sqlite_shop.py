"""A worked example of a user's own tool, tasks, reward and teacher: SQL over a shop's database.

What a user writes to train an agent on a tool of their own (docs/tools_and_rollouts.md, "Add
your own tool"), using only the standard library and `tools_env`:

- `Sql`: the tool, a `tools_env.Tool` that runs one read-only SQLite query (a time limit, a row
  limit, errors as observations) on a connection that cannot write (`connect_read_only`);
- `build`: the environment, a seeded SQLite database of orders (orders(id, customer, product,
  quantity, price)) and its tasks: "How many pens did customer 4821 buy?" and "How much did
  customer 4821 spend?", each answered by one aggregate query;
- `teach`: the scripted teacher's behaviour, a hook over `coa_jax.distill.teacher.TeacherRun`:
  plan, query, propose, double-check, answer; at the rate `mental_math_rate` it answers from
  memory instead, right for the teacher and a guess for a student that imitates it;
- `reward`: the outcome reward, which sees the whole response (its answer, every tool call
  with its result, token counts) and scores the answer alone.

`sqlite_shop_mcp` serves the same tool from an MCP server. `configs/pipeline_sql_cpu.py` runs
the recipe on it (distil, SFT, DAPO, evaluate).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import sqlite3
import time
from typing import Any

from tools_env.base import BAD_REQUEST, TIMEOUT, Tool, ToolFailure

PRODUCTS = ("pens", "cups", "lamps", "books", "chairs", "bags")
# What a read-only query may do (sqlite3 authorizer actions): read tables and columns, call
# functions (not load_extension), recurse in a CTE, and run the PRAGMA statements that only
# describe the schema (not their table-valued functions). Everything else is denied: writes,
# ATTACH (and so VACUUM INTO, which attaches its output), DETACH, transactions, schema changes,
# ANALYZE and every other pragma.
READ_ACTIONS = (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                sqlite3.SQLITE_RECURSIVE)
READ_PRAGMAS = ("table_info", "table_xinfo", "table_list", "index_list", "index_info",
                "index_xinfo", "foreign_key_list")


def _authorize(action: int, arg1: str | None, arg2: str | None, database: str | None,
               trigger: str | None) -> int:
  """The authorizer of a read-only connection: SQLITE_OK for `READ_ACTIONS` and `READ_PRAGMAS`,
  SQLITE_DENY for anything else."""
  if action in READ_ACTIONS and not (action == sqlite3.SQLITE_FUNCTION
                                     and arg2 == "load_extension"):
    return sqlite3.SQLITE_OK
  if action == sqlite3.SQLITE_PRAGMA and arg1 in READ_PRAGMAS:
    return sqlite3.SQLITE_OK
  return sqlite3.SQLITE_DENY


def connect_read_only(database: str) -> sqlite3.Connection:
  """Returns a connection to the SQLite file `database` that cannot write anything: opened with
  mode=ro through a URI whose path is escaped (a `?`, `#` or `%` in it stays part of the
  file name), and with an authorizer that denies every statement but reads (`_authorize`)."""
  uri = pathlib.Path(os.path.abspath(database)).as_uri() + "?mode=ro"
  db = sqlite3.connect(uri, uri=True)
  db.set_authorizer(_authorize)
  return db


class Sql(Tool):
  """Runs one read-only SQLite query on the table orders(customer, product, quantity, price) and
  returns its rows."""

  name = "sql"

  def __init__(self, database: str, max_rows: int = 20, timeout_s: float = 2.0,
               max_output_chars: int = 2000):
    super().__init__(max_output_chars)
    if not os.path.isfile(database):
      raise ValueError(f"sql: no database at {database!r}")
    self.database, self.max_rows, self.timeout_s = database, max_rows, timeout_s

  def _run(self, body: str, goal: str) -> tuple[str, dict[str, Any]]:
    deadline = time.monotonic() + self.timeout_s
    try:
      with contextlib.closing(connect_read_only(self.database)) as db:
        db.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        rows = db.execute(body.strip()).fetchmany(self.max_rows + 1)
    except sqlite3.Error as e:  # a bad query, a write denied, or interrupted at the deadline
      kind = TIMEOUT if time.monotonic() > deadline else BAD_REQUEST
      raise ToolFailure(kind, f"SQL error: {e}") from None
    lines = [" | ".join(str(value) for value in row) for row in rows[:self.max_rows]]
    if len(rows) > self.max_rows:
      lines.append(f"... (more than {self.max_rows} rows)")
    return "\n".join(lines) or "(no rows)", {"rows": len(rows)}


def _queries(task: dict[str, Any]) -> tuple[str, str]:
  """Returns (the plan, the query) that answer a task."""
  meta = task["metadata"]
  if meta["family"] == "quantity":
    return (f"Sum the quantities of {meta['product']} in the orders of customer "
            f"{meta['customer']}.", f"SELECT SUM(quantity) FROM orders WHERE customer = "
                                    f"{meta['customer']} AND product = '{meta['product']}'")
  return (f"Sum quantity times price over the orders of customer {meta['customer']}.",
          f"SELECT SUM(quantity * price) FROM orders WHERE customer = {meta['customer']}")


def build(directory: str, seed: int = 0, customers: int = 400, train_tasks: int = 2000,
          heldout_tasks: int = 200) -> dict[str, str]:
  """Writes shop.db, train.jsonl, heldout.jsonl and tools.json under `directory` (held-out
  tasks ask about customers no training task names); returns their paths."""
  rng = random.Random(seed)
  os.makedirs(directory, exist_ok=True)
  ids = rng.sample(range(1000, 10000), customers)
  orders = [(customer, rng.choice(PRODUCTS), rng.randint(1, 9), rng.randint(2, 40))
            for customer in ids for _ in range(rng.randint(2, 5))]
  database = os.path.abspath(os.path.join(directory, "shop.db"))
  with contextlib.suppress(FileNotFoundError):
    os.remove(database)
  with contextlib.closing(sqlite3.connect(database)) as db, db:
    db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer INTEGER, product TEXT, "
               "quantity INTEGER, price INTEGER)")
    db.executemany("INSERT INTO orders (customer, product, quantity, price) VALUES (?, ?, ?, ?)",
                   orders)
  split_at = customers * 9 // 10  # the last tenth of the customers are held out
  paths = {"tools": os.path.join(directory, "tools.json")}
  for split, (pool, count) in {"train": (ids[:split_at], train_tasks),
                               "heldout": (ids[split_at:], heldout_tasks)}.items():
    rows = [_task(f"{split}-{i}", rng.choice(pool), orders, rng) for i in range(count)]
    paths[split] = os.path.join(directory, f"{split}.jsonl")
    with open(paths[split], "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
  with open(paths["tools"], "w") as f:
    json.dump({"sql": {"kind": "python", "class": "tools_env.examples.sqlite_shop:Sql",
                       "options": {"database": database}}}, f, indent=1)
  return paths


def _task(task_id: str, customer: int, orders: list[tuple], rng: random.Random) -> dict:
  """Returns one task record about `customer`: a product they bought, or their whole spend."""
  theirs = [order for order in orders if order[0] == customer]
  if rng.random() < 0.5:
    product = rng.choice(sorted({order[1] for order in theirs}))
    question = f"Question: How many {product} did customer {customer} buy?"
    answer = sum(order[2] for order in theirs if order[1] == product)
    meta = {"family": "quantity", "product": product}
  else:
    question = f"Question: How much did customer {customer} spend?"
    answer = sum(order[2] * order[3] for order in theirs)
    meta = {"family": "spent"}
  return {"id": task_id, "question": question,
          "metadata": {"domain": "shop", "ground_truth": str(answer), "customer": customer, **meta}}


def teach(task: dict[str, Any], run: Any) -> None:
  """The teacher's behaviour on a shop task, through `run` (a TeacherRun): plan, query,
  propose, double-check, answer; at `run.config.mental_math_rate`, from memory (no query)."""
  plan, query = _queries(task)
  if run.chance(run.config.mental_math_rate):
    run.act("planner", "plan", "I remember this total.")
    answer = task["metadata"]["ground_truth"]
  else:
    run.act("planner", "plan", plan)
    answer = run.act("sql_agent", "sql", query, tool_call=query).tool_result.strip()
  run.act("proposer", "suggested_answer", answer)
  run.act("verifier", "double_check", f"The total is {answer}. Score: 4")
  run.act("answerer", "answer", answer)


def reward(response: Any) -> tuple[float, dict[str, Any]]:
  """1 when the final answer is the task's total, else 0; the details say how many queries ran
  and whether the answer was read off a query's result."""
  gold = str(response.task.get("ground_truth", "")).strip()
  results = [call.result for call in response.tool_calls if call.tag == "sql"]
  return float(response.answer is not None and response.answer.strip() == gold), {
      "queries": len(results),
      "read_off_a_result": any(r is not None and r.strip() == response.answer for r in results)}
