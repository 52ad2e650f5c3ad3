"""A user's own tool: the example of docs/tools_and_rollouts.md ("Add your own tool") runs as
written, from a folder that is not on sys.path; a module beside the command imports by its
import path; a pipeline config's `tools` is every stage's."""

import json
import os
import re
import subprocess
import sys

import pytest

from coa_jax.data.tokenizer import declared_tags
from coa_jax.distill import job as distill_job
from configs import pipeline_sql_cpu
from tools_env import base, registry
from tools_env.examples import sqlite_shop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Loads the documented config as experiments/pipeline.py does (by its path), shrinks it with its
# `quick`, distils, and declares every later stage's tools: what `make pipeline` runs first.
DRIVER = """
import importlib.util, json, os, sys
cwd_on_path = any(os.path.abspath(p or os.curdir) == os.getcwd() for p in sys.path)
spec = importlib.util.spec_from_file_location("pipeline_config", "my_shop_config.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.quick(module.get_config())
from coa_jax import distill
from coa_jax.data.tokenizer import declared_tags
summary = distill.run(module.stage_configs(config)["distill"])
stages = module.stage_configs(config)  # the tools spec exists now
trajectories = [json.loads(line) for line in open(summary["trajectories"])]
print(json.dumps({
    "cwd_on_path": cwd_on_path, "system_prompt": config.system_prompt, "kept": summary["output"],
    "sql_steps": sum(step["tag"] == "sql" for t in trajectories for step in t["steps"]),
    "tags": {stage: list(declared_tags(stages[stage].tools))
             for stage in ("sft", "eval_teacher", "dapo", "eval_dapo")}}))
"""


def documented_files() -> dict[str, str]:
  """Returns the python blocks of the doc's "Add your own tool", by the file name on their first
  line ("# my_shop.py")."""
  with open(os.path.join(ROOT, "docs", "tools_and_rollouts.md")) as f:
    section = f.read().split("### Add your own tool\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
  return {re.match(r"# (\S+\.py)", block).group(1): block for block in blocks}


def test_the_documented_example_runs_as_written(tmp_path):
  files = documented_files()
  assert sorted(files) == ["my_shop.py", "my_shop_config.py"]
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  (tmp_path / "driver").mkdir()  # a script's folder is on sys.path, the working directory not
  (tmp_path / "driver" / "drive.py").write_text(DRIVER)
  done = subprocess.run([sys.executable, "driver/drive.py"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["cwd_on_path"] is False
  assert out["system_prompt"] == (
      "Solve the question with tools:\nsql: Runs one read-only SQLite query on the table "
      "orders(customer, product, quantity, price).")
  assert out["kept"] > 0 and out["sql_steps"] == out["kept"]  # every kept trajectory queries
  assert out["tags"] == {stage: ["sql"] for stage in ("sft", "eval_teacher", "dapo", "eval_dapo")}
  spec = json.load(open(tmp_path / "runs/my_shop_quick/distill/world/tools.json"))
  assert spec["sql"]["class"] == "my_shop:Sql"


def test_the_documented_mcp_declaration_serves_the_tool(tmp_path, monkeypatch):
  with open(os.path.join(ROOT, "docs", "tools_and_rollouts.md")) as f:
    text = " ".join(f.read().split())
  line = ('{"shop": {"kind": "mcp", "command": ["python", "-m", '
          '"tools_env.examples.sqlite_shop_mcp", DB]}}')
  assert line in text
  sqlite_shop.build(str(tmp_path), customers=4, train_tasks=1, heldout_tasks=1)
  database = os.path.join(tmp_path, "shop.db")
  fake = tmp_path / "bin" / "python"  # the first `python` on PATH cannot serve
  fake.parent.mkdir()
  fake.write_text("#!/bin/sh\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
  spec = json.loads(line.replace("DB", json.dumps(database)))
  assert declared_tags(spec) == ("sql",)
  with registry.build_registry(spec) as tools:
    assert tools.call("sql", "SELECT COUNT(*) FROM orders WHERE quantity < 0").observation == "0"


def test_a_module_in_the_working_directory_imports_by_its_path(tmp_path, monkeypatch):
  (tmp_path / "beside_me.py").write_text("ANSWER = 42\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [p for p in sys.path  # as under `python script.py`
                                    if os.path.abspath(p or os.curdir) != str(tmp_path)])
  monkeypatch.delitem(sys.modules, "beside_me", raising=False)
  path = list(sys.path)
  assert base.import_object("beside_me:ANSWER", "tools.x.class") == 42
  assert sys.modules["beside_me"].__file__ == str(tmp_path / "beside_me.py")
  assert sys.path == path  # left as it was
  with pytest.raises(ValueError, match="tools.x.class: cannot import 'not_beside_me:X'"):
    base.import_object("not_beside_me:X", "tools.x.class")


def test_a_pipeline_configs_tools_are_every_stages(tmp_path):
  config = pipeline_sql_cpu.get_config()
  config.output_dir = str(tmp_path)
  config.tools = {"sql": {"kind": "python", "class": "tools_env.examples.sqlite_shop:Sql",
                          "options": {"database": "/data/shop.db"}}}
  stages = pipeline_sql_cpu.stage_configs(config)
  expected = config.tools.to_dict()
  for stage in ("distill", "sft", "eval_teacher", "eval_sft", "dapo", "eval_dapo", "ppo"):
    assert stages[stage].tools.to_dict() == expected, stage
  settings = distill_job.distill_settings(stages["distill"])
  assert distill_job.tool_spec(settings, {}) == expected  # not the environment's
