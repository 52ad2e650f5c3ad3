"""The trajectory viewer: one self-contained HTML page per run, `trajectories.html`.

`write_page(run_dir)` reads a run directory of one of three kinds (`detect`):
- an evaluation's output_dir: samples.jsonl, with each task's question, gold answer and family
  from the task file (passed in, or the pipeline's held-out file found beside the run);
- an RL workdir: rollouts.jsonl (written by `coa_jax.rl.job` at the end of a run: the last
  step's scored groups, with each response's tokens, loss mask, sampler log-probs, policy
  versions and advantage), so that tokens can be coloured by any of them;
- a pipeline's output_dir: every evaluation side by side (eval_teacher, seed-N/eval_sft,
  seed-N/eval_dapo), one column each.

Responses are read with the tool tags the run recorded (an evaluation's metrics.json and an RL
run's rows hold `tool_tags`; a run from before they were recorded is read with the four CoA
tools), plus every tool a sample called.

Per task the page shows the question, the gold answer and each sample's outcome, reward (RL),
finish reason, and its turns step by step: role and tool tags, tool calls, observations (shaded:
masked from the loss) and the answer. Filters (family, outcome, tool, finish reason, seed, a
search over questions and texts) and the page number are read from and written to the URL's
fragment, e.g. `trajectories.html#outcome=wrong&tool=code&page=2`. No server and no network: CSS,
JS and data are inline (the page itself: assets/trajectories.html). The data is JSON (no NaN:
non-finite numbers are null), gzip-compressed and base64-encoded (`embed`), which the browser
decompresses itself; the page then builds only the tasks of its current page (PAGE_TASKS), each
sample folded to its summary but the first that matches the filters in each column, and a sample's
steps or tokens when it is unfolded: a run of 10,000 samples made a 346 KB page that chromium
showed in 0.3-0.8 s.

A page is never replaced by one that knows less: a task whose question or gold answer neither
the task file nor the run's files name keeps the one the run's page already shows, and
`write_page` refuses (`PoorerPage`) to replace a page it cannot read with one that lacks
questions.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import importlib.resources
import json
import math
import os
import re
from typing import Any, Callable, Iterable, Sequence

from coa_jax.data import coa_format
from coa_jax.data.tasks import load_tasks
from coa_jax.rl.rollout_log import ROLLOUTS

PAGE = "trajectories.html"
PAGE_TASKS = 20  # tasks the page shows at a time (its script reads it from the data)
STAGE_NAMES = {"eval_sft": "after SFT", "eval_dapo": "after DAPO", "eval_ppo": "after PPO"}


class PoorerPage(ValueError):
  """A page would replace one that shows questions or gold answers it lacks."""


# --- reading runs ----------------------------------------------------------------------------


def detect(run_dir: str) -> str:
  """Returns the kind of run in `run_dir`: "pipeline" (eval_teacher or seed-N/eval_* folders),
  "rl" (rollouts.jsonl) or "evaluation" (samples.jsonl); raises FileNotFoundError otherwise."""
  if _pipeline_columns(run_dir):
    return "pipeline"
  if os.path.isfile(os.path.join(run_dir, ROLLOUTS)):
    return "rl"
  if os.path.isfile(os.path.join(run_dir, "samples.jsonl")):
    return "evaluation"
  raise FileNotFoundError(f"{run_dir}: no samples.jsonl (evaluation), {ROLLOUTS} (RL run) or "
                          f"eval_* folders (pipeline)")


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  """Returns the rows of a JSONL file."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _pipeline_columns(run_dir: str) -> list[tuple[str, str, str]]:
  """Returns (column name, seed, folder) of each evaluation of a pipeline run: the teacher's,
  then every seed's in stage order (SFT before DAPO)."""
  columns = []
  if os.path.isfile(os.path.join(run_dir, "eval_teacher", "samples.jsonl")):
    columns.append(("teacher", "", os.path.join(run_dir, "eval_teacher")))
  seeds = [d for d in os.listdir(run_dir) if re.fullmatch(r"seed-\d+", d)] if os.path.isdir(
      run_dir) else []
  order = list(STAGE_NAMES)
  for seed in sorted(seeds, key=lambda d: int(d[5:])):
    stages = [d for d in os.listdir(os.path.join(run_dir, seed)) if d.startswith("eval_") and
              os.path.isfile(os.path.join(run_dir, seed, d, "samples.jsonl"))]
    for stage in sorted(stages, key=lambda s: (order.index(s) if s in order else len(order), s)):
      name = f"seed {seed[5:]} {STAGE_NAMES.get(stage, stage[5:])}"
      columns.append((name, seed[5:], os.path.join(run_dir, seed, stage)))
  return columns


