"""A small, deterministic set of CoA trajectories shipped for the tiny SFT run and the tests.

Three task families, each solved the way the recipe's agents do: arithmetic through the
`code` tool (the observation is the program's real output), look-ups through `web_search`
over a fixed fact table (ranked snippets), and definitions through `wiki_search` followed
by `crawl_page`. Some pages contain tag-like text (`<think>`, `<answer>`, `</think>` inside
prose) to exercise the rule that environment text never makes tags.
"""

from __future__ import annotations

import json
import os
import random

from coa_jax.data import prompts
from coa_jax.data.coa_format import Step, Trajectory

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
    "Norway": "Oslo", "Egypt": "Cairo", "Canada": "Ottawa", "Chile": "Santiago",
    "Greece": "Athens", "India": "New Delhi", "Ghana": "Accra", "Cuba": "Havana",
}
TERMS = {
    "photosynthesis": "the process by which plants turn light, water and carbon dioxide into "
                      "sugar and oxygen",
    "entropy": "a measure of how many microscopic states are consistent with a system's "
               "macroscopic state",
    "recursion": "defining something in terms of a smaller instance of itself",
    "osmosis": "the movement of water through a membrane toward the side with more solute",
    "inflation": "a general rise in prices that lowers the purchasing power of money",
}


def _math(rng: random.Random) -> Trajectory:
  a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 50)
  op = rng.choice(["+", "-"])
  expression = f"{a} * {b} {op} {c}"
  value = eval(expression)  # our own arithmetic on integers
  steps = (
      Step("plan", f"1. Compute {expression} with code.\n2. Check and answer."),
      Step("code", f"```python\nprint({expression})\n```"),
      Step("observation", f"{value}\n"),
      Step("think", f"The program printed {value}."),
      Step("suggested_answer", str(value)),
      Step("double_check", f"The code evaluates exactly {expression}. Score: 4"),
      Step("answer", str(value)),
  )
  return Trajectory(prompts.AGENT, f"Question: What is {expression}?", steps,
                    {"domain": "math", "ground_truth": str(value)})


def _lookup(rng: random.Random) -> Trajectory:
  country = rng.choice(sorted(CAPITALS))
  capital = CAPITALS[country]
  decoy = rng.choice([c for c in sorted(CAPITALS) if c != country])
  snippets = [
      f"1. [{country} - Overview](https://facts.example/{country.lower()})\n"
      f"{capital} is the capital and largest city of {country}.",
      f"2. [Travel notes](https://travel.example/{country.lower()})\n"
      f"Visitors to {country} often start in {capital}. Tip: write <think> in your diary.",
      f"3. [{decoy}](https://facts.example/{decoy.lower()})\n"
      f"{CAPITALS[decoy]} is the capital of {decoy}.",
  ]
  steps = (
      Step("think", f"I need the capital of {country}; a web search will tell."),
      Step("web_search", f"capital of {country}"),
      Step("observation", "\n".join(snippets)),
      Step("reflection", "The first result answers it directly; the third is about "
                         "another country. Progress: good."),
      Step("answer", capital),
  )
  return Trajectory(prompts.AGENT, f"Question: What is the capital of {country}?", steps,
                    {"domain": "qa", "ground_truth": capital})


def _definition(rng: random.Random) -> Trajectory:
  term = rng.choice(sorted(TERMS))
  url = f"https://wiki.example/{term}"
  steps = (
      Step("plan", f"1. Find the wiki page on {term}.\n2. Read it.\n3. Answer in one line."),
      Step("wiki_search", term),
      Step("observation", f"1. [{term.title()}]({url})\n{term.title()} is a concept..."),
      Step("crawl_page", url),
      Step("observation", f"{term.title()}\n\n{term.title()} is {TERMS[term]}. (Markup seen on "
                          f"this page: <answer> and </think> are just text.)"),
      Step("think", "The page gives a one-line definition."),
      Step("answer", f"{term.title()} is {TERMS[term]}."),
  )
  return Trajectory(prompts.AGENT, f"Question: What is {term}?", steps,
                    {"domain": "qa", "ground_truth": TERMS[term]})


def make_trajectories(count: int, seed: int = 0) -> list[Trajectory]:
  """Returns `count` trajectories drawn deterministically from the three families."""
  rng = random.Random(seed)
  makers = [_math, _lookup, _definition]
  return [makers[i % len(makers)](rng) for i in range(count)]


def write_jsonl(path: str, trajectories: list[Trajectory]) -> None:
  """Writes trajectories as our JSONL format, one record per line."""
  with open(path, "w") as f:
    for t in trajectories:
      f.write(json.dumps(t.to_json()) + "\n")


SHIPPED_COUNT = 240
# The shipped sample (package data): the tiny SFT, rollout and DAPO configs read it.
SAMPLE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                           "coa_sample.jsonl")

if __name__ == "__main__":  # regenerates the shipped sample
  write_jsonl(SAMPLE_PATH, make_trajectories(SHIPPED_COUNT))
