"""The rollout job: task files, records on disk, the interactive session."""

import dataclasses
import io
import json

import jax
import pytest

from coa_jax.rollout import job as rollout_job
from coa_jax.rollout import settings as agent
from coa_jax.runtime import sharding
from configs import rollout_tiny_cpu
from tools_env.sandbox import CodeSandbox


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
  with open(f"{config.output_dir}/summary.json") as f:  # the code tool's isolation
    assert json.load(f)["sandbox_isolation"] == CodeSandbox().isolation


def test_interactive_session_answers_each_question(config):
  out = io.StringIO()
  rollout_job.interactive(config, io.StringIO("What is 2 + 2?\n\n"), out)
  assert out.getvalue().count("> ") == 2 and "tokens," in out.getvalue()




def test_a_tool_whose_tag_the_model_lacks_is_refused(config):
  from coa_jax.data.tokenizer import default_tokenizer
  from coa_jax.model import ConfigError

  tokenizer = default_tokenizer(config.tokenizer.template, tool_tags=("web_search", "crawl_page"))
  with pytest.raises(ConfigError, match=r"tools \['code', 'wiki_search'\] are not among"):
    agent.engine(agent.rollout_settings(config), tokenizer)


def test_jobs_that_decode_alike_share_one_sampler(config):
  settings = agent.rollout_settings(config)
  tokenizer = agent.agent_tokenizer(settings)
  model = settings.model.fresh_config()
  host = lambda: sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])  # equal, not the same
  first = agent.sampler(settings, model, host(), tokenizer)
  assert agent.sampler(settings, model, host(), tokenizer) is first
  longer = dataclasses.replace(settings.rollout, max_response_tokens=96)
  assert agent.sampler(settings, model, host(), tokenizer, longer).cache_size > first.cache_size
