"""The experiment runner (overrides, per-cell caching, results files), RL query selection on a
fake sampler, and the experiment kinds' summaries and tables on hand-made results."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from coa_jax.data import load_tasks
from coa_jax.data.tasks import Task
from coa_jax import evaluation
from coa_jax.experiments import Experiment, filters, publish, rl_curves, run, scaling_curves
from coa_jax.experiments import with_overrides
from coa_jax.model import ConfigError
from coa_jax.rl import query_selection
from coa_jax.rl.query_selection import SelectionConfig, select_tasks
from configs.experiments import EXPERIMENTS
from configs import pipeline_tiny_cpu
from coa_jax import pipeline
from coa_jax.pipeline import Stages


def _config(tmp_path):
  return with_overrides(pipeline_tiny_cpu.get_config(), {"output_dir": str(tmp_path / "run")})


def _stages(config):
  return Stages(config, pipeline_tiny_cpu.stage_configs)


def test_overrides_set_dotted_paths_and_reject_unknown_ones(tmp_path):
  config = _config(tmp_path)
  out = with_overrides(config, {"dapo.rl.steps": 48, "selection.high": 0.75})
  assert out.dapo.rl.steps == 48 and out.selection.high == 0.75
  assert config.dapo.rl.steps == 16  # the base is untouched
  with pytest.raises(ConfigError, match="'step' is not a field of dapo.rl"):
    with_overrides(config, {"dapo.rl.step": 48})
  with pytest.raises(ConfigError, match="dapo.learning_rate is not a section"):
    with_overrides(config, {"dapo.learning_rate.peak": 1.0})


class FakeKind:
  """An experiment kind whose cell result is a function of the config, seed and options."""

  def __init__(self):
    self.calls = []

  def run_cell(self, stages, seed, options):
    learning_rate = stages.of(seed)["dapo"].optimizer.learning_rate
    self.calls.append((learning_rate, seed, options.get("stage")))
    return {"score": learning_rate * 1e5 + seed, "stage": options.get("stage")}

  def summarize(self, results):
    return {name: [r["score"] for r in by_seed.values()] for name, by_seed in results.items()}

  def table(self, summary):
    return "\n".join(f"| {name} | {scores} |" for name, scores in summary.items())

  def plot(self, report, path):
    open(path, "w").write("png")


def test_runner_caches_each_cell_and_seed_under_its_settings(tmp_path):
  kind = FakeKind()
  experiment = Experiment("lr", "fake", {"low": {"dapo.learning_rate": 1e-5},
                                         "high": {"dapo.learning_rate": 1e-4,
                                                  "options.stage": "ppo"}},
                          seeds=2, options={"stage": "dapo"})
  report = run(experiment, _config(tmp_path), pipeline_tiny_cpu.stage_configs, {"fake": kind})
  assert kind.calls == [(1e-5, 0, "dapo"), (1e-5, 1, "dapo"), (1e-4, 0, "ppo"), (1e-4, 1, "ppo")]
  assert report["summary"] == {"low": [1.0, 2.0], "high": [10.0, 11.0]}
  out = tmp_path / "run" / "experiments" / "lr"
  saved = json.loads((out / "results.json").read_text())
  assert saved["results"]["high"]["1"] == {"score": 11.0, "stage": "ppo"}
  assert (out / "results.md").read_text() == report["table"] + "\n"
  # a re-run reuses every cell; a new seed runs only that seed; a changed cell only that cell
  run(experiment, _config(tmp_path), pipeline_tiny_cpu.stage_configs, {"fake": kind})
  assert len(kind.calls) == 4
  run(Experiment("lr", "fake", experiment.cells, seeds=3, options={"stage": "dapo"}),
      _config(tmp_path), pipeline_tiny_cpu.stage_configs, {"fake": kind})
  assert kind.calls[4:] == [(1e-5, 2, "dapo"), (1e-4, 2, "ppo")]
  changed = {**experiment.cells, "high": {"dapo.learning_rate": 2e-4}}
  again = run(Experiment("lr", "fake", changed, seeds=2, options={"stage": "dapo"}),
              _config(tmp_path), pipeline_tiny_cpu.stage_configs, {"fake": kind})
  assert kind.calls[6:] == [(2e-4, 0, "dapo"), (2e-4, 1, "dapo")]
  assert again["summary"]["high"] == [20.0, 21.0]
  copied = publish(str(out), str(tmp_path / "docs"))
  assert sorted(p.split("/")[-1] for p in copied) == ["results.json", "results.md", "results.png"]


def test_runner_checks_every_cell_before_running_any(tmp_path):
  kind = FakeKind()
  bad = Experiment("bad", "fake", {"ok": {}, "typo": {"dapo.lr": 1.0}}, seeds=1)
  with pytest.raises(ConfigError, match="'lr' is not a field"):
    run(bad, _config(tmp_path), pipeline_tiny_cpu.stage_configs, {"fake": kind})
  assert kind.calls == []
  with pytest.raises(ConfigError, match="kind 'nope'"):
    run(Experiment("x", "nope", {"a": {}}), _config(tmp_path), pipeline_tiny_cpu.stage_configs,
        {"fake": kind})


def test_every_named_experiment_applies_to_the_main_job_config():
  """Each override lands where its path says, and every stage of every cell builds its
  settings (as the runner checks before it runs any)."""
  config = pipeline_tiny_cpu.get_config()
  for experiment in EXPERIMENTS.values():
    for overrides in experiment.cells.values():
      settings = {k: v for k, v in overrides.items() if not k.startswith("options.")}
      out = with_overrides(config, settings)
      for path, value in settings.items():  # each override lands where its path says
        node = out
        for part in path.split("."):
          node = node[part]
        assert node == value, (experiment.name, path)
      assert set(_stages(out).of()) >= {"sft", "dapo", "eval_sft"}


# --- query selection ------------------------------------------------------------------------


def _tasks(n):
  return [Task(f"t{i}", f"Question: {i}?", {"ground_truth": str(i), "family": "x"})
          for i in range(n)]


def _fake_sampler(calls):
  """Task t<i> is solved by the samples j < i % 5 (pass rate (i % 5) / k for k = 4)."""

  def sample(tasks, k):
    calls.append((len(tasks), k))
    return {t.id: [j < int(t.id[1:]) % 5 for j in range(k)] for t in tasks}

  return sample


def test_query_selection_keeps_tasks_in_the_pass_rate_range(tmp_path):
  calls = []
  tasks = _tasks(20)
  cache = str(tmp_path / "rates.json")
  mixed = SelectionConfig(k=4, low=0.25, high=0.75, max_tasks=15)
  kept, report = select_tasks(mixed, tasks, _fake_sampler(calls), cache, {"model": "m"})
  # rates (i % 5) / 4 capped at 1: i % 5 in {1, 2, 3} is kept, among the first 15 tasks
  assert [t.id for t in kept] == [f"t{i}" for i in range(15) if i % 5 in (1, 2, 3)]
  assert report["sampled"] == 15 and report["kept"] == 9
  assert report["pass_rates"] == {"0/4": 3, "1/4": 3, "2/4": 3, "3/4": 3, "4/4": 3}
  # another range over the same pass rates samples nothing; another model samples again
  solved = SelectionConfig(k=4, low=1.0, high=1.0, max_tasks=15)
  kept, _ = select_tasks(solved, tasks, _fake_sampler(calls), cache, {"model": "m"})
  assert [t.id for t in kept] == ["t4", "t9", "t14"] and calls == [(15, 4)]
  select_tasks(mixed, tasks, _fake_sampler(calls), cache, {"model": "other"})
  assert calls == [(15, 4), (15, 4)]


def test_query_selection_off_samples_nothing_and_an_empty_range_is_an_error(tmp_path):
  calls = []
  kept, report = select_tasks(SelectionConfig(), _tasks(6), _fake_sampler(calls),
                              str(tmp_path / "r.json"), {})
  assert len(kept) == 6 and report["sampled"] == 0 and calls == []
  always = lambda tasks, k: {t.id: [True] * k for t in tasks}
  with pytest.raises(ConfigError, match="kept no task"):
    select_tasks(SelectionConfig(high=0.5), _tasks(6), always, str(tmp_path / "r.json"), {})
  with pytest.raises(ConfigError, match="low <= high"):
    SelectionConfig(low=0.8, high=0.2)


def test_selected_tasks_are_written_as_a_task_file_that_reads_back(tmp_path):
  source = tmp_path / "train.jsonl"
  rows = [{"id": f"train-{i}", "question": f"Question: What is {i} * 2?",
           "metadata": {"domain": "math", "ground_truth": str(2 * i), "family": "arithmetic"}}
          for i in range(4)]
  source.write_text("".join(json.dumps(r) + "\n" for r in rows))
  tasks = load_tasks(str(source))
  path = query_selection.write_tasks(tasks[1:3], str(tmp_path / "sel" / "tasks.jsonl"))
  assert load_tasks(path) == tasks[1:3]


# --- the kinds' summaries and tables -------------------------------------------------------


def _stat(mean):
  return {"mean": mean, "sd": 0.0}


def test_rl_curves_summary_and_table(tmp_path):
  def result(scores):
    points = {str(k): {"pass@1": s, "tokens_per_task": 200.0, "tool_calls_per_task": 2.0,
                       "format_error_rate": 0.0, "pass@1_by_family": {"lookup": s}}
              for k, s in zip((0, 12, 24), scores)}
    return {"points": points, "training": []}

  pages = {"0": result([0.8, 0.9, 0.94]), "1": result([0.8, 0.92, 0.96])}
  summary = rl_curves.summarize({"dapo": pages})
  row = summary["dapo"][24]
  assert row["pass@1"]["mean"] == pytest.approx(0.95)
  assert row["pass@1"]["sd"] == pytest.approx(0.02 ** 0.5 * 0.1)
  assert row["by_family"]["lookup"]["values"] == [0.94, 0.96]
  lines = rl_curves.table(summary).splitlines()
  assert lines[0].startswith("| cell | pass@1 after 0 | pass@1 after 12 | pass@1 after 24 |")
  assert lines[2].startswith("| dapo | 0.800 +- 0.000 | 0.910 +- 0.014 | 0.950 +- 0.014 |")
  assert lines[-1] == "| dapo: lookup | 0.800 +- 0.000 | 0.910 +- 0.014 | 0.950 +- 0.014 |"
  assert "near-miss" not in rl_curves.table(summary)  # a world without them
  for seed, first in (("0", 0.0), ("1", 0.1)):  # on a world with near-miss figures
    for k, point in pages[seed]["points"].items():
      point["pass@1_by_page"] = {"none": 1.0, "before": first + int(k) / 100}
  lines = rl_curves.table(rl_curves.summarize({"dapo": pages})).splitlines()
  assert lines[-2:] == [
      "| dapo: near-miss none | 1.000 +- 0.000 | 1.000 +- 0.000 | 1.000 +- 0.000 |",
      "| dapo: near-miss before | 0.050 +- 0.071 | 0.170 +- 0.071 | 0.290 +- 0.071 |"]
  for seed, own in (("0", -6.0), ("1", -4.0)):  # the near-miss probe, its own table
    for k, point in pages[seed]["points"].items():
      point["near_miss_chance"] = {"own_log10": own + int(k) / 12, "own_likelier": 0.5}
  lines = rl_curves.table(rl_curves.summarize({"dapo": pages})).splitlines()
  assert lines[-4:] == [
      "| cell: near-miss probe (median over tasks) | after 0 | after 12 | after 24 |",
      "|---|---|---|---|",
      "| dapo: own figure, log10 chance | -5.00 +- 1.41 | -4.00 +- 1.41 | -3.00 +- 1.41 |",
      "| dapo: own figure the likelier | 0.50 +- 0.00 | 0.50 +- 0.00 | 0.50 +- 0.00 |"]
  report = {"name": "near-miss-rl", "about": "levers", "seeds": [0, 1], "results": {"dapo": pages},
            "summary": rl_curves.summarize({"dapo": pages})}  # its middle panel: the pages
  assert rl_curves.plot(report, str(tmp_path / "curves.png")) and (tmp_path / "curves.png").exists()


def test_rl_cells_sample_rollouts_at_their_temperature_and_evaluate_at_the_main_jobs(
    tmp_path, monkeypatch):
  """options "temperature" reaches the RL stage's sampler config (a fake stage records it)
  and no evaluation's; on a world with near-miss figures each point has its per-page split."""
  config = with_overrides(pipeline_tiny_cpu.get_config(),
                          {"output_dir": str(tmp_path), "dapo.rl.steps": 2})
  stages = pipeline_tiny_cpu.stage_configs(config, 0)
  for path in (stages["eval_sft"].output_dir, stages["dapo"].model.checkpoint,
               os.path.dirname(stages["dapo"].tasks)):
    os.makedirs(path, exist_ok=True)
  metrics = {c: 0.5 for c in rl_curves.COLUMNS}
  (Path(stages["eval_sft"].output_dir) / "metrics.json").write_text(json.dumps(metrics))
  Path(stages["dapo"].tasks).write_text("")
  seen = []

  def fake_rl(cfg):
    seen.append(("rl", cfg.sampling.temperature))
    os.makedirs(cfg.export_dir)
    Path(cfg.export_dir, "config.json").write_text("{}")

  def fake_evaluation(cfg):
    seen.append(("eval", cfg.sampling.temperature))
    os.makedirs(cfg.output_dir)
    Path(cfg.output_dir, "metrics.json").write_text(json.dumps(metrics))

  monkeypatch.setattr(rl_curves.rl, "run", fake_rl)
  monkeypatch.setattr(rl_curves.evaluation, "run", fake_evaluation)
  pages = []
  monkeypatch.setattr(rl_curves.evaluation, "pass_at_1_by_page",
                      lambda world, tasks, where: pages.append(where) or {"before": 0.25})
  result = rl_curves.run_cell(_stages(config), 0, {"every": 1, "temperature": 1.0})
  assert seen == [("rl", 1.0), ("eval", 0.6), ("rl", 1.0), ("eval", 0.6)]
  assert not pages and "pass@1_by_page" not in result["points"][1]  # no near-miss figures
  near_miss = with_overrides(config, {"world.distractors": 0.5})
  probed = []
  monkeypatch.setattr(rl_curves, "_near_miss_probe", lambda world, evaluate: (
      lambda checkpoint: probed.append(checkpoint) or {"own_log10": -5.0}))
  result = rl_curves.run_cell(_stages(near_miss), 0,
                              {"every": 1, "temperature": 1.0})  # the runs on disk are reused
  assert len(seen) == 4 and len(pages) == 3
  assert result["points"][2]["pass@1_by_page"] == {"before": 0.25}
  # the near-miss probe of each point's model: the SFT model's, then each segment's export
  assert probed == [stages["dapo"].model.checkpoint,
                    *(os.path.join(result["run"], f"export-{k}") for k in (1, 2))]
  assert result["points"][1]["near_miss_chance"] == {"own_log10": -5.0}
  with pytest.raises(ConfigError, match="temperature=0"):
    rl_curves.run_cell(_stages(config), 0, {"temperature": 0})


