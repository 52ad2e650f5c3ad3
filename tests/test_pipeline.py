"""The end-to-end pipeline's --quick variant: every stage runs and the results are written; the
results over seeds (mean and sample standard deviation)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from coa_jax import experiments, pipeline
from coa_jax.experiments import chaos
from coa_jax.model import ConfigError
from coa_jax.runtime.cache import file_fingerprint
from configs import common, pipeline_tiny_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """The main job's --quick variant on the 8 fake devices: its config and results."""
  tmp_path = tmp_path_factory.mktemp("pipeline")
  config = pipeline_tiny_cpu.quick(pipeline_tiny_cpu.get_config())
  config.output_dir = str(tmp_path / "run")
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)  # the 8 fake devices
  return tmp_path, config, pipeline.run(config, pipeline_tiny_cpu.stage_configs)


def test_quick_pipeline_runs_every_stage(quick_run):
  tmp_path, config, results = quick_run
  rows = results["per_seed"][config.seed]
  assert list(rows) == ["teacher", "sft", "dapo"]
  assert rows["teacher"]["pass@1"] > 0.5  # the scripted teacher solves them
  copied = rows["sft"]["copy_exact"] * rows["sft"]["copy_steps"]  # the copy probe ran on SFT
  assert rows["sft"]["copy_steps"] > 0 and copied == round(copied)  # of whole copy steps
  curves = rows["sft"]["curves"]  # test-time scaling, k = 1..samples per task
  k = len(curves["k"])
  assert curves["k"] == list(range(1, k + 1)) and k == rows["sft"]["samples_per_task"]
  assert curves["pass@k"][0] == pytest.approx(rows["sft"]["pass@1"])
  assert curves["pass@k"][-1] == pytest.approx(rows["sft"][f"pass@{k}"])
  for name in ("distill/trajectories.jsonl", "distill/heldout_trajectories.jsonl",
               "seed-0/sft/hf_export/config.json", "seed-0/dapo/hf_export/config.json",
               "results.png", "trajectories.html"):
    assert (tmp_path / "run" / name).exists(), name
  page = (tmp_path / "run" / "results.md").read_text()
  assert results["table"] in page and "(trajectories.html)" in page and "(results.png)" in page
  saved = json.load(open(tmp_path / "run" / "results.json"))
  assert saved["per_seed"]["0"]["sft"]["tasks"] == config.eval.max_tasks
  assert saved["summary"]["sft"]["pass@1"]["values"] == [rows["sft"]["pass@1"]]
  assert set(saved["pass@1_by_family"]["sft"]) <= {"lookup", "arithmetic", "mixed"}
  assert list(saved["stage_seconds"]) == ["distill", "eval teacher", "seed 0 sft",
                                          "seed 0 eval sft", "seed 0 dapo", "seed 0 eval dapo"]
  # every stage's output exists: all are reused
  again = pipeline.run(config, pipeline_tiny_cpu.stage_configs)
  assert again["per_seed"] == results["per_seed"]
  assert again["stage_seconds"] == results["stage_seconds"]  # the times they took when they ran


def test_a_stages_compared_settings_leave_out_how_it_runs_and_hold_paths_relative():
  settings = {"model": {"checkpoint": "/base/qwen"}, "checkpoint": {"every": 100},
              "mesh": {"fsdp": 2}, "train": {"log_every": 20, "steps": 9},
              "data": {"path": "/runs/a/distill/trajectories.jsonl"}, "note": "/runs/ab"}
  section = pipeline.stage_section(settings, "/runs/a/")
  assert section == {"model": {"checkpoint": "/base/qwen"}, "train": {"steps": 9},
                     "data": {"path": "<output_dir>/distill/trajectories.jsonl"},
                     "note": "/runs/ab"}
  moved = {**settings, "data": {"path": "/runs/b/distill/trajectories.jsonl"},
           "checkpoint": {"every": 7}, "mesh": {"fsdp": 8}}
  assert pipeline.stage_section(moved, "/runs/b") == section  # moved, on other hardware


