"""The embedded world, the teacher systems and distillation's filter stages."""

import dataclasses
import http.server
import json
import threading

import numpy as np
import pytest

from coa_jax.data import coa_format, prompts
from coa_jax.data import tokenize as sft_tokenize
from coa_jax.data import tokenizer as tokenizer_lib
from coa_jax.data.coa_format import Step, Trajectory
from coa_jax.data.world import NEAR, NOUNS, RELATIONS, World, WorldConfig, load_tools_spec
from coa_jax.distill.job import Distiller, FilterConfig, format_report, to_trajectory
from coa_jax.distill.chat_teacher import ChatTeacher
from coa_jax.distill.teacher import (
  ScriptedTeacher,
  TeacherConfig,
  TeacherError,
  read_question,
)
from tools_env import registry
from tools_env.remote import ChatClient, HttpLimits

CONFIG = WorldConfig(seed=3, entities=6, train_tasks=40, heldout_tasks=10)


@pytest.fixture(scope="module")
def world_and_tools(tmp_path_factory):
  world = World(CONFIG)
  directory = str(tmp_path_factory.mktemp("world"))
  world.write(directory)
  return world, registry.build_registry(load_tools_spec(directory))


def test_world_is_deterministic_and_its_splits_are_disjoint(world_and_tools):
  world, _ = world_and_tools
  again = World(CONFIG)
  assert again.tasks == world.tasks and again.corpus() == world.corpus()
  assert World(WorldConfig(seed=4, entities=6, train_tasks=40)).tasks != world.tasks
  names = {split: {e.name for kind in world.entities[split].values() for e in kind}
           for split in ("train", "heldout")}
  assert not names["train"] & names["heldout"]
  for entity in world.by_name.values():  # links stay inside the entity's split
    linked = [v for k, v in entity.attrs.items() if (entity.kind, k) in RELATIONS]
    assert all(world.by_name[name].split == entity.split for name in linked)
  for task in world.tasks["heldout"]:
    plan = read_question(task["question"])
    assert "expression" in plan or plan["name"] in names["heldout"]


def test_numbered_names_are_a_kind_and_a_number_used_once():
  world = World(dataclasses.replace(CONFIG, names="numbers", entities=300))
  numbers = [e.name.split()[1] for e in world.by_name.values()]
  assert len(numbers) == len(set(numbers)) == 1800
  assert {e.name.split()[0] for e in world.by_name.values()} == {"City", "Person", "Company"}


@pytest.mark.parametrize("question,plan", [
    ("Question: What is 12 * 34 - 5?", {"expression": "12 * 34 - 5"}),
    ("Question: Who is the CEO of Norvale Works?",
     {"name": "Norvale Works", "path": ["ceo"], "multiplier": None}),
    ("Question: What is the population of the city where the CEO of Norvale Works was born?",
     {"name": "Norvale Works", "path": ["ceo", "birthplace", "population"], "multiplier": None}),
    ("Question: What is the birth year of the mayor of Tunim *24?",
     {"name": "Tunim", "path": ["mayor", "born"], "multiplier": 24}),
])
def test_questions_are_read_into_plans(question, plan):
  assert read_question(question) == plan


@pytest.mark.parametrize("variant", [{}, {"search_results": 1}, {"names": "numbers"}])
def test_teacher_answers_every_task_through_real_tool_calls(world_and_tools, variant, tmp_path):
  world, tools = world_and_tools
  if variant:  # the world with fewer search results, or with numbered names
    world = World(dataclasses.replace(CONFIG, **variant))
    world.write(str(tmp_path))
    tools = registry.build_registry(load_tools_spec(str(tmp_path)))
    assert tools.tools["web_search"].top_k == world.config.search_results
  teacher = ScriptedTeacher(tools, TeacherConfig(vague_query_rate=0, misread_rate=0,
                                                 skip_verify_rate=0))
  for task in world.tasks["train"][:20]:
    trace = teacher.run(task)
    assert trace.answer == task["metadata"]["ground_truth"], task["question"]
    calls = [a for a in trace.activations if a.tool_call is not None]
    assert calls and all(a.tool_ok and a.tool_result for a in calls)
    assert not trace.mistakes and trace.tokens > 0