def test_scaling_summary_and_table():
  def result(p):
    return {"curves": {"k": [1, 2, 4], "pass@k": [p, p + 0.05, p + 0.1],
                       "maj@k": [p, p, p + 0.02]},
            "tokens_per_task": 100.0, "tool_calls_per_task": 2.0}

  summary = scaling_curves.summarize({"sft": {"0": result(0.8), "1": result(0.9)}})
  assert summary["sft"]["pass@k"][2]["mean"] == pytest.approx(0.95)
  lines = scaling_curves.table(summary).splitlines()
  assert lines[0] == ("| system | pass@1 | pass@2 | pass@4 | maj@2 | maj@4 | tokens per sample "
                      "| tool calls per sample |")
  assert lines[2].startswith("| sft | 0.850 +- 0.071 | 0.900 +- 0.071 | 0.950 +- 0.071 | "
                             "0.850 +- 0.071 | 0.870 +- 0.071 | 100.0 +- 0.0 |")
  assert "near-miss" not in scaling_curves.table(summary)  # a world without them
  pages = {"0": {**result(0.8), "pass@1_by_page": {"none": 1.0, "after": 0.9, "before": 0.1}},
           "1": {**result(0.9), "pass@1_by_page": {"none": 1.0, "after": 0.7, "before": 0.3}}}
  lines = scaling_curves.table(scaling_curves.summarize({"sft": pages})).splitlines()
  assert lines[-3:] == ["| system | near-miss none | near-miss after | near-miss before |",
                        "|---|---|---|---|",
                        "| sft | 1.000 +- 0.000 | 0.800 +- 0.141 | 0.200 +- 0.141 |"]


