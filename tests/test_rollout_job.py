"""The rollout job: task files, records on disk, the interactive session."""

import io
import json

import pytest

from coa_jax import rollout_job
from coa_jax.model import ConfigError
from configs import rollout_tiny_cpu


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  config = rollout_tiny_cpu.get_config()
  config.model.checkpoint = ""  # a fresh model: no SFT run needed (8 rows over 8 devices)
  config.max_tasks = 3
  config.rollout.max_response_tokens = 64
  config.output_dir = str(tmp_path_factory.mktemp("rollout"))
  config.tools.web_search.cache_dir = config.tools.wiki_search.cache_dir = config.output_dir
  return config


def test_run_writes_records_transcripts_and_summary(config):
  summary = rollout_job.run(config)
  with open(f"{config.output_dir}/records.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert len(records) == summary["samples"] == 3 * config.rollout.group_size
  for record in records:
    assert len(record["ids"]) == len(record["loss_mask"]) == len(record["logprobs"])
    assert record["finish_reason"] in ("answer", "eos", "max_turns", "length")
    assert record["response_len"] <= config.rollout.max_response_tokens
  assert "=== task" in open(f"{config.output_dir}/transcripts.txt").read()


def test_interactive_session_answers_each_question(config):
  out = io.StringIO()
  rollout_job.interactive(config, io.StringIO("What is 2 + 2?\n\n"), out)
  assert out.getvalue().count("> ") == 2 and "tokens," in out.getvalue()


@pytest.mark.parametrize("content,message", [
    ("", "has no tasks"),
    ('{"id": 1}\n', "not a task record with a 'question'"),
    ('{"question": ""}\n', "non-empty string"),
    ("not json\n", "1: not a task record"),
])
def test_bad_task_files_are_clear_errors(tmp_path, content, message):
  path = tmp_path / "tasks.jsonl"
  path.write_text(content)
  with pytest.raises(ConfigError, match=message):
    rollout_job.load_tasks(str(path))
  with pytest.raises(ConfigError, match="does not exist"):
    rollout_job.load_tasks(str(tmp_path / "missing.jsonl"))