def test_lookups_take_as_many_hops_as_the_world_asks_and_the_teacher_follows_them(tmp_path):
  world = World(dataclasses.replace(CONFIG, families=(("lookup", 1.0),),
                                    hops=(0, 0, 0, 0, 0, 1), train_tasks=6))
  world.write(str(tmp_path))
  teacher = ScriptedTeacher(registry.build_registry(load_tools_spec(str(tmp_path))),
                            TeacherConfig(vague_query_rate=0, misread_rate=0,
                                          skip_verify_rate=0))
  for task in world.tasks["train"]:
    assert task["metadata"]["hops"] == 6  # the sixth weight
    trace = teacher.run(task)
    assert trace.answer == task["metadata"]["ground_truth"], task["question"]


@pytest.mark.parametrize("field, value, message", [
    ("families", (("riddles", 1.0),), "names must be among"),
    ("hops", (0.0, 0.0), "world.hops"),
    ("names", "letters", "world.names"),
    ("distractors", 1.5, "world.distractors must be in"),
])
def test_a_wrong_world_config_is_an_error_naming_the_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CONFIG, **{field: value})


def test_near_miss_figures_leave_the_world_as_it_was_and_mislead_a_first_match_reader(tmp_path):
  plain = World(dataclasses.replace(CONFIG, families=(("mixed", 1.0),), train_tasks=16))
  world = World(dataclasses.replace(plain.config, distractors=1.0))
  assert world.tasks == plain.tasks
  assert all(e.attrs == plain.by_name[e.name].attrs for e in world.by_name.values())
  world.write(str(tmp_path))
  teacher = ScriptedTeacher(registry.build_registry(load_tools_spec(str(tmp_path))),
                            TeacherConfig(vague_query_rate=0, misread_rate=0,
                                          skip_verify_rate=0))
  by_url = {e.url: e for e in world.by_name.values()}
  outcomes = []
  for task in world.tasks["train"]:
    trace = teacher.run(task)
    crawl = [a for a in trace.activations if a.step == "crawl_page"][-1]
    entity, attr = by_url[crawl.tool_call], task["metadata"]["program"]["path"][-1]
    near, near_first = entity.near[attr]
    truth = entity.attrs[attr]
    own = f"The {NOUNS[attr]} of {entity.name} is {truth}."
    other = f"The {NOUNS[attr]} of {NEAR[entity.kind].format(x=entity.name)} is {near}."
    assert own in crawl.tool_result and other in crawl.tool_result  # the focus keeps both
    factor = int(task["metadata"]["program"]["expression"].split("*")[1])
    read = near if near_first else truth  # the teacher reads the first figure, and checks it
    assert trace.answer == str(read * factor)
    assert world.near_miss(task) == ("before" if near_first else "after")
    outcomes.append(near_first)
  assert 0 < sum(outcomes) < len(outcomes)  # both orders occur


def test_teacher_does_arithmetic_in_its_head_at_its_rate(world_and_tools):
  world, tools = world_and_tools
  exact = dict(vague_query_rate=0, misread_rate=0, skip_verify_rate=0)
  arithmetic = [t for t in world.tasks["train"] if t["metadata"]["family"] == "arithmetic"]
  assert len(arithmetic) >= 3
  for rate in (0, 1):
    teacher = ScriptedTeacher(tools, TeacherConfig(**exact, mental_math_rate=rate))
    for task in arithmetic:
      trace = teacher.run(task)
      steps = [a.step for a in trace.activations]
      assert trace.answer == task["metadata"]["ground_truth"], task["question"]
      if rate:
        assert trace.mistakes == ["mental_arithmetic"] and "code" not in steps
        assert "in my head" in trace.activations[0].output.content
        assert steps == ["plan", "think", "suggested_answer", "double_check", "answer"]
      else:
        assert not trace.mistakes and "code" in steps
  with pytest.raises(TeacherError, match="not an arithmetic expression"):
    teacher.run({"id": "x-0", "question": "Question: What is 2 ** 8?"})