def test_pass_at_1_by_page_groups_the_samples_by_where_the_near_miss_figure_stands(tmp_path):
  from coa_jax.data import World, WorldConfig

  world_config = WorldConfig(seed=3, entities=6, train_tasks=0, heldout_tasks=40,
                             families=(("mixed", 1.0),), distractors=0.5)
  world = World(world_config)
  world.write(str(tmp_path))
  page = {t["id"]: world.near_miss(t) for t in world.tasks["heldout"]}
  assert set(page.values()) == {"none", "before", "after"}
  right = {"none": [True, True], "after": [True, False], "before": [False, False]}
  with open(tmp_path / "samples.jsonl", "w") as f:
    for task_id, where in page.items():
      samples = [dict(correct=c, answer="1", tokens=1, tool_calls={}, format_errors=0,
                      finish_reason="answer", text="") for c in right[where]]
      f.write(json.dumps({"task_id": task_id, "samples": samples}) + "\n")
  tasks = str(tmp_path / "heldout.jsonl")
  assert evaluation.pass_at_1_by_page(world_config, tasks, str(tmp_path)) == {
      "after": 0.5, "before": 0.0, "none": 1.0}
  world_config = dataclasses.replace(world_config, seed=4)  # the task file is another world's
  with pytest.raises(ConfigError, match="not the held-out split of the config's world"):
    evaluation.pass_at_1_by_page(world_config, tasks, str(tmp_path))


