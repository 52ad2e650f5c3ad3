"""Checkpoints: a save cut short is not a step; an unreadable newest step falls back to the
previous one with a warning, and the run can save that step again."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coa_jax.runtime.checkpointing import Checkpointer, CheckpointWarning


@pytest.fixture
def abstract(single_device_mesh):
  sharding = NamedSharding(single_device_mesh, P())
  return {"w": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=sharding)}


def _saved(directory, steps):
  checkpointer = Checkpointer(str(directory), max_to_keep=5, async_save=False)
  for step in steps:
    checkpointer.save(step, {"w": jnp.full((64,), float(step))}, {"position": step})
  checkpointer.close()


def test_a_save_cut_short_is_not_a_step(tmp_path, abstract):
  _saved(tmp_path, [2, 4])
  partial = tmp_path / "6.orbax-checkpoint-tmp-1234" / "state"  # a killed save's leftovers
  partial.mkdir(parents=True)
  (partial / "junk").write_bytes(b"\0" * 10)
  checkpointer = Checkpointer(str(tmp_path))
  assert checkpointer.latest_step() == 4
  state, data = checkpointer.restore_latest(abstract)
  assert data == {"position": 4} and float(state["w"][0]) == 4.0


def test_an_unreadable_newest_step_falls_back_to_the_previous_one(tmp_path, abstract):
  _saved(tmp_path, [2, 4])
  for folder, _, files in os.walk(tmp_path / "4" / "state"):
    for name in files:
      with open(os.path.join(folder, name), "wb") as f:
        f.write(b"not a checkpoint")
  checkpointer = Checkpointer(str(tmp_path), async_save=False)
  with pytest.warns(CheckpointWarning, match="step 4 .* cannot be read"):
    state, data = checkpointer.restore_latest(abstract)
  assert data == {"position": 2}
  np.testing.assert_array_equal(state["w"], np.full((64,), 2.0))
  assert [p.name.split("-")[0] for p in tmp_path.iterdir() if ".corrupt" in p.name] == [
      "4.corrupt"]
  checkpointer.save(4, {"w": jnp.full((64,), 40.0)}, {"position": 4})  # the run goes on
  checkpointer.close()
  assert Checkpointer(str(tmp_path)).restore_latest(abstract)[1] == {"position": 4}
