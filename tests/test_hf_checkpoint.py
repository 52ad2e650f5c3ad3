"""HF checkpoints: logit parity with transformers, sharded loading, export, clear errors."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_logits, make_hf_model

from coa_jax.model import Transformer
from coa_jax.runtime import hf_checkpoint, safetensors_io, sharding
from coa_jax.runtime.sharding import param_shardings

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=16)

CASES = {
    "qwen2-gqa2-untied": ("qwen2", dict()),
    "qwen2-mqa-tied": ("qwen2", dict(tie=True, kv_heads=1)),
    "qwen2-mha-6heads": ("qwen2", dict(hidden=48, heads=6, kv_heads=6, layers=3)),
    "llama-gqa4-llama3rope": ("llama", dict(heads=8, kv_heads=2, rope_scaling=LLAMA3_SCALING)),
    "llama-tied-headdim16": ("llama", dict(tie=True, head_dim=16, layers=1)),
}


def _ids(vocab=96, shape=(2, 40), seed=0):
  return np.random.RandomState(seed).randint(0, vocab, shape)


def _ours(config, params, ids):
  return np.asarray(Transformer(config).apply({"params": params}, ids))


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, attention, tmp_path):
  family, kwargs = CASES[case]
  model = make_hf_model(family, **kwargs)
  model.save_pretrained(tmp_path)
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path), attention_impl=attention,
                                                 attention_block=16)
  ids = _ids()
  reference = hf_logits(model, ids)
  assert np.abs(reference).max() > 0.1  # logits are not trivially tiny
  assert np.abs(_ours(config, params, ids) - reference).max() <= 1e-4


def test_llama3_rope_scaling_is_read_from_config(tmp_path):
  make_hf_model("llama", rope_scaling=LLAMA3_SCALING).save_pretrained(tmp_path)
  config, _ = hf_checkpoint.load_checkpoint(str(tmp_path))
  assert config.rope_scaling.factor == 8.0
  assert config.rope_scaling.original_max_position_embeddings == 16


def test_sharded_folder_with_index_loads(tmp_path):
  model = make_hf_model("qwen2", layers=3)
  model.save_pretrained(tmp_path, max_shard_size="40KB")
  assert os.path.isfile(tmp_path / hf_checkpoint.INDEX_FILE)
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path))
  ids = _ids()
  assert np.abs(_ours(config, params, ids) - hf_logits(model, ids)).max() <= 1e-4


@pytest.mark.parametrize("family,kwargs", [("qwen2", {}), ("llama", dict(tie=True))])
def test_export_reloads_in_transformers(family, kwargs, tmp_path):
  model = make_hf_model(family, **kwargs)
  model.save_pretrained(tmp_path / "src")
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path / "src"))
  files = hf_checkpoint.save_checkpoint(str(tmp_path / "out"), config, params, dtype="float32",
                                        max_shard_bytes=30_000)
  assert len(files) > 1 and os.path.isfile(tmp_path / "out" / hf_checkpoint.INDEX_FILE)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  ids = _ids()
  assert np.abs(hf_logits(reloaded, ids) - _ours(config, params, ids)).max() <= 1e-4


def test_load_places_params_with_target_shardings(tmp_path):
  model = make_hf_model("qwen2", heads=4, kv_heads=4, intermediate=64, vocab=96)
  model.save_pretrained(tmp_path)
  mesh = sharding.make_mesh((2, 2, 2))
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path), mesh)
  expected = param_shardings(Transformer(config), mesh)
  got = jax.tree_util.tree_map(lambda a: a.sharding.spec, params)
  assert got == jax.tree_util.tree_map(lambda s: s.spec, expected)
  ids = _ids(shape=(4, 16))
  with sharding.activate(mesh):
    logits = np.asarray(jax.jit(Transformer(config).apply)({"params": params}, ids))
  assert np.abs(logits - hf_logits(model, ids)).max() <= 1e-4


@pytest.fixture
def saved_qwen(tmp_path):
  make_hf_model("qwen2").save_pretrained(tmp_path)
  return tmp_path


def _edit_config(folder, **changes):
  config = json.loads((folder / "config.json").read_text())
  config.update(changes)
  (folder / "config.json").write_text(json.dumps(config))


def test_missing_config_is_named(tmp_path):
  with pytest.raises(hf_checkpoint.CheckpointError, match="no config.json"):
    hf_checkpoint.load_checkpoint(str(tmp_path))


def test_config_that_is_not_json_is_named(tmp_path):
  (tmp_path / "config.json").write_text('{"model_type": ')
  with pytest.raises(hf_checkpoint.CheckpointError) as raised:
    hf_checkpoint.load_checkpoint(str(tmp_path))
  assert str(raised.value) == (f"{tmp_path}/config.json: invalid JSON "
                               f"(Expecting value: line 1 column 16 (char 15))")


def test_missing_tensor_is_named(saved_qwen):
  _edit_config(saved_qwen, num_hidden_layers=3)
  with pytest.raises(hf_checkpoint.CheckpointError,
                     match=r"'model.layers.2.input_layernorm.weight' is missing"):
    hf_checkpoint.load_checkpoint(str(saved_qwen))


def test_shape_mismatch_is_named(saved_qwen):
  _edit_config(saved_qwen, intermediate_size=80)
  with pytest.raises(hf_checkpoint.CheckpointError,
                     match=r"mlp.gate_proj.weight' has shape \(64, 32\), expected \(80, 32\)"):
    hf_checkpoint.load_checkpoint(str(saved_qwen))


def test_missing_safetensors_file_is_named(saved_qwen):
  (saved_qwen / "model.safetensors").unlink()
  with pytest.raises(hf_checkpoint.CheckpointError, match="no \\*.safetensors files"):
    hf_checkpoint.load_checkpoint(str(saved_qwen))


def test_a_shard_the_index_lists_but_the_folder_lacks_is_named(saved_qwen):
  weight_map = {"model.norm.weight": "model.safetensors",
                "lm_head.weight": "model-00002-of-00002.safetensors"}
  (saved_qwen / hf_checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(hf_checkpoint.CheckpointError) as raised:
    hf_checkpoint.load_checkpoint(str(saved_qwen))
  assert str(raised.value) == (f"{saved_qwen}: {hf_checkpoint.INDEX_FILE} lists "
                               f"model-00002-of-00002.safetensors, which is missing")


def test_truncated_safetensors_is_named(saved_qwen):
  path = saved_qwen / "model.safetensors"
  path.write_bytes(path.read_bytes()[:-100])
  with pytest.raises(safetensors_io.SafetensorsError, match="truncated or has bad offsets"):
    hf_checkpoint.load_checkpoint(str(saved_qwen))


def test_unsupported_architecture_is_named(saved_qwen):
  _edit_config(saved_qwen, model_type="gpt2")
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    hf_checkpoint.load_checkpoint(str(saved_qwen))


def test_bfloat16_checkpoint_loads_and_exports(tmp_path):
  model = make_hf_model("qwen2")
  model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path / "bf16"))
  assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(params))
  ids = _ids()
  upcast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16",
                                                             dtype=torch.float32).eval()
  reference = hf_logits(upcast, ids)  # the same bf16-rounded weights, float32 compute
  assert np.abs(_ours(config, params, ids) - reference).max() <= 1e-4
  hf_checkpoint.save_checkpoint(str(tmp_path / "out"), config, params, dtype="bfloat16")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert reloaded.dtype == torch.bfloat16
  for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
    assert torch.equal(a.to(torch.bfloat16), b), name


@pytest.mark.parametrize("tie", [True, False])
def test_added_tokens_get_mean_embedding_rows(tmp_path, tie):
  model = make_hf_model("qwen2", tie=tie, vocab=96)
  model.save_pretrained(tmp_path)
  config, params = hf_checkpoint.load_checkpoint(str(tmp_path), vocab_size=100,
                                                 mean_init_ids=[90])
  hf_embed = model.model.embed_tokens.weight.detach().numpy()
  mean = np.delete(hf_embed, 90, axis=0).mean(axis=0)
  embedding = np.asarray(params["embedding"])
  assert config.vocab_size == 100 and embedding.shape == (100, 32)
  np.testing.assert_allclose(embedding[:90], hf_embed[:90])
  np.testing.assert_allclose(embedding[[90, 96, 97, 98, 99]], np.tile(mean, (5, 1)), rtol=1e-6)
  if not tie:
    head = np.asarray(params["lm_head"])
    hf_head = model.lm_head.weight.detach().numpy()
    np.testing.assert_allclose(head[:, :90], hf_head[:90].T)
    np.testing.assert_allclose(head[:, 99], np.delete(hf_head, 90, axis=0).mean(axis=0),
                               rtol=1e-6)
  ids = _ids(vocab=90)  # the original tokens still give the original logits
  np.testing.assert_allclose(_ours(config, params, ids)[..., :90],
                             hf_logits(model, ids)[..., :90], atol=1e-4)


def test_grown_vocabulary_loads_sharded(tmp_path):
  make_hf_model("qwen2", heads=4, kv_heads=4, vocab=96).save_pretrained(tmp_path)
  _, params = hf_checkpoint.load_checkpoint(str(tmp_path), sharding.make_mesh((1, 2, 4)),
                                            vocab_size=104)
  assert params["embedding"].shape == (104, 32)
  assert params["embedding"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


def test_a_model_config_contradicting_the_checkpoint_is_named(tmp_path, single_device_mesh):
  from coa_jax.model import ConfigError

  make_hf_model("qwen2", layers=2).save_pretrained(tmp_path / "hf")
  with pytest.raises(ConfigError, match=r"num_layers=1 \(checkpoint: 2\)"):
    hf_checkpoint.load_checkpoint(str(tmp_path / "hf"), single_device_mesh, num_layers=1)
  config, _ = hf_checkpoint.load_checkpoint(str(tmp_path / "hf"), single_device_mesh,
                                            num_layers=2, remat="full", vocab_size=128)
  assert (config.num_layers, config.remat, config.vocab_size) == (2, "full", 128)


def test_an_export_over_an_earlier_one_leaves_only_its_own_weights(tmp_path):
  first, second = (hf_checkpoint.load_checkpoint(_saved(tmp_path / f"src{seed}", seed))
                   for seed in (0, 1))
  out = str(tmp_path / "out")
  hf_checkpoint.save_checkpoint(out, *first, dtype="float32", max_shard_bytes=30_000)
  assert hf_checkpoint.save_checkpoint(out, *second, dtype="float32") == ["model.safetensors"]
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json",
                                                                  "model.safetensors"]
  config, params = hf_checkpoint.load_checkpoint(out)
  ids = _ids()
  np.testing.assert_array_equal(_ours(config, params, ids), _ours(*second, ids))


def _saved(folder, seed=0, **kwargs):
  make_hf_model("qwen2", seed=seed, **kwargs).save_pretrained(folder)
  return str(folder)


def test_sliding_window_attention_is_named(saved_qwen):
  from coa_jax.model import ConfigError

  # As transformers reads it: `layer_types`, or without them the layers from max_window_layers.
  for layer_types in (["full_attention", "sliding_attention"], None):
    _edit_config(saved_qwen, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                 layer_types=layer_types)
    with pytest.raises(ConfigError, match=r"layers \[1\] sliding-window attention \(window 8"):
      hf_checkpoint.load_checkpoint(str(saved_qwen))
  _edit_config(saved_qwen, use_sliding_window=False)  # Qwen2.5's own configs: full attention
  hf_checkpoint.load_checkpoint(str(saved_qwen))


def test_a_tied_checkpoint_holding_another_lm_head_is_named(tmp_path):
  folder = _saved(tmp_path / "tied", tie=True)
  file = safetensors_io.SafetensorsFile(f"{folder}/model.safetensors")
  tensors = {name: file.get(name) for name in file.names()}
  head = np.random.RandomState(0).randn(*tensors["model.embed_tokens.weight"].shape)
  safetensors_io.write_safetensors(f"{folder}/model.safetensors", [
      (name, value.shape, value.dtype, lambda v=value: v)
      for name, value in {**tensors, "lm_head.weight": head.astype(np.float32)}.items()])
  with pytest.raises(hf_checkpoint.CheckpointError, match="set tie_word_embeddings to false"):
    hf_checkpoint.load_checkpoint(folder)


def test_a_checkpoints_model_section_may_grow_the_vocabulary(tmp_path, single_device_mesh):
  from coa_jax.data.tokenizer import default_tokenizer
  from coa_jax.model import ModelSettings

  tokenizer = default_tokenizer("plain")
  model = ModelSettings.from_section({"checkpoint": _saved(tmp_path / "hf"),
                                      "vocab_size": tokenizer.vocab_size + 64})
  config, _ = hf_checkpoint.load_model(model, tokenizer, single_device_mesh)
  assert config.vocab_size == tokenizer.vocab_size + 64