def test_a_finished_stage_is_reused_only_with_the_settings_it_ran_with(quick_run):
  """Another mesh or log cadence reuses every stage; another SFT length on the same folder is
  an error naming the setting, before that stage runs (it reused the old model silently)."""
  tmp_path, config, results = quick_run
  moved = config.copy_and_resolve_references()
  moved.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  moved.log_every = 1
  export = os.path.join(config.output_dir, "seed-0", "sft", "hf_export")
  before = file_fingerprint(export)
  assert pipeline.run(moved, pipeline_tiny_cpu.stage_configs)["per_seed"] == results["per_seed"]
  # reused, the export is not written to (the experiments' caches are keyed on it)
  assert file_fingerprint(export) == before
  moved.sft.steps += 1
  with pytest.raises(ConfigError, match=r"holds a finished seed 0 sft stage made with other "
                     r"settings \(.*train\.steps: \d+ -> \d+\): run with another"):
    pipeline.run(moved, pipeline_tiny_cpu.stage_configs)


# The packages of the extras that `make pipeline`'s lean install leaves out (setup.py: test, tpu,
# tfds, mcp, serve, agents, gcs; array_record stays, grain requires it), hidden from a process as
# if not installed.
NOT_IN_THE_LEAN_INSTALL = ("pytest", "xdist", "hypothesis", "pyarrow", "torch", "math_verify",
                           "peft", "mcp", "libtpu", "tensorflow", "tensorflow_datasets", "openai",
                           "fastapi", "starlette", "uvicorn", "agents", "gcsfs")
HIDE_PACKAGES = f"""import sys
HIDDEN = {NOT_IN_THE_LEAN_INSTALL!r}


class Hide:
  def __init__(self, finder):
    self.finder = finder

  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in HIDDEN or not hasattr(self.finder, "find_spec"):
      return None
    return self.finder.find_spec(name, path, target)

  def __getattr__(self, name):
    return getattr(self.finder, name)


sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
"""


