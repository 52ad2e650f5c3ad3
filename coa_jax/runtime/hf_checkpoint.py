"""Load HF checkpoint folders into sharded params and export params back, without torch.

Loading places every parameter with its target sharding through
`jax.make_array_from_callback`: each addressable device shard is read from the memory-mapped
safetensors files on its own, so from local files a host only ever reads the slices its devices
hold, and no tensor (let alone a 32B checkpoint) is materialized whole on one device; from a
bucket, each tensor's whole byte range is read once.

A folder is local or a URL (gs://bucket/run/export): every file is read and written through
`runtime.paths`, so one stage's export in a bucket is the next stage's checkpoint. An export is
a folder transformers loads whole: beside the weights and config.json, the files a job passes
(`files`: the tokenizer, its chat template, the generation defaults and the tag mapping,
`coa_jax.data.hf_tokenizer.export_files`); config.json is written last.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from coa_jax.model.config import ModelConfig, ModelSettings, from_hf_config, to_hf_config
from coa_jax.model.transformer import Transformer
from coa_jax.runtime import distributed, paths
from coa_jax.runtime import sharding as sharding_lib
from coa_jax.runtime.safetensors_io import SafetensorsFile, write_safetensors
from coa_jax.runtime.sharding import param_shardings

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint folder is missing files or tensors, or holds tensors of the wrong shape."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """How one parameter maps to HF tensors: name template, HF shape, HF <-> ours layout."""

  path: tuple[str, ...]
  hf_name: str  # with "{layer}" for per-layer tensors
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  vocab_axis: int | None = None  # the vocabulary axis in our layout (embedding, lm_head)

  @property
  def stacked(self) -> bool:
    return "{layer}" in self.hf_name


def _identity(x):
  return x


def _tensor_map(cfg: ModelConfig, head: str = "lm") -> list[_Tensor]:
  """Returns the mapping of every parameter of `cfg`'s model to HF tensor names and layouts;
  head="value" maps a value model's head to a token classifier's one-label `score` (verl's
  critic format)."""
  d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  n, k = cfg.num_heads, cfg.num_kv_heads
  layer = "model.layers.{layer}."
  out = [
      _Tensor(("embedding",), "model.embed_tokens.weight", (cfg.vocab_size, d),
              _identity, _identity, vocab_axis=0),
      _Tensor(("final_norm", "scale"), "model.norm.weight", (d,), _identity, _identity),
      _Tensor(("layers", "input_norm", "scale"), layer + "input_layernorm.weight", (d,),
              _identity, _identity),
      _Tensor(("layers", "post_attn_norm", "scale"), layer + "post_attention_layernorm.weight",
              (d,), _identity, _identity),
      _Tensor(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight",
              (d, n * h), lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T),
  ]
  for name, heads in (("q_proj", n), ("k_proj", k), ("v_proj", k)):
    hf = layer + f"self_attn.{name}."
    out.append(_Tensor(("layers", "attn", name, "kernel"), hf + "weight", (heads * h, d),
                       lambda w, heads=heads: w.T.reshape(d, heads, h),
                       lambda w, heads=heads: w.reshape(d, heads * h).T))
    if cfg.qkv_bias:
      out.append(_Tensor(("layers", "attn", name, "bias"), hf + "bias", (heads * h,),
                         lambda b, heads=heads: b.reshape(heads, h),
                         lambda b, heads=heads: b.reshape(heads * h)))
  for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
    out.append(_Tensor(("layers", "mlp", name, "kernel"), layer + f"mlp.{name}.weight", shape,
                       lambda w: w.T, lambda w: w.T))
  if head == "value":
    out.append(_Tensor(("value_head",), "score.weight", (1, d), lambda w: w.T, lambda w: w.T))
  elif not cfg.tie_embeddings:
    out.append(_Tensor(("lm_head",), "lm_head.weight", (cfg.vocab_size, d),
                       lambda w: w.T, lambda w: w.T, vocab_axis=1))
  return out


def _names(t: _Tensor, cfg: ModelConfig) -> list[str]:
  if not t.stacked:
    return [t.hf_name]
  return [t.hf_name.format(layer=i) for i in range(cfg.num_layers)]


def read_hf_config(folder: str) -> dict[str, Any]:
  """Returns the parsed config.json of an HF checkpoint folder (local or a URL)."""
  path = os.path.join(folder, "config.json")
  if not paths.to_epath(path).is_file():
    raise CheckpointError(f"{folder}: no config.json (is this an HF checkpoint folder?)")
  return _read_json(path)


def _read_json(path: str) -> Any:
  try:
    return json.loads(paths.to_epath(path).read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: invalid JSON ({e})") from None


class _TensorSource:
  """Finds each HF tensor in a folder's safetensors files (single file or sharded with index)."""

  def __init__(self, folder: str):
    index_path = os.path.join(folder, INDEX_FILE)
    if paths.to_epath(index_path).is_file():
      weight_map: dict[str, str] = _read_json(index_path)["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      root = paths.to_epath(folder)
      files = sorted(p.name for p in (root.iterdir() if root.is_dir() else ())
                     if p.name.endswith(".safetensors") and not p.name.startswith("."))
      if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX_FILE}")
      weight_map = None
    self._files: dict[str, SafetensorsFile] = {}
    for name in files:
      path = os.path.join(folder, name)
      if weight_map is not None and not paths.to_epath(path).is_file():
        raise CheckpointError(f"{folder}: {INDEX_FILE} lists {name}, which is missing")
      self._files[name] = SafetensorsFile(path)
    if weight_map is None:
      weight_map = {t: name for name, file in self._files.items() for t in file.names()}
    self._where = weight_map
    self.folder = folder

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def shape(self, name: str) -> tuple[int, ...]:
    if name not in self._where:
      raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
    return self._files[self._where[name]].shape(name)

  def check(self, name: str, shape: tuple[int, ...]) -> None:
    found = self.shape(name)
    if found != shape:
      raise CheckpointError(f"{self.folder}: tensor {name!r} has shape {found}, "
                            f"expected {shape} from config.json")

  def get(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get(name)


def load_params(folder: str, config: ModelConfig, shardings: Any,
                mean_init_ids: Sequence[int] = ()) -> Any:
  """Returns params read from `folder`, each placed with its sharding from `shardings`.

  When `config.vocab_size` exceeds the checkpoint's (tokens were added, e.g. the CoA tags),
  the new embedding and LM-head rows are the mean of the checkpoint's rows; rows listed in
  `mean_init_ids` (new tokens that fall inside an already padded vocabulary) get the mean too.
  A LoRA model's weights are its frozen base: they are read straight into the compute dtype
  (a 32B base in bf16 is 64 GB; in float32 it would pass through 128).
  """
  source = _TensorSource(folder)
  source_vocab = source.shape("model.embed_tokens.weight")[0]
  if source_vocab > config.vocab_size:
    raise CheckpointError(f"{folder}: the checkpoint has {source_vocab} vocabulary rows, more "
                          f"than vocab_size={config.vocab_size}")
  source_config = config.replace(vocab_size=source_vocab)
  tensors = _tensor_map(source_config)
  for t in tensors:  # validate every name and shape before reading any data
    for name in _names(t, config):
      source.check(name, t.hf_shape)
  if config.tie_embeddings and "lm_head.weight" in source:
    head, embedding = source.get("lm_head.weight"), source.get("model.embed_tokens.weight")
    if head.shape != embedding.shape or not np.array_equal(head, embedding):
      raise CheckpointError(
          f"{folder}: config.json ties the embeddings (tie_word_embeddings) but the weights "
          f"hold an lm_head.weight that differs from them, which transformers loads as an "
          f"untied head: set tie_word_embeddings to false in config.json to load that head")
  dtype = config.compute_dtype if config.lora_rank else config.params_dtype
  mean_ids = np.asarray(sorted(set(int(i) for i in mean_init_ids)), np.int64)
  if mean_ids.size and (mean_ids.min() < 0 or mean_ids.max() >= config.vocab_size):
    raise CheckpointError(f"mean_init_ids must lie in [0, {config.vocab_size})")
  params: dict[str, Any] = {}
  for t in tensors:
    names = _names(t, config)
    ours_shape = list(jax.eval_shape(t.to_ours, jax.ShapeDtypeStruct(t.hf_shape, dtype)).shape)
    if t.vocab_axis is not None:
      ours_shape[t.vocab_axis] = config.vocab_size
      read = _vocab_reader(t.to_ours(source.get(names[0])), t.vocab_axis, source_vocab,
                           config.vocab_size, mean_ids, dtype)
    elif t.stacked:
      read = lambda index, t=t, names=names: np.stack(
          [np.asarray(t.to_ours(source.get(names[i]))[index[1:]], dtype=dtype)
           for i in range(len(names))[index[0]]])
    else:
      read = lambda index, t=t, names=names: np.asarray(
          t.to_ours(source.get(names[0]))[index], dtype=dtype)
    shape = ((config.num_layers,) if t.stacked else ()) + tuple(ours_shape)
    node = params
    for key in t.path[:-1]:
      node = node.setdefault(key, {})
    sharding = _lookup(shardings, t.path)
    node[t.path[-1]] = jax.make_array_from_callback(shape, sharding, read, dtype=dtype)
  return params


def _vocab_reader(array: np.ndarray, axis: int, source_vocab: int, target_vocab: int,
                  mean_ids: np.ndarray, dtype) -> Callable:
  """Returns a shard reader over a vocabulary-indexed array (our layout) whose rows past
  `source_vocab`, and rows in `mean_ids`, read as the mean of the other checkpoint rows."""
  cache = []

  def mean_row() -> np.ndarray:
    if not cache:
      keep = np.setdiff1d(np.arange(source_vocab), mean_ids)
      cache.append(np.take(array, keep, axis=axis).astype(np.float64).mean(axis=axis,
                                                                            keepdims=True))
    return cache[0]

  def read(index):
    rows = np.arange(target_vocab)[index[axis]]
    rest = tuple(slice(None) if a == axis else index[a] for a in range(array.ndim))
    base = array[rest]
    out = np.broadcast_to(mean_row()[rest], _with_axis(base.shape, axis, len(rows)))
    out = out.astype(dtype)
    from_file = (rows < source_vocab) & ~np.isin(rows, mean_ids)
    if from_file.any():
      selector = [slice(None)] * array.ndim
      selector[axis] = np.flatnonzero(from_file)
      out[tuple(selector)] = np.take(base, rows[from_file], axis=axis)
    return out

  return read


def _with_axis(shape: tuple[int, ...], axis: int, size: int) -> tuple[int, ...]:
  return tuple(size if a == axis else s for a, s in enumerate(shape))


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def load_checkpoint(folder: str, mesh: Mesh | None = None, vocab_size: int | None = None,
                    mean_init_ids: Sequence[int] = (),
                    **config_overrides: Any) -> tuple[ModelConfig, Any]:
  """Returns (config, params) of an HF folder, params sharded over `mesh` (default: this host's
  first device).

  `vocab_size` grows the vocabulary to fit added tokens (e.g. `CoATokenizer.vocab_size`);
  new rows, and rows listed in `mean_init_ids`, start as the mean embedding. Other
  `config_overrides` set numerics such as dtype, param_dtype, remat or attention_impl.
  """
  config = from_hf_config(read_hf_config(folder), **config_overrides)
  if vocab_size is not None and vocab_size > config.vocab_size:
    config = config.replace(vocab_size=vocab_size)
  if mesh is None:  # this host's first device (the global first is only process 0's)
    mesh = sharding_lib.make_mesh((1, 1, 1), devices=jax.local_devices()[:1])
  sharding_lib.check_model_fits_mesh(config, mesh)
  shardings = param_shardings(Transformer(config), mesh)
  return config, load_params(folder, config, shardings, mean_init_ids)


def _to_host(x: jax.Array) -> np.ndarray:
  """Returns the full value of a (possibly multi-host) global array on every host."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_checkpoint(folder: str, config: ModelConfig, params: Any, dtype: str = "bfloat16",
                    max_shard_bytes: int = 4 << 30, head: str = "lm",
                    files: Mapping[str, str] | None = None) -> list[str]:
  """Writes params as an HF folder (config.json + safetensors, sharded with an index if large),
  with `files` ({name: text}: the tokenizer's, `hf_tokenizer.export_files`) beside them.

  head="value" writes a value model (`Transformer(head="value")`) as the family's
  `...ForTokenClassification` with one label and no bias, which transformers loads as verl's
  critic: its logits[..., 0] are our values.

  Arrays are fetched one layer slice at a time; every process takes part in the gathers,
  process 0 writes. Returns the written safetensors file names.
  """
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  items = []
  for t in _tensor_map(config, head):
    array = _lookup(params, t.path)
    for i, name in enumerate(_names(t, config)):
      piece = (lambda a=array, i=i: a[i]) if t.stacked else (lambda a=array: a)
      items.append((name, t.hf_shape, np_dtype,
                    lambda piece=piece, t=t: t.to_hf(_to_host(piece()))))
  shards: list[list] = [[]]
  size = 0
  for item in items:
    nbytes = int(np.prod(item[1])) * np_dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += nbytes
  shard_files = ([SINGLE_FILE] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                  for i in range(len(shards))])
  hf_config = to_hf_config(config, torch_dtype=dtype)
  if head == "value":
    hf_config.update(architectures=[hf_config["architectures"][0].replace(
        "ForCausalLM", "ForTokenClassification")], num_labels=1, id2label={"0": "VALUE"},
        label2id={"VALUE": 0}, token_classification_bias=False, classifier_dropout=0.0)
  jsons = {}
  if len(shard_files) > 1:
    weight_map = {item[0]: file for file, shard in zip(shard_files, shards) for item in shard}
    total = sum(int(np.prod(item[1])) * np_dtype.itemsize for item in items)
    jsons[INDEX_FILE] = {"metadata": {"total_size": total}, "weight_map": weight_map}
  jsons["config.json"] = hf_config  # written last (`written_last`)
  # An earlier export's weights go first (config.json first of all): with another shard count
  # its files would stay beside these, and a loader could read them instead.
  _write_on_process_0(folder, list(zip(shard_files, shards)), jsons, f"hf export {folder}",
                      files, stale=("config.json", INDEX_FILE, "model*.safetensors"))
  return shard_files


def written_last(folder: str) -> str:
  """Returns the path of the file an export writes last (config.json): the folder holds a whole
  export once it exists (a killed export leaves the folder without it)."""
  return os.path.join(folder, "config.json")


def _write_on_process_0(folder: str, safetensors: list[tuple[str, list]],
                        jsons: dict[str, Any], where: str,
                        texts: Mapping[str, str] | None = None,
                        stale: Sequence[str] = ()) -> None:
  """Collective: process 0 deletes the files of `folder` (local or a URL) that the `stale`
  patterns match, in their order, then writes `safetensors` ((file, tensors) pairs), `texts`
  (file: text) and `jsons` (file: value, the last one last) into it, while every process
  produces each tensor (the gathers of sharded arrays). A write that fails on process 0 (a full
  disk, a read-only folder) lets the gathers run to the end, then raises on every process
  (`FirstError`), so none waits."""
  writer, errors = jax.process_index() == 0, distributed.FirstError()
  if writer:
    out = paths.to_epath(folder)
    errors.run(lambda: out.mkdir(parents=True, exist_ok=True))
    for pattern in stale:
      errors.run(lambda p=pattern: [path.unlink() for path in out.glob(p)])
  for file, tensors in safetensors:
    produced = 0

    def counted(produce: Callable[[], np.ndarray]) -> np.ndarray:
      nonlocal produced
      produced += 1
      return produce()

    if writer:
      errors.run(write_safetensors, os.path.join(folder, file),
                 [(*t[:3], lambda p=t[3]: counted(p)) for t in tensors], {"format": "pt"})
    for *_, produce in tensors[produced:]:  # the gathers a failed or absent write left
      produce()
  for file, text in (texts or {}).items() if writer else ():
    errors.run(lambda f=file, t=text: paths.to_epath(os.path.join(folder, f)).write_text(t))
  for file, value in jsons.items() if writer else ():
    errors.run(lambda f=file, v=value: paths.to_epath(os.path.join(folder, f)).write_text(
        json.dumps(v, indent=2)))
  errors.raise_together(where)  # also: no process reads the folder before it is written


ADAPTER_FILE = "adapter_model.safetensors"


def save_adapters(folder: str, config: ModelConfig, adapters: Any, base_checkpoint: str = "",
                  dtype: str = "float32", files: Mapping[str, str] | None = None) -> None:
  """Writes LoRA adapters (`lora.split`'s second tree) in PEFT's format: adapter_config.json
  and adapter_model.safetensors, which `peft.PeftModel.from_pretrained` puts onto the HF base
  model, with `files` beside them (the tokenizer's, as `save_checkpoint`'s: the base model's
  tokenizer lacks the tags). PEFT's lora_A.weight is (rank, in) and lora_B.weight (out, rank),
  in and out flattened as the kernels' HF layouts flatten them; trained embedding and LM-head
  rows go as PEFT stores them (`_token_row_tensors`). Every process takes part in the gathers;
  process 0 writes."""
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  items, token_rows_config = _token_row_tensors(config, adapters, np_dtype)
  for t in _tensor_map(config):
    *parent, leaf = t.path
    if leaf != "kernel" or parent[-1] not in config.lora_targets:
      continue
    rank = config.lora_rank
    for key, hf_key, layout in (("lora_a", "lora_A", lambda a: a.reshape(-1, rank).T),
                                ("lora_b", "lora_B", lambda b: b.reshape(rank, -1).T)):
      array = _lookup(adapters, (*parent, key))
      shape = layout(np.zeros(array.shape[1:], np.int8)).shape
      for i, name in enumerate(_names(t, config)):
        items.append(("base_model.model." + name.replace(".weight", f".{hf_key}.weight"), shape,
                      np_dtype, lambda a=array, i=i, layout=layout: layout(_to_host(a[i]))))
  adapter_config = dict(
      peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_checkpoint,
      r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
      target_modules=sorted(config.lora_targets), bias="none", fan_in_fan_out=False,
      use_rslora=False, inference_mode=True, **token_rows_config)
  _write_on_process_0(folder, [(ADAPTER_FILE, items)], {"adapter_config.json": adapter_config},
                      f"adapter export {folder}", files)


def _token_row_tensors(config: ModelConfig, trained: Any,
                       np_dtype: np.dtype) -> tuple[list, dict[str, Any]]:
  """Returns (tensors, adapter_config entries) of the embedding and LM-head rows that train
  beside LoRA's adapters, as PEFT 0.21 stores them: the rows of `trained_token_ids` as
  TrainableTokens' `trainable_tokens_delta` (the rows themselves, not a difference) with
  `trainable_token_indices` (a list when the head is tied to the embedding: PEFT ties it, else
  a list for embed_tokens and one for lm_head); the whole embedding and head ("all") as
  `modules_to_save`. None without either."""
  prefix = "base_model.model."
  host = lambda leaf, layout=lambda x: x: (  # noqa: E731
      lambda: layout(_to_host(trained[leaf])))
  if "embedding_rows" in trained:
    ids = list(config.trained_token_ids)
    rows = [("model.embed_tokens", "embedding_rows"), ("lm_head", "lm_head_rows")]
    tensors = [(f"{prefix}{module}.token_adapter.trainable_tokens_delta",
                trained[leaf].shape, np_dtype, host(leaf))
               for module, leaf in rows if leaf in trained]
    indices = ids if config.tie_embeddings else {"embed_tokens": ids, "lm_head": ids}
    return tensors, {"trainable_token_indices": indices}
  if "embedding" in trained:  # our lm_head is (embed, vocab); a tied head is the embedding
    head = ("lm_head", lambda x: x.T) if "lm_head" in trained else ("embedding", lambda x: x)
    shape = trained["embedding"].shape
    tensors = [(f"{prefix}model.embed_tokens.weight", shape, np_dtype, host("embedding")),
               (f"{prefix}lm_head.weight", shape, np_dtype, host(*head))]
    return tensors, {"modules_to_save": ["embed_tokens", "lm_head"]}
  return [], {}


def with_trained_token_ids(config: ModelConfig, tokenizer, source_vocab: int) -> ModelConfig:
  """Returns `config` with the token ids whose rows train beside LoRA's adapters
  (lora_train_embeddings="added_tokens", unless given): the tags the tokenizer added to its
  source tokenizer and every row past the checkpoint's `source_vocab` rows, which no base
  model trained (they start as the mean row, or as a padded vocabulary's untrained rows)."""
  if (not config.lora_rank or config.lora_train_embeddings != "added_tokens"
      or config.lora_trained_token_ids):
    return config
  ids = set(tokenizer.added_ids) | set(range(source_vocab, tokenizer.vocab_size))
  return config.replace(lora_trained_token_ids=tuple(sorted(ids)))


def load_model(model: ModelSettings, tokenizer, mesh) -> tuple[ModelConfig, Any]:
  """Returns (model config, params) from the HF folder `model.checkpoint`, or (model config,
  None) for a fresh model built from `model`; the vocabulary covers the tokenizer's, and a LoRA
  model's trained token rows are the tokens the checkpoint lacks (`with_trained_token_ids`). A
  folder that saved its tag mapping (a coa-jax export) is checked against the tokenizer's first
  (`CoATokenizer.check_saved`: a tag whose id moved is an error)."""
  sharding_lib.check_backend(model.get("attention_impl", "xla"), model.get("remat", "none"),
                             mesh)
  if model.checkpoint:
    tokenizer.check_saved(model.checkpoint)
    overrides = model.overrides  # a vocabulary grown further than the tokenizer's: kept
    vocab_size = max(tokenizer.vocab_size, overrides.pop("vocab_size", 0))
    model_config, params = load_checkpoint(model.checkpoint, mesh, vocab_size=vocab_size,
                                           **overrides)
    source_vocab = int(read_hf_config(model.checkpoint)["vocab_size"])
    return with_trained_token_ids(model_config, tokenizer, source_vocab), params
  model_config = model.fresh_config()
  if model_config.vocab_size < tokenizer.vocab_size:
    model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
  sharding_lib.check_model_fits_mesh(model_config, mesh)
  return model_config, None
