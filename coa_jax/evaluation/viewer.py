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
finish reason, and its turns step by step: role and tool tags, tool calls, observations
(shaded: masked from the loss) and the answer. Filters (family, outcome, tool, finish reason,
seed, a search over questions and texts) and the page number are read from and written to the
URL's fragment, e.g. `trajectories.html#outcome=wrong&tool=code&page=2`. No server and no
network: CSS, JS and data are inline. The data is JSON (no NaN: non-finite numbers are null),
gzip-compressed and base64-encoded (`embed`), which the browser decompresses itself; the page
then builds only the tasks of its current page (PAGE_TASKS), each sample folded to its summary
but the first that matches the filters in each column, and a sample's steps or tokens when it
is unfolded: a run of 10,000 samples made a 346 KB page that chromium showed in 0.3-0.8 s.

A page is never replaced by one that knows less: a task whose question or gold answer neither
the task file nor the run's files name keeps the one the run's page already shows, and
`write_page` refuses (`PoorerPage`) to replace a page it cannot read with one that lacks
questions.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import math
import os
import re
from typing import Any, Callable, Iterable, Sequence

from coa_jax.data import coa_format
from coa_jax.data.tasks import load_tasks
from coa_jax.rl.job import ROLLOUTS

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


def render(data: dict[str, Any]) -> str:
  """Returns the page's HTML for `page_data`'s data."""
  parts = {"TITLE": html.escape(data["title"]), "CSS": _CSS, "JS": _JS, "DATA": embed(data)}
  return re.sub(r"\$(TITLE|CSS|JS|DATA)", lambda m: parts[m.group(1)], _HTML)


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


# --- the page --------------------------------------------------------------------------------

_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>$TITLE</title>
<style>$CSS</style></head>
<body>
<header><h1>$TITLE</h1>
<div id="filters">
<label>family <select id="family"></select></label>
<label>outcome <select id="outcome"><option value="">any</option>
<option value="correct">correct</option><option value="wrong">wrong</option></select></label>
<label>tool <select id="tool"></select></label>
<label>finish <select id="finish"></select></label>
<label id="seed-box">seed <select id="seed"></select></label>
<label id="colour-box">colour tokens by <select id="colour"><option value="">- (steps)</option>
<option value="logp">log-prob</option><option value="adv">advantage</option>
<option value="ver">policy version</option></select></label>
<input id="q" type="search" placeholder="search questions and texts">
<span id="count">reading the samples...</span>
<span id="pager"><button id="previous" type="button">&lsaquo; previous</button>
<label>page <select id="page"></select></label> <span id="pages"></span>
<button id="next" type="button">next &rsaquo;</button></span>
</div>
<div id="legend">A task is shown when one of its samples matches every filter; samples that do
not are faded, and each column unfolds its first sample that does (click a summary to unfold
another). Observations are shaded: the environment wrote them, and they are masked from the
loss. <b id="scale"></b></div>
</header>
<main id="tasks"></main>
<script type="application/gzip" id="data">$DATA</script>
<script>$JS</script>
</body></html>
"""

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2330; }
header { position: sticky; top: 0; background: #fff; padding: 8px 16px;
  border-bottom: 1px solid #ccd; z-index: 1; }
h1 { font-size: 18px; margin: 0 0 6px; }
#filters { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; }
#filters select, #q, #pager button { font: inherit; }
#q { min-width: 220px; }
#count { font-weight: 600; }
#legend { color: #667; font-size: 12px; margin-top: 4px; }
main { padding: 12px 16px; }
.task { background: #fff; border: 1px solid #ccd; border-radius: 6px; margin-bottom: 14px;
  padding: 10px 12px; }
[hidden] { display: none !important; }
.question { font-weight: 600; white-space: pre-wrap; }
.meta { color: #556; font-size: 12px; margin: 2px 0 8px; }
.gold { background: #fff3c4; padding: 0 4px; border-radius: 3px; }
.cols { display: grid; gap: 10px; grid-auto-flow: column; grid-auto-columns: minmax(340px, 1fr);
  overflow-x: auto; }
.col h3 { font-size: 13px; margin: 0 0 4px; color: #334; }
.sample { border: 1px solid #dde; border-left: 4px solid #c33; border-radius: 4px;
  margin-bottom: 6px; padding: 2px 6px; }
.sample.ok { border-left-color: #2a8a4a; }
.sample.dim { opacity: 0.35; }
.sample summary { cursor: pointer; font-size: 12px; }
.verdict { font-weight: 700; color: #c33; }
.ok .verdict { color: #2a8a4a; }
.step { margin: 4px 0; }
.tag { display: inline-block; font: 11px monospace; padding: 0 5px; border-radius: 3px;
  background: #e3e7f3; color: #334; }
.step.tool .tag { background: #d9ecff; color: #0b4f8a; }
.step.observation { background: #eceef1; border-left: 3px solid #aab; padding: 2px 6px; }
.step.observation .tag { background: #bbc; color: #222; }
.step.text .tag { background: #fde2e2; color: #922; }
.step.role-answer { background: #e9f7ee; }
pre { margin: 2px 0 0; white-space: pre-wrap; word-break: break-word; font: 12px/1.35 monospace; }
.tokens { font: 12px/1.6 monospace; white-space: pre-wrap; word-break: break-word; }
.tokens .masked { background: #e4e6ea; color: #777; }
"""