def test_the_near_miss_probe_pairs_every_near_miss_first_task_the_teacher_misread(
    tmp_path, monkeypatch):
  """Each held-out task whose page states the near-miss figure first, answered by the teacher
  with that figure, gives a pair: its step with the near-miss figure and with the entity's own
  (those of `World.near_miss_figures`, which the page states)."""
  from coa_jax.data import World, WorldConfig
  from coa_jax.data.tokenizer import default_tokenizer
  from coa_jax.evaluation import copy_probe

  world_config = WorldConfig(seed=3, entities=6, train_tasks=0, heldout_tasks=40,
                             families=(("lookup", 1.0),), distractors=0.5)
  world = World(world_config)
  world.write(str(tmp_path))
  before = [t for t in world.tasks["heldout"] if world.near_miss(t) == "before"]
  assert before
  with open(tmp_path / "teacher.jsonl", "w") as f:
    for task in world.tasks["heldout"]:  # the teacher reads the first figure on the page
      near, own = world.near_miss_figures(task) if world.near_miss(task) != "none" else (1, 1)
      page = next(e for e in world.by_name.values()
                  if str(own) in e.page() and str(near) in e.page()).page()
      read = near if world.near_miss(task) == "before" else own
      steps = [{"tag": "crawl_page", "content": "https://kb.world/x"},
               {"tag": "observation", "content": page},
               {"tag": "suggested_answer", "content": str(read)},
               {"tag": "double_check", "content": "Score: 4"},
               {"tag": "answer", "content": str(read)}]
      f.write(json.dumps({"system": "s", "question": task["question"], "steps": steps}) + "\n")
  pairs = []
  monkeypatch.setattr(copy_probe, "near_miss_chance",
                      lambda model, params, found: pairs.extend(found) or {"own_log10": -1.0})
  tokenizer = default_tokenizer("plain")
  assert evaluation.near_miss_chance(world_config, str(tmp_path / "heldout.jsonl"),
                                     str(tmp_path / "teacher.jsonl"), tokenizer, None,
                                     None) == {"own_log10": -1.0}
  assert len(pairs) == len(before)
  for pair, task in zip(pairs, before):  # each span: where the figures part, to the step's end
    for example, figure in zip(pair, world.near_miss_figures(task)):
      (begin, end), = example.spans
      written = tokenizer.decode(example.input_ids[begin:end])
      assert written.endswith("\n</suggested_answer>") and len(written) > 20
      assert str(figure).endswith(written.split("\n")[0])
      assert str(figure) in tokenizer.decode(example.input_ids[begin - 8:end])
    np.testing.assert_array_equal(pair[0].input_ids[:begin], pair[1].input_ids[:begin])


