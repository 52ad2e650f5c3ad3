"""The copy probe: does a model answer with the value a tool's observation gave it?

An agent model is only as good as its reading: a look-up's answer is a value on a page, an
arithmetic answer is the number the code printed. A model that writes the format but does not
copy values scores near zero, however low its training loss. The probe measures exactly that,
cheaply and without sampling: on held-out teacher trajectories, each `suggested_answer` whose
value appears in an earlier observation is a copy step, and the probe counts the copy steps
whose every token (content, newlines, closing tag) is the model's greedy next-token prediction
given the trajectory up to it (teacher forcing). A model that cannot see observations scores
what it can guess, about 0 on numbers it has never seen.

The near-miss probe asks why a model misreads a page that states a near-miss figure ("the
population of the province of City 2216") before the entity's own: at the teacher's first step
that writes the near-miss figure, how likely is the model to write the entity's own instead?
Teacher-forced at the model's own temperature (1), the chance of each figure's step is the
chance an RL rollout has of finding it there; a median of 1e-5 means that outcome rewards
almost never see the right answer to reward (docs/experiments.md).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from coa_jax.data import coa_format
from coa_jax.data import tokenize as sft_tokenize
from coa_jax.data.coa_format import Trajectory
from coa_jax.data.tokenizer import CoATokenizer

COPY_TAG = "suggested_answer"
# A copy the model writes exactly less often than this when sampling is unsure: a task whose
# copy it is fails in one sample of ten or more (the tail that an average chance hides).
UNSURE = 0.9
# What a question copy is made of: a number, or a capitalized word (a name or a part of one).
_ITEM_RE = re.compile(r"\d+|[A-Z][A-Za-z]+")


@dataclasses.dataclass(frozen=True)
class CopyExample:
  """A tokenized trajectory, the token ranges [start, end) of its copy steps' bodies, of its
  tool calls' bodies (the calls copy names and operands from the question and earlier steps)
  and of the question copies inside those calls (`question_spans`)."""

  input_ids: np.ndarray
  spans: tuple[tuple[int, int], ...]
  call_spans: tuple[tuple[int, int], ...] = ()
  question_spans: tuple[tuple[int, int], ...] = ()


def question_copies(tokenizer: CoATokenizer, step: coa_format.Step, question_items: set[str],
                    body_start: int) -> list[tuple[int, int]]:
  """Returns the token ranges of a tool step whose text is an item (`_ITEM_RE`) of
  `question_items`; the step's body (its newline, content, newline) starts at `body_start`."""
  body = f"\n{step.content}\n"
  offsets = tokenizer.backend.encode(body, add_special_tokens=False).offsets
  spans = []
  for match in _ITEM_RE.finditer(body):
    if match.group() in question_items:
      tokens = [t for t, (a, b) in enumerate(offsets) if a < match.end() and b > match.start()]
      spans.append((body_start + tokens[0], body_start + tokens[-1] + 1))
  return spans


def copy_example(trajectory: Trajectory, tokenizer: CoATokenizer,
                 max_len: int) -> CopyExample | None:
  """Returns the trajectory's copy steps within `max_len` tokens, or None when it has none."""
  ids = tokenizer.prompt_ids(trajectory.system, trajectory.question)
  seen, spans, calls, questions = [], [], [], []
  from_question = set(_ITEM_RE.findall(trajectory.question))  # less what observations show
  for i, step in enumerate(trajectory.steps):
    span = sft_tokenize.step_ids(tokenizer, step, first=i == 0)
    body_start = len(ids) + span.index(tokenizer.tag_id(step.tag)) + 1
    ids.extend(span)
    value = step.content.strip()
    if step.tag == coa_format.OBSERVATION:
      seen.append(step.content)
      from_question -= set(_ITEM_RE.findall(step.content))
    elif (step.tag == COPY_TAG and value and any(value in text for text in seen)
          and len(ids) <= max_len):
      spans.append((body_start, len(ids)))
    elif step.is_tool and len(ids) <= max_len:
      calls.append((body_start, len(ids)))
      questions += question_copies(tokenizer, step, from_question, body_start)
  if not spans:
    return None
  return CopyExample(np.asarray(ids[:max_len], np.int32), tuple(spans), tuple(calls),
                     tuple(questions))


