"""Checkpoints: a save cut short is not a step; a damaged newest step (truncated, missing or
corrupt files) falls back to the previous one and is set aside with a warning, and the run can
save that step again; a folder of damaged steps only is an error unless the run may start over;
a read that fails for another reason (out of memory, permissions) is raised and moves nothing;
a step that does not fit the run (tree, shape, dtype, mesh) is an error that moves nothing; a
gs:// directory reaches orbax as a URL."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coa_jax.runtime import sharding
from coa_jax.runtime.checkpointing import (CheckpointDamagedError, CheckpointMismatchError,
                                           Checkpointer, CheckpointWarning)


@pytest.fixture
def abstract(single_device_mesh):
  return _abstract(single_device_mesh)


def _abstract(mesh, shape=(64,), dtype=jnp.float32, name="w"):
  return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))}


def _saved(directory, steps):
  checkpointer = Checkpointer(str(directory), max_to_keep=5, async_save=False)
  for step in steps:
    checkpointer.save(step, {"w": jnp.full((64,), float(step))}, {"position": step})
  checkpointer.close()


def _files(folder):
  return sorted(os.path.join(d, name) for d, _, names in os.walk(folder) for name in names)


def test_a_save_cut_short_is_not_a_step(tmp_path, abstract):
  _saved(tmp_path, [2, 4])
  partial = tmp_path / "6.orbax-checkpoint-tmp-1234" / "state"  # a killed save's leftovers
  partial.mkdir(parents=True)
  (partial / "junk").write_bytes(b"\0" * 10)
  checkpointer = Checkpointer(str(tmp_path))
  assert checkpointer.latest_step() == 4
  step, state, data = checkpointer.restore_latest(abstract)
  assert (step, data, float(state["w"][0])) == (4, {"position": 4}, 4.0)


def test_an_unreadable_newest_step_falls_back_to_the_previous_one(tmp_path, abstract):
  _saved(tmp_path, [2, 4])
  for path in _files(tmp_path / "4" / "state"):
    with open(path, "wb") as f:
      f.write(b"not a checkpoint")
  checkpointer = Checkpointer(str(tmp_path), async_save=False)
  with pytest.warns(CheckpointWarning, match="step 4 .* is damaged"):
    step, state, data = checkpointer.restore_latest(abstract)
  assert (step, data) == (2, {"position": 2})
  np.testing.assert_array_equal(state["w"], np.full((64,), 2.0))
  assert [p.name.split("-")[0] for p in tmp_path.iterdir() if ".corrupt" in p.name] == [
      "4.corrupt"]
  checkpointer.save(4, {"w": jnp.full((64,), 40.0)}, {"position": 4})  # the run goes on
  checkpointer.close()
  assert Checkpointer(str(tmp_path)).restore_latest(abstract)[2] == {"position": 4}


@pytest.mark.parametrize("damage", ["truncated", "missing", "metadata missing"])
def test_a_step_with_truncated_or_missing_files_is_set_aside(tmp_path, abstract, damage):
  _saved(tmp_path, [2, 4])
  data_files = [p for p in _files(tmp_path / "4" / "state") if os.sep + "d" + os.sep in p]
  assert data_files
  if damage == "metadata missing":
    os.remove(tmp_path / "4" / "state" / "_METADATA")
  for path in data_files if damage != "metadata missing" else ():
    if damage == "missing":
      os.remove(path)
    else:
      os.truncate(path, os.path.getsize(path) // 2)
  with pytest.warns(CheckpointWarning, match="step 4 .* is damaged"):
    step, _, _ = Checkpointer(str(tmp_path)).restore_latest(abstract)
  assert step == 2
  assert [p.name.split("-")[0] for p in tmp_path.iterdir() if ".corrupt" in p.name] == [
      "4.corrupt"]


def _damage_every_step(folder):
  for path in _files(folder):
    if os.sep + "d" + os.sep in path:
      os.truncate(path, os.path.getsize(path) // 2)


def test_a_folder_of_damaged_steps_only_is_an_error_that_moves_nothing(tmp_path, abstract):
  _saved(tmp_path, [2, 4])
  _damage_every_step(tmp_path)
  before = _files(tmp_path)
  with pytest.raises(CheckpointDamagedError, match="step 4: .*step 2: .*start_over_if_all_dam"):
    Checkpointer(str(tmp_path)).restore_latest(abstract)
  assert _files(tmp_path) == before


def test_a_run_that_may_start_over_sets_every_damaged_step_aside(tmp_path, abstract):
  _saved(tmp_path, [2, 4])
  _damage_every_step(tmp_path)
  with pytest.warns(CheckpointWarning):
    assert Checkpointer(str(tmp_path), start_over_if_all_damaged=True).restore_latest(
        abstract) is None
  assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["2.corrupt", "4.corrupt"]


@pytest.mark.parametrize("failure", [
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1073741824 bytes"),
    PermissionError(13, "Permission denied", "/ckpt/4/state/d/0"),
    ValueError("UNAVAILABLE: Error reading local file: Connection reset"),
], ids=["out-of-memory", "permission", "unavailable"])
def test_a_read_that_fails_for_another_reason_is_raised_and_moves_nothing(
    tmp_path, abstract, failure):
  _saved(tmp_path, [2, 4])
  before = _files(tmp_path)
  checkpointer = Checkpointer(str(tmp_path))

  def fail(*args, **kwargs):
    raise failure

  checkpointer._manager.restore = fail
  with pytest.raises(type(failure)) as raised:
    checkpointer.restore_latest(abstract)
  assert raised.value is failure
  assert _files(tmp_path) == before


def test_an_empty_directory_is_an_error_not_the_working_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="checkpoint.directory is empty"):
    Checkpointer("")
  assert not list(tmp_path.iterdir())


def test_a_gs_directory_reaches_orbax_as_a_url(monkeypatch):
  seen = []
  monkeypatch.setattr(ocp, "CheckpointManager", lambda directory, **kwargs: seen.append(directory))
  checkpointer = Checkpointer("gs://bucket/coa/run/ckpt")
  assert checkpointer.directory == "gs://bucket/coa/run/ckpt"
  assert [type(p).__name__ for p in seen] == ["PosixGPath"]
  assert str(seen[0]) == "gs://bucket/coa/run/ckpt"


@pytest.mark.parametrize("run, difference", [
    (dict(shape=(32,)), r"w: saved float32\[64\], this run float32\[32\]"),
    (dict(dtype=jnp.bfloat16), r"w: saved float32\[64\], this run bfloat16\[64\]"),
    (dict(name="v"), "v: not in the checkpoint.*w: in the checkpoint, not in this run"),
])
def test_a_step_that_does_not_fit_the_run_is_an_error_that_moves_nothing(
    tmp_path, single_device_mesh, run, difference):
  _saved(tmp_path, [2, 4])
  before = _files(tmp_path)
  with pytest.raises(CheckpointMismatchError, match=f"step 4 .*nothing was moved.*{difference}"):
    Checkpointer(str(tmp_path)).restore_latest(_abstract(single_device_mesh, **run))
  assert _files(tmp_path) == before


def test_a_step_saved_on_another_mesh_is_an_error(tmp_path):
  two = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  four = sharding.make_mesh((4, 1, 1), devices=jax.devices()[:4])
  checkpointer = Checkpointer(str(tmp_path), async_save=False)
  w = jax.device_put(jnp.zeros((64,)), NamedSharding(two, P("data")))
  checkpointer.save(1, {"w": w}, {})
  checkpointer.close()
  abstract = {"w": jax.ShapeDtypeStruct((64,), jnp.float32,
                                        sharding=NamedSharding(four, P("data")))}
  with pytest.raises(CheckpointMismatchError, match=r"w: saved on mesh \{'data': 2"):
    Checkpointer(str(tmp_path)).restore_latest(abstract)