def find_tasks(run_dir: str) -> str | None:
  """Returns the task file of an evaluation or pipeline run found beside it (a pipeline's
  held-out tasks, distill/world/heldout.jsonl, up to two folders up), or None."""
  for up in ("", "..", os.path.join("..", "..")):
    path = os.path.normpath(os.path.join(run_dir, up, "distill", "world", "heldout.jsonl"))
    if os.path.isfile(path):
      return path
  return None


def _task_info(path: str | None) -> dict[str, dict[str, str]]:
  """Returns each task's question, gold answer and family from a task file (none without)."""
  if not path:
    return {}
  return {task.id: {"question": task.question, "gold": _gold(task.data.get("ground_truth")),
                    "family": str(task.data.get("family", ""))}
          for task in load_tasks(path, require_answer=False)}


def _gold(value: Any) -> str:
  """Returns a gold answer as text (a list of accepted answers joined by " | ")."""
  if value is None:
    return ""
  if isinstance(value, (list, tuple)):
    return " | ".join(map(str, value))
  return value if isinstance(value, str) else json.dumps(value)


def recorded_tags(folder: str, rows: Sequence[dict[str, Any]]) -> tuple[str, ...] | None:
  """Returns the tool tags a run recorded: an RL run's rows' `tool_tags`, else its
  metrics.json's (an evaluation); None for a run from before they were recorded."""
  if rows and "tool_tags" in rows[0]:
    return tuple(rows[0]["tool_tags"])
  path = os.path.join(folder, "metrics.json")
  if os.path.isfile(path):
    with open(path) as f:
      metrics = json.load(f)
    if isinstance(metrics, dict) and "tool_tags" in metrics:
      return tuple(metrics["tool_tags"])
  return None


# --- a response as steps ---------------------------------------------------------------------


def tool_tags_of(samples: Iterable[dict[str, Any]],
                 recorded: Sequence[str] | None = None) -> tuple[str, ...]:
  """Returns the tool tags to read responses with: the run's `recorded` tags (None: the four
  CoA tools, for a run that recorded none) and every tool the samples called."""
  tags = list(coa_format.TOOL_TAGS if recorded is None else recorded)
  tags += [tag for s in samples for tag in s.get("tool_calls", {})]
  valid = [t for t in dict.fromkeys(tags) if coa_format.TOOL_TAG_RE.fullmatch(t) and
           t not in coa_format.ROLE_TAGS and t != coa_format.OBSERVATION]
  return tuple(valid)


def steps_of(text: str, tool_tags: Sequence[str]) -> list[list[str]]:
  """Returns the response as [kind, tag, content] steps, kind one of "role", "tool",
  "observation" or "text" (anything outside a step, so that nothing of the text is lost). A
  step runs from its tag to its first closing tag (or to the end, unclosed); tags inside it
  stay text, as in `coa_format.parse`."""
  tags = coa_format.ROLE_TAGS + tuple(tool_tags) + (coa_format.OBSERVATION,)
  opening = re.compile(r"<(" + "|".join(tags) + r")>")
  out, pos = [], 0
  while pos < len(text):
    match = opening.search(text, pos)
    stray = text[pos:match.start() if match else len(text)]
    if stray.strip():
      out.append(["text", "", stray.strip("\n")])
    if match is None:
      break
    tag = match.group(1)
    end = text.find(coa_format.closing(tag), match.end())
    body = text[match.end():end if end >= 0 else len(text)]
    kind = ("observation" if tag == coa_format.OBSERVATION else
            "role" if tag in coa_format.ROLE_TAGS else "tool")
    out.append([kind, tag, body.removeprefix("\n").removesuffix("\n")])
    pos = len(text) if end < 0 else end + len(coa_format.closing(tag))
  return out


