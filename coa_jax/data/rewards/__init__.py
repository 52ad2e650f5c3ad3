"""Verifiable rewards for DAPO: a rollout's final answer scored against its task's ground truth.

Scorers, each `(answer, ground truth, ...) -> (score in [0, 1], details)` and never raising (a
failure scores 0.0 with an "error" in details):

- `math_reward`: the last `\\boxed{...}` (or the whole answer) against the gold, by `math_verify`
  when it is installed and can parse both, else by a normalized string/number comparison;
  under a wall-clock timeout that works from any thread.
- `qa_reward`: SQuAD-normalized exact match (score) and token F1; `|`-separated gold parts
  must all be given.
- `code_reward`: the last ```python block run on stdin/stdout tests, or with a test script after
  it (`functional`), in the code sandbox.
- `judge_reward`: a verdict from an LLM judge behind an OpenAI-compatible endpoint (a JSON
  `correct` flag, or a `judgement` of "correct" / "incorrect" as the reference release asks).
- a `python` domain: a user's function by import path that sees the whole trajectory
  (`Response`: answer, every tool call with its result, token counts, the task's data).

`build_rewarder(spec)` maps each task's domain to one of them and turns the result into a
`Reward`: the `correct` / `incorrect` values (DAPO: +1 / -1), minus a format penalty when the
response breaks the CoA format. `Rewarder.sandbox_isolation()` names the weakest isolation its code
domains run programs under (the RL and evaluation summaries' `reward_sandbox_isolation`).

One module a concern: `answers` (final answers, gold answers, ground truths), one a scorer
(`math_scorer`, `qa_scorer`, `code_scorer`, `judge_scorer`, `python_scorer`) and `rewarder` (the
spec, the dispatch by domain, the format penalty); their public names are all importable from
here.
"""

from coa_jax.data.rewards.answers import final_answer, gold_answers, ground_truth_of
from coa_jax.data.rewards.code_scorer import (EXITED_EARLY, WRONG_ANSWER, CodeScorer,
                                              code_reward, normalize_output)
from coa_jax.data.rewards.judge_scorer import JudgeClient, judge_reward, parse_verdict
from coa_jax.data.rewards.math_scorer import (extract_boxed, fallback_equal, math_equivalent,
                                              math_reward, normalize_math)
from coa_jax.data.rewards.python_scorer import PythonScorer, Response, ToolCall, tool_calls_of
from coa_jax.data.rewards.qa_scorer import (QA_METRICS, exact_match, normalize_text, qa_reward,
                                            token_f1)
from coa_jax.data.rewards.rewarder import (KINDS, Reward, Rewarder, RewardSpec, Scorer,
                                           build_rewarder, format_penalty)
