"""Serve a trained model behind an OpenAI-compatible API (`make serve`).

  python experiments/serve.py [--model=runs/pipeline_tiny/seed-0/dapo/hf_export]
      [--config=configs/serve_tiny_cpu.py] [--config.port=8000] [--config.batch_size=64]

With --model (default: the config's model.checkpoint), the model's shape comes from its
checkpoint and its tokenizer, tools, system prompt, sampling and rollout limits from the settings
the run that trained it saved there (coa_jax.evaluation.model_settings; the first line printed
says which). Prints the base URL and a curl example; stops on SIGTERM or Ctrl-C after what is in
flight has finished (docs/serving.md).
"""

from absl import app, flags
from ml_collections import config_flags

from coa_jax.evaluation import model_settings
from coa_jax.runtime import cli
from coa_jax.runtime.distributed import say
from coa_jax.serving import job as serving
from configs import serve_tiny_cpu

_CONFIG = config_flags.DEFINE_config_file("config", serve_tiny_cpu.__file__)
_MODEL = flags.DEFINE_string("model", "", "a trained model's folder (a coa-jax export or an HF "
                             "checkpoint; default: the config's model.checkpoint)")
_SAVED = ("model", "tokenizer", "tools", "system_prompt", "sampling", "rollout")


def main(argv):
  del argv
  cli.start()
  config = _CONFIG.value
  folder = _MODEL.value or config.model.checkpoint
  if folder:
    config, source = model_settings.saved_config(config, folder, _SAVED)
    say(f"serving {folder} with {source}")
  serving.run(config)


if __name__ == "__main__":
  app.run(main)