def _sample(raw: dict[str, Any], tool_tags: Sequence[str]) -> dict[str, Any]:
  """Returns a sample of samples.jsonl or rollouts.jsonl as the page reads it."""
  sample = {"correct": bool(raw.get("correct")), "answer": raw.get("answer"),
            "finish": raw.get("finish_reason", ""), "tokens": raw.get("tokens", 0),
            "tools": raw.get("tool_calls", {}), "errors": raw.get("format_errors"),
            "steps": steps_of(raw.get("text", ""), tool_tags)}
  if raw.get("reward") is not None:
    sample["reward"] = raw["reward"]
  if "token_texts" in raw:
    sample["tok"] = {"text": raw["token_texts"], "mask": raw["loss_mask"],
                     "logp": raw["logprobs"], "ver": raw["versions"]}
    sample["adv"] = raw.get("advantage")
  return sample


# --- the page's data -------------------------------------------------------------------------


def page_data(run_dir: str, tasks: str | None = None) -> dict[str, Any]:
  """Returns the data the page embeds: its title and kind, its columns ({"name", "seed"}) and
  per task its id, question, gold answer, family and each column's samples. A task's question,
  gold answer and family come from the task file `tasks` (default: found beside the run,
  `find_tasks`), else from the run's rows (an RL run records them), else are blank."""
  kind = detect(run_dir)
  if kind == "pipeline":
    columns = _pipeline_columns(run_dir)
  else:
    columns = [("rollouts" if kind == "rl" else os.path.basename(os.path.abspath(run_dir)),
                "", run_dir)]
  rows = [_read_jsonl(os.path.join(folder, ROLLOUTS if kind == "rl" else "samples.jsonl"))
          for _, _, folder in columns]
  info = _task_info(tasks or (None if kind == "rl" else find_tasks(run_dir)))
  by_task: dict[str, dict[str, Any]] = {}
  for column, ((_, _, folder), part) in enumerate(zip(columns, rows)):
    tool_tags = tool_tags_of((s for r in part for s in r["samples"]), recorded_tags(folder, part))
    for row in part:
      task = by_task.setdefault(row["task_id"], {
          "id": row["task_id"], "cells": [[] for _ in columns],
          **info.get(row["task_id"], {"question": row.get("question", ""),
                                      "gold": _gold(row.get("gold")),
                                      "family": str(row.get("family", ""))})})
      task["cells"][column] += [_sample(s, tool_tags) for s in row["samples"]]
  order = {task_id: i for i, task_id in enumerate(info)}
  step = max([r["step"] for part in rows for r in part if "step" in r], default=None)
  what = {"pipeline": "held-out evaluations side by side", "evaluation": "evaluation samples",
          "rl": f"RL rollouts of step {step} (the run's last)"}[kind]
  title = f"{os.path.basename(os.path.abspath(run_dir))}: {what}"
  return {"title": title, "kind": kind, "page_tasks": PAGE_TASKS,
          "columns": [{"name": name, "seed": seed} for name, seed, _ in columns],
          "tasks": sorted(by_task.values(), key=lambda t: order.get(t["id"], len(order)))}


