"""The LM demo (make lm-demo): train the tiny model over all devices, export to HF, reload,
check.

  python experiments/demo.py [--config=configs/demo_tiny.py] [--config.steps=100 ...]
"""



from absl import app
from ml_collections import config_flags

from coa_jax.train import lm_demo as demo
from configs import demo_tiny

_CONFIG = config_flags.DEFINE_config_file(
    "config", demo_tiny.__file__)


def main(argv):
  del argv
  demo.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