_JS = r"""
const FILTERS = ["family", "outcome", "tool", "finish", "seed", "q", "colour"];
const $ = (id) => document.getElementById(id);
let DATA, PAGE_TASKS, page = 1, shownBodies = [];
const RANGE = {adv: 0, ver: [Infinity, -Infinity]};

/** Returns the page's data: base64 of gzip-compressed JSON, decompressed by the browser. */
async function load() {
  const script = $("data");
  const binary = atob(script.textContent.trim());
  script.remove();  // its text is the page's largest part, and is read once
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

/** Returns a new element with a class and text. */
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** Fills a select with "any" and the sorted distinct values; hides its label with none. */
function fill(id, values) {
  const select = $(id);
  select.append(new Option("any", ""));
  const distinct = [...new Set(values)].filter((v) => v !== "").sort();
  distinct.forEach((v) => select.append(new Option(v, v)));
  if (select.options.length < 2) select.parentElement.hidden = true;
}

/** Returns a number with 3 decimals, or "not finite" for null (NaN or infinity in the run). */
const fixed = (x) => x === null ? "not finite" : x.toFixed(3);

/** Returns a sample's one-line summary. */
function summary(s) {
  const tools = Object.entries(s.tools).map(([k, n]) => `${k} x${n}`).join(", ") || "no tool";
  const parts = [s.correct ? "correct" : "wrong"];
  if (s.reward !== undefined) parts.push(`reward ${fixed(s.reward)}`);
  if (s.adv !== undefined && s.adv !== null) parts.push(`advantage ${fixed(s.adv)}`);
  parts.push(`answer: ${s.answer === null ? "none" : JSON.stringify(s.answer)}`,
             `finish: ${s.finish}`, `${s.tokens} tokens`, tools);
  if (s.errors) parts.push(`${s.errors} format errors`);
  return parts;
}

/** Returns a token's background for the colouring `by` (null: none). */
function shade(s, i, by) {
  const t = s.tok;
  if (!t.mask[i]) return null;
  if (by === "logp") {
    return t.logp[i] === null ? "#b0b" : `rgba(220, 50, 40, ${Math.min(1, -t.logp[i] / 5)})`;
  }
  if (by === "adv") {
    const a = s.adv || 0, alpha = Math.min(1, Math.abs(a) / (RANGE.adv || 1));
    return a >= 0 ? `rgba(40, 160, 80, ${alpha})` : `rgba(220, 50, 40, ${alpha})`;
  }
  const [low, high] = RANGE.ver;
  const x = high > low ? (t.ver[i] - low) / (high - low) : 0;
  return `hsl(${210 - 180 * x}, 75%, 80%)`;
}

/** Returns the response's tokens coloured by `by`; masked tokens are grey. */
function tokenView(s, by) {
  const box = el("div", "tokens");
  s.tok.text.forEach((text, i) => {
    const span = el("span", s.tok.mask[i] ? "" : "masked", text);
    const colour = shade(s, i, by);
    if (colour) span.style.background = colour;
    const logp = s.tok.logp[i] === null ? "not finite" : s.tok.logp[i];
    span.title = s.tok.mask[i] ? `log-prob ${logp}, version ${s.tok.ver[i]}` :
      `version ${s.tok.ver[i]}, masked from the loss`;
    box.append(span);
  });
  return box;
}

/** Returns the response's steps, each with its tag; observations labelled as masked. */
function stepView(s) {
  const box = el("div", "steps");
  for (const [kind, tag, text] of s.steps) {
    const step = el("div", `step ${kind} ${kind}-${tag}`);
    const label = kind === "tool" ? `tool call: ${tag}` : kind === "observation" ?
      "observation (masked from the loss)" : kind === "text" ? "text outside any step" : tag;
    step.append(el("span", "tag", label), el("pre", "", text));
    box.append(step);
  }
  return box;
}

const SCALES = {logp: "Sampled tokens: white at log-prob 0 to red at -5 or below.",
  adv: "Sampled tokens: green for a positive advantage, red for a negative one, darker larger.",
  ver: "Sampled tokens: blue for the oldest policy version to orange for the newest."};

/** Fills a sample's body: its steps, or its tokens when colouring. */
function renderBody(s, body) {
  const by = $("colour").value;
  body.replaceChildren(by && s.tok ? tokenView(s, by) : stepView(s));
}

/** Renders (again) the bodies of the page's unfolded samples, and says the colour scale. */
function renderBodies() {
  const by = $("colour").value;
  $("scale").textContent = by ? SCALES[by] + " Grey tokens are masked from the loss." : "";
  for (const [s, body] of shownBodies) renderBody(s, body);
}

/** Keeps the filters and the page in the URL's fragment. */
function remember() {
  const state = FILTERS.filter((k) => $(k).value).map((k) => [k, $(k).value]);
  if (page > 1) state.push(["page", page]);
  const params = new URLSearchParams(state);
  history.replaceState(null, "", params.toString() ? "#" + params : location.pathname);
}

/** Returns a sample folded to its summary, unfolded (its body built) when `open`; a folded
 * one builds its body when first unfolded. */
function sampleView(s, open, dim) {
  const node = el("details", `sample ${s.correct ? "ok" : "bad"}${dim ? " dim" : ""}`);
  const head = el("summary");
  const [verdict, ...rest] = summary(s);
  head.append(el("span", "verdict", verdict), " · " + rest.join(" · "));
  const body = el("div");
  node.append(head, body);
  let built = false;
  const build = () => {
    if (built) return;
    built = true;
    shownBodies.push([s, body]);
    renderBody(s, body);
  };
  if (open) {
    node.open = true;
    build();
  }
  node.addEventListener("toggle", () => { if (node.open) build(); });
  return node;
}

/** Returns the tools a sample called, or ["(none)"]. */
const toolsOf = (s) => Object.keys(s.tools).length ? Object.keys(s.tools) : ["(none)"];

/** Returns a sample's text for the search, lower-cased (computed once). */
function searchText(s) {
  if (s.search === undefined) s.search = s.steps.map((x) => x[2]).join("\n").toLowerCase();
  return s.search;
}

/** Returns whether a sample matches the outcome, tool, finish and search filters. */
function matches(s, f, t) {
  if (f.outcome && (f.outcome === "correct") !== s.correct) return false;
  if (f.tool && !toolsOf(s).includes(f.tool)) return false;
  if (f.finish && s.finish !== f.finish) return false;
  if (!f.q) return true;
  if (t.lower === undefined) t.lower = t.question.toLowerCase();
  return t.lower.includes(f.q) || searchText(s).includes(f.q);
}

/** Returns whether a column is shown under the seed filter. */
const columnShown = (column, f) => !f.seed || column.seed === "" || column.seed === f.seed;

/** Returns whether a task is shown: its family matches and a shown column has a sample that
 * matches. */
function taskShown(t, f) {
  if (f.family && t.family !== f.family) return false;
  return DATA.columns.some((column, c) => columnShown(column, f) &&
    t.cells[c].some((s) => matches(s, f, t)));
}

/** Returns a task's section: the question, the gold answer and a column per shown column. */
function taskView(t, f) {
  const node = el("section", "task");
  node.append(el("div", "question", t.question || "(question not found)"));
  const meta = el("div", "meta", `${t.id}${t.family ? " · " + t.family : ""} · gold answer: `);
  meta.append(el("span", "gold", t.gold || "?"));
  const cols = el("div", "cols");
  DATA.columns.forEach((column, c) => {
    if (!columnShown(column, f)) return;
    const col = el("div", "col");
    const right = t.cells[c].filter((s) => s.correct).length;
    col.append(el("h3", "", `${column.name}: ${right} of ${t.cells[c].length} correct`));
    let unfolded = false;
    for (const s of t.cells[c]) {
      const ok = matches(s, f, t);
      col.append(sampleView(s, ok && !unfolded, !ok));
      unfolded = unfolded || ok;
    }
    cols.append(col);
  });
  node.append(meta, cols);
  return node;
}

/** Shows the tasks that match the filters (PAGE_TASKS of them: page `page`), counts them, and
 * keeps the filters and the page in the URL's fragment. */
function apply() {
  const f = Object.fromEntries(FILTERS.map((k) => [k, $(k).value]));
  f.q = f.q.trim().toLowerCase();
  const shown = DATA.tasks.filter((t) => taskShown(t, f));
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_TASKS));
  page = Math.min(Math.max(1, page), pages);
  shownBodies = [];
  const first = (page - 1) * PAGE_TASKS;
  $("tasks").replaceChildren(...shown.slice(first, first + PAGE_TASKS).map((t) => taskView(t, f)));
  $("count").textContent = `${shown.length} of ${DATA.tasks.length} tasks shown`;
  $("count").dataset.shown = shown.length;
  const select = $("page");
  select.replaceChildren(...Array.from({length: pages}, (_, i) => new Option(i + 1, i + 1)));
  select.value = page;
  $("pages").textContent = `of ${pages}`;
  $("previous").disabled = page === 1;
  $("next").disabled = page === pages;
  $("pager").hidden = pages === 1;
  remember();
}

/** Goes to page `n` and scrolls to its top. */
function go(n) {
  page = n;
  apply();
  window.scrollTo(0, 0);
}

/** Reads the data, fills the filters, and shows the first page (or the URL's). */
async function main() {
  try {
    DATA = await load();
  } catch (e) {
    $("count").textContent = `This page's data could not be read (${e}): it needs a browser ` +
      "that decompresses gzip itself (DecompressionStream: Chrome, Edge, Firefox, Safari of " +
      "2023 or later).";
    return;
  }
  PAGE_TASKS = DATA.page_tasks;
  const samples = DATA.tasks.flatMap((t) => t.cells.flat());
  const tokens = samples.filter((s) => s.tok);
  for (const s of tokens) {
    RANGE.adv = Math.max(RANGE.adv, Math.abs(s.adv || 0));
    for (const v of s.tok.ver) RANGE.ver = [Math.min(RANGE.ver[0], v), Math.max(RANGE.ver[1], v)];
  }
  fill("family", DATA.tasks.map((t) => t.family));
  fill("tool", samples.flatMap(toolsOf));
  fill("finish", samples.map((s) => s.finish));
  fill("seed", DATA.columns.map((c) => c.seed));
  if ($("seed").options.length < 3) $("seed-box").hidden = true;
  if (!tokens.length) $("colour-box").hidden = true;
  const initial = new URLSearchParams(location.hash.slice(1) || location.search.slice(1));
  for (const k of FILTERS) if (initial.has(k)) $(k).value = initial.get(k);
  page = parseInt(initial.get("page"), 10) || 1;
  renderBodies();  // the colour scale (no body is built yet)
  apply();
  for (const k of FILTERS) {
    $(k).addEventListener("input", k === "colour" ? () => { renderBodies(); remember(); } :
      () => { page = 1; apply(); });
  }
  $("page").addEventListener("input", () => go(parseInt($("page").value, 10)));
  $("previous").addEventListener("click", () => go(page - 1));
  $("next").addEventListener("click", () => go(page + 1));
}

main();
"""