def finite(value: Any) -> Any:
  """Returns `value` (JSON-like) with every non-finite float (NaN, +-inf) replaced by None:
  JSON has no such numbers, and a browser's JSON.parse rejects Python's NaN."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {key: finite(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite(item) for item in value]
  return value


def embed(data: Any) -> str:
  """Returns `data` as the page embeds it: strict JSON (`finite`), gzip-compressed (evaluation
  samples shrank 15 to 27 times, measured), base64-encoded, so that no "<" can close or confuse its
  <script> element. `embedded` reads it back."""
  try:
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
  except ValueError:  # a NaN or an infinity somewhere: walk the data only then (seconds on RL)
    text = json.dumps(finite(data), allow_nan=False, separators=(",", ":"))
  return base64.b64encode(gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0)).decode(
      "ascii")


_DATA_RE = re.compile(r'<script type="application/(gzip|json)" id="data">(.*?)</script>', re.S)


def embedded(page: str) -> dict[str, Any]:
  """Returns the data a page's HTML embeds (this viewer's pages, and the earlier ones that
  embedded plain JSON); raises ValueError when it holds none."""
  match = _DATA_RE.search(page)
  if match is None:
    raise ValueError("no embedded data")
  text = match.group(2)
  if match.group(1) == "gzip":
    text = gzip.decompress(base64.b64decode(text)).decode("utf-8")
  return json.loads(text)


@functools.cache
def _template() -> str:
  """Returns the page (assets/trajectories.html: its HTML, style and script), $TITLE and $DATA
  to fill."""
  return (importlib.resources.files("coa_jax") / "assets" / PAGE).read_text(encoding="utf-8")


def render(data: dict[str, Any]) -> str:
  """Returns the page's HTML for `page_data`'s data."""
  parts = {"TITLE": html.escape(data["title"]), "DATA": embed(data)}
  return re.sub(r"\$(TITLE|DATA)", lambda m: parts[m.group(1)], _template())


def _shown_tasks(path: str) -> dict[str, dict[str, str]] | None:
  """Returns the question, gold answer and family per task id of the page at `path` ({}
  without one; None when it cannot be read)."""
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      data = embedded(f.read())
    return {t["id"]: {key: t.get(key) or "" for key in ("question", "gold", "family")}
            for t in data["tasks"]}
  except (ValueError, KeyError, TypeError, OSError):  # not a page of this viewer
    return None


def write_page(run_dir: str, tasks: str | None = None, out: str | None = None) -> str:
  """Writes the page of `run_dir` (an evaluation, RL or pipeline run, see `detect`) to `out`
  (default: trajectories.html in `run_dir`) with questions, gold answers and families from the
  task file `tasks` (`page_data`), and for the tasks it does not name, those the run's own page
  shows; returns its path. Raises PoorerPage, writing nothing, when the page would replace one
  that shows questions or gold answers it lacks (or one it cannot read, lacking questions)."""
  path = out or os.path.join(run_dir, PAGE)
  data = page_data(run_dir, tasks)
  blank = [t for t in data["tasks"] if not (t["question"] and t["gold"])]
  if blank:
    own = os.path.join(run_dir, PAGE)
    shown = _shown_tasks(own) or {}
    for task in blank:
      for key, value in shown.get(task["id"], {}).items():
        task[key] = task[key] or value
    replaced = _shown_tasks(path)
    lost = [t["id"] for t in blank if (not t["question"] if replaced is None else any(
        replaced.get(t["id"], {}).get(key) and not t[key] for key in ("question", "gold")))]
    if lost:
      raise PoorerPage(
          f"{path} not replaced: it shows questions or gold answers that this run's files lack "
          f"(task {lost[0]}{f' and {len(lost) - 1} more' if len(lost) > 1 else ''}); name "
          f"the task file (--tasks=<file>) or write the page elsewhere (--out=<file>)")
  text = render(data)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(temporary, path)
  return path


def logged(write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """Returns write(*args, **kwargs), or None when it raised, printing why: a job never stops
  for the viewer."""
  try:
    return write(*args, **kwargs)
  except Exception as e:  # noqa: BLE001 - the viewer is a by-product of the job
    print(f"trajectory viewer: {write.__name__} failed: {type(e).__name__}: {e}", flush=True)
    return None
