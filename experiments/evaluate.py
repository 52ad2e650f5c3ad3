"""Evaluate a trained model on a task file, or a checkpoint or the teacher system by config.

  python experiments/evaluate.py --model=runs/pipeline_tiny/seed-0/dapo/hf_export \\
      --tasks=my_tasks.jsonl [--k=3] [--max_tasks=0] [--output_dir=runs/evaluate_my_tasks]
  python experiments/evaluate.py [--config=configs/evaluate_tiny.py] [--config.k=8]
  python experiments/evaluate.py --config.system=teacher

With --model, the model's shape comes from its checkpoint and the tools, system prompt, sampling
and rollout limits from the settings the run that trained it saved there
(coa_jax.evaluation.model_settings; the first line printed says which). Prints pass@1, avg@k,
pass@k, maj@k, tokens and tool calls per task and the format-error rate; writes metrics.json and
samples.jsonl to the output folder.
"""

import os

from absl import app, flags
from ml_collections import config_flags

from coa_jax.evaluation import job as evaluate
from coa_jax.evaluation import model_settings
from coa_jax.runtime import cli, distributed
from coa_jax.runtime.distributed import say
from configs import evaluate_tiny

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    evaluate_tiny.__file__)
_MODEL = flags.DEFINE_string("model", "", "a trained model's folder (an HF export)")
_TASKS = flags.DEFINE_string("tasks", "", "with --model: the task file (JSONL or parquet)")
_K = flags.DEFINE_integer("k", 0, "with --model: samples per task (default: the saved k)")
_MAX_TASKS = flags.DEFINE_integer("max_tasks", 0, "with --model: the first N tasks (0: all)")
_OUTPUT = flags.DEFINE_string("output_dir", "", "with --model: where metrics.json goes "
                              "(default: runs/evaluate_<task file's name>)")


def main(argv):
  del argv
  cli.start()
  config = _CONFIG.value
  if _MODEL.value:
    if not _TASKS.value:
      raise app.UsageError("--model needs --tasks=FILE (the tasks to evaluate it on)")
    name = os.path.splitext(os.path.basename(_TASKS.value))[0]
    config, source = distributed.agreed(  # a host without the model folder stops them all
        lambda: model_settings.evaluation_config(
            config, _MODEL.value, _TASKS.value, _OUTPUT.value or f"runs/evaluate_{name}",
            _K.value, _MAX_TASKS.value), "reading the model's evaluation settings")
    say(f"evaluating {_MODEL.value} with {source}; outputs: {config.output_dir}")
  evaluate.run(config)


if __name__ == "__main__":
  app.run(main)
