"""The quick recipe of the worked example (configs/pipeline_sql_cpu.py) with its task rows in
every documented layout (the truth under a row's `answer`, `ground_truth` or
`metadata.ground_truth`): the reward sees the same `response.task` in distillation, RL and
evaluation, which all read task rows through `coa_jax.data.tasks`. A distillation that keeps
nothing stops there and says why."""

import inspect
import json
import os

import pytest

from coa_jax import distill, pipeline
from coa_jax.data.tasks import load_tasks
from configs import common, pipeline_sql_cpu
from tools_env.examples import sqlite_shop

SEEN = []  # (stage, response.task) of every reward call in this process
STAGES = {"distill": "coa_jax/distill/", "rl": "coa_jax/rl/", "evaluation": "coa_jax/evaluation/"}


def reward(response):
  """The shop's reward, recording which stage asked and the task data it was given."""
  files = [frame.filename for frame in inspect.stack()]
  stage = next((name for name, part in STAGES.items() if any(part in f for f in files)), None)
  SEEN.append((stage, dict(response.task)))
  return sqlite_shop.reward(response)


def _relayout(row, number):
  """The shop's row (truth in metadata.ground_truth) in one of the three layouts, by number."""
  meta = dict(row["metadata"])
  layout = number % 3
  if layout == 0:  # the truth under a top-level `answer`, the other fields beside it
    truth = meta.pop("ground_truth")
    return {"id": row["id"], "question": row["question"], "answer": truth, **meta}
  if layout == 1:  # a top-level `ground_truth`, the rest in metadata
    return {"id": row["id"], "question": row["question"],
            "ground_truth": meta.pop("ground_truth"), "metadata": meta}
  return row  # metadata.ground_truth


def build_in_layouts(directory, **options):
  """The shop's environment with its task rows rewritten in the three layouts in turn."""
  paths = sqlite_shop.build(directory, **options)
  for split in ("train", "heldout"):
    rows = [json.loads(line) for line in open(paths[split])]
    with open(paths[split], "w") as f:
      f.writelines(json.dumps(_relayout(row, i)) + "\n" for i, row in enumerate(rows))
  return paths


def _config(tmp_path):
  config = pipeline_sql_cpu.quick(pipeline_sql_cpu.get_config())
  config.output_dir = str(tmp_path / "run")
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)  # the 8 fake devices
  config.environment.build = f"{__name__}:build_in_layouts"
  config.rewards.domains.shop.function = f"{__name__}:reward"
  return config


def test_the_quick_recipe_gives_every_stage_the_same_task_data_in_every_layout(tmp_path):
  SEEN.clear()
  config = _config(tmp_path)
  results = pipeline.run(config, pipeline_sql_cpu.stage_configs)
  rows = results["per_seed"][config.seed]  # the worked example's recipe runs through
  assert rows["teacher"]["pass@1"] == 1.0  # the teacher knows the database
  assert set(rows["teacher"]["tool_calls_by_kind"]) <= {"sql"}
  assert json.load(open(tmp_path / "run/seed-0/sft/hf_export/config.json"))["vocab_size"] == 1026
  assert list(results["stage_seconds"])[-1] == "seed 0 eval dapo"
  report = json.load(open(tmp_path / "run/distill/distill_report.json"))
  assert report["stages"][0]["reasons"].get("wrong_answer", 0) < report["input"]
  world = tmp_path / "run/distill/world"
  expected = {task.id: task.data for split in ("train", "heldout")
              for task in load_tasks(str(world / f"{split}.jsonl"))}
  by_stage = {}
  for stage, task in SEEN:
    by_stage.setdefault(stage, set()).add(task["id"])
    assert task == expected[task["id"]], stage
  assert set(by_stage) >= {"distill", "rl", "evaluation"}
  for stage, ids in by_stage.items():  # every layout reached every stage
    layouts = {json.dumps(sorted(k for k in ("answer", "ground_truth") if k in expected[i]))
               for i in ids}
    assert len(layouts) >= 2, (stage, ids)


def wrong_truths(directory, **options):
  """The shop with every task's truth moved under a field no reader looks in."""
  paths = sqlite_shop.build(directory, **options)
  rows = [json.loads(line) for line in open(paths["train"])]
  for row in rows:
    row["metadata"]["ground_truth"] = "nobody's total"
  with open(paths["train"], "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  return paths


def test_a_distillation_that_keeps_nothing_stops_and_says_why(tmp_path):
  config = _config(tmp_path)
  config.environment.build = f"{__name__}:wrong_truths"
  config.teacher.mental_math_rate = 0.0  # from memory, the teacher would answer the wrong truth
  config.rewards.domains.shop.function = f"{sqlite_shop.__name__}:reward"
  stages = pipeline_sql_cpu.stage_configs(config)
  with pytest.raises(distill.job.DistillError) as error:
    distill.run(stages["distill"])
  message = str(error.value)
  assert "kept no trajectory of 48 tasks" in message
  assert "solved 0 of 48" in message and "wrong_answer" in message
  assert "ground_truth=\"nobody's total\"" in message
  assert os.path.exists(tmp_path / "run/distill/traces.jsonl")
  assert not os.path.exists(tmp_path / "run/distill/distill_report.json")
