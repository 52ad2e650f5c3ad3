"""Folders that name a remote store stay URLs: an HF export and a training job's workdir under
gs:// reach the storage layer (etils' epath, here over a local stand-in for the bucket) as
gs:// paths, never as `<cwd>/gs:/...`; an export in a bucket (here fsspec's memory filesystem
serving gs://) is the next stage's checkpoint, tag mapping included; gs:// without gcsfs names
the extra to install; outputs that only local files hold refuse a URL."""

import importlib
import os

import jax
import ml_collections
import numpy as np
import pytest
from etils.epath import backend as epath_backend
from etils.epath import gpath
from etils.epath import testing as epath_testing
from fsspec.implementations.memory import MemoryFileSystem
from hf_reference import make_hf_model

from coa_jax.data import hf_tokenizer
from coa_jax.data import tokenizer as tk
from coa_jax.model import ConfigError, ModelSettings, Transformer, build_config
from coa_jax.runtime import hf_checkpoint, paths
from coa_jax.runtime.sharding import init_params
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


class FakeBucket(MemoryFileSystem):
  """gs:// in memory: fsspec's memory filesystem under gcsfs's protocols."""

  protocol = ("gs", "gcs")
  store: dict = {}
  pseudo_dirs = [""]

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      path = path[len(prefix):] if path.startswith(prefix) else path
    return super()._strip_protocol(path)


@pytest.fixture
def fsspec_gs(monkeypatch):
  """Serves gs:// through epath's fsspec backend from a fresh FakeBucket."""
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # fsspec, not TensorFlow
  registry = importlib.import_module("fsspec.registry")
  for protocol in FakeBucket.protocol:
    monkeypatch.setitem(registry._registry, protocol, FakeBucket)
  monkeypatch.setattr(FakeBucket, "store", {})
  monkeypatch.setattr(FakeBucket, "pseudo_dirs", [""])
  epath_backend.fsspec_backend._get_filesystem.cache_clear()  # it keeps one per protocol
  yield FakeBucket
  epath_backend.fsspec_backend._get_filesystem.cache_clear()


def test_an_export_in_a_bucket_is_the_next_stage_s_checkpoint(fsspec_gs, single_device_mesh):
  tokenizer = tk.default_tokenizer("plain", tool_tags=("code", "sql"))
  config = build_config({"preset": "tiny", "vocab_size": tokenizer.vocab_size, "num_layers": 1})
  params = init_params(Transformer(config), single_device_mesh, jax.random.key(0))
  hf_checkpoint.save_checkpoint("gs://bucket/run/export", config, params, dtype="float32",
                                files=hf_tokenizer.export_files(tokenizer))
  assert "/bucket/run/export/model.safetensors" in fsspec_gs.store
  stage = ml_collections.ConfigDict(dict(
      tokenizer=dict(path="default", template="plain"),
      model=dict(preset="tiny", checkpoint="gs://bucket/run/export")))
  loaded = tk.load_tokenizer(tk.TokenizerSettings(), stage.model.checkpoint)
  assert loaded.tag_map() == tokenizer.tag_map()
  reloaded, got = hf_checkpoint.load_model(ModelSettings.from_section(stage.model), loaded,
                                           single_device_mesh)
  assert reloaded == config
  for want, have in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(got)):
    np.testing.assert_array_equal(np.asarray(have), np.asarray(want))


def test_gs_without_gcsfs_names_the_extra_to_install(monkeypatch):
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # fsspec, not TensorFlow
  registry = importlib.import_module("fsspec.registry")
  monkeypatch.delitem(registry._registry, "gcs", raising=False)
  monkeypatch.setitem(registry.known_implementations, "gcs", {  # gcsfs as if not installed
      "class": "no_such_gcsfs.GCSFileSystem", "err": "Please install gcsfs"})
  with pytest.raises(paths.StoreUnavailableError) as raised:
    hf_checkpoint.read_hf_config("gs://bucket/run/export")
  assert str(raised.value) == ("gs://bucket/run/export/config.json: gs:// paths need gcsfs, "
                               "which is not installed: pip install 'coa-jax[gcs]' (or gcsfs "
                               "itself)")
