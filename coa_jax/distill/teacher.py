"""The teacher multi-agent system whose traces are distilled: agents passing messages through an
orchestrator, calling real tools.

Roles: a planner, tool agents (search, crawl, code), a thinker, a reflector, a verifier (a
double check with a 1-4 score) and an answerer. The orchestrator keeps the shared board
(question, plan, facts), routes each activation's input messages to an agent and records the
activation: its input and output messages, the tool call and result, and the tokens exchanged.
A `Trace` is that record; `coa_jax.distill` turns it into a CoA trajectory.

`chat_teacher.ChatTeacher` runs every role on a model behind an OpenAI-compatible endpoint
(role prompts; a controller model picks the next agent), for real tasks against a real server.
`ScriptedTeacher` is the offline policy for the embedded world (`coa_jax.world`): it reads the
question's structure from its wording, looks every fact up with the tools and computes with
the code tool. It is imperfect on purpose, at configurable rates: a vague (misspelled) first
query, a misread number that the verifier catches and the reflector corrects, and a skipped
verification that lets a misread answer through, so traces contain reflection and re-planning
as real ones do and some are wrong. Like a large model, it can also do an arithmetic task in its
head: right every time for the teacher, a guess for a small student that imitates it, so the
student's choice between mental arithmetic and the code tool is one that RL can improve.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
from typing import Any, Callable

import numpy as np

from coa_jax.data import coa_format
from coa_jax.data import world as world_lib
from tools_env.base import import_object
from tools_env.registry import ToolRegistry, TrajectoryTools

_RESULT_RE = re.compile(r"^\d+\. \[(.+?)\]\((\S+?)\)", re.MULTILINE)
_NUMBER_RE = re.compile(r"-?\d+")
# The sentence giving each attribute on an entity's page (see world.Entity.page), the value its
# group. Names hold no period: a linked entity's name runs to the end of its sentence.
_FACT_RE = {attr: rf"The {noun} of [^.]+? is ([^.]+)\." for attr, noun in world_lib.NOUNS.items()}
_FACT_RE["country"] = r"[^.\n]+ is a city in the country of ([^.]+)\."


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """How often the scripted teacher errs (each a probability per task)."""

  seed: int = 0
  vague_query_rate: float = 0.3  # the first search misspells the entity's name
  misread_rate: float = 0.2  # a number read off a page is wrong; the verifier catches it
  skip_verify_rate: float = 0.1  # the answer is given without a double check
  mental_math_rate: float = 0.0  # an arithmetic task is computed in the head, not with code
  # The thinker quotes each fact read off a page. Off, the next step reads the page itself: a
  # tiny model copies a value right after the page more reliably than through a quote.
  quote_facts: bool = True
  # A user's teacher policy for tasks of their own (`HookTeacher`): the import path of
  # hook(task, run: TeacherRun, **hook_options), which acts through `run` (the rates above are
  # its to use). Empty: the scripted teacher of the embedded world.
  hook: str = ""
  hook_options: Any = None

  def __post_init__(self):
    for name in ("vague_query_rate", "misread_rate", "skip_verify_rate", "mental_math_rate"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"teacher.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclasses.dataclass
class Message:
  sender: str
  recipient: str
  content: str


@dataclasses.dataclass
class Activation:
  """One agent's turn: what it was sent, what it said, the tool call it made and its result."""

  agent: str
  step: str  # the CoA tag this turn becomes
  inputs: list[Message]
  output: Message
  tool_call: str | None = None
  tool_result: str | None = None
  tool_ok: bool = True

  @property
  def tokens(self) -> int:
    """Returns the whitespace tokens exchanged: inputs, output and tool result."""
    texts = [m.content for m in self.inputs] + [self.output.content, self.tool_result or ""]
    return sum(len(t.split()) for t in texts)


@dataclasses.dataclass
class Trace:
  """A multi-agent run on one task."""

  task_id: str
  question: str
  activations: list[Activation] = dataclasses.field(default_factory=list)
  answer: str | None = None
  mistakes: list[str] = dataclasses.field(default_factory=list)  # injected, by kind
  task_data: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def tokens(self) -> int:
    return sum(a.tokens for a in self.activations)

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "tokens": self.tokens}

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> "Trace":
    """Returns the trace `to_json` wrote (distillation's traces.jsonl)."""
    fields = {k: v for k, v in record.items() if k != "tokens"}
    fields["activations"] = [
        Activation(**{**a, "inputs": [Message(**m) for m in a["inputs"]],
                      "output": Message(**a["output"])}) for a in record["activations"]]
    return cls(**fields)