def test_teacher_reads_focused_pages_and_quotes_them(world_and_tools):
  world, tools = world_and_tools
  exact = dict(vague_query_rate=0, misread_rate=0, skip_verify_rate=0)
  lookups = [t for t in world.tasks["train"] if t["metadata"]["family"] == "lookup"]
  for quote in (True, False):
    teacher = ScriptedTeacher(tools, TeacherConfig(**exact, quote_facts=quote))
    for task in lookups[:8]:
      acts = teacher.run(task).activations
      for i, act in enumerate(acts):
        if act.step == "crawl_page":  # one sentence: the fact the last query asked for
          query = next(a.tool_call for a in reversed(acts[:i]) if a.step == "web_search")
          noun, name = query.split(" of ", 1)
          sentence = act.tool_result.split("\n\n", 1)[1]
          assert sentence.count(". ") == 0 and noun in sentence and name in sentence
          if quote:
            assert acts[i + 1].output.content == f"The page says: {sentence}"
          else:
            assert not acts[i + 1].output.content.startswith("The page says")


def test_teacher_mistakes_appear_with_their_recoveries(world_and_tools):
  world, tools = world_and_tools
  teacher = ScriptedTeacher(tools, TeacherConfig(vague_query_rate=1, misread_rate=1,
                                                 skip_verify_rate=0))
  lookups = [t for t in world.tasks["train"] if t["metadata"]["family"] != "arithmetic"]
  numeric = [t for t in lookups if t["metadata"]["domain"] == "math"]
  for task in numeric[:5]:
    trace = teacher.run(task)
    steps = [a.step for a in trace.activations]
    assert {"vague_query", "misread"} <= set(trace.mistakes)
    assert trace.answer == task["metadata"]["ground_truth"]  # the verifier caught the misread
    rejected = next(i for i, a in enumerate(trace.activations)
                    if a.step == "double_check" and a.output.content.endswith("Score: 1"))
    assert "reflection" in steps[rejected:] and steps[0] == "plan"
    first_search = next(a for a in trace.activations if a.step == "web_search")
    assert steps[steps.index("web_search") + 1] == "reflection", first_search.tool_call


def test_the_default_rates_give_an_imperfect_teacher(world_and_tools):
  world, tools = world_and_tools
  teacher = ScriptedTeacher(tools, TeacherConfig(vague_query_rate=0.3, misread_rate=0.5,
                                                 skip_verify_rate=0.5))
  traces = [teacher.run(task) for task in world.tasks["train"]]
  correct = np.mean([t.answer == t.task_data["ground_truth"] for t in traces])
  assert 0.6 < correct < 1.0
  assert any("skipped_verification" in t.mistakes for t in traces)


def _trajectory(*steps, answer="42", truth="42"):
  return Trajectory(prompts.AGENT, "Question: q?", tuple(Step(t, c) for t, c in steps) +
                    (Step("answer", answer),), {"domain": "math", "ground_truth": truth})


_GOOD = [("plan", "1. Compute."), ("code", "```python\nprint(6 * 7)\n```"),
         ("observation", "42\n"), ("suggested_answer", "42"), ("double_check", "Yes. Score: 4")]


