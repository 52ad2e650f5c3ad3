"""Test setup: CPU only, 8 fake devices (set before JAX is imported), shared fixtures."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from coa_jax import sharding  # noqa: E402


@pytest.fixture(scope="session")
def single_device_mesh():
  return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