def test_quick_pipeline_killed_in_three_stages_ends_with_the_uninterrupted_results(quick_run):
  """The main job as a process, SIGKILLed while distillation writes its data, while SFT exports
  and while the SFT model is evaluated, each time launched again: it completes with quick_run's
  results and byte-equal SFT and DAPO exports (`make chaos` kills it in every stage). Its
  processes cannot import the packages of the extras (a sitecustomize hides them): the main job
  runs from the lean install."""
  tmp_path, config, _ = quick_run
  hide = tmp_path / "lean"
  hide.mkdir()
  (hide / "sitecustomize.py").write_text(HIDE_PACKAGES)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [str(hide), os.environ.get("PYTHONPATH")])))
  hidden = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
  assert hidden.returncode != 0  # the sitecustomize took effect
  points = (chaos.Point("distill", line="teacher: ", max_delay_s=0.2),
            chaos.Point("seed 0 sft", file="seed-0/sft/hf_export", max_delay_s=0.005),
            chaos.Point("seed 0 eval sft", line="== seed 0 eval sft", max_delay_s=1.0))
  command = [sys.executable, "experiments/pipeline.py", "--quick",
             f"--config.output_dir={tmp_path / 'chaos'}", "--config.mesh.data=2",
             "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]  # quick_run's mesh
  report = chaos.run(command, str(tmp_path / "chaos_quick"), None, config.output_dir, points,
                     0, chaos.EXPORTS, ROOT, env, str(tmp_path / "chaos.json"))
  assert [k.get("exit") for k in report["kills"]] == [-signal.SIGKILL] * 3, report["kills"]
  assert report["launches"] == 4
  assert report["comparison"]["equal"], report["comparison"]


def test_a_stage_whose_job_was_cut_short_runs_again(tmp_path):
  """An output left by a job that did not return (a process killed mid-export) is not reused;
  once the job has returned, it is."""
  path, export = str(tmp_path / "stage_seconds.json"), tmp_path / "hf_export"

  def cut_short():
    export.mkdir()  # part of the output, then the process dies
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    pipeline.StageTimes(path).run("seed 0 sft", str(export), cut_short)
  runs = []
  pipeline.StageTimes(path).run("seed 0 sft", str(export), lambda: runs.append("again"))
  pipeline.StageTimes(path).run("seed 0 sft", str(export), lambda: runs.append("a third time"))
  assert runs == ["again"]


def test_a_stage_stopped_by_a_signal_ends_the_run_saying_to_rerun(tmp_path):
  """A training stage stopped by SIGTERM saves a checkpoint and returns without its export:
  the pipeline stops there (not in the next stage, which would find no model) and the stage
  runs again on the rerun."""
  path, export = str(tmp_path / "stage_seconds.json"), tmp_path / "hf_export"
  with pytest.raises(pipeline.StageStopped, match="seed 0 sft stage stopped before it "
                     "finished .* run the same command again to resume it"):
    pipeline.StageTimes(path).run("seed 0 sft", str(export), lambda: None)
  runs = []
  pipeline.StageTimes(path).run("seed 0 sft", str(export), lambda: runs.append(export.mkdir()))
  assert len(runs) == 1 and "seed 0 sft" in pipeline.StageTimes(path).seconds


def test_experiments_run_on_the_main_job_outputs(quick_run):
  """Each experiment kind on the quick main job: RL curves with query selection on, the filter
  ablation reusing the main job's SFT where its data are the main job's, test-time scaling,
  and LoRA against full fine-tuning from one shared prefix of the main job's SFT; a re-run
  reuses everything."""
  _, config, results = quick_run
  cells = {"rl": {"selected": {"selection.k": 2, "selection.max_tasks": 6,
                               "selection.high": 0.5}},
           "sft": {"quality": {"options.data": "quality"}},
           "scaling": {"teacher": {"options.system": "teacher"},
                       "dapo": {"options.system": "dapo"}},
           "lora": {"full": {"options.rank": 0}, "lora": {"options.rank": 4}}}
  options = {"rl": {"every": 1}, "sft": {}, "scaling": {"k": 2},
             "lora": {"from_step": 2, "lr_scale": 1.0}}
  reports = {kind: experiments.run(experiments.Experiment(kind, kind, cells[kind], seeds=1,
                                                          options=options[kind]),
                                   config, pipeline_tiny_cpu.stage_configs, experiments.KINDS)
             for kind in cells}
  curve = reports["rl"]["results"]["selected"]["0"]
  assert curve["points"]["0"]["pass@1"] == results["per_seed"][0]["sft"]["pass@1"]
  assert list(curve["points"]) == ["0", "1"] and len(curve["training"]) == 1
  selection = curve["selection"]  # pass rates of the 6 tasks sampled twice each
  assert selection["sampled"] == 6 and sum(selection["pass_rates"].values()) == 6
  assert selection["kept"] == sum(n for rate, n in selection["pass_rates"].items()
                                  if int(rate[0]) <= 1)
  ablation = reports["sft"]["results"]["quality"]["0"]
  assert ablation["main_job"] and ablation["pass@1"] == results["per_seed"][0]["sft"]["pass@1"]
  scaling = reports["scaling"]["results"]
  assert scaling["teacher"]["0"]["curves"]["k"] == [1, 2]
  pass_1, pass_2 = scaling["dapo"]["0"]["curves"]["pass@k"]
  assert 0 <= pass_1 <= pass_2 <= 1
  full, lora = (reports["lora"]["results"][name]["0"] for name in ("full", "lora"))
  assert full["pass@1"] == results["per_seed"][0]["sft"]["pass@1"]  # the main job's SFT
  assert full["start_pass@1"] == lora["start_pass@1"]  # one prefix, evaluated once
  assert 0 < lora["trained_params"] < full["trained_params"] / 5
  assert 0 <= lora["pass@1"] <= 1 and lora["train_loss"] > 0
  runs = os.listdir(os.path.join(config.output_dir, "experiments", "runs"))
  assert [sum(name.startswith(f"sft-{run}-") for name in runs) for run in ("prefix", "lora")
          ] == [1, 1]
  for kind in cells:
    assert reports[kind]["table"] in open(os.path.join(
        config.output_dir, "experiments", kind, "results.md")).read()
  again = experiments.run(experiments.Experiment("rl", "rl", cells["rl"], seeds=1,
                                                 options=options["rl"]),
                          config, pipeline_tiny_cpu.stage_configs, experiments.KINDS)
  assert again["results"] == reports["rl"]["results"]


def test_the_documented_evaluate_command_runs_on_the_main_jobs_export(quick_run, tmp_path):
  """docs/distill_and_eval.md's "Your model on your tasks", as written (the interpreter and
  the script by absolute path), in a folder where runs/pipeline_tiny is the quick main job."""
  _, config, _ = quick_run
  doc = open(os.path.join(ROOT, "docs", "distill_and_eval.md")).read()
  section = doc[doc.index("## Your model on your tasks"):]
  script = section.split("```bash\n", 1)[1].split("```", 1)[0]
  script = script.replace(".venv/bin/python experiments/",
                          f"{sys.executable} {os.path.join(ROOT, 'experiments')}/")
  os.makedirs(tmp_path / "runs")
  os.symlink(config.output_dir, tmp_path / "runs" / "pipeline_tiny")
  done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "with the settings of the run that trained it" in done.stdout + done.stderr
  metrics = json.load(open(tmp_path / "runs" / "evaluate_my_tasks" / "metrics.json"))
  assert metrics["tasks"] == 3 and metrics["samples_per_task"] == config.eval.k


def test_results_over_seeds_are_mean_and_sample_sd():
  per_seed = {seed: {system: {"pass@1": value, "tokens_per_task": 100.0 * value}
                     for system in pipeline.SYSTEMS}
              for seed, value in ((0, 0.5), (1, 0.7), (2, 0.9))}
  summary = pipeline.aggregate(per_seed, k=3)
  assert summary["sft"]["pass@1"]["values"] == [0.5, 0.7, 0.9]
  assert summary["sft"]["pass@1"]["mean"] == pytest.approx(0.7)
  assert summary["sft"]["pass@1"]["sd"] == pytest.approx(0.2)  # ddof=1
  table = pipeline.format_summary(summary, k=3)
  assert "| AFM after SFT | 0.700 +- 0.200 | 0.500 | 70 +- 20 |" in table  # the worst seed
  per_seed[2]["sft"]["copy_exact"] = 0.9  # measured on one seed of three: not a mean over seeds
  table = pipeline.format_summary(pipeline.aggregate(per_seed, k=3), k=3)
  assert "| AFM after SFT | 0.700 +- 0.200 | 0.500 | 70 +- 20 | - |" in table


def test_the_per_seed_table_gives_every_seed_family_and_the_worst():
  row = lambda p, mixed: {"pass@1": p, "pass@1_by_family": {"lookup": 1.0, "mixed": mixed},
                          "question_exact": mixed}
  per_seed = {0: {"sft": row(0.9, 0.8), "dapo": row(1.0, 1.0)},
              7: {"sft": row(0.5, 0.0), "dapo": row(0.6, 0.2)}}
  lines = pipeline.per_seed_table(per_seed).splitlines()
  assert lines[0] == ("| seed | SFT pass@1 | SFT lookup | SFT mixed | SFT question exact | "
                      "DAPO pass@1 | DAPO lookup | DAPO mixed | DAPO question exact |")
  assert lines[3] == "| 7 | 0.500 | 1.000 | 0.000 | 0.000 | 0.600 | 1.000 | 0.200 | 0.200 |"
  assert lines[4] == "| worst | 0.500 | 1.000 | 0.000 | 0.000 | 0.600 | 1.000 | 0.200 | 0.200 |"
  assert lines[5].startswith("| mean +- sd | 0.700 +- 0.283 | 1.000 +- 0.000 | 0.400 +- 0.566 |")


def test_runs_of_disjoint_seeds_combine_into_one_result():
  run = lambda seeds: {"per_seed": {str(s): {"sft": {"pass@1": s / 10}} for s in seeds}}
  combined = pipeline.combine([run([5, 6]), run([0])], k=3)
  assert combined["seeds"] == [0, 5, 6]
  assert combined["summary"]["sft"]["pass@1"]["values"] == [0.0, 0.5, 0.6]
  with pytest.raises(ValueError, match="seed 6"):
    pipeline.combine([run([6]), run([6])], k=3)


def test_family_pass_rates_are_averaged_over_seeds():
  per_seed = {seed: {"sft": {"pass@1_by_family": {"lookup": 1.0, "mixed": value}}}
              for seed, value in ((0, 0.2), (1, 0.6))}
  assert pipeline.family_means(per_seed) == {"sft": pytest.approx({"lookup": 1.0, "mixed": 0.4})}
  per_seed[2] = {"sft": {"pass@1_by_family": {"lookup": 1.0}}}  # another task file's run
  with pytest.raises(ValueError, match=r"seeds lack groups the others have: \{2: \['mixed'\]\}"):
    pipeline.family_means(per_seed)


def test_copy_curve_probes_each_segment_of_sft(tmp_path):
  config = pipeline_tiny_cpu.quick(pipeline_tiny_cpu.get_config())
  config.output_dir = str(tmp_path / "run")
  config.mesh = common.mesh(data=2, fsdp=2, tensor=2)
  curves = pipeline.copy_curve(config, pipeline_tiny_cpu.stage_configs, seeds=1, every=2)
  assert [p["step"] for p in curves[config.seed]] == [2, 4]  # config.sft.steps is 4
  first, last = curves[config.seed]
  # Both points probe the same held-out copy steps (8), each with its own segment's params:
  # the chance of sampling the copies moves as SFT trains (9e-14 at step 2, 3e-12 at step 4).
  assert first["copy_steps"] == last["copy_steps"] > 0
  assert first["copy_sampled"] != last["copy_sampled"] and first["loss"] != last["loss"]
  for point in (first, last):
    copied = point["copy_exact"] * point["copy_steps"]
    assert copied == round(copied)
  saved = json.load(open(tmp_path / "run" / "copy_curve" / "copy_curve.json"))
  assert saved["curves"]["0"] == curves[0] and saved["every"] == 2
  assert (tmp_path / "run" / "copy_curve" / "copy_curve.png").exists()


def test_the_readme_table_is_the_committed_results_table():
  """The README's main-result table is the `table` of the committed 10-seed results file, and
  docs/pipeline.md's per-seed table its `per_seed_table`."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "results", "pipeline_10_seeds", "after.json")) as f:
    results = json.load(f)
  assert len(results["seeds"]) == 10
  for page, table in (("README.md", results["table"]),
                      (os.path.join("docs", "pipeline.md"), results["per_seed_table"])):
    with open(os.path.join(root, page)) as f:
      assert table.strip() in f.read(), page


def test_the_experiment_tables_are_the_committed_results_tables():
  """Each published experiment's table (docs/results/<name>/results.md) is on
  docs/experiments.md, as its results.json holds it."""
  from configs.experiments import EXPERIMENTS

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "experiments.md")) as f:
    page = f.read()
  for name in EXPERIMENTS:
    folder = os.path.join(root, "docs", "results", name)
    if os.path.exists(os.path.join(folder, "results.md")):
      with open(os.path.join(folder, "results.md")) as f:
        table = f.read().strip()
      with open(os.path.join(folder, "results.json")) as f:
        assert json.load(f)["table"].strip() == table, name
      assert table in page, f"docs/experiments.md lacks the table of {name}"