def to_trajectory(trace: Trace, system_prompt: str) -> coa_format.Trajectory:
  """Returns the CoA trajectory of a trace: one step per activation, plus observations."""
  steps = []
  for activation in trace.activations:
    steps.append(coa_format.Step(activation.step, activation.output.content))
    if activation.tool_call is not None:
      steps.append(coa_format.Step(coa_format.OBSERVATION, activation.tool_result or ""))
  metadata = {"task_id": trace.task_id, "mistakes": list(trace.mistakes),
              "teacher_tokens": trace.tokens, "agents": len(trace.activations),
              **{k: v for k, v in trace.task_data.items() if k != "program"}}
  return coa_format.Trajectory(system_prompt, trace.question, tuple(steps), metadata)


class TeacherError(RuntimeError):
  """The scripted teacher could not read the question or a page (not a world question)."""


def _template_re(template: str) -> re.Pattern:
  return re.compile("^" + re.escape(template).replace(re.escape("{x}"), "(.+)") + "$")


_QUESTION_RES = [(key, _template_re(t)) for key, t in world_lib.QUESTIONS.items()]
_RELATION_RES = [(key, _template_re(phrase)) for key, (_, phrase) in world_lib.RELATIONS.items()]
_NOUN_RES = [(key, _template_re(t)) for key, t in world_lib.NUMERIC_NOUNS.items()]
_MIXED_RE = re.compile(r"^What is (.+) \*(\d+)\?$")  # world_lib.times
_ARITHMETIC_RE = re.compile(r"^What is ([\d\s()+*-]+)\?$")


def read_question(question: str) -> dict[str, Any]:
  """Returns the plan a world question asks for: {"name", "path": [attributes], "multiplier"}
  for look-ups (and mixed ones), or {"expression"} for arithmetic. Raises TeacherError."""
  text = question.removeprefix("Question:").strip()
  arithmetic = _ARITHMETIC_RE.match(text)
  if arithmetic:
    return {"expression": arithmetic.group(1).strip()}
  mixed = _MIXED_RE.match(text)
  multiplier, matchers = None, _QUESTION_RES
  if mixed:
    text, multiplier, matchers = mixed.group(1), int(mixed.group(2)), _NOUN_RES
  text = text[0].lower() + text[1:] if mixed else text
  for key, pattern in matchers:
    found = pattern.match(text)
    if found:
      description, path = found.group(1), [key[1]]
      break
  else:
    raise TeacherError(f"not a question of the embedded world: {question!r}")
  while True:  # peel "the city where X was born" -> X, innermost first in the path
    for key, pattern in _RELATION_RES:
      found = pattern.match(description)
      if found:
        description = found.group(1)
        path.insert(0, key[1])
        break
    else:
      return {"name": description, "path": path, "multiplier": multiplier}


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(expression: str) -> int:
  """Returns the value of an arithmetic question's expression (integers, + - *, parentheses)."""
  def value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](value(node.left), value(node.right))
    raise TeacherError(f"not an arithmetic expression: {expression!r}")
  try:
    return value(ast.parse(expression, mode="eval").body)
  except SyntaxError:
    raise TeacherError(f"not an arithmetic expression: {expression!r}") from None


class ScriptedTeacher:
  """The offline multi-agent policy for the embedded world; `run(task)` returns its Trace."""

  AGENTS = ("planner", "search_agent", "crawl_agent", "code_agent", "thinker", "reflector",
            "verifier", "answerer")

  def __init__(self, tools: ToolRegistry, config: TeacherConfig = TeacherConfig()):
    self.tools, self.config = tools, config

  def run(self, task: dict[str, Any]) -> Trace:
    """Solves one task record ({"id", "question", "metadata"}) with real tool calls."""
    run = _task_run(_Run, self.config, self.tools, task)
    run.solve()
    return run.trace


class HookTeacher:
  """A user's teacher policy (`TeacherConfig.hook`) for tasks of their own: `run(task)` calls
  hook(task, run, **hook_options) on a fresh TeacherRun and returns its Trace; a hook that
  gives no answer step fails the task (TeacherError)."""

  def __init__(self, tools: ToolRegistry, config: TeacherConfig):
    self.tools, self.config = tools, config
    self.hook = import_object(config.hook, "teacher.hook")
    if not callable(self.hook):
      raise ValueError(f"teacher.hook: {config.hook!r} is not callable")

  def run(self, task: dict[str, Any]) -> Trace:
    run = _task_run(TeacherRun, self.config, self.tools, task)
    self.hook(task, run, **dict(self.config.hook_options or {}))
    if run.trace.answer is None:
      raise TeacherError(f"teacher.hook {self.config.hook!r} gave task {task['id']} no answer")
    return run.trace


