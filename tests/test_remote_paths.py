"""Folders that name a remote store stay URLs: an HF export and a training job's workdir under
gs:// reach the storage layer (etils' epath, here over a local stand-in for the bucket) as
gs:// paths, never as `<cwd>/gs:/...`; outputs that only local files hold refuse a URL."""

import os

import pytest
from etils.epath import gpath
from etils.epath import testing as epath_testing
from hf_reference import make_hf_model

from coa_jax.model import ConfigError
from coa_jax.runtime import hf_checkpoint, paths
from coa_jax.train import writers
from coa_jax.train.loop import plot_metrics

OPS = ("open", "makedirs", "mkdir", "replace", "rename", "exists", "isdir", "listdir", "stat")


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """Serves gs:// from tmp_path/"gcs" and returns the paths naming "gs:" that the storage layer
  was asked for (a URL, or a URL taken for a local path: `<cwd>/gs:/...`); the test runs in a
  fresh working folder, where such a local path would land."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # take the mocked backend
  asked, root = [], str(tmp_path / "gcs") + "/"
  local = lambda path: str(path).replace("gs://", root)  # noqa: E731

  def serve(name):
    def op(original, path, *args, **kwargs):
      if "gs:" in str(path):
        asked.append(str(path))
      return original(local(path), *(local(a) if name in ("replace", "rename") else a
                                     for a in args), **kwargs)
    return op

  with epath_testing.mock_epath(**{name: serve(name) for name in OPS}):
    yield asked


def test_paths_keep_a_url_and_make_a_local_path_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert paths.resolve("gs://bucket/run") == "gs://bucket/run"
  assert paths.resolve("run/ckpt") == str(tmp_path / "run" / "ckpt")


def test_an_hf_export_to_gs_reaches_the_store_as_a_url(bucket, tmp_path):
  make_hf_model("qwen2").save_pretrained(tmp_path / "src")
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path / "src"))
  hf_checkpoint.save_checkpoint("gs://bucket/run/export", config, params, dtype="float32")
  hf_checkpoint.save_checkpoint(str(tmp_path / "local"), config, params, dtype="float32")
  assert bucket and all(p.startswith("gs://bucket/run/export") for p in bucket)
  assert not os.path.exists(tmp_path / "gs:")
  for name in ("config.json", hf_checkpoint.SINGLE_FILE):  # the same bytes as a local export
    with open(tmp_path / "gcs" / "bucket" / "run" / "export" / name, "rb") as remote, \
        open(tmp_path / "local" / name, "rb") as local:
      assert remote.read() == local.read()


def test_a_workdir_on_gs_gets_the_metrics_and_the_plot(bucket, tmp_path):
  writer = writers.MetricWriter("gs://bucket/run/work", append=False)
  for step in (1, 2):
    writer.write_scalars(step, {"loss": 1.0 / step})
  writer.close()
  plot_metrics("gs://bucket/run/work/metrics.jsonl", "gs://bucket/run/work/loss.png", ("loss",))
  assert bucket and all(p.startswith("gs://bucket/run/work") for p in bucket)
  work = tmp_path / "gcs" / "bucket" / "run" / "work"
  assert (work / "metrics.jsonl").read_text().count("\n") == 2
  assert (work / "loss.png").read_bytes()[:4] == b"\x89PNG"
  assert len(os.listdir(work / "tensorboard")) == 1


def test_an_output_that_only_local_files_hold_refuses_a_url():
  with pytest.raises(ConfigError, match="output_dir='gs://bucket/eval' names a remote store"):
    paths.local("gs://bucket/eval", "output_dir")
