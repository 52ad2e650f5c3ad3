"""An embedded task world: a fictional knowledge base, its document corpus, and tasks that need
tools. Everything is generated deterministically from a seed, with no internet and no
pretrained weights.

The knowledge base has cities, people and companies with numeric or named attributes and
links between them (a person's birthplace and employer, a company's headquarters and CEO, a
city's mayor). Each entity is one page of the corpus, one sentence per fact ("The founding year
of City 5230 is 1773."), served by the embedded search (whose short snippets rarely hold the
fact) and crawl tools. The crawl keeps the sentences sharing the most words with the agent's
last query (`tools_env.search.focus`), as the reference's crawl condenses a page toward the
goal. Task families:

- `lookup`: a fact some hops away ("What is the population of the city where the CEO of
  Norvale Works was born?"; `hops` weighs 1, 2, 3, ... hops, any number of them);
- `arithmetic`: a computation a small model cannot do in its head (needs `code`);
- `mixed`: facts looked up, then computed with ("What is the population of Tunim *24?").

The train and held-out splits are two disjoint sets of entities (links stay inside a split),
so held-out answers can only come from the tools. Difficulty: the hop mix, the family mix, the
operands' digits, the names: made-up words ("Druthae Holdings"), or a kind and a number
("Company 4172"), which a small model copies from page to query as easily as any number, and
near-miss figures on the pages ("The population of the province of City 5230 is 48213.").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from coa_jax.runtime.cache import write_json, write_jsonl

SPLITS = ("train", "heldout")
KINDS = ("city", "person", "company")
URL = "https://kb.world/{kind}/{slug}"

# Entity-valued attributes: (kind, attribute) -> (target kind, a noun phrase for "that entity").
RELATIONS = {
    ("person", "birthplace"): ("city", "the city where {x} was born"),
    ("person", "employer"): ("company", "the company that {x} works for"),
    ("company", "headquarters"): ("city", "the city where {x} is headquartered"),
    ("company", "ceo"): ("person", "the CEO of {x}"),
    ("city", "mayor"): ("person", "the mayor of {x}"),
}
# The question asking for each attribute of an entity described by {x}.
QUESTIONS = {
    ("city", "population"): "What is the population of {x}?",
    ("city", "founded"): "In which year was {x} founded?",
    ("city", "country"): "In which country is {x}?",
    ("person", "born"): "In which year was {x} born?",
    ("company", "founded"): "In which year was {x} founded?",
    ("company", "employees"): "How many employees does {x} have?",
    ("person", "birthplace"): "In which city was {x} born?",
    ("person", "employer"): "Which company does {x} work for?",
    ("company", "headquarters"): "In which city is {x} headquartered?",
    ("company", "ceo"): "Who is the CEO of {x}?",
    ("city", "mayor"): "Who is the mayor of {x}?",
}
# How plans, queries and notes name each attribute.
NOUNS = {"population": "population", "founded": "founding year", "born": "birth year",
         "employees": "number of employees", "country": "country", "mayor": "mayor",
         "birthplace": "birthplace", "employer": "employer", "headquarters": "headquarters",
         "ceo": "CEO"}
# The facts each kind's page states in "The <noun> of <name> is <value>." sentences, in order
# (a city's country is in its first sentence).
FIELDS = {"city": ("founded", "population", "mayor"), "person": ("born", "birthplace", "employer"),
          "company": ("founded", "headquarters", "ceo", "employees")}
NUMERIC = {("city", "population"), ("city", "founded"), ("person", "born"),
           ("company", "founded"), ("company", "employees")}
# How each numeric attribute is named inside a mixed question ("the population of {x}").
NUMERIC_NOUNS = {("city", "population"): "the population of {x}",
                 ("city", "founded"): "the founding year of {x}",
                 ("person", "born"): "the birth year of {x}",
                 ("company", "founded"): "the founding year of {x}",
                 ("company", "employees"): "the number of employees of {x}"}


def times(x: object, k: int) -> str:
  """Returns how a mixed task writes `x` times `k`, alike in its question, in the teacher's
  plan and in the code: "*k" with no space. The default tokenizer makes the space before a
  number a token of its own, so in "* k" the factor followed " *", " " (the two tokens before
  every operand of an arithmetic question) and finding it took a two-token match, which some
  seeds never formed (one wrote a random factor in 166 of 171 mixed samples); after " *" the
  factor is found by the token just before it (issue 19)."""
  return f"{x} *{k}"


_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "th",
           "v", "z", "qu", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "th", "x")
_COUNTRIES = ("Ardenia", "Belvost", "Corrin", "Daluvia", "Estmere", "Falkreth", "Gorvania",
              "Hesperion")
_COMPANY_SUFFIXES = ("Works", "Labs", "Foundry", "Holdings", "Systems", "Mills")
_PROFESSIONS = ("engineer", "chemist", "architect", "teacher", "pilot", "economist",
                "botanist", "surveyor")
# Near-miss figures (`WorldConfig.distractors`): a page may state a numeric attribute of a thing
# named after its entity as well, in the sentence form of the entity's own fact.
NEAR = {"city": "the province of {x}", "person": "the father of {x}",
        "company": "the parent company of {x}"}
_RANGES = {("city", "population"): (12_000, 950_000), ("city", "founded"): (1100, 1950),
           ("person", "born"): (1935, 2001), ("company", "founded"): (1850, 2015),
           ("company", "employees"): (40, 90_000)}


@dataclasses.dataclass(frozen=True)
class WorldConfig:
  """How big and how hard the world is."""

  seed: int = 0
  entities: int = 24  # per kind and split
  train_tasks: int = 1000
  heldout_tasks: int = 200
  families: tuple[tuple[str, float], ...] = (("lookup", 0.5), ("arithmetic", 0.25),
                                             ("mixed", 0.25))
  hops: tuple[float, ...] = (0.4, 0.4, 0.2)  # chance of 1, 2, 3, ... hops in lookup tasks
  digits: int = 3  # digits of the arithmetic operands
  search_results: int = 3  # results per search (1: the agent must find the page in one try)
  names: str = "words"  # "words" (made-up words) or "numbers" (a kind and a 4-digit number)
  # The chance that a page states, beside a numeric fact, the same attribute of a near-miss
  # thing ("The population of the province of City 5230 is 48213."), before or after the
  # entity's own sentence at even odds: a reader has to tell which figure the question asks for.
  # Drawn from a generator of its own, so the entities and tasks are those of the world without.
  distractors: float = 0.0

  def __post_init__(self):
    names = {name for name, _ in self.families}
    if not names <= {"lookup", "arithmetic", "mixed"} or not names:
      raise ValueError(f"world.families {self.families}: names must be among lookup, "
                       f"arithmetic, mixed")
    if any(w < 0 for _, w in self.families) or sum(w for _, w in self.families) <= 0:
      raise ValueError(f"world.families weights must be >= 0 and not all 0: {self.families}")
    if not self.hops or any(w < 0 for w in self.hops) or sum(self.hops) <= 0:
      raise ValueError(f"world.hops must give non-negative weights (of 1, 2, ... hops), not "
                       f"all 0, got {self.hops}")
    if self.names not in ("words", "numbers"):
      raise ValueError(f"world.names={self.names!r}: expected 'words' or 'numbers'")
    if not 0 <= self.distractors <= 1:
      raise ValueError(f"world.distractors must be in [0, 1], got {self.distractors}")
    if self.names == "numbers" and 6 * self.entities > 9000:
      raise ValueError(f"world.names='numbers' has 9000 numbers for {6 * self.entities} "
                       f"entities; use at most 1500 entities per kind")
    if (self.entities < 2 or self.digits < 1 or self.search_results < 1 or
        min(self.train_tasks, self.heldout_tasks) < 0):
      raise ValueError("world.entities must be >= 2, world.digits >= 1, "
                       "world.search_results >= 1, task counts >= 0")


@dataclasses.dataclass
class Entity:
  """One knowledge-base entity: its attributes hold numbers, strings or linked entities' names."""

  kind: str
  name: str
  split: str
  attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
  # attribute -> (a near-miss figure, whether its sentence comes before the entity's own)
  near: dict[str, tuple[int, bool]] = dataclasses.field(default_factory=dict)

  @property
  def slug(self) -> str:
    return self.name.lower().replace(" ", "-")

  @property
  def url(self) -> str:
    return URL.format(kind=self.kind, slug=self.slug)

  def page(self) -> str:
    """Returns the entity's page text: one sentence per fact, naming the attribute as plans and
    queries do (`NOUNS`), so a crawl focused on a query keeps the sentence it asks for."""
    a, n = self.attrs, self.name
    if self.kind == "city":
      intro = f"{n} is a city in the country of {a['country']}."
    elif self.kind == "person":
      intro = f"{n} is {'an' if a['profession'][0] in 'aeiou' else 'a'} {a['profession']}."
    else:
      intro = f"{n} is a company."
    sentences = [intro]
    for f in FIELDS[self.kind]:
      fact = f"The {NOUNS[f]} of {n} is {a[f]}."
      if f in self.near:
        value, first = self.near[f]
        other = f"The {NOUNS[f]} of {NEAR[self.kind].format(x=n)} is {value}."
        sentences += [other, fact] if first else [fact, other]
      else:
        sentences.append(fact)
    return " ".join(sentences)


