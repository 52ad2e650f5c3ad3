"""Main job (README): train the tiny model over all devices, export to HF, reload and check.

  python experiments/demo.py [--config=configs/demo_tiny.py] [--config.steps=100 ...]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from coa_jax import demo  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "../configs/demo_tiny.py"))


def main(argv):
  del argv
  demo.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
