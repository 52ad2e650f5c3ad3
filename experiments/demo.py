"""The LM demo (make lm-demo): train the tiny model over all devices, export to HF, reload,
check.

  python experiments/demo.py [--config=configs/demo_tiny.py] [--config.steps=100 ...]
"""

from coa_jax.runtime import cli
from coa_jax.train import lm_demo as demo
from configs import demo_tiny

if __name__ == "__main__":
  cli.run_job(demo.run, demo_tiny.__file__)
