"""The worked example of a user's own tool (tools_env/examples/sqlite_shop.py): the tool's
limits, its teacher and reward, the same runs through MCP and through the Python class, and the
quick recipe on it: tests/test_task_layouts.py."""

import contextlib
import dataclasses
import json
import os
import re
import sqlite3
import sys

import pytest
from test_rollout import SYSTEM, ScriptedSampler

from coa_jax.data import coa_format, rewards
from coa_jax.data.tasks import Task, load_tasks
from coa_jax.data.tokenize import step_ids
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.distill.job import to_trajectory
from coa_jax.distill.teacher import TeacherConfig, build_teacher
from coa_jax.rollout.tool_loop import Rollout, RolloutConfig, stop_ids
from configs import pipeline_sql_cpu
from tools_env import registry
from tools_env.examples import sqlite_shop

SHOP = "tools_env.examples.sqlite_shop"


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
  """A small shop: its paths and the two declarations of its tool (Python class, MCP server)."""
  paths = sqlite_shop.build(str(tmp_path_factory.mktemp("shop")), customers=30, train_tasks=12,
                            heldout_tasks=4)
  python_spec = json.load(open(paths["tools"]))
  database = python_spec["sql"]["options"]["database"]
  mcp_spec = {"shop": {"kind": "mcp", "command": [
      sys.executable, "-m", "tools_env.examples.sqlite_shop_mcp", database]}}
  return paths, python_spec, mcp_spec