def test_filter_ablation_table():
  summary = filters.summarize({"all": {"0": {"trajectories": 40, "pass@1": 0.5,
                                             "format_error_rate": 0.1,
                                             "tokens_per_task": 90.0}}})
  assert filters.table(summary).splitlines()[2] == (
      "| all | 40 | 0.500 +- 0.000 | 0.100 +- 0.000 | 90.0 +- 0.0 |")


def test_filter_stage_data_rebuilds_each_stage_from_the_traces(tmp_path):
  from coa_jax.data import World, WorldConfig, load_tools_spec, prompts
  from coa_jax.distill import job as distill
  from coa_jax.distill.teacher import ScriptedTeacher, TeacherConfig
  from tools_env import registry

  world = World(WorldConfig(seed=3, entities=6, train_tasks=30, heldout_tasks=2))
  world.write(str(tmp_path / "world"))
  tools = registry.build_registry(load_tools_spec(str(tmp_path / "world")))
  teacher = ScriptedTeacher(tools, TeacherConfig(misread_rate=0.3, skip_verify_rate=0.3))
  traces, _ = distill.solve(teacher, world.tasks["train"], workers=2)
  path = tmp_path / "traces.jsonl"
  path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in traces))
  stages = _stages(with_overrides(_config(tmp_path), {
      "system_prompt": prompts.WORLD, "filters.min_tool_calls": 0, "filters.max_tool_calls": 12,
      "filters.max_steps": 48}))
  trajectories = [distill.to_trajectory(t, prompts.WORLD) for t in traces]
  kept, report = distill.Distiller(distill.FilterConfig(0, 12, 48)).filter(trajectories)
  counts = {}
  for stage in filters.DATA:
    lines = open(filters.stage_data(stages, str(path), stage)).read().splitlines()
    counts[stage] = len(lines)
  assert counts["all"] == len(traces)
  assert [counts[s["stage"]] for s in report["stages"]] == [s["kept"] for s in report["stages"]]
  assert counts["correct"] < counts["all"] and counts["quality"] < counts["complexity"]
  final = open(filters.stage_data(stages, str(path), "quality")).read().splitlines()
  assert final == [json.dumps(t.to_json()) for t in kept]  # the main job's bytes
  with pytest.raises(ConfigError, match="not one of"):
    filters.stage_data(stages, str(path), "nope")


