"""The rewarder: `RewardSpec` maps each task's domain to a scorer, and `Rewarder` turns the
scorer's verdict into a `Reward` (the `correct` / `incorrect` values, minus a format penalty when
the response breaks the CoA format)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from coa_jax.data import coa_format
from coa_jax.data.rewards.answers import answer_of, error_text, ground_truth_of
from coa_jax.data.rewards.code_scorer import CodeScorer
from coa_jax.data.rewards.judge_scorer import JudgeClient, judge_reward
from coa_jax.data.rewards.math_scorer import math_reward
from coa_jax.data.rewards.python_scorer import PythonScorer, Response, tool_calls_of
from coa_jax.data.rewards.qa_scorer import QA_METRICS, qa_reward
from tools_env.base import import_object
from tools_env.remote import HttpLimits
from tools_env.sandbox import CodeSandbox, SandboxLimits, weakest

KINDS = ("math", "qa", "code", "judge", "python")

Scorer = Callable[[str, Mapping[str, Any]], tuple[float, dict[str, Any]]]


# --- format --------------------------------------------------------------------------------


def format_penalty(response_text: str, penalty: float,
                   tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS
                   ) -> tuple[float, dict[str, Any]]:
  """Returns (`penalty` if the response breaks the CoA format, else 0.0; details with the
  error count and kinds)."""
  _, errors = coa_format.parse_and_validate(response_text, True, tool_tags)
  return _penalty(errors, penalty)


def _penalty(errors: list[coa_format.FormatError], penalty: float
             ) -> tuple[float, dict[str, Any]]:
  kinds = sorted({error.kind for error in errors})
  return (penalty if errors else 0.0), {"format_errors": len(errors), "format_kinds": kinds}


# --- the rewarder --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reward:
  """A response's reward: the shaped score, whether the answer is correct, and why."""

  score: float
  correct: bool
  details: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Which scorer judges each domain, and how a verdict becomes a score.

  `domains`: {name: {"kind": one of KINDS, **options}}; options: qa `metric` ("em" or "f1");
  math `use_math_verify`; code `limits` (SandboxLimits fields), `isolation`, `workers`; judge
  `base_url`, `model`, `api_key_env`, `max_tokens`, `http` (HttpLimits fields), `prompt` (a
  format string with {question}, {gold} and {predicted}; default `JudgeClient.PROMPT`); python
  `function` (an import path: `function(response: Response, **options)` returns a score in
  [0, 1], or (score, details)) and `options`. `sources` maps a task's `data_source` (e.g.
  "hotpotqa") to a domain.
  """

  domains: Mapping[str, Mapping[str, Any]]
  default_domain: str
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
  correct: float = 1.0
  incorrect: float = -1.0
  format_penalty: float = 0.0  # subtracted when the response breaks the CoA format
  timeout_s: float = 10.0  # the math checker's wall-clock limit

  def __post_init__(self):
    if not self.domains:
      raise ValueError("rewards.domains is empty; give at least one {name: {'kind': ...}}")
    for name, config in self.domains.items():
      if config.get("kind") not in KINDS:
        raise ValueError(f"rewards.domains.{name}: unknown kind {config.get('kind')!r}; "
                         f"valid kinds: {', '.join(KINDS)}")
    for where, domain in [("default_domain", self.default_domain),
                          *((f"sources.{k}", v) for k, v in self.sources.items())]:
      if domain not in self.domains:
        raise ValueError(f"rewards.{where} = {domain!r} is not a domain; domains: "
                         f"{sorted(self.domains)}")
    if not self.timeout_s > 0:
      raise ValueError(f"rewards.timeout_s must be > 0, got {self.timeout_s!r}")
    if not self.format_penalty >= 0:
      raise ValueError(f"rewards.format_penalty must be >= 0, got {self.format_penalty!r}")
    if not self.correct > self.incorrect:
      raise ValueError(f"rewards.correct ({self.correct!r}) must exceed rewards.incorrect "
                       f"({self.incorrect!r})")

  @classmethod
  def from_dict(cls, spec: Mapping[str, Any]) -> RewardSpec:
    """Returns the spec a config mapping describes; raises ValueError on unknown fields."""
    fields = {field.name for field in dataclasses.fields(cls)}
    unknown = set(spec) - fields
    if unknown:
      raise ValueError(f"unknown rewards fields {sorted(unknown)}; expected some of "
                       f"{sorted(fields)}")
    if "default_domain" not in spec:
      raise ValueError("rewards.default_domain is missing")
    values = dict(spec)
    values["domains"] = {name: dict(config)
                         for name, config in dict(spec.get("domains") or {}).items()}
    values["sources"] = dict(spec.get("sources") or {})
    return cls(**values)



def _options(name: str, config: Mapping[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
  options = {key: value for key, value in config.items() if key != "kind"}
  unknown = set(options) - set(allowed)
  if unknown:
    raise ValueError(f"rewards.domains.{name} ({config['kind']}): unknown options "
                     f"{sorted(unknown)}; expected some of {list(allowed)}")
  return options


def _build_scorer(name: str, config: Mapping[str, Any], spec: RewardSpec) -> Scorer:
  """Returns the (answer, task_data) -> (score, details) function of one domain (a `python`
  domain's: a PythonScorer, called with the whole Response)."""
  kind = config["kind"]
  if kind == "math":
    use_mv = _options(name, config, ("use_math_verify",)).get("use_math_verify", True)
    return lambda answer, task: math_reward(answer, ground_truth_of(task), spec.timeout_s, use_mv)
  if kind == "qa":
    metric = _options(name, config, ("metric",)).get("metric", "em")
    if metric not in QA_METRICS:
      raise ValueError(f"rewards.domains.{name}.metric must be one of {QA_METRICS}, "
                       f"got {metric!r}")
    return lambda answer, task: qa_reward(answer, ground_truth_of(task), metric)
  if kind == "python":
    options = _options(name, config, ("function", "options"))
    if "function" not in options:
      raise ValueError(f"rewards.domains.{name} (python): `function` (an import path) is missing")
    function = import_object(str(options["function"]), f"rewards.domains.{name}.function")
    if not callable(function):
      raise ValueError(f"rewards.domains.{name}.function: {options['function']!r} is not callable")
    return PythonScorer(function, dict(options.get("options") or {}))
  try:
    if kind == "code":
      options = _options(name, config, ("limits", "isolation", "workers", "persistent"))
      # The tests compare what the program printed: its stderr (debug lines, warnings) apart.
      return CodeScorer(CodeSandbox(SandboxLimits(**dict(options.pop("limits", {}))),
                                    merge_stderr=False, **options))
    options = _options(name, config, ("base_url", "model", "api_key_env", "max_tokens", "http",
                                      "prompt"))
    if "http" in options:
      options["limits"] = HttpLimits(**dict(options.pop("http")))
    try:
      client = JudgeClient(**options)
    except ValueError as e:
      raise ValueError(f"rewards.domains.{name} (judge): {e}") from None
    return lambda answer, task: judge_reward(task.get("question", ""), answer,
                                             ground_truth_of(task), client)
  except TypeError as e:
    raise ValueError(f"rewards.domains.{name} ({kind}): {e}") from None



class Rewarder:
  """Scores a response against its task with the scorer of the task's domain. `tool_tags`: the
  declared tools' tags (the response is parsed with them)."""

  def __init__(self, spec: RewardSpec, tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS):
    self.spec, self.tool_tags = spec, tuple(tool_tags)
    self.scorers = {name: _build_scorer(name, config, spec)
                    for name, config in spec.domains.items()}

  def sandbox_isolation(self) -> str | None:
    """Returns the weakest isolation mode the code domains' sandboxes run programs under (None
    without a code domain)."""
    return weakest([scorer.sandbox.isolation for scorer in self.scorers.values()
                    if isinstance(scorer, CodeScorer)])

  def domain_of(self, task_data: Mapping[str, Any]) -> str:
    """Returns the task's domain: its `domain` or `data_source`, through `sources`, else the
    default domain."""
    name = task_data.get("domain") or task_data.get("data_source")
    if not isinstance(name, str):
      return self.spec.default_domain
    if name in self.spec.domains:
      return name
    return self.spec.sources.get(name, self.spec.default_domain)

  def __call__(self, response_text: str, task_data: Mapping[str, Any],
               response_tokens: int | None = None, sampled_tokens: int | None = None) -> Reward:
    """Returns the reward of a response; never raises. Token counts go to `python` domains."""
    spec = self.spec
    steps, errors = coa_format.parse_and_validate(response_text, True, self.tool_tags)
    penalty, details = _penalty(errors, spec.format_penalty)
    domain = self.domain_of(task_data)
    scorer = self.scorers[domain]
    answer = answer_of(steps)
    details.update(domain=domain, answer=answer)
    try:
      if isinstance(scorer, PythonScorer):
        value, found = scorer(Response(response_text, tuple(steps), answer, tool_calls_of(steps),
                                       task_data, response_tokens, sampled_tokens))
      elif answer is None:
        value, found = 0.0, {"error": "no final answer (no closed, non-empty <answer> step)"}
      else:
        value, found = scorer(answer, task_data)
    except Exception as e:  # noqa: BLE001 - a reward never raises
      value, found = 0.0, {"error": error_text(e)}
    score = spec.incorrect + value * (spec.correct - spec.incorrect) - penalty
    return Reward(score, value >= 1.0, {**details, **found})

  def check(self, tasks: Sequence[Any]) -> None:  # Tasks (coa_jax.data.tasks)
    """Raises ValueError before the first step when a task names a domain that is not one, or
    a `python` domain's function raises or returns a bad score on the first task of its domain
    (scored as an empty response)."""
    checked = set()
    for task in tasks:
      named = task.data.get("domain")
      if named is not None and named not in self.spec.domains and named not in self.spec.sources:
        raise ValueError(f"task {task.id}: domain {named!r} is not a rewards domain; domains: "
                         f"{sorted(self.spec.domains)}")
      domain = self.domain_of(task.data)
      scorer = self.scorers[domain]
      if isinstance(scorer, PythonScorer) and domain not in checked:
        checked.add(domain)
        try:
          scorer(Response("", (), None, (), task.data, 0, 0))
        except Exception as e:  # noqa: BLE001 - reported as a config error
          raise ValueError(f"rewards.domains.{domain}: the reward function fails on task "
                           f"{task.id} (an empty response): {error_text(e)}") from None


def build_rewarder(spec: Mapping[str, Any] | RewardSpec,
                   tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> Rewarder:
  """Returns the rewarder a config describes (see `RewardSpec`), parsing responses with the
  declared `tool_tags`; raises ValueError."""
  return Rewarder(spec if isinstance(spec, RewardSpec) else RewardSpec.from_dict(spec), tool_tags)