def build_teacher(tools: ToolRegistry, config: TeacherConfig) -> ScriptedTeacher | HookTeacher:
  """Returns the teacher a config names: its hook's, else the embedded world's scripted one."""
  return HookTeacher(tools, config) if config.hook else ScriptedTeacher(tools, config)


class TeacherRun:
  """The orchestrator of one task: the board, the message routing and the recorded trace. A
  teacher policy acts through it: `act` records an agent's turn and runs its tool call;
  `chance(rate)` draws from the task's own generator `rng`; `config` holds the rates."""

  def __init__(self, config: TeacherConfig, trace: Trace, tools: TrajectoryTools, rng):
    self.config, self.trace, self.tools, self.rng = config, trace, tools, rng
    self.board: list[Message] = [Message("user", "planner", trace.question)]

  def chance(self, rate: float) -> bool:
    """Returns True with probability `rate`."""
    return bool(self.rng.random() < rate)

  def act(self, agent: str, step: str, content: str, tool_call: str | None = None,
          inputs: int = 2) -> Activation:
    """Records `agent`'s turn (its last `inputs` board messages in, `content` out) and runs
    its tool call, if any, with the tool of the tag `step`; the result is posted back to the
    board (and is the activation's `tool_result`). An `answer` step sets the trace's answer."""
    out = Message(agent, "orchestrator", content)
    activation = Activation(agent, step, list(self.board[-inputs:]), out, tool_call)
    if tool_call is not None:
      result = self.tools.call(step, tool_call)
      activation.tool_result, activation.tool_ok = result.observation, result.ok
      self.board.append(Message(step, agent, result.observation))
    self.board.append(out)
    self.trace.activations.append(activation)
    if step == "answer":
      self.trace.answer = content
    return activation


def _task_run(cls: type, config: TeacherConfig, tools: ToolRegistry,
              task: dict[str, Any]) -> Any:
  """Returns the run (a `cls`, a TeacherRun) of one task record ({"id", "question",
  "metadata"}), its generator seeded by the teacher's seed and the task."""
  question = task["question"]
  index = int(re.sub(r"\D", "", str(task["id"])) or 0)
  rng = np.random.default_rng([config.seed, index, len(question)])
  return cls(config, Trace(str(task["id"]), question, task_data=dict(task.get("metadata", {}))),
             TrajectoryTools(tools, goal=question), rng)