def test_results_keep_the_cells_in_their_order(tmp_path):
  cells = {name: {"dapo.learning_rate": lr} for name, lr in (("zeta", 1e-5), ("alpha", 2e-5))}
  report = run(Experiment("order", "fake", cells, seeds=1), _config(tmp_path),
               pipeline_tiny_cpu.stage_configs, {"fake": FakeKind()})
  assert list(report["summary"]) == ["zeta", "alpha"]
  assert report["table"].splitlines()[0] == "| zeta | [1.0] |"


def _recipe_rows(sft: float, dapo: float) -> dict:
  metrics = lambda p: {"pass@1": p, "pass@3": p, "copy_exact": p, "call_exact": p,
                       "question_exact": p, "tokens_per_task": 120.0, "avg@3": p,
                       "pass@1_by_family": {"lookup": p, "mixed": p - 0.1},
                       "invented_numbers": {"all": 0.05, "mixed": 0.1}}
  return {"teacher": {"pass@1": 0.997, "tokens_per_task": 245.0}, "sft": metrics(sft),
          "dapo": metrics(dapo)}


def test_recipe_cells_read_the_main_job_or_run_the_pipeline_in_their_own_folder(
    tmp_path, monkeypatch):
  from coa_jax.experiments import recipe

  config = with_overrides(pipeline_tiny_cpu.get_config(), {"output_dir": str(tmp_path / "main")})
  with pytest.raises(ConfigError, match="has no seed 1: run the main job first"):
    recipe.run_cell(_stages(config), 1, {"main_job": True})
  (tmp_path / "main").mkdir()
  (tmp_path / "main" / "results.json").write_text(json.dumps(
      {"per_seed": {"1": _recipe_rows(0.85, 0.92)}}))
  main = recipe.run_cell(_stages(config), 1, {"main_job": True})
  assert main["params"] == 559_104 and main["dapo"]["pass@1"] == 0.92  # 3 x 128, 8 heads of 16
  assert set(main["sft"]) == set(recipe.METRICS)  # avg@3 is not carried
  # a main job whose seed-1 SFT ran with other steps does not stand in this cell's row
  trained = pipeline.trained(_stages(with_overrides(config, {"sft.steps": 900})), 1)
  (tmp_path / "main" / "stage_settings.json").write_text(json.dumps(
      {name: pipeline.stage_section(s, config.output_dir) for name, s in trained.items()}))
  with pytest.raises(ConfigError, match=r"finished seed 1 sft stage made with other settings "
                     r"\(.*train\.steps: 900 -> 2000\): .* run the main job again"):
    recipe.run_cell(_stages(config), 1, {"main_job": True})
  (tmp_path / "main" / "stage_settings.json").unlink()

  calls = []

  def fake_run(stages, seeds):
    run = stages.settings
    calls.append((run.output_dir, run.seed, seeds, stages.section()["model"]["num_layers"]))
    return {"per_seed": {run.seed: _recipe_rows(0.9, 0.95)}}

  monkeypatch.setattr(recipe.pipeline, "run_stages", fake_run)
  bigger = with_overrides(config, {"model.num_layers": 6, "model.hidden_size": 256})
  results = {seed: recipe.run_cell(_stages(bigger), seed, {}) for seed in (0, 1)}
  (folder, _, _, layers), (folder_1, seed_1, seeds, _) = calls
  assert folder == folder_1 and folder.startswith(str(tmp_path / "main" / "experiments" / "runs"
                                                      / "recipe-"))  # seeds share the folder
  assert (seed_1, seeds, layers) == (1, 1, 6) and results[0]["params"] > 3 * main["params"]
  summary = recipe.summarize({"3x128": {"1": main}, "6x256": results})
  assert summary["6x256"]["dapo"]["pass@1"] == {"values": [0.95, 0.95], "mean": 0.95, "sd": 0.0}
  assert summary["6x256"]["dapo"]["pass@1_by_family"]["mixed"]["mean"] == pytest.approx(0.85)
  assert recipe.table(summary).splitlines()[2:] == [
      "| 3x128 | 0.56M | 2,000 | 0.850 +- 0.000 | 0.920 +- 0.000 | 0.850 +- 0.000 | "
      "0.920 +- 0.000 | 120 +- 0 | 0.997 +- 0.000 |",
      f"| 6x256 | {results[0]['params'] / 1e6:.2f}M | 2,000 | 0.900 +- 0.000 | 0.950 +- 0.000 | "
      "0.900 +- 0.000 | 0.950 +- 0.000 | 120 +- 0 | 0.997 +- 0.000 |"]
  longer = recipe.run_cell(_stages(with_overrides(bigger, {"sft.steps": 3400})), 0, {})
  assert longer["sft_steps"] == 3400 and calls[-1][0] != folder  # a folder of its own
  summary["6x256-2x"] = recipe.summarize({"6x256-2x": {"0": longer}})["6x256-2x"]
  older = {k: v for k, v in longer.items() if k != "sft_steps"}  # cached by older code
  with pytest.raises(ConfigError, match="cached by older code"):
    recipe.summarize({"6x256": {"0": older}})
  report = {"name": "model-size", "about": "sizes", "seeds": [0, 1], "summary": summary}
  assert recipe.plot(report, str(tmp_path / "sizes.png")) and (tmp_path / "sizes.png").exists()