def test_each_filter_stage_drops_exactly_its_examples():
  examples = {
      "good": _trajectory(*_GOOD),
      "wrong": _trajectory(*_GOOD, answer="41"),
      "bad_format": _trajectory(("code", "```python\nprint(1)\n```"), ("think", "no obs"),
                                *_GOOD[3:]),
      "no_tools": _trajectory(("think", "42"), *_GOOD[3:]),
      "duplicate": _trajectory(*_GOOD[:3], *_GOOD[1:]),
      "no_reflection": _trajectory(*_GOOD[:4], ("double_check", "Wrong. Score: 1"),
                                   ("suggested_answer", "42"), ("double_check", "ok Score: 4")),
      "skipped": _trajectory(*_GOOD[:3], ("think", "It is 42.")),
  }
  kept, report = Distiller(FilterConfig(min_tool_calls=1)).filter(examples.values())
  assert kept == [examples["good"]]
  reasons = {row["stage"]: row["reasons"] for row in report["stages"]}
  assert reasons == {"correct": {"wrong_answer": 1}, "format": {"missing_observation": 1},
                     "complexity": {"tool_calls_out_of_range": 1},
                     "quality": {"duplicate_call": 1, "no_reflection_after_error": 1,
                                 "verification_skipped": 1}}
  assert [row["kept"] for row in report["stages"]] == [6, 5, 4, 1]
  assert "overall: 1 of 7" in format_report(report)


def test_distilled_trajectories_tokenize_with_observations_masked(world_and_tools):
  world, tools = world_and_tools
  tokenizer = tokenizer_lib.default_tokenizer("plain")
  teacher = ScriptedTeacher(tools, TeacherConfig(seed=1))
  for task in world.tasks["train"][:6]:
    trajectory = to_trajectory(teacher.run(task), prompts.AGENT)
    assert not coa_format.validate(list(trajectory.steps))
    example = sft_tokenize.tokenize_trajectory(trajectory, tokenizer, max_len=4096)
    ids, mask = example.input_ids.tolist(), example.loss_mask.tolist()
    position = len(tokenizer.prompt_ids(trajectory.system, trajectory.question))
    assert not any(mask[:position])
    for i, step in enumerate(trajectory.steps):
      span = sft_tokenize.step_ids(tokenizer, step, first=i == 0)
      assert ids[position:position + len(span)] == span
      assert set(mask[position:position + len(span)]) == {int(step.tag != "observation")}
      position += len(span)


class _ChatHandler(http.server.BaseHTTPRequestHandler):
  """A fake OpenAI-compatible endpoint: each role prompt gets its scripted reply; the
  controller's decisions are served in order."""

  ROLES = {"planner": "1. Search for France.\n2. Read its page.", "search agent": "France",
           "crawl agent": "https://facts.example/france", "proposer": "Paris",
           "verifier": "The page says Paris. Score: 4", "answerer": "Paris",
           "reflector": "The decision was unreadable; continue with the search."}

  def log_message(self, *args):
    pass

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    system = body["messages"][0]["content"]
    if system.startswith("You coordinate"):
      content = self.server.decisions.pop(0)
    else:
      content = next(reply for role, reply in self.ROLES.items() if f"the {role}" in system)
    data = json.dumps({"choices": [{"message": {"content": content}}]}).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)


def test_chat_teacher_runs_the_agents_on_a_fake_endpoint_with_real_tools():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChatHandler)
  server.decisions = ["not json at all",
                      json.dumps({"agent": "search_agent", "instruction": "find France"}),
                      json.dumps({"agent": "crawl_agent", "instruction": "read it"}),
                      'Next: {"agent": "proposer", "instruction": "propose"}']
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    client = ChatClient(f"http://127.0.0.1:{server.server_address[1]}/v1", "fake",
                        api_key_env=None, limits=HttpLimits(timeout_s=5.0, retries=0))
    teacher = ChatTeacher(registry.build_registry(registry.default_spec()), client)
    trace = teacher.run({"id": "q1", "question": "Question: What is the capital of France?",
                         "metadata": {"domain": "qa", "ground_truth": "Paris"}})
  finally:
    server.shutdown()
    server.server_close()
  steps = [a.step for a in trace.activations]
  assert steps == ["plan", "reflection", "web_search", "crawl_page", "suggested_answer",
                   "double_check", "answer"]
  crawl = trace.activations[3]
  assert crawl.tool_ok and "Paris is the capital" in crawl.tool_result
  assert trace.answer == "Paris"
  trajectory = to_trajectory(trace, prompts.AGENT)
  assert not coa_format.validate(list(trajectory.steps))
  assert Distiller().filter([trajectory])[1]["output"] == 1