class _Run(TeacherRun):
  """The scripted teacher's run: the world policy over the orchestrator."""

  def __init__(self, *args: Any):
    super().__init__(*args)
    self.pages: dict[str, str] = {}  # entity name -> its crawled page, reused within the task

  # --- the policy --------------------------------------------------------------------------

  def solve(self) -> None:
    self.plan = plan = read_question(self.trace.question)
    if "expression" in plan:
      expression = plan["expression"]
      # Drawn only when on, so the other draws (and existing traces) do not depend on it.
      mental = bool(self.config.mental_math_rate) and self.chance(self.config.mental_math_rate)
      self.act("planner", "plan", f"1. Compute {expression} "
                                  f"{'in my head' if mental else 'with code'}.\n"
                                  f"2. Double-check the result and answer.")
      if mental:
        self.trace.mistakes.append("mental_arithmetic")
        value = _evaluate(expression)
        self.act("thinker", "think", f"{expression} = {value}.")
        check = lambda: (True, "Computed again in my head: the same result.")
      else:
        value, check = self.compute(expression), self.compute_check
      self.conclude(str(value), check)
      return
    subjects = [plan["name"]] + [f"the result of step {i}" for i in range(1, len(plan["path"]))]
    steps = [f"{i}. Find the {world_lib.NOUNS[attr]} of {subject}." for i, (attr, subject) in
             enumerate(zip(plan["path"], subjects), 1)]
    if plan["multiplier"]:
      product = world_lib.times("it", plan["multiplier"])
      steps.append(f"{len(steps) + 1}. Compute {product} with code.")
    self.act("planner", "plan", "\n".join(steps + [f"{len(steps) + 1}. Double-check and "
                                                     f"answer."]))
    name, page = plan["name"], ""
    for position, attr in enumerate(plan["path"]):
      page = self.page_of(name, attr)
      final = position == len(plan["path"]) - 1
      value, sentence = self.read(page, attr,
                                  misread=final and self.chance(self.config.misread_rate))
      if self.config.quote_facts:
        self.act("thinker", "think", f"The page says: {sentence}")
      name = value
    answer = name
    if plan["multiplier"]:
      answer = str(self.compute(world_lib.times(name, plan["multiplier"])))
    truth = lambda: self.read(page, plan["path"][-1])[0]
    self.conclude(answer, lambda: self.fact_check(page, plan, answer, truth()))

  def page_of(self, name: str, attr: str) -> str:
    """Searches for the `attr` of `name` (the name misspelled first, sometimes) and crawls the
    page of `name`, unless a crawl already read the fact."""
    if re.search(_FACT_RE[attr], self.pages.get(name, "")):
      self.act("thinker", "think", f"The page of {name} was already read above.")
      return self.pages[name]
    asking = f"{world_lib.NOUNS[attr]} of "
    query = exact = asking + name
    if self.chance(self.config.vague_query_rate):
      query = asking + " ".join(word[:-1] for word in name.split())
      self.trace.mistakes.append("vague_query")
    while True:
      results = self.act("search_agent", "web_search", query, tool_call=query).tool_result
      urls = {title: url for title, url in _RESULT_RE.findall(results or "")}
      if name in urls:
        break
      if query == exact:
        raise TeacherError(f"search does not find {name!r}")
      self.act("reflector", "reflection",
               f"The results do not list {name}: the query {query!r} was wrong. I will search "
               f"for the exact name.")
      query = exact
    crawl = self.act("crawl_agent", "crawl_page", urls[name], tool_call=urls[name])
    self.pages[name] = crawl.tool_result or ""
    return self.pages[name]

  def read(self, page: str, attr: str, misread: bool = False) -> tuple[str, str]:
    """Returns (the `attr` value on `page`, the page's sentence stating it with that value)."""
    found = re.search(_FACT_RE[attr], page)
    if not found:
      raise TeacherError(f"the page does not give the {attr}: {page[:200]!r}")
    value, sentence = found.group(1), found.group(0)
    if misread and value.isdigit() and len(value) > 1:
      self.trace.mistakes.append("misread")
      wrong = value[:-2] + value[-1] + value[-2] if value[-1] != value[-2] else value + "0"
      return wrong, sentence[:found.start(1) - found.start()] + wrong + "."
    return value, sentence

  def compute(self, expression: str) -> int:
    # The operands follow " = " as they follow a word in the question, so they tokenize alike.
    program = f"```python\nresult = {expression}\nprint(result)\n```"
    result = self.act("code_agent", "code", program, tool_call=program).tool_result or ""
    numbers = _NUMBER_RE.findall(result)
    if not numbers:
      raise TeacherError(f"the code tool returned no number: {result!r}")
    return int(numbers[0])

  @staticmethod
  def compute_check() -> tuple[bool, str]:
    return True, "The code ran without error and printed the suggested answer."

  def fact_check(self, page: str, plan: dict[str, Any], answer: str,
                 truth: str) -> tuple[bool, str]:
    """Re-reads the last page; returns (consistent, the verifier's explanation)."""
    expected = truth
    if plan["multiplier"]:
      expected = str(int(truth) * plan["multiplier"])
    if expected == answer:
      return True, f"The page states {truth}, as used."
    return False, f"The page states {truth}, not the value used; {answer} is wrong."

  def conclude(self, answer: str, check: Callable[[], tuple[bool, str]]) -> None:
    """Suggests the answer, has the verifier double-check it (unless skipped), corrects it
    through the reflector if the check fails, and answers."""
    if self.chance(self.config.skip_verify_rate):
      self.trace.mistakes.append("skipped_verification")
      self.act("thinker", "think", f"The answer is {answer}.")
    else:
      self.act("thinker", "suggested_answer", answer)
      consistent, reason = check()
      if not consistent:
        self.act("verifier", "double_check", f"{reason} Score: 1")
        answer = self._recover()
        self.act("reflector", "reflection",
                 f"I misread a number on the page; the corrected answer is {answer}.")
        self.act("thinker", "suggested_answer", answer)
        consistent, reason = True, f"The corrected value {answer} matches the page."
      self.act("verifier", "double_check", f"{reason} Score: 4")
    self.act("answerer", "answer", answer)

  def _recover(self) -> str:
    """Returns the answer recomputed from the page text already on the board."""
    plan = self.plan
    page = next(a.tool_result for a in reversed(self.trace.activations)
                if a.step == "crawl_page")
    value = self.read(page or "", plan["path"][-1])[0]
    if plan["multiplier"]:
      return str(self.compute(world_lib.times(value, plan["multiplier"])))
    return value


# --- the chat-model teacher ------------------------------------------------------------------

# Each agent of the chat teacher: the CoA step it writes and its role prompt.
