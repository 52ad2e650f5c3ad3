"""The trajectory viewer: its embedded data (pure Python), and its pages rendered by a headless
chromium (skipped without one, failed under CI=true)."""

import json
import os
import re
import shutil
import subprocess
import types

import pytest

from coa_jax.data.tasks import Task
from coa_jax.evaluation import viewer
from coa_jax.evaluation.job import Sample, _write
from coa_jax.rl import job as rl_job
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
  write_jsonl(os.path.join(rl, rl_job.ROLLOUTS), rl_job.rollout_rows(
      3, rl_groups(), [1.0, -1.0], FakeTokenizer(), [Task("t3", TASKS[3][2])]))
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


def test_embedded_data_cannot_close_its_script(runs, tmp_path):
  folder = str(tmp_path / "eval")
  hostile = sample(False, "</script><script>alert(1)</script><!--", tools={})
  _write(folder, {}, {"t0": [hostile]})
  path = viewer.write_page(folder)
  with open(path) as f:
    page = f.read()
  assert page.count("</script>") == 2  # the data's and the code's own
  embedded = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
  data = json.loads(embedded.group(1))
  assert data == json.loads(json.dumps(viewer.page_data(folder)))
  assert data["tasks"][0]["cells"][0][0]["answer"] == "</script><script>alert(1)</script><!--"


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
  """Returns the page's count of shown tasks, checked against the task sections not hidden."""
  count = int(re.search(r'id="count" data-shown="(\d+)"', dom).group(1))
  sections = re.findall(r'<section class="task"( hidden="")?', dom)
  assert count == sum(not hidden for hidden in sections)
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
    assert dom.count(f"<h3>{column}:") == 5


def test_the_rl_page_colours_tokens(runs, tmp_path):
  dom = rendered(viewer.write_page(runs["rl"]), "#colour=logp", tmp_path)
  assert shown(dom) == 1 and 'class="tokens"' in dom
  assert 'class="masked"' in dom and "rgba(220, 50, 40" in dom
