"""tools_env: the interface never raises, BM25 search and local crawl, per-trajectory state."""

import json
import time

import pytest

from tools_env import base, search
from tools_env.registry import (
  TOOL_TAGS,
  ToolRegistry,
  TrajectoryTools,
  build_registry,
  default_spec,
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("bm25"))


@pytest.fixture(scope="module")
def web(cache_dir):
  return search.Bm25Search(cache_dir=cache_dir, top_k=3)


@pytest.mark.parametrize("query,expected", [
    ("capital of Kenya", "capital-kenya"),
    ("highest mountain above sea level", "everest"),
    ("Nobel prize radioactivity", "curie"),
    ("movement of water through a membrane", "wiki-osmosis"),
    ("Zürich Switzerland lake", "zurich"),
])
def test_search_ranks_the_right_document_first(web, query, expected):
  result = web(query)
  assert result.ok and result.metadata["ids"][0] == expected
  assert result.observation.startswith("1. [")


def test_search_handles_empty_huge_and_unmatched_queries(web):
  assert web("   ").error_kind == base.BAD_REQUEST
  huge = web("capital of Peru " * 7000)  # ~110 KB
  assert huge.ok and huge.metadata["ids"][0] == "capital-peru"
  assert web("zzqx qqvv").error_kind == base.NO_RESULTS
  assert web("東京").error_kind in (None, base.NO_RESULTS)  # non-ASCII never crashes


def test_index_cache_is_reused_on_second_construction(web, cache_dir):
  again = search.Bm25Search(cache_dir=cache_dir, top_k=3)
  assert again.loaded_from_cache
  assert again("capital of Chile").metadata == web("capital of Chile").metadata


def test_crawl_serves_pages_by_url_and_reports_missing_ones():
  crawl = search.LocalCrawl()
  result = crawl("https://wiki.example/everest | https://nowhere.example/x")
  assert result.ok and "8,849 metres" in result.observation
  assert result.metadata["failed"] == ["https://nowhere.example/x"]
  assert crawl("https://nowhere.example/x").error_kind == base.NOT_FOUND
  assert crawl("").error_kind == base.BAD_REQUEST


def test_output_is_truncated_keeping_head_and_tail():
  text, truncated = base.truncate_middle("a" * 50 + "b" * 50, 20)
  assert truncated and text.startswith("a" * 10) and text.endswith("b" * 10)
  assert "[80 characters omitted]" in text


def test_a_crashing_tool_becomes_an_error_observation():
  class Broken(base.Tool):
    name = "broken"

    def _run(self, body, goal):
      raise RuntimeError("boom")

  result = Broken()("x")
  assert not result.ok and result.error_kind == base.TOOL_ERROR
  assert result.observation == "Error: broken failed: RuntimeError: boom"


def test_registry_and_trajectory_state(web):
  registry = ToolRegistry({"web_search": web})
  assert registry.call("code", "x").error_kind == base.UNKNOWN_TOOL
  session = TrajectoryTools(registry)
  assert session.call("web_search", "capital of Cuba").ok
  repeated = session.call("web_search", "  Capital of   CUBA ")
  assert repeated.error_kind == base.REPEATED and repeated.observation.startswith("Notice:")
  assert session.calls["web_search"] == 2 and session.repeats["web_search"] == 1


def test_a_program_differing_in_indentation_or_case_is_not_a_repeat():
  class Run(base.Tool):
    def _run(self, body, goal):
      if body == "down":
        raise RuntimeError("the service is down")
      return body, {}

  session = TrajectoryTools(ToolRegistry({"code": Run()}))
  assert session.call("code", "if True:\nprint('A')").ok
  assert session.call("code", "if True:\n    print('A')").ok  # the fix runs
  assert session.call("code", "if True:\n    print('a')").ok
  assert session.call("code", " if True:\n    print('a') ").error_kind == base.REPEATED
  # A failure on the tool's side is not the call's: the same call may be made again.
  assert [session.call("code", "down").error_kind for _ in range(2)] == [base.TOOL_ERROR] * 2