def test_model_sizes_grow_to_about_7x_the_main_jobs_parameters_and_fit_a_cpu_run():
  from coa_jax.model import build_config
  from coa_jax.perf import flops

  base = pipeline_tiny_cpu.get_config()
  sizes, steps = {}, {}
  cells = {**EXPERIMENTS["model-size"].cells, **EXPERIMENTS["model-size-2x"].cells}
  for name, overrides in cells.items():
    cfg = with_overrides(base, {k: v for k, v in overrides.items() if not k.startswith("options.")})
    sizes[name] = build_config(pipeline_tiny_cpu.stage_configs(cfg, 0)["sft"].model)
    steps[name] = cfg.sft.steps
    assert cfg.sft.batch_size == base.sft.batch_size
  # equal tokens, and every size again with twice the steps
  assert {n: s // base.sft.steps for n, s in steps.items()} == {
      "3x128": 1, "4x192": 1, "6x256": 1, "3x128-2x": 2, "4x192-2x": 2, "6x256-2x": 2}
  params = {name: model.num_params() for name, model in sizes.items()}
  assert params["3x128"] < params["4x192"] < params["6x256"] <= 8 * params["3x128"]
  assert params["6x256"] >= 5 * params["3x128"]  # 7.3x (4x192: 2.8x)
  assert all(params[f"{n}-2x"] == params[n] for n in ("3x128", "4x192", "6x256"))
  # The budget: the largest SFT run's model FLOPs stay within 25x the main job's (an afternoon
  # of this 2-core machine for 3 seeds), and its AdamW state within 100 MB.
  run = {n: steps[n] * flops.train_flops(m, base.sft.batch_size, base.sft.seq_len)
         for n, m in sizes.items()}
  assert max(run.values()) == run["6x256-2x"] <= 25 * run["3x128"]
  assert 16 * params["6x256"] < 100e6
