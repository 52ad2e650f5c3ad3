"""Per-backend XLA flag sets: applied to the environment before a backend starts, and passed to
ahead-of-time compiles as compiler options that the backend's compiler accepts."""

import os
import subprocess
import sys

import pytest

from coa_jax.model import get_preset
from coa_jax.perf import aot
from coa_jax.runtime import sharding, xla_flags
from configs import common


def test_a_job_applies_its_flags_before_the_backend_starts_keeping_flags_already_set():
  code = ("from coa_jax.runtime import xla_flags; xla_flags.apply('tpu'); import os; "
          "print(os.environ['LIBTPU_INIT_ARGS'])")
  env = dict(os.environ, LIBTPU_INIT_ARGS="--xla_enable_async_all_gather=false")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout.split()
  assert out[0] == "--xla_enable_async_all_gather=false"  # the user's value stays
  assert "--xla_tpu_enable_async_collective_fusion=true" in out
  assert not any(flag.startswith("--xla_enable_async_all_gather=true") for flag in out)


def test_flags_applied_after_the_backend_started_are_an_error_not_ignored():
  import jax
  jax.devices()
  with pytest.raises(RuntimeError, match="must be applied before JAX starts a backend"):
    xla_flags.apply("gpu")
  xla_flags.apply("")  # no flags: nothing to apply


def test_an_unknown_flag_set_is_named():
  with pytest.raises(ValueError, match="xla_flags='cuda': expected '' or one of"):
    xla_flags.compiler_options("cuda")


def test_the_tpu_flags_are_options_the_tpu_compiler_accepts():
  """libtpu rejects an option it does not know ("No such compile option"), so this compile
  checks every flag of the set by name."""
  compiled, *_ = aot.compile_train_step(get_preset("tiny"), common.optimizer(),
                                        aot.topology_devices("v5e:2x2"),
                                        sharding.MeshConfig(fsdp=-1), 4, 16, flags="tpu")
  assert aot._cost(compiled)[0] > 0
