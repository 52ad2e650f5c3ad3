"""The README's one-line figures are those of their committed results files under docs/results/:
each test reads a file, formats its numbers as the README writes them and checks the README says
so. A re-run that publishes new results fails here until the README is brought up to date. And
every test the docs name by `file::name` exists. Reads files only."""

import glob
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def _results(*path: str) -> dict:
  with open(os.path.join(ROOT, "docs", "results", *path)) as f:
    return json.load(f)


def _readme(section: str) -> str:
  """The README's section under `## <section>`, its whitespace collapsed (lines wrap anywhere)."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  assert f"\n## {section}\n" in text, f"README.md has no section {section!r}"
  body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
  return " ".join(body.split())


def _mean_sd(stat: dict) -> str:
  return f"{stat['mean']:.3f} +- {stat['sd']:.3f}"


def _minutes(seconds: float) -> str:
  seconds = round(seconds)
  return f"{seconds // 60}m{seconds % 60:02d}s"


def test_the_model_size_line_is_the_model_size_results():
  summary = _results("model-size", "results.json")["summary"]
  main, big = summary["3x128"], summary["6x256"]
  table = _results("pipeline_10_seeds", "after.json")["summary"]
  line = _readme("More, one line each")
  assert (f"a {big['params'] / main['params']:.1f}x student reaches "
          f"{_mean_sd(big['dapo']['pass@1'])} after DAPO against "
          f"{_mean_sd(main['dapo']['pass@1'])} for the main job's size in the same run") in line
  # the main job's own row there is an older run of it: the README names today's figure too
  assert (f"the table above has {table['dapo']['pass@1']['mean']:.3f} over "
          f"{len(table['dapo']['pass@1']['values'])} seeds") in line
  assert f"the teacher's {big['teacher']['pass@1']['mean']:.3f}" in line
  middle = summary["4x192"]
  assert (f"a {middle['params'] / main['params']:.1f}x student matches the main job "
          f"({_mean_sd(middle['dapo']['pass@1'])})") in line


def test_the_model_size_seed_table_is_the_model_size_results():
  """docs/experiments.md's per-seed, per-family rows of the larger sizes, and where the widest
  one's numbers from nowhere come from."""
  results = _results("model-size", "results.json")["results"]
  with open(os.path.join(ROOT, "docs", "experiments.md")) as f:
    page = f.read()
  for name in ("4x192", "6x256"):
    for seed, row in results[name].items():
      for system in ("sft", "dapo"):
        m = row[system]
        head = f"{name.replace('x', ' x ')}, {seed}" if system == "sft" else ""
        families = m["pass@1_by_family"]
        cells = [m["pass@1"], families["arithmetic"], families["lookup"], families["mixed"],
                 m["pass@3"]]
        line = (f"| {head} | {system.upper()} | " + " | ".join(f"{v:.3f}" for v in cells) +
                f" | {m['copy_exact']:.3f} / {m['call_exact']:.3f} / {m['question_exact']:.3f} | "
                f"{m['invented_numbers']['all']:.3f} / {m['invented_numbers']['mixed']:.3f} |")
        assert line.replace("|  |", "| |") in page, line
  origins = {seed: models["sft"]["origins"]
             for seed, models in _results("model-size", "diagnosis_6x256.json").items()}
  text = " ".join(page.split())
  for seed in ("0", "2"):
    o = origins[seed]
    assert (f"{o['near_seen']:.3f} ({round(o['near_seen'] * o['numbers'])} of {o['numbers']}, "
            f"seed {seed})") in text
  assert (f"{origins['0']['in_training']:.3f} and {origins['2']['in_training']:.3f} of them are "
          f"numbers of the training trajectories, against "
          f"{origins['0']['in_training_by_chance']:.3f} and "
          f"{origins['2']['in_training_by_chance']:.3f}") in text


def test_the_main_results_paragraph_is_the_ten_seed_results():
  """The README's sentences under the main table: the worst seed and task family after DAPO,
  each family's mean before and after DAPO, and the earlier recipe's mean on the same seeds."""
  after = _results("pipeline_10_seeds", "after.json")
  before = _results("pipeline_10_seeds", "before.json")["summary"]["dapo"]["pass@1"]
  dapo = {seed: rows["dapo"] for seed, rows in after["per_seed"].items()}
  worst = min(dapo, key=lambda seed: dapo[seed]["pass@1"])
  family, seed = min(((family, seed) for seed in dapo for family in dapo[seed]["pass@1_by_family"]),
                     key=lambda item: dapo[item[1]]["pass@1_by_family"][item[0]])
  means = after["pass@1_by_family"]
  text = _readme("Main result")
  assert (f"After DAPO every seed scores at least {dapo[worst]['pass@1']:.3f} (seed {worst}) and "
          f"every task family at least {dapo[seed]['pass@1_by_family'][family]:.3f} on every "
          f"seed ({family}, seed {seed})") in text
  assert "DAPO raises each family's mean over SFT (" + ", ".join(
      f"{name} {means['sft'][name]:.3f} -> {means['dapo'][name]:.3f}"
      for name in sorted(means["dapo"])) + ")" in text
  assert all(means["dapo"][name] > means["sft"][name] for name in means["dapo"])
  assert f"scored {_mean_sd(before)} on the same seeds" in text


def test_the_near_miss_rl_line_is_the_near_miss_rl_results():
  results = _results("near-miss-rl", "results.json")
  summary = results["summary"]
  last = str(max(int(update) for update in summary["dapo"]))
  best = max(cell[last]["pass@1"]["mean"] for cell in summary.values())
  teacher = _results("pipeline_distractors", "results.json")["summary"]["teacher"]["pass@1"]
  levers = len(summary) - 2  # every cell but plain DAPO and `all`, the levers together
  assert set(summary) >= {"dapo", "all"}
  assert (f"{NUMBERS[levers]} levers for DAPO, alone and together, end at {best:.3f} at best "
          f"over {len(results['seeds'])} seeds against the teacher's {teacher['mean']:.3f}"
          ) in _readme("More, one line each")


def test_the_sql_line_is_the_worked_examples_results():
  results = _results("pipeline_sql", "results.json")
  summary = results["summary"]
  assert (f"goes from {_mean_sd(summary['sft']['pass@1'])} after SFT to "
          f"{_mean_sd(summary['dapo']['pass@1'])} after DAPO over {len(results['seeds'])} seeds"
          ) in _readme("More, one line each")


def test_the_pod_fit_line_is_the_pod_fit_report():
  report = _results("pod_fit.json")
  shipped = {os.path.basename(path)[:-3]
             for path in glob.glob(os.path.join(ROOT, "configs", "*_qwen2_5_*.py"))}
  assert set(report) == shipped  # "every shipped TPU and GPU preset"
  assert all(program["fits"] for config in report.values() for program in config.values())
  sft_7b = report["sft_qwen2_5_7b"]["train"]
  assert (f"SFT 7B on {sft_7b['topology']} at {round(100 * sft_7b['implied_mfu'])}% "
          f"XLA-estimated MFU") in _readme("More, one line each")


def test_the_gpu_line_is_the_h200_decode_results():
  (row,) = _results("gpu_h200", "decode_b16.json")["decode"]
  assert (f"1.5B decode at batch {row['batch']} on the H200: {row['ours_tokens_per_s']:,.0f} "
          f"tok/s, {row['ratio']:.2f}x HF `generate`, {row['ours_of_roofline']:.1%} of the HBM "
          f"roofline") in _readme("More, one line each")


def test_the_quick_starts_times_are_the_timing_file():
  timing = _results("pipeline_time", "results.json")
  text = " ".join(_readme("Quick start").split())
  install = timing["install"]
  assert (f"{install['lean_venv_bytes'] / 1e9:.1f} GB from a warm pip cache in "
          f"{round(install['lean_install_seconds_at_most'])} s") in text
  today = timing["todays_recipe"]
  earlier = [timing[key]["after"] for key in ("attention_backward", "ninth_session")]
  assert f"took {_minutes(today['recipe']['make_pipeline_wall_s'])} on a day" in text
  assert (f"took {_minutes(today['earlier_recipe']['make_pipeline_wall_s'])} there against "
          f"{_minutes(earlier[0]['make_pipeline_wall_s'])} and "
          f"{_minutes(earlier[1]['make_pipeline_wall_s'])} two days") in text
  ratio = today["ratio"]["make_pipeline"]
  usual = today["at_the_2026_11_28_speed"]["make_pipeline_wall_s"]
  assert usual == [round(ratio * run["make_pipeline_wall_s"], 1) for run in earlier]
  assert (f"costs {ratio:.2f}x the earlier one's, about {_minutes(usual[0])} and "
          f"{_minutes(usual[1])} at the usual speed") in text


def test_every_test_the_docs_name_exists():
  """`tests/FILE.py::NAME` in the README and docs/ (the reliability table names one a row)."""
  named = []
  for doc in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
    with open(doc) as f:
      named += [(doc, *m) for m in re.findall(r"(test_\w+\.py)::(\w+)", f.read())]
  missing = []
  for doc, file, name in named:
    path = os.path.join(ROOT, "tests", file)
    if not os.path.isfile(path) or not re.search(rf"^def {name}\(", open(path).read(), re.M):
      missing.append(f"{os.path.relpath(doc, ROOT)}: {file}::{name}")
  assert named and not missing, missing
