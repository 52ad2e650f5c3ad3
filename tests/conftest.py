"""Test setup: CPU only, 8 fake devices (set before JAX is imported), shared fixtures."""

import atexit
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
# The suite compiles hundreds of small programs and runs each a few times: compiling costs more
# than running. LLVM's optimisation passes off (the suite needed 27% less CPU), and XLA:CPU's
# older, cheaper code generation: elemental emitters in place of the MLIR fusion emitters, no
# XNNPACK fusions, one LLVM module per program (half the CPU again on test_rl, test_model and
# test_lora). Subprocesses that check the documented commands' numerics (the copy guard) set
# their own flags.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_use_xnnpack=false --xla_cpu_parallel_codegen_split_count=1")
# A collective on fake CPU devices waits for one thread per device; XLA aborts the process when
# one has not arrived after 40 s, which a loaded 2-core machine can exceed (the suite beside a
# pipeline run). Tests bound their own waits.
PATIENT_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=900"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") +
    f" --xla_force_host_platform_device_count=8 {FAST_COMPILE} {PATIENT_COLLECTIVES}").strip()
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# libtpu (loaded to compile for TPU topologies; no TPU is used) holds a host-wide lock for the
# life of the process that loaded it: without this, a second test run on the machine fails.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One persistent compilation cache per session: tests that rebuild the same jitted steps, and the
# subprocesses of the multi-process and crash-recovery tests, load a compiled program instead of
# compiling it again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="coa_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import jax  # noqa: E402
import pytest  # noqa: E402

from coa_jax.runtime import sharding  # noqa: E402


@pytest.fixture(scope="session")
def single_device_mesh():
  return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


# The files that take longest (`make test` prints the slowest tests), longest first: pytest-xdist
# hands each worker whole files in collection order (the Makefile turns off its own reordering,
# which puts the files with most tests first), and a long file collected last keeps one worker
# busy after the other has run out of files.
SLOW_FILES = ("test_aot.py", "test_multihost.py", "test_pipeline.py", "test_sql_example.py",
              "test_copy_guard.py", "test_serving_rl.py", "test_ppo.py", "test_sft.py",
              "test_sampler.py", "test_crash_recovery.py", "test_sharding.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOW_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable
