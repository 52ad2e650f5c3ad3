"""The trajectory viewer: its embedded data (pure Python), and its pages rendered by a headless
chromium (skipped without one, failed under CI=true)."""

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

from coa_jax.data import coa_format
from coa_jax.data.tasks import Task
from coa_jax.evaluation import viewer
from coa_jax.evaluation.job import Sample, _write
from coa_jax.rl import rollout_log
from coa_jax.rl.dynamic_sampling import ScoredGroup
from coa_jax.runtime.cache import write_jsonl
from coa_jax.rollout.tool_loop import RolloutRecord

TASKS = [("t0", "lookup", "Question: How many people live in Paris?", "2 million"),
         ("t1", "lookup", "Question: Which river flows through Rome?", "Tiber"),
         ("t2", "lookup", "Question: What is the capital of Peru?", "Lima"),
         ("t3", "arithmetic", "Question: What is 12 times 7?", "84"),
         ("t4", "arithmetic", "Question: What is 2 to the 10th?", "1024")]
SEARCH = ("<think>\nLook it up.\n</think>\n<wiki_search>\nParis population\n</wiki_search>\n"
          "<observation>\nParis has 2 million people.\n</observation>\n<answer>\n2 million\n"
          "</answer>")
CODE = ("<plan>\nCompute it.\n</plan>\n<code>\n```python\nprint(2 ** 10)\n```\n</code>\n"
        "<observation>\n1024\n</observation>\n<answer>\n1024\n</answer>")


def sample(correct, answer, text=None, tools=None, finish="answer"):
  """Returns a Sample answering `answer` (its text a plain answer unless given)."""
  return Sample(correct, answer, 20, tools or {}, 0, finish,
                text or f"<think>\nI know it.\n</think>\n<answer>\n{answer}\n</answer>")


def outcomes(fixed=False):
  """Returns 2 samples per task: t1 and t3 have wrong ones (t3 none with `fixed`)."""
  t3 = ([sample(True, "84")] * 2 if fixed else
        [sample(False, None, "<think>\n12 times 7 is", finish="length")] * 2)
  return {"t0": [sample(True, "2 million", SEARCH, {"wiki_search": 1})] * 2,
          "t1": [sample(True, "Tiber"), sample(False, "Po")],
          "t2": [sample(True, "Lima")] * 2, "t3": t3,
          "t4": [sample(True, "1024", CODE, {"code": 1}), sample(True, "1024")]}


def write_tasks(path):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    for task_id, family, question, gold in TASKS:
      f.write(json.dumps({"id": task_id, "question": question,
                          "metadata": {"ground_truth": gold, "family": family}}) + "\n")
  return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An evaluation folder (with its task file beside it), a pipeline folder (teacher, seed 0
  after SFT and after DAPO) and an RL workdir with rollouts.jsonl."""
  root = tmp_path_factory.mktemp("viewer")
  evaluation = str(root / "eval")
  tasks = write_tasks(str(root / "tasks.jsonl"))
  _write(evaluation, {"tasks": 5}, outcomes())
  pipeline = str(root / "pipeline")
  write_tasks(os.path.join(pipeline, "distill", "world", "heldout.jsonl"))
  for folder, fixed in (("eval_teacher", True), ("seed-0/eval_sft", False),
                        ("seed-0/eval_dapo", True)):
    _write(os.path.join(pipeline, folder), {}, outcomes(fixed))
  rl = str(root / "rl")
  write_jsonl(os.path.join(rl, rollout_log.ROLLOUTS), rollout_log.rollout_rows(
      3, rl_groups(), [1.0, -1.0], FakeTokenizer(), [Task("t3", TASKS[3][2])],
      coa_format.TOOL_TAGS))
  return {"evaluation": evaluation, "tasks": tasks, "pipeline": pipeline, "rl": rl}


class FakeTokenizer:
  """Ids 0..: the pieces below; decode joins them."""

  PIECES = ["<prompt>", "<think>", "\n", "12", " x", " 7", "</think>", "<answer>", "84",
            "</answer>", "<code>", "</code>", "<observation>", "</observation>", "48"]

  def __init__(self):
    self.backend = types.SimpleNamespace(decode_batch=lambda batch, skip_special_tokens: [
        self.decode(ids) for ids in batch])

  def decode(self, ids):
    return "".join(self.PIECES[i] for i in ids)


def rl_groups():
  """Returns one scored group of two samples, the first with a code call and observation
  tokens (masked) sampled by policy versions 2 and 3."""
  data = {"ground_truth": "84", "family": "arithmetic"}
  right = RolloutRecord("t3", 0, [], [], [], prompt_len=1, task_data=data)
  right.append([0])
  right.append([1, 3, 4, 5, 6], [-0.1, -2.0, -0.5, -0.2, -0.01], version=2)
  right.append([10, 2, 11], [-0.3, -0.3, -0.3], version=2)
  right.append([12, 8, 13], version=3)
  right.append([7, 8, 9], [-0.05, -0.02, -0.01], version=3)
  wrong = RolloutRecord("t3", 1, [], [], [], prompt_len=1, task_data=data)
  wrong.append([0])
  wrong.append([7, 14, 9], [-3.0, -4.0, -0.1], version=2)
  right.finish_reason = wrong.finish_reason = "answer"
  return [ScoredGroup("t3", [right, wrong], [1.0, 0.0], [True, False])]


# --- the data (no browser) -------------------------------------------------------------------


def test_steps_keep_every_part_of_a_response():
  steps = viewer.steps_of("junk\n" + SEARCH + "\n<answer>\nunclosed", ("wiki_search",))
  assert [s[:2] for s in steps] == [["text", ""], ["role", "think"], ["tool", "wiki_search"],
                                    ["observation", "observation"], ["role", "answer"],
                                    ["role", "answer"]]
  assert steps[2][2] == "Paris population" and steps[-1][2] == "unclosed"


def test_evaluation_data_has_tasks_families_and_golds(runs):
  assert viewer.detect(runs["evaluation"]) == "evaluation"
  data = viewer.page_data(runs["evaluation"], runs["tasks"])
  assert [t["id"] for t in data["tasks"]] == ["t0", "t1", "t2", "t3", "t4"]
  assert {t["family"] for t in data["tasks"]} == {"lookup", "arithmetic"}
  t0 = data["tasks"][0]
  assert t0["question"] == TASKS[0][2] and t0["gold"] == "2 million"
  assert len(t0["cells"]) == 1 and len(t0["cells"][0]) == 2
  assert t0["cells"][0][0]["tools"] == {"wiki_search": 1}
  assert ["observation", "observation", "Paris has 2 million people."] in t0["cells"][0][0]["steps"]
  assert data["tasks"][3]["cells"][0][0]["finish"] == "length"


def test_pipeline_data_puts_evaluations_side_by_side(runs):
  assert viewer.detect(runs["pipeline"]) == "pipeline"
  data = viewer.page_data(runs["pipeline"])  # the held-out tasks found in distill/world
  assert [c["name"] for c in data["columns"]] == ["teacher", "seed 0 after SFT",
                                                   "seed 0 after DAPO"]
  t3 = data["tasks"][3]
  assert t3["question"] == TASKS[3][2]
  assert [[s["correct"] for s in cell] for cell in t3["cells"]] == [[True] * 2, [False] * 2,
                                                                    [True] * 2]


def test_rl_data_has_token_arrays_and_advantages(runs):
  assert viewer.detect(runs["rl"]) == "rl"
  data = viewer.page_data(runs["rl"])
  assert "step 3" in data["title"]
  (task,) = data["tasks"]
  assert task["question"] == TASKS[3][2] and task["gold"] == "84"
  right, wrong = task["cells"][0]
  assert (right["reward"], right["adv"], wrong["adv"]) == (1.0, 1.0, -1.0)
  assert right["tok"]["text"][:3] == ["<think>", "12", " x"]
  assert right["tok"]["mask"][8:11] == [0, 0, 0]  # the observation
  assert right["tok"]["ver"][8:11] == [3, 3, 3]
  assert [s[1] for s in right["steps"]] == ["think", "code", "observation", "answer"]


def test_rl_rows_record_the_tool_tags(runs):
  rows = viewer._read_jsonl(os.path.join(runs["rl"], rollout_log.ROLLOUTS))
  assert [row["tool_tags"] for row in rows] == [list(coa_format.TOOL_TAGS)]


def test_the_evaluation_records_its_tool_tags(tmp_path):
  from coa_jax.data import World, WorldConfig
  from coa_jax.evaluation import job as evaluation
  from configs import evaluate_tiny

  world = World(WorldConfig(seed=0, entities=4, train_tasks=0, heldout_tasks=2))
  paths = world.write(str(tmp_path / "world"))
  config = evaluate_tiny.get_config()
  config.system, config.k, config.tasks = "teacher", 1, paths["heldout"]
  config.tools = {"code": {"kind": "sandbox"}, "lookup": {"kind": "bm25",
                                                          "corpus_path": paths["corpus"]}}
  config.output_dir = str(tmp_path / "eval")
  evaluation.run(config)
  with open(tmp_path / "eval" / "metrics.json") as f:
    assert json.load(f)["tool_tags"] == ["code", "lookup"]


def read_embedded(path):
  """Returns the JSON text a page embeds (base64 of gzip), decoded but not parsed."""
  with open(path) as f:
    page = f.read()
  encoded = re.search(r'<script type="application/gzip" id="data">(.*?)</script>', page, re.S)
  return gzip.decompress(base64.b64decode(encoded.group(1))).decode()


def test_embedded_data_cannot_close_its_script(tmp_path):
  folder = str(tmp_path / "eval")
  hostile = sample(False, "</script><script>alert(1)</script><!--", tools={})
  _write(folder, {}, {"t0": [hostile]})
  path = viewer.write_page(folder)
  with open(path) as f:
    page = f.read()
  assert page.count("</script>") == 2  # the data's and the code's own
  data = viewer.embedded(page)
  assert data == json.loads(json.dumps(viewer.page_data(folder)))
  assert data["tasks"][0]["cells"][0][0]["answer"] == "</script><script>alert(1)</script><!--"


def nan_run(folder):
  """Writes an RL run whose sample has a NaN reward and an infinite log-prob (json.dumps writes
  them as NaN and -Infinity); returns the folder."""
  row = {"step": 1, "task_id": "t3", "question": TASKS[3][2], "gold": "84", "family": "",
         "tool_tags": list(coa_format.TOOL_TAGS),
         "samples": [{"correct": False, "reward": float("nan"), "finish_reason": "answer",
                      "tokens": 2, "tool_calls": {}, "text": "<answer>\n48\n</answer>",
                      "token_texts": ["<answer>", "48"], "loss_mask": [1, 1],
                      "logprobs": [-0.5, float("-inf")], "versions": [1, 1],
                      "advantage": float("nan")}]}
  write_jsonl(os.path.join(folder, rollout_log.ROLLOUTS), [row])
  return folder


def test_the_embedded_json_is_strict_non_finite_numbers_are_null(tmp_path):
  path = viewer.write_page(nan_run(str(tmp_path / "rl")))

  def reject(constant):
    raise ValueError(f"{constant} is not JSON")

  data = json.loads(read_embedded(path), parse_constant=reject)
  (s,) = data["tasks"][0]["cells"][0]
  assert (s["reward"], s["adv"], s["tok"]["logp"]) == (None, None, [-0.5, None])


def write_tool_run(folder, metrics):
  """Writes an evaluation that called no tool, whose response writes an MCP entry's name and
  an MCP tool's tag, beside a world whose tools.json declares the MCP entry "weather"."""
  text = ("<weather>\nParis\n</weather>\n<get_forecast>\nParis\n</get_forecast>\n"
          "<code>\nprint(1)\n</code>")
  _write(os.path.join(folder, "eval"), metrics, {"t0": [sample(False, None, text)]})
  os.makedirs(os.path.join(folder, "distill", "world"))
  with open(os.path.join(folder, "distill", "world", "tools.json"), "w") as f:
    json.dump({"weather": {"kind": "mcp", "command": ["weather-server"]}}, f)
  return os.path.join(folder, "eval")


def test_responses_are_read_with_the_tags_the_run_recorded(tmp_path):
  folder = write_tool_run(str(tmp_path), {"tool_tags": ["get_forecast"]})
  (s,) = viewer.page_data(folder)["tasks"][0]["cells"][0]
  assert [step[:2] for step in s["steps"]] == [["text", ""], ["tool", "get_forecast"],
                                               ["text", ""]]


def test_a_run_without_recorded_tags_is_read_with_the_coa_tools(tmp_path):
  folder = write_tool_run(str(tmp_path), {})
  (s,) = viewer.page_data(folder)["tasks"][0]["cells"][0]
  assert [step[:2] for step in s["steps"]] == [["text", ""], ["tool", "code"]]


def test_a_page_written_again_keeps_the_questions_the_run_has_no_file_for(runs, tmp_path):
  folder = str(tmp_path / "eval")
  _write(folder, {}, outcomes())
  viewer.write_page(folder, tasks=runs["tasks"])  # as the evaluation job does
  viewer.write_page(folder)  # as `make view RUN=...` does: no task file beside the run
  with open(os.path.join(folder, viewer.PAGE)) as f:
    t3 = viewer.embedded(f.read())["tasks"][3]
  assert (t3["question"], t3["gold"], t3["family"]) == (TASKS[3][2], "84", "arithmetic")


def test_a_page_it_cannot_read_is_not_replaced_by_one_without_questions(tmp_path):
  folder = str(tmp_path / "eval")
  _write(folder, {}, outcomes())
  path = os.path.join(folder, viewer.PAGE)
  with open(path, "w") as f:
    f.write("<html>a page written by hand</html>")
  with pytest.raises(viewer.PoorerPage, match="not replaced.*task t0 and 4 more.*--tasks"):
    viewer.write_page(folder)
  with open(path) as f:
    assert f.read() == "<html>a page written by hand</html>"


def test_view_without_a_run_prints_its_usage(tmp_path):
  out = subprocess.run([sys.executable, "experiments/view.py", "--run="], capture_output=True,
                       text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert "make view RUN=runs/pipeline_tiny" in out.stderr
  assert out.stderr.endswith("name a run directory: --run=<dir> (make view RUN=<dir>)\n")


def test_a_failing_page_is_printed_not_raised(tmp_path, capsys):
  assert viewer.logged(viewer.write_page, str(tmp_path)) is None
  assert "trajectory viewer: write_page failed" in capsys.readouterr().out


# --- the pages in a browser ------------------------------------------------------------------


def chromium():
  """Returns the chromium binary; skips without one, fails under CI (CI=true), which must never
  pass with the pages untested."""
  binary = shutil.which("chromium") or shutil.which("chromium-browser")
  if binary:
    return binary
  reason = "chromium is not installed (make install installs it as root with apt-get)"
  if os.environ.get("CI") == "true":
    pytest.fail(f"CI=true, and {reason}")
  pytest.skip(reason)


def rendered(path, fragment, profile):
  """Returns the DOM of the page at `path` with `fragment` in its URL, after its script ran."""
  out = subprocess.run(
      [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
       "--virtual-time-budget=2000", "--dump-dom", f"file://{os.path.abspath(path)}{fragment}"],
      capture_output=True, text=True, timeout=60, check=True)
  return out.stdout


def shown(dom):
  """Returns the page's count of shown tasks, checked against the task sections of its first
  page (at most PAGE_TASKS)."""
  count = int(re.search(r'id="count" data-shown="(\d+)"', dom).group(1))
  assert dom.count('<section class="task">') == min(count, viewer.PAGE_TASKS)
  return count


def test_the_evaluation_page_counts_and_filters_from_the_url(runs, tmp_path):
  path = viewer.write_page(runs["evaluation"], tasks=runs["tasks"])
  for fragment, count in (("", 5), ("#outcome=wrong", 2), ("#family=arithmetic", 2),
                          ("#tool=code", 1), ("#finish=length", 1), ("#q=paris", 1)):
    dom = rendered(path, fragment, tmp_path)
    assert shown(dom) == count, fragment
  assert "observation (masked from the loss)" in dom and "tool call: wiki_search" in dom


def test_the_pipeline_page_has_both_columns(runs, tmp_path):
  dom = rendered(viewer.write_page(runs["pipeline"]), "#outcome=wrong", tmp_path)
  assert shown(dom) == 2  # t1 and t3 after SFT
  for column in ("teacher", "seed 0 after SFT", "seed 0 after DAPO"):
    assert dom.count(f"<h3>{column}:") == 2


def test_the_rl_page_colours_tokens(runs, tmp_path):
  dom = rendered(viewer.write_page(runs["rl"]), "#colour=logp", tmp_path)
  assert shown(dom) == 1 and 'class="tokens"' in dom
  assert 'class="masked"' in dom and "rgba(220, 50, 40" in dom


def test_a_page_with_non_finite_numbers_renders(tmp_path):
  dom = rendered(viewer.write_page(nan_run(str(tmp_path / "rl"))), "", tmp_path / "profile")
  assert shown(dom) == 1 and "reward not finite" in dom


def big_task(i):
  """Returns task i of the big run: (id, question, gold, the 8 samples' texts)."""
  question = f"Question: What is the population of City {i} times {i % 7 + 2}?"
  texts = []
  for j in range(8):
    population = (i * 7919 + j * 104729) % 900000 + 1000
    texts.append(
        f"<plan>\n1. Find the population of City {i}.\n2. Multiply it with code.\n</plan>\n"
        f"<web_search>\npopulation of City {i}\n</web_search>\n<observation>\n1. [City {i}]"
        f"(https://kb.world/city/city-{i})\nThe population of City {i} is {population}.\n"
        f"</observation>\n<code>\n```python\nprint({population} * {i % 7 + 2})\n```\n</code>\n"
        f"<observation>\n{population * (i % 7 + 2)}\n</observation>\n<answer>\n"
        f"{population * (i % 7 + 2)}\n</answer>")
  return f"big-{i}", question, str((i * 7919 % 900000 + 1000) * (i % 7 + 2)), texts


@pytest.fixture(scope="module")
def big(tmp_path_factory):
  """An evaluation of 1,250 tasks x 8 samples (10,000) with its task file; returns the page's
  path and samples.jsonl's size."""
  root = tmp_path_factory.mktemp("big")
  folder, outcomes_by_task = str(root / "eval"), {}
  with open(root / "tasks.jsonl", "w") as f:
    for i in range(1250):
      task_id, question, gold, texts = big_task(i)
      f.write(json.dumps({"id": task_id, "question": question,
                          "metadata": {"ground_truth": gold}}) + "\n")
      outcomes_by_task[task_id] = [
          sample(j == 0, gold, text, {"web_search": 1, "code": 1}) for j, text in enumerate(texts)]
  _write(folder, {}, outcomes_by_task)
  path = viewer.write_page(folder, tasks=str(root / "tasks.jsonl"))
  return path, os.path.getsize(os.path.join(folder, "samples.jsonl"))


def test_a_run_of_10000_samples_opens_on_its_first_page(big, tmp_path):
  path, samples_bytes = big
  assert samples_bytes > 5_000_000 and os.path.getsize(path) < samples_bytes / 10
  dom = rendered(path, "", tmp_path)
  assert shown(dom) == 1250 and dom.count('<details class="sample') == 20 * 8
  assert "Question: What is the population of City 0 times 2?" in dom
  assert "tool call: web_search" in dom and "print(105729 * 2)" not in dom  # folded: sample 1
  assert "print(1000 * 2)" in dom  # unfolded: task 0's first sample
  assert len(dom) < 200_000


def test_a_run_of_10000_samples_opens_on_the_page_its_url_names(big, tmp_path):
  dom = rendered(big[0], "#page=63", tmp_path)
  assert 'id="count" data-shown="1250"' in dom and dom.count('<section class="task">') == 10
  assert "Question: What is the population of City 1240 times 3?" in dom
