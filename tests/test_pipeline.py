"""The end-to-end pipeline's --quick variant: every stage runs and the table is written."""

import json

from coa_jax import pipeline
from configs import common, pipeline_tiny_cpu


def test_quick_pipeline_runs_every_stage(tmp_path):
  config = pipeline_tiny_cpu.quick(pipeline_tiny_cpu.get_config())
  config.output_dir = str(tmp_path / "run")
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)  # the 8 fake devices
  results = pipeline.run(config)
  assert list(results["rows"]) == ["teacher", "sft", "dapo"]
  assert results["rows"]["teacher"]["pass@1"] > 0.5  # the scripted teacher solves them
  for name in ("distill/trajectories.jsonl", "sft/hf_export/config.json",
               "dapo/hf_export/config.json", "results.png"):
    assert (tmp_path / "run" / name).exists(), name
  saved = json.load(open(tmp_path / "run" / "results.json"))
  assert saved["rows"]["sft"]["tasks"] == config.eval.max_tasks
  again = pipeline.run(config)  # every stage's output exists: all are reused
  assert again["rows"] == results["rows"]