def test_build_registry_from_a_config_spec(cache_dir):
  registry = build_registry({
      "web_search": {"kind": "bm25", "cache_dir": cache_dir, "top_k": 2},
      "crawl_page": {"kind": "http_crawl", "http": {"timeout_s": 3.0, "retries": 0}},
      "code": {"kind": "sandbox", "workers": 2, "limits": {"wall_timeout_s": 5.0}},
  })
  assert registry.tools["web_search"].top_k == 2
  assert registry.tools["crawl_page"].limits.timeout_s == 3.0
  assert registry.tools["code"].limits.wall_timeout_s == 5.0
  assert registry.call("code", "```python\nprint(3 * 3)\n```").observation == "9\n"
  assert set(default_spec()) == set(TOOL_TAGS)


@pytest.mark.parametrize("spec,message", [
    ({"code": {"kind": "docker"}}, "tools.code.kind must be one of"),
    ({"code": {"kind": "sandbox", "limits": {"wall_timeout": 5}}}, "tools.code:.*wall_timeout"),
    ({"web_search": {"kind": "bm25", "top": 3}}, "tools.web_search:.*top"),
])
def test_build_registry_rejects_bad_specs(spec, message):
  with pytest.raises(ValueError, match=message):
    build_registry(spec)


def test_a_tool_with_a_modelled_latency_waits_a_fixed_time_per_call(cache_dir):
  registry = build_registry({"web_search": {"kind": "bm25", "cache_dir": cache_dir,
                                            "latency_s": [0.05, 0.15]}})
  tool = registry.tools["web_search"]
  plain = build_registry({"web_search": {"kind": "bm25", "cache_dir": cache_dir}})
  delays = [tool.delay_s(q) for q in ("speed of light", "capital of Kenya", "largest ocean")]
  assert all(0.05 <= d <= 0.15 for d in delays) and len(set(delays)) == 3
  assert tool.delay_s("speed of light") == delays[0]  # the same call waits the same time
  start = time.perf_counter()
  result = registry.call("web_search", "speed of light")
  assert time.perf_counter() - start >= delays[0] and result.elapsed_s >= delays[0]
  assert result.observation == plain.call("web_search", "speed of light").observation
  with pytest.raises(ValueError, match="latency_s"):
    build_registry({"web_search": {"kind": "bm25", "latency_s": [2.0, 1.0]}})


def test_trajectory_passes_its_goal_to_every_call_then_the_last_query():
  class Echo(base.Tool):
    def _run(self, body, goal):
      if body == "fail":
        raise base.ToolFailure(base.NO_RESULTS, "nothing")
      return f"{body} toward {goal}", {}

  session = TrajectoryTools(ToolRegistry({"crawl_page": Echo(), "web_search": Echo()}),
                            goal="find the depth")
  assert session.call("crawl_page", "https://x.example").observation == \
      "https://x.example toward find the depth"
  session.call("web_search", " depth of Lake Zurich ")
  session.call("web_search", "fail")  # a failed search does not change the goal
  assert session.call("crawl_page", "https://y.example").observation == \
      "https://y.example toward depth of Lake Zurich"


def test_a_focused_crawl_keeps_the_sentences_sharing_most_words_with_the_goal(tmp_path):
  text = "Oslo is a city. The founding year of Oslo is 1040. The mayor of Oslo is Anne Lind."
  assert search.focus(text, "founding year of Oslo") == "The founding year of Oslo is 1040."
  assert search.focus(text, "the mayor, founding") == \
      "The founding year of Oslo is 1040. The mayor of Oslo is Anne Lind."  # a tie keeps both
  assert search.focus(text, "population of Oslo") == text  # no sentence shares a word
  assert search.focus(text, "") == text
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(json.dumps({"id": "oslo", "title": "Oslo", "url": "https://x.example/oslo",
                                "text": text}) + "\n")
  crawl = search.LocalCrawl(str(corpus), focus_on_goal=True)
  assert crawl("https://x.example/oslo", goal="mayor of Oslo").observation == \
      "Page: https://x.example/oslo\nOslo\n\nThe mayor of Oslo is Anne Lind."
  assert search.LocalCrawl(str(corpus))("https://x.example/oslo", goal="mayor").observation \
      .endswith(text)