def copy_examples(trajectories: Sequence[Trajectory], tokenizer: CoATokenizer,
                  max_len: int) -> list[CopyExample]:
  """Returns the copy examples of `trajectories` (those without a copy step are skipped)."""
  examples = (copy_example(t, tokenizer, max_len) for t in trajectories)
  return [e for e in examples if e is not None]


def _score(predicted_T: np.ndarray, logp_T: np.ndarray, ids_T: np.ndarray,
           spans: Sequence[tuple[int, int]]) -> np.ndarray:
  """Returns [spans predicted exactly, tokens predicted, tokens, summed chance of sampling each
  span exactly, spans whose chance is below UNSURE] of one row (the token at position t is
  predicted at position t - 1)."""
  score = np.zeros(5)
  for begin, end in spans:
    hit = predicted_T[begin - 1:end - 1] == ids_T[begin:end]
    chance = np.exp(logp_T[begin - 1:end - 1].sum())
    score += (hit.all(), hit.sum(), len(hit), chance, chance < UNSURE)
  return score


def teacher_forced(model: Any, params: Any, examples: Sequence[CopyExample], batch_size: int,
                   temperature: float):
  """Yields (example, greedy prediction_T, log-prob of each next token at `temperature`_T) of
  every example, teacher-forced; rows are padded to the longest example, so one shape is
  compiled per call."""
  length = max(len(e.input_ids) for e in examples)

  @jax.jit
  def predict(p, ids_BxT):
    logits_BxTxV = model.apply({"params": p}, ids_BxT)
    predicted_BxT = jnp.argmax(logits_BxTxV, axis=-1)
    targets_BxT = jnp.roll(ids_BxT, -1, axis=1)  # position t predicts token t + 1
    if temperature == 0:
      return predicted_BxT, jnp.where(predicted_BxT == targets_BxT, 0.0, -jnp.inf)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV / temperature, axis=-1)
    return predicted_BxT, jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]

  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    ids_BxT = np.zeros((batch_size, length), np.int32)
    for row, example in enumerate(chunk):
      ids_BxT[row, :len(example.input_ids)] = example.input_ids
    predicted_BxT, logp_BxT = map(np.asarray, predict(params, ids_BxT))
    for row, example in enumerate(chunk):
      yield example, predicted_BxT[row], logp_BxT[row]


def copy_accuracy(model: Any, params: Any, examples: Sequence[CopyExample],
                  batch_size: int = 16, temperature: float = 0.6) -> dict[str, float]:
  """Returns the fractions of copy steps predicted exactly (teacher-forced greedy), of their
  tokens, of tool calls and of question copies predicted exactly, and the chance that sampling
  at `temperature` (0: greedy) writes each exactly (`copy_sampled`, `call_sampled`,
  `question_sampled`: the product of its tokens' probabilities, averaged), and the fraction of
  question copies whose chance is below `UNSURE` (`question_unsure`)."""
  if not examples:
    raise ValueError("no copy examples: the trajectories have no answer copied from an "
                     "observation")
  copies, calls, questions = np.zeros(5), np.zeros(5), np.zeros(5)
  for example, predicted_T, logp_T in teacher_forced(model, params, examples, batch_size,
                                                     temperature):
    copies += _score(predicted_T, logp_T, example.input_ids, example.spans)
    calls += _score(predicted_T, logp_T, example.input_ids, example.call_spans)
    questions += _score(predicted_T, logp_T, example.input_ids, example.question_spans)
  steps = sum(len(e.spans) for e in examples)
  n_calls = sum(len(e.call_spans) for e in examples)
  n_questions = sum(len(e.question_spans) for e in examples)
  return {"copy_exact": copies[0] / steps, "copy_token_accuracy": copies[1] / copies[2],
          "copy_sampled": copies[3] / steps, "copy_steps": float(steps),
          "call_exact": calls[0] / max(n_calls, 1), "call_sampled": calls[3] / max(n_calls, 1),
          "calls": float(n_calls), "question_exact": questions[0] / max(n_questions, 1),
          "question_sampled": questions[3] / max(n_questions, 1),
          "question_unsure": questions[4] / max(n_questions, 1),
          "question_copies": float(n_questions)}


