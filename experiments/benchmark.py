"""The paper's benchmarks on a trained model, graded as the paper grades them
(coa_jax.evaluation.benchmarks; the table of files and graders: coa_jax.data.benchmark_files).

  python experiments/benchmark.py --model=runs/pipeline_tiny/seed-0/dapo/hf_export \
      --benchmarks=aime25,math500,lcb_v5,gaia [--max_tasks=N] [--k=4] \
      [--judge_url=http://host:8000/v1 --judge_model=NAME] [--data_dir=../shared/benchmarks/afm]
  make benchmark ARGS="--model=... --benchmarks=aime25,gaia --max_tasks=20"

Prints progress lines (tasks done, rate, ETA) and writes results.json, results.md and
results.png (per benchmark: grader, pass@1, avg@k, tokens and tool calls per task) into
--output_dir, each benchmark's evaluation in a folder of its own. Decoding, rollout limits, tools
and the system prompt: --config (configs/benchmark.py), e.g. --config.sampling.temperature=0.6.
"""

from absl import app, flags
from ml_collections import config_flags

from coa_jax.data.benchmark_files import BENCHMARKS, DEFAULT_DATA_DIR
from coa_jax.evaluation import benchmarks
from coa_jax.runtime import cli
from configs import benchmark as benchmark_config

_CONFIG = config_flags.DEFINE_config_file("config", benchmark_config.__file__)
_MODEL = flags.DEFINE_string("model", None, "the model folder (an HF export)", required=True)
_BENCHMARKS = flags.DEFINE_list("benchmarks", None, f"benchmarks to run, of: "
                                f"{', '.join(BENCHMARKS)}", required=True)
_DATA_DIR = flags.DEFINE_string("data_dir", DEFAULT_DATA_DIR, "the folder of the benchmark files")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/benchmark", "where the results go")
_K = flags.DEFINE_integer("k", 1, "samples per task (avg@k, pass@k)")
_MAX_TASKS = flags.DEFINE_integer("max_tasks", 0, "the first N tasks of each benchmark (0: all)")
_JUDGE_URL = flags.DEFINE_string("judge_url", "", "an OpenAI-compatible endpoint for the LLM "
                                 "judge of GAIA, HLE, BrowseComp, WebWalker (empty: exact match, "
                                 "named as a fallback in the results)")
_JUDGE_MODEL = flags.DEFINE_string("judge_model", "", "the judge's model name")
_JUDGE_KEY = flags.DEFINE_string("judge_api_key_env", "OPENAI_API_KEY",
                                 "the variable holding the judge's API key (empty: none)")
_CODE_TIMEOUT = flags.DEFINE_float("code_timeout_s", 6.0, "time limit of each code test (s)")


def main(argv):
  del argv
  cli.start()
  settings = benchmarks.BenchmarkSettings(
      model=_MODEL.value, benchmarks=tuple(_BENCHMARKS.value), data_dir=_DATA_DIR.value,
      output_dir=_OUTPUT_DIR.value, k=_K.value, max_tasks=_MAX_TASKS.value,
      judge_url=_JUDGE_URL.value, judge_model=_JUDGE_MODEL.value,
      judge_api_key_env=_JUDGE_KEY.value, code_timeout_s=_CODE_TIMEOUT.value)
  benchmarks.run(_CONFIG.value, settings)


if __name__ == "__main__":
  app.run(main)