def test_the_sql_tool_reads_only_within_its_limits(shop):
  database = shop[1]["sql"]["options"]["database"]
  tool = sqlite_shop.Sql(database, max_rows=3, timeout_s=5.0)  # a stall is no timeout here
  assert tool("SELECT COUNT(*) FROM orders").observation.isdigit()
  rows = tool("SELECT * FROM orders").observation.splitlines()
  assert len(rows) == 4 and rows[-1] == "... (more than 3 rows)"
  assert tool("SELEC 1").error_kind == "bad_request"
  refused = tool("DELETE FROM orders")
  assert refused.error_kind == "bad_request" and "not authorized" in refused.observation
  endless = sqlite_shop.Sql(database, timeout_s=0.2)("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                 "SELECT COUNT(*) FROM n")
  assert endless.error_kind == "timeout" and endless.elapsed_s < 5
  with pytest.raises(ValueError, match="no database"):
    sqlite_shop.Sql("/no/such.db")


def shop_db(directory, name: str = "shop.db") -> str:
  """Writes a database of one order (customer 7 bought 2 pens at 3) and returns its path."""
  path = os.path.join(directory, name)
  with contextlib.closing(sqlite3.connect(path)) as db, db:
    db.execute("CREATE TABLE orders (customer INTEGER, product TEXT, quantity INTEGER, "
               "price INTEGER)")
    db.execute("INSERT INTO orders VALUES (7, 'pens', 2, 3)")
  return path


def files(directory) -> dict[str, bytes]:
  """Returns every file under `directory` with its bytes."""
  return {str(path): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("attack", [
    "VACUUM INTO '{folder}/copy.db'", "ATTACH 'file:{folder}/new.db?mode=rwc' AS new",
    "ATTACH '{folder}/new.db' AS new", "DETACH main", "VACUUM", "DELETE FROM orders",
    "INSERT INTO orders VALUES (1, 'cups', 1, 1)", "UPDATE orders SET price = 0",
    "DROP TABLE orders", "CREATE TABLE t (x)", "CREATE TEMP TABLE t AS SELECT 1",
    "CREATE INDEX i ON orders (customer)", "ALTER TABLE orders ADD COLUMN note TEXT",
    "PRAGMA user_version = 7", "PRAGMA journal_mode = WAL", "PRAGMA optimize", "ANALYZE",
    "BEGIN IMMEDIATE", "SELECT load_extension('x')"])
def test_the_sql_tool_denies_every_statement_that_could_write(tmp_path, attack):
  database = shop_db(str(tmp_path))
  before = files(tmp_path)
  result = sqlite_shop.Sql(database)(attack.format(folder=tmp_path))
  assert (result.ok, result.error_kind) == (False, "bad_request")
  assert re.fullmatch(r"Error: SQL error: (not authorized|authorization denied)"
                      r"( to use function: load_extension)?", result.observation)
  assert files(tmp_path) == before  # no file written, created or changed


@pytest.mark.parametrize("query, rows", [
    ("SELECT customer, product, quantity * price FROM orders", "7 | pens | 6"),
    ("PRAGMA table_info(orders)", "0 | customer | INTEGER | 0 | None | 0"),
    ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
     "SELECT SUM(i) FROM n", "6"),
    ("SELECT upper(product) FROM orders", "PENS")])
def test_the_sql_tool_reads(tmp_path, query, rows):
  result = sqlite_shop.Sql(shop_db(str(tmp_path)))(query)
  assert (result.ok, result.observation.splitlines()[0]) == (True, rows)


def test_the_database_path_is_escaped_in_the_uri(tmp_path):
  database = shop_db(str(tmp_path), "odd?mode=rwc#x%41.db")  # unescaped: the file "odd", rwc
  before = files(tmp_path)
  tool = sqlite_shop.Sql(database)
  assert tool("SELECT product FROM orders").observation == "pens"
  assert "not authorized" in tool("DELETE FROM orders").observation
  assert files(tmp_path) == before


def test_the_teacher_queries_or_answers_from_memory_and_the_reward_reads_the_results(shop):
  paths, python_spec, _ = shop
  tasks = [json.loads(line) for line in open(paths["train"])]
  rewarder = rewards.build_rewarder(pipeline_sql_cpu.get_config().rewards.to_dict(), ("sql",))
  with registry.build_registry(python_spec) as tools:
    for rate, queries in ((0.0, 1), (1.0, 0)):
      teacher = build_teacher(tools, TeacherConfig(hook=f"{SHOP}:teach", mental_math_rate=rate))
      for task in tasks:
        trace = teacher.run(task)
        steps = [a.step for a in trace.activations]
        assert steps.count("sql") == queries and steps[-3:] == [
            "suggested_answer", "double_check", "answer"]
        assert trace.answer == task["metadata"]["ground_truth"]  # right either way
        reward = rewarder(to_trajectory(trace, SYSTEM).response_text(), task["metadata"])
        assert reward.correct and reward.details["queries"] == queries
        assert reward.details["read_off_a_result"] == bool(queries)


def _scripted_rollout(tools, tasks):
  """Rolls out a scripted model on `tasks`: a bad query, then the right one, then its result."""
  tokenizer = default_tokenizer("plain", tool_tags=("sql",))
  scripts, expected = {}, {}
  for task in tasks:
    _, query = sqlite_shop._queries({"metadata": task.data})
    bad = step_ids(tokenizer, coa_format.Step("sql", "SELEC 1"), True)
    good = step_ids(tokenizer, coa_format.Step("sql", query), False)
    answer = step_ids(tokenizer, coa_format.Step("answer", task.data["ground_truth"]), False)
    scripts[task.question] = bad + good + answer
  sampler = ScriptedSampler(scripts, 4, stop_ids=stop_ids(tokenizer))
  engine = Rollout(sampler, None, tokenizer, tools,
                   RolloutConfig(max_prompt_tokens=64, max_response_tokens=300), SYSTEM)
  # The scripted sampler keys its scripts by question: the tasks' ids are their questions.
  records = [record for group in engine.run([Task(t.question, t.question, t.data)
                                             for t in tasks]) for record in group]
  return {r.task_id: dataclasses.asdict(r) for r in records}, tokenizer


def test_the_tool_through_mcp_equals_the_tool_as_a_python_class(shop):
  paths, python_spec, mcp_spec = shop
  assert registry.declare(mcp_spec)[0].tag == "sql"
  tasks = load_tasks(paths["heldout"])
  with registry.build_registry(python_spec) as as_class, \
       registry.build_registry(mcp_spec) as over_mcp:
    runs = [_scripted_rollout(tools, tasks) for tools in (as_class, over_mcp)]
    teacher_config = TeacherConfig(hook=f"{SHOP}:teach", mental_math_rate=0.0)
    traces = [[build_teacher(tools, teacher_config).run(t).to_json()
               for t in map(json.loads, open(paths["train"]))] for tools in (as_class, over_mcp)]
  (by_class, tokenizer), (by_mcp, _) = runs
  for records in (by_class, by_mcp):  # for each: the bad query's error, then the result
    for record in records.values():
      assert record["tool_calls"] == {"sql": 2} and record["tool_errors"] == {"bad_request": 1}
      assert record["finish_reason"] == "answer"
  for record in list(by_class.values()) + list(by_mcp.values()):
    record.pop("decode_s"), record.pop("tool_s")  # wall times
  assert by_class == by_mcp  # ids, masks, log-probs, versions, calls, errors
  assert traces[0] == traces[1]  # the teacher's: every message and tool result
  assert "SQL error" in tokenizer.decode(next(iter(by_mcp.values()))["ids"])