# --- numbers from nowhere, in sampled responses ------------------------------------------------

_NUMBER_RE = re.compile(r"\d+")
# A plan's own numbering: "2. Find ..." and "the result of step 1".
_PLAN_NUMBERING_RE = re.compile(r"(?m)^\s*\d+\.\s|\bstep \d+\b")


def invented_numbers(question: str, steps: Sequence[coa_format.Step]) -> list[tuple[str, str]]:
  """Returns (tag, number) of each number that a plan or a tool call of a sampled response
  writes and that neither the question nor any earlier step holds: a number from nowhere
  (`*16` for the question's `*20`). Where a plan invents a factor and the code repeats it, only
  the plan is named: the code copied it."""
  return [(tag, number) for tag, number, _ in invented_numbers_seen(question, steps)]


def invented_numbers_seen(question: str, steps: Sequence[coa_format.Step]
                          ) -> list[tuple[str, str, frozenset[str]]]:
  """`invented_numbers`, each with the numbers the question and the earlier steps held."""
  known = set(_NUMBER_RE.findall(question))
  invented = []
  for step in steps:
    text = _PLAN_NUMBERING_RE.sub(" ", step.content) if step.tag == "plan" else step.content
    numbers = _NUMBER_RE.findall(text)
    new = [n for n in numbers if n not in known] if step.tag == "plan" or step.is_tool else []
    if new:  # the evaluation calls this per sample: the seen set is copied only when needed
      seen = frozenset(known)
      invented += [(step.tag, n, seen) for n in new]
    known.update(_NUMBER_RE.findall(step.content))
  return invented


def numbers_in(text: str) -> set[str]:
  """The numbers (digit runs) that `text` writes."""
  return set(_NUMBER_RE.findall(text))


# --- the near-miss probe -----------------------------------------------------------------------


def near_miss_pairs(trajectory: Trajectory, tokenizer: CoATokenizer, near: str,
                    own: str) -> tuple[CopyExample, CopyExample] | None:
  """Returns the trajectory up to its first step (not an observation) that writes the
  near-miss figure `near` after an observation showed it, twice: as written, and with the
  entity's own figure `own` in its place; each example's span is what follows the tokens the
  two share (the figure and the rest of the step). None when no step writes `near`."""
  ids = tokenizer.prompt_ids(trajectory.system, trajectory.question)
  seen = False
  for i, step in enumerate(trajectory.steps):
    if step.tag == coa_format.OBSERVATION:
      seen = seen or near in step.content
    elif seen and near in step.content:
      near_ids, own_ids = (
          sft_tokenize.step_ids(tokenizer, dataclasses.replace(step, content=content),
                                first=i == 0)
          for content in (step.content, step.content.replace(near, own)))
      shared = next((j for j, (a, b) in enumerate(zip(near_ids, own_ids)) if a != b),
                    min(len(near_ids), len(own_ids)))
      return tuple(CopyExample(np.asarray(ids + span, np.int32),
                               ((len(ids) + shared, len(ids) + len(span)),))
                   for span in (near_ids, own_ids))
    ids.extend(sft_tokenize.step_ids(tokenizer, step, first=i == 0))
  return None


def near_miss_chance(model: Any, params: Any,
                     pairs: Sequence[tuple[CopyExample, CopyExample]],
                     batch_size: int = 16) -> dict[str, float]:
  """Returns, over (near-miss, own figure) pairs of `near_miss_pairs`, the median log10 chance
  that the model's own distribution (temperature 1) writes each figure's step where the teacher
  wrote the near-miss one, and the fraction of pairs whose own figure is the likelier."""
  if not pairs:
    raise ValueError("no near-miss pairs: no trajectory writes a near-miss figure")
  flat = [example for pair in pairs for example in pair]
  log10 = np.array([logp_T[example.spans[0][0] - 1:example.spans[0][1] - 1].sum() / np.log(10)
                    for example, _, logp_T in teacher_forced(model, params, flat, batch_size,
                                                             1.0)])
  near, own = log10[0::2], log10[1::2]
  return {"own_log10": float(np.median(own)), "near_log10": float(np.median(near)),
          "own_likelier": float(np.mean(own > near))}
