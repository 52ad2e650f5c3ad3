"""A trained model's evaluation settings, saved beside its export: evaluate it on any task file
as the run that trained it evaluated it, with nothing but the folder and the file.

The pipeline saves, in each model folder it evaluates (`save`), what its evaluations ran with:
the tools, the system prompt, the tokenizer, the model's runtime fields, the sampling, the
rollout limits, the rewards and the teacher. `evaluation_config(model_dir, tasks)` turns that
back into an evaluation config; a folder without it (any coa-jax or HF checkpoint) gets the
caller's defaults (`experiments/evaluate.py`: `configs/evaluate_tiny.py`'s), its shape from the
checkpoint, and says so.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from coa_jax.model import ConfigError
from coa_jax.evaluation.settings import EvaluationSettings
from coa_jax.runtime.cache import canonical, write_json
from coa_jax.runtime.settings import to_section

FILE = "coa_evaluation.json"
SAVED = ("model", "tokenizer", "tools", "system_prompt", "sampling", "rollout", "rewards",
         "teacher", "k", "batch_size", "chunk")


def save(settings: EvaluationSettings) -> str:
  """Writes the evaluation settings (`SAVED`) of a model's evaluation into its model folder,
  settings.model.checkpoint; returns the file's path."""
  saved = {key: to_section(getattr(settings, key)) for key in SAVED}
  saved["model"].pop("checkpoint")
  path = os.path.join(settings.model.checkpoint, FILE)
  if _read(path) != canonical(saved):  # unchanged, the file is left as it is: a rewrite would
    write_json(path, saved)            # change the folder's fingerprint (`file_fingerprint`)
  return path


def _read(path: str) -> Any:
  """Returns a JSON file's value, or None when it is missing or unreadable."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def evaluation_config(defaults: ml_collections.ConfigDict, model_dir: str, tasks: str,
                      output_dir: str, k: int = 0, max_tasks: int = 0
                      ) -> tuple[ml_collections.ConfigDict, str]:
  """Returns the config that evaluates the model in `model_dir` on the task file `tasks` (k
  samples a task, default the saved k): the saved settings over `defaults` (an evaluation
  config), and a line saying where its settings come from."""
  config, source = saved_config(defaults, model_dir, SAVED)
  config.system, config.tasks, config.max_tasks = "model", tasks, max_tasks
  config.copy_probe, config.output_dir = "", output_dir
  if k:
    config.k = k
  config.batch_size = max(config.k, config.batch_size // config.k * config.k)
  return config, source


def saved_config(defaults: ml_collections.ConfigDict, model_dir: str, keys: tuple[str, ...]
                 ) -> tuple[ml_collections.ConfigDict, str]:
  """Returns `defaults` with the `keys` that the model folder's saved settings hold (`FILE`)
  and model.checkpoint set to the folder, and a line saying where its settings come from."""
  if not os.path.isdir(model_dir):
    raise ConfigError(f"model folder {model_dir!r} does not exist")
  config = ml_collections.ConfigDict(defaults.to_dict())
  path = os.path.join(model_dir, FILE)
  if os.path.isfile(path):
    with open(path) as f:
      saved = json.load(f)
    for key, value in saved.items():
      if key in keys:
        config[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
    source = (f"the settings of the run that trained it ({path}): "
              f"temperature {config.sampling.temperature}, "
              f"{config.rollout.max_response_tokens}-token responses, tools "
              f"{', '.join(sorted(config.tools)) or 'none'}")
  else:
    source = (f"no saved settings ({FILE}): the defaults (temperature "
              f"{config.sampling.temperature}, {config.rollout.max_response_tokens}-token "
              f"responses, tools {', '.join(sorted(config.tools)) or 'none'})")
  config.model.checkpoint = model_dir
  return config, source