class World:
  """The generated knowledge base, corpus and tasks of one WorldConfig."""

  def __init__(self, config: WorldConfig):
    self.config = config
    self.rng = np.random.default_rng(config.seed)
    self._used: set[str] = set()
    self.entities = {split: {kind: [] for kind in KINDS} for split in SPLITS}
    for split in SPLITS:
      self._populate(split)
    self.by_name = {e.name: e for split in SPLITS for kind in KINDS
                    for e in self.entities[split][kind]}
    if config.distractors:
      self._add_distractors(np.random.default_rng([config.seed, 1]))
    counts = {"train": config.train_tasks, "heldout": config.heldout_tasks}
    self.tasks = {split: [self._task(split, i) for i in range(counts[split])]
                  for split in SPLITS}

  # --- the knowledge base ------------------------------------------------------------------

  def _word(self, syllables: int) -> str:
    parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + self.rng.choice(_CODAS)).capitalize()

  def _unique(self, make) -> str:
    while True:
      name = make()
      if name not in self._used:
        self._used.add(name)
        return name

  def _name(self, kind: str) -> str:
    if self.config.names == "numbers":  # a number names one entity only, of any kind
      return f"{kind.capitalize()} {self._unique(lambda: str(self.rng.integers(1000, 10_000)))}"
    if kind == "city":
      return self._word(2)
    if kind == "person":
      return f"{self._word(2)} {self._word(2)}"
    return f"{self._word(2)} {self.rng.choice(_COMPANY_SUFFIXES)}"

  def _populate(self, split: str) -> None:
    count, rng, ents = self.config.entities, self.rng, self.entities[split]
    for _ in range(count):
      for kind in KINDS:
        ents[kind].append(Entity(kind, self._unique(lambda: self._name(kind)), split))
    pick = lambda kind: ents[kind][rng.integers(count)].name
    for (kind, attr), (low, high) in _RANGES.items():
      for entity in ents[kind]:
        entity.attrs[attr] = int(rng.integers(low, high))
    for entity in ents["city"]:
      entity.attrs.update(country=str(rng.choice(_COUNTRIES)), mayor=pick("person"))
    for entity in ents["person"]:
      entity.attrs.update(profession=str(rng.choice(_PROFESSIONS)), birthplace=pick("city"),
                          employer=pick("company"))
    for entity in ents["company"]:
      entity.attrs.update(headquarters=pick("city"), ceo=pick("person"))

  def _add_distractors(self, rng: np.random.Generator) -> None:
    for entity in self.by_name.values():
      for kind, attr in _RANGES:
        if kind == entity.kind and rng.random() < self.config.distractors:
          value = entity.attrs[attr]
          while value == entity.attrs[attr]:
            value = int(rng.integers(*_RANGES[kind, attr]))
          entity.near[attr] = (value, bool(rng.random() < 0.5))

  def corpus(self) -> list[dict[str, str]]:
    """Returns every entity's page as a corpus record (id, title, url, text)."""
    return [{"id": f"{e.kind}-{e.slug}", "title": e.name, "url": e.url, "text": e.page()}
            for e in self.by_name.values()]

  # --- tasks -------------------------------------------------------------------------------

  def _choice(self, weights) -> int:
    weights = np.asarray(weights, np.float64)
    return int(self.rng.choice(len(weights), p=weights / weights.sum()))

  def _chain(self, split: str, hops: int, final_kinds=None):
    """Returns (description, entity, path) of an entity reached by hops-1 links from a random
    start; `final_kinds` limits the kinds the chain may end on."""
    while True:
      kind = KINDS[self.rng.integers(len(KINDS))]
      entity = self.entities[split][kind][self.rng.integers(self.config.entities)]
      description, path = entity.name, [entity.name]
      for _ in range(hops - 1):
        options = [key for key in RELATIONS if key[0] == entity.kind]
        key = options[self.rng.integers(len(options))]
        description = RELATIONS[key][1].format(x=description)
        entity = self.by_name[entity.attrs[key[1]]]
        path.append(key[1])
      if final_kinds is None or entity.kind in final_kinds:
        return description, entity, path

  def _lookup(self, split: str, numeric_only: bool = False):
    hops = 1 + self._choice(self.config.hops)
    kinds = {k for k, _ in NUMERIC} if numeric_only else None
    description, entity, path = self._chain(split, hops, kinds)
    options = [key for key in QUESTIONS if key[0] == entity.kind and
               (key in NUMERIC or not numeric_only)]
    key = options[self.rng.integers(len(options))]
    return description, entity, key, path + [key[1]]

  def _task(self, split: str, index: int) -> dict[str, Any]:
    names = [name for name, _ in self.config.families]
    family = names[self._choice([w for _, w in self.config.families])]
    low, high = 10 ** (self.config.digits - 1), 10 ** self.config.digits
    if family == "lookup":
      description, entity, key, path = self._lookup(split)
      question, answer = QUESTIONS[key].format(x=description), entity.attrs[key[1]]
      program = {"path": path}
    elif family == "arithmetic":
      a, b, c = (int(v) for v in self.rng.integers(low, high, 3))
      expression, answer = [(f"{a} * {b} - {c}", a * b - c), (f"{a} * {b} + {c}", a * b + c),
                            (f"({a} + {b}) * {c}", (a + b) * c)][self.rng.integers(3)]
      question, program = f"What is {expression}?", {"expression": expression}
    else:
      description, entity, key, path = self._lookup(split, numeric_only=True)
      value = entity.attrs[key[1]]
      k = int(self.rng.integers(3, 30))
      noun = NUMERIC_NOUNS[key].format(x=description)
      question, answer = f"What is {times(noun, k)}?", value * k
      program = {"path": path, "expression": times(value, k)}
    question = question[0].upper() + question[1:]
    numeric = isinstance(answer, int)
    return {"id": f"{split}-{index}", "question": f"Question: {question}",
            "metadata": {"domain": "math" if numeric else "qa", "ground_truth": str(answer),
                         "family": family, "hops": max(len(program.get("path", [])) - 1, 0),
                         "split": split, "program": program}}

  def _answer_entity(self, task: dict[str, Any]) -> tuple[Any, str]:
    """Returns the entity whose page answers a look-up `task` (its path's last hop) and the
    attribute asked."""
    path = task["metadata"]["program"]["path"]
    entity = self.by_name[path[0]]
    for attr in path[1:-1]:
      entity = self.by_name[entity.attrs[attr]]
    return entity, path[-1]

  def near_miss(self, task: dict[str, Any]) -> str:
    """Returns where the page that answers a look-up `task` (the last hop's) states a near-miss
    figure of the asked attribute: "before" or "after" the entity's own sentence, or "none"
    (also for arithmetic tasks)."""
    if not task["metadata"]["program"].get("path"):
      return "none"
    entity, attr = self._answer_entity(task)
    if attr not in entity.near:
      return "none"
    return "before" if entity.near[attr][1] else "after"

  def near_miss_figures(self, task: dict[str, Any]) -> tuple[int, int]:
    """Returns (the near-miss figure, the entity's own) of a look-up `task` whose page states
    one (`near_miss` is not "none")."""
    entity, attr = self._answer_entity(task)
    return entity.near[attr][0], entity.attrs[attr]

  # --- files -------------------------------------------------------------------------------

  def tools_spec(self, corpus_path: str, snippet_chars: int = 40) -> dict[str, dict]:
    """Returns the tools_env registry spec serving this world: search with short snippets
    (facts need a crawl), crawl by URL, the code sandbox."""
    search = {"kind": "bm25", "corpus_path": corpus_path, "snippet_chars": snippet_chars,
              "top_k": self.config.search_results}
    return {"web_search": search, "wiki_search": dict(search),
            "crawl_page": {"kind": "local_crawl", "corpus_path": corpus_path,
                           "focus_on_goal": True},
            "code": {"kind": "sandbox"}}

  def write(self, directory: str) -> dict[str, str]:
    """Writes corpus.jsonl, train.jsonl, heldout.jsonl and tools.json, each atomically (a
    killed run leaves no half-written file for the next to read); returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {name: os.path.join(directory, f"{name}.jsonl")
             for name in ("corpus",) + SPLITS}
    rows = {"corpus": self.corpus(), **self.tasks}
    for name, path in paths.items():
      write_jsonl(path, rows[name])
    paths["tools"] = os.path.join(directory, "tools.json")
    # the corpus relative to it: the folder can move
    write_json(paths["tools"], self.tools_spec(os.path.basename(paths["corpus"])))
    return paths


def load_tools_spec(directory: str) -> dict[str, dict]:
  """Returns the tool spec of the world written to `directory`, with its corpus path resolved
  against that folder."""
  with open(os.path.join(directory, "tools.json")) as f:
    spec = json.load(f)
  for tool in spec.values():
    if "corpus_path" in tool:
      tool["corpus_path"] = os.path.join(os.path.abspath(directory), tool["corpus_path"])
  return spec
