"""LoRA adapters on the model's projections (coa_jax/model/lora.py): a fresh adapter changes
nothing, merged adapters equal unmerged ones, and the adapters' shardings follow their kernels'.
The embedding and LM-head rows of the tokens the tokenizer adds train beside them: a LoRA SFT
from an HF base learns to choose the CoA tags only so, PEFT reloads them with the same logits,
and the pod fit counts them."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from coa_jax.model import ConfigError, ModelSettings, Transformer, get_preset
from coa_jax.model import lora
from coa_jax.model.config import LORA_TARGETS
from coa_jax.runtime import sharding
from coa_jax.train import optimizer
from coa_jax.train import state as state_lib
from coa_jax.train import step as step_lib

BASE = get_preset("tiny", num_layers=2)
LORA = BASE.replace(lora_rank=4, lora_alpha=8.0)
IDS = jax.random.randint(jax.random.key(1), (2, 12), 0, BASE.vocab_size)


@pytest.fixture(scope="module")
def params():
  return nn.unbox(jax.jit(Transformer(LORA).init)(jax.random.key(0), IDS)["params"])


@functools.cache
def _apply(config):
  """One jitted forward per config (a fresh lambda each call would compile again each call)."""
  return jax.jit(lambda p: Transformer(config).apply({"params": p}, IDS))


def _logits(config, params):
  return _apply(config)(params)


def test_adapters_sit_on_every_target_projection_with_b_at_zero(params):
  base, adapters = lora.split(params)
  attn, mlp = adapters["layers"]["attn"], adapters["layers"]["mlp"]
  assert set(attn) | set(mlp) == set(LORA_TARGETS)
  assert attn["q_proj"]["lora_a"].shape == (2, BASE.hidden_size, 4)  # layers, embed, rank
  assert attn["o_proj"]["lora_a"].shape == (2, BASE.num_heads, BASE.head_dim, 4)
  assert attn["o_proj"]["lora_b"].shape == (2, 4, BASE.hidden_size)
  assert not any(np.any(p["lora_b"]) for p in (*attn.values(), *mlp.values()))
  assert all(jax.tree_util.tree_leaves(optimizer.weight_decay_mask(adapters)))  # matrices
  assert sum(a.size for a in jax.tree_util.tree_leaves(adapters)) == LORA.lora_params()
  assert lora.combine(base, adapters).keys() == params.keys()
  assert jax.tree_util.tree_structure(lora.combine(base, adapters)) == (
      jax.tree_util.tree_structure(params))


def test_a_fresh_adapter_leaves_the_base_models_logits_exactly(params):
  base, _ = lora.split(params)
  np.testing.assert_array_equal(_logits(LORA, params), _logits(BASE, base))


def test_merged_adapters_give_the_unmerged_models_logits(params):
  _, adapters = lora.split(params)
  trained = jax.tree_util.tree_map(  # B as if trained: random, of a kernel's scale
      lambda a: jax.random.normal(jax.random.key(a.size), a.shape) * 0.05, adapters)
  full = lora.combine(lora.split(params)[0], trained)
  merged = lora.merge(full, LORA)
  assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(lora.split(full)[0])
  np.testing.assert_allclose(_logits(BASE, merged), _logits(LORA, full), rtol=2e-5, atol=2e-5)
  assert not np.allclose(_logits(BASE, merged), _logits(BASE, lora.split(full)[0]), atol=1e-3)


def test_targets_choose_the_projections_and_dropout_needs_an_rng(params):
  config = LORA.replace(lora_targets=("q_proj", "down_proj"), lora_dropout=0.5)
  variables = nn.unbox(jax.jit(Transformer(config).init)(jax.random.key(0), IDS))
  _, adapters = lora.split(variables["params"])
  assert set(adapters["layers"]["attn"]) == {"q_proj"} and set(adapters["layers"]["mlp"]) == {
      "down_proj"}
  b_set = jax.tree_util.tree_map(lambda a: jnp.ones_like(a) * 0.1, adapters)
  full = lora.combine(lora.split(variables["params"])[0], b_set)
  apply = jax.jit(lambda rngs: Transformer(config).apply({"params": full}, IDS, rngs=rngs))
  np.testing.assert_array_equal(apply({}), apply({}))  # no rng: no dropout
  assert not np.allclose(apply({"dropout": jax.random.key(1)}), apply({}))


def test_adapter_shardings_follow_their_kernels():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  shardings = sharding.param_shardings(Transformer(LORA), mesh)
  q, down = shardings["layers"]["attn"]["q_proj"], shardings["layers"]["mlp"]["down_proj"]
  assert q["lora_a"].spec == P(None, "fsdp", None)  # layers, embed, rank
  assert q["lora_b"].spec == P(None, None, "tensor", None)  # layers, rank, heads, head_dim
  assert down["lora_a"].spec == P(None, "tensor", None)  # layers, mlp, rank
  assert down["lora_b"].spec == P(None, None, "fsdp")  # layers, rank, embed


def test_lora_steps_on_eight_devices_equal_one_device(single_device_mesh):
  """Two steps of 2 micro-batches each, dropout on: the same adapters on a (2, 2, 2) mesh as on
  one device, the base weights untouched on both."""
  config = LORA.replace(lora_dropout=0.1)
  model, tx = Transformer(config), optax.adamw(1e-2, eps=1e-3)  # eps: as test_sharding
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 17))
  batch = step_lib.next_token_batch(tokens)
  ends = []
  for mesh in (single_device_mesh, sharding.make_mesh(sharding.MeshConfig(2, 2, 2))):
    state = state_lib.init_state(model, tx, mesh, jax.random.key(0))
    frozen = jax.device_get(state.frozen)
    step = step_lib.jit_train_step(model, tx, mesh, micro_batches=2)
    for _ in range(2):
      state, metrics = step(state, sharding.shard_batch(batch, mesh))
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.frozen), frozen)
    ends.append((jax.device_get(state.params), float(metrics["loss"])))
  (one, loss_one), (eight, loss_eight) = ends
  np.testing.assert_allclose(loss_eight, loss_one, rtol=1e-5)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), eight, one)
  assert np.any(one["layers"]["attn"]["q_proj"]["lora_b"])  # the adapters moved


@pytest.mark.parametrize("change, message", [
    (dict(lora_rank=-1), "lora_rank=-1"),
    (dict(lora_alpha=0.0), "lora_alpha=0.0"),
    (dict(lora_dropout=1.0), "lora_dropout=1.0"),
    (dict(lora_targets=("q_proj", "c_attn")), "lora_targets=.*expected one or more of"),
    (dict(lora_train_embeddings="rows"), "lora_train_embeddings='rows'"),
    (dict(lora_trained_token_ids=(7, 3)), r"lora_trained_token_ids=\(7, 3\): expected increasing"),
    (dict(lora_trained_token_ids=(3, 512)), r"in \[0, vocab_size=512\)"),
    (dict(lora_train_embeddings="all", lora_trained_token_ids=(3,)),
     "train only with 'added_tokens'"),
])
def test_bad_lora_settings_are_named(change, message):
  with pytest.raises(ConfigError, match=message):
    BASE.replace(**change)


def test_a_lora_models_base_loads_in_the_compute_dtype_and_becomes_the_frozen_weights(tmp_path):
  """The base of a LoRA model is read straight into bf16 (no float32 pass) and the train state
  takes those arrays as its frozen weights, without a copy."""
  from hf_reference import make_hf_model
  from coa_jax.runtime import hf_checkpoint

  make_hf_model("qwen2", vocab=96, heads=4, kv_heads=2, layers=1).save_pretrained(tmp_path)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  config, base = hf_checkpoint.load_checkpoint(str(tmp_path), mesh, dtype="bfloat16",
                                               param_dtype="float32", lora_rank=4)
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(base)} == {jnp.dtype(jnp.bfloat16)}
  model = Transformer(config)
  state = state_lib.state_from_params(base, optax.adamw(1e-3), model, mesh, jax.random.key(0))
  assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(state.frozen),
                                    jax.tree_util.tree_leaves(base)))
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(state.params)} == {
      jnp.dtype(jnp.float32)}


# --- The embedding and LM-head rows of added tokens ------------------------------------------

ROW_IDS = (3, 100, 511)


def _token_row_params(tie: bool):
  config = LORA.replace(tie_embeddings=tie, lora_trained_token_ids=ROW_IDS)
  return config, nn.unbox(jax.jit(Transformer(config).init)(jax.random.key(0), IDS)["params"])


@pytest.mark.parametrize("tie", [True, False])
def test_token_rows_start_as_the_base_rows_and_change_only_their_own_columns_by_rounding(tie):
  config, params = _token_row_params(tie)
  base, trained = lora.split(params)
  assert set(trained) == {"layers", "embedding_rows"} | (set() if tie else {"lm_head_rows"})
  # Decayed as their tables are when the whole tables train ("all").
  assert all(jax.tree_util.tree_leaves(optimizer.weight_decay_mask(trained)))
  np.testing.assert_array_equal(trained["embedding_rows"], params["embedding"][ROW_IDS, :])
  if not tie:
    np.testing.assert_array_equal(trained["lm_head_rows"], params["lm_head"][:, ROW_IDS].T)
  ours, plain = _logits(config, params), _logits(config.replace(lora_rank=0), base)
  others = np.setdiff1d(np.arange(config.vocab_size), ROW_IDS)
  np.testing.assert_array_equal(ours[..., others], plain[..., others])
  # Their columns: the same dot products in a matmul of another shape (to float32 rounding).
  np.testing.assert_allclose(ours[..., ROW_IDS], plain[..., ROW_IDS], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_merged_token_rows_give_the_unmerged_models_logits(tie):
  config, params = _token_row_params(tie)
  base, trained = lora.split(params)
  moved = jax.tree_util.tree_map(
      lambda a: a + jax.random.normal(jax.random.key(a.size), a.shape) * 0.05, trained)
  full = lora.combine(base, moved)
  merged = lora.merge(full, config)
  plain = config.replace(lora_rank=0)
  np.testing.assert_allclose(_logits(plain, merged), _logits(config, full), rtol=2e-5, atol=2e-5)
  assert not np.allclose(_logits(plain, merged)[..., ROW_IDS],
                         _logits(plain, base)[..., ROW_IDS], atol=1e-3)


# A tiny HF base with its own word-level vocabulary of 64 (no CoA tag), a cue word for each of 8
# tags: the CoA tokenizer adds the 22 tags as ids 64..85, whose rows start as the mean row.
WORDS = ("ponder", "outline", "review", "search", "crawl", "wiki", "compute", "final")
TAGS = ("think", "plan", "reflection", "web_search", "crawl_page", "wiki_search", "code", "answer")
_BASES: dict = {}


def _tagged_base(tmp_path_factory, tie: bool = False):
  """Returns (folder, tokenizer) of the tiny HF base (tokenizer.json and weights)."""
  if tie not in _BASES:
    import tokenizers
    from hf_reference import make_hf_model

    from coa_jax.data import tokenizer as tokenizer_lib

    folder = str(tmp_path_factory.mktemp(f"tagged_base_tie{tie}"))
    words = ("<|endoftext|>", "<unk>") + WORDS + tuple(f"w{i}" for i in range(54))
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>"])
    backend.save(f"{folder}/tokenizer.json")
    make_hf_model("qwen2", vocab=len(words), layers=1, tie=tie).save_pretrained(folder)
    _BASES[tie] = folder, tokenizer_lib.from_hf_folder(folder, "plain")
  return _BASES[tie]


def _tag_rows(tokenizer, seed: int) -> np.ndarray:
  """Returns 8 rows of the 8 (cue, tag) pairs in random orders, then the end token: every tag
  is the target once per row, after its cue."""
  cues = [tokenizer.encode(w)[0] for w in WORDS]
  tags = [tokenizer.tag_id(t) for t in TAGS]
  orders = [np.random.default_rng(seed + i).permutation(len(TAGS)) for i in range(8)]
  return np.array([[i for k in order for i in (cues[k], tags[k])] + [tokenizer.end_id]
                   for order in orders])


def _lora_sft(folder, tokenizer, embeddings: str, steps: int = 10):
  """Returns (model config, state) after `steps` LoRA SFT steps (rank 4, AdamW at 1e-2) from
  the HF base in `folder` on the (cue, tag) rows, on one device."""
  import ml_collections

  from coa_jax.runtime import hf_checkpoint
  from configs import common

  config = ml_collections.ConfigDict(dict(model=common.model(
      "tiny", checkpoint=folder, lora_rank=4, lora_alpha=8.0, lora_train_embeddings=embeddings)))
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  model_config, params = hf_checkpoint.load_model(ModelSettings.from_section(config.model),
                                                  tokenizer, mesh)
  model = Transformer(model_config)
  tx = optimizer.make_optimizer(common.optimizer(learning_rate=1e-2, schedule="constant",
                                                 weight_decay=0.0))
  state = state_lib.state_from_params(params, tx, model, mesh, jax.random.key(0))
  step, batch = step_lib.jit_train_step(model, tx, mesh), step_lib.next_token_batch(
      _tag_rows(tokenizer, seed=0))
  for _ in range(steps):
    state, _ = step(state, batch)
  return model_config, state


def _tag_accuracy(model_config, state, tokenizer) -> float:
  """Returns the teacher-forced accuracy, on held-out rows, at the positions whose target is a
  tag: the most likely of the 8 tags against the target."""
  batch = step_lib.next_token_batch(_tag_rows(tokenizer, seed=100))
  logits = np.asarray(Transformer(model_config).apply({"params": state.model_params()},
                                                      batch.input_ids))
  tags = np.array([tokenizer.tag_id(t) for t in TAGS])
  at_tags = np.isin(batch.targets, tags)
  return float((tags[logits[..., tags].argmax(-1)] == batch.targets)[at_tags].mean())


def test_lora_sft_from_an_hf_base_chooses_the_added_tags_only_when_their_rows_train(
    tmp_path_factory):
  """The tags' rows start alike (the mean row), so with them frozen every tag has the same
  logit whatever the adapters do: chance among the 8 tags (each is the target equally often).
  Trained (the default, or the whole embedding and head), 10 steps choose the tag of the cue."""
  folder, tokenizer = _tagged_base(tmp_path_factory)
  assert tokenizer.added_ids == tuple(range(64, 86)) and tokenizer.vocab_size == 86
  runs = {mode: _lora_sft(folder, tokenizer, mode) for mode in ("none", "added_tokens", "all")}
  trained = {mode: set(state.params) - {"layers"} for mode, (_, state) in runs.items()}
  assert trained == {"none": set(), "added_tokens": {"embedding_rows", "lm_head_rows"},
                     "all": {"embedding", "lm_head"}}
  assert runs["added_tokens"][0].trained_token_ids == tuple(range(64, 86))
  accuracy = {mode: _tag_accuracy(*run, tokenizer) for mode, run in runs.items()}
  assert accuracy["none"] == 1 / 8
  assert accuracy["added_tokens"] >= 0.9 and accuracy["all"] >= 0.9


@pytest.mark.parametrize("embeddings, tie", [("added_tokens", False), ("added_tokens", True),
                                             ("all", False)])
def test_peft_loads_the_trained_rows_with_the_lora_models_logits(tmp_path_factory, tmp_path,
                                                                 embeddings, tie):
  """The adapters export (PEFT's trainable_token_indices, or modules_to_save for the whole
  embedding and head) reloads onto the HF base, its vocabulary resized to the tokenizer's, as
  the LoRA model; so does the merged export, in transformers."""
  import peft
  import transformers
  from hf_reference import hf_logits

  from coa_jax.runtime import hf_checkpoint

  folder, tokenizer = _tagged_base(tmp_path_factory, tie)
  model_config, state = _lora_sft(folder, tokenizer, embeddings, steps=3)
  hf_checkpoint.save_adapters(str(tmp_path / "adapter"), model_config, state.params, folder)
  hf_checkpoint.save_checkpoint(str(tmp_path / "merged"), model_config.replace(lora_rank=0),
                                lora.merge(state.model_params(), model_config), dtype="float32")
  ids = step_lib.next_token_batch(_tag_rows(tokenizer, seed=100)).input_ids[:2]
  ours = np.asarray(Transformer(model_config).apply({"params": state.model_params()}, ids))
  base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  base.resize_token_embeddings(tokenizer.vocab_size)
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  np.testing.assert_allclose(hf_logits(adapted, ids), ours, atol=1e-4)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  np.testing.assert_allclose(hf_logits(merged, ids), ours, atol=1e-4)
  frozen = Transformer(model_config.replace(lora_rank=0)).apply({"params": state.frozen}, ids)
  assert not np.allclose(np.asarray(frozen)[..., 64:], ours[..., 64:], atol=1e-2)  # they moved


def test_the_pod_fit_counts_the_tag_rows_and_their_adamw_moments():
  """The 32B LoRA preset (scaled down) trains a row of the embedding and of the LM head per
  CoA tag a Qwen2.5 tokenizer lacks (22): 3 float32 copies each (the row and two moments)."""
  from coa_jax.data.tokenizer import TAG_TOKENS
  from coa_jax.model import build_config
  from coa_jax.perf import pod_fit
  from configs import sft_qwen2_5_32b_lora

  preset = build_config(sft_qwen2_5_32b_lora.get_config().model).replace(
      num_layers=2, hidden_size=512, head_dim=128, intermediate_size=1024, vocab_size=4096)
  with_rows = pod_fit.with_tag_rows(preset)
  assert len(with_rows.trained_token_ids) == len(TAG_TOKENS) == 22
  assert with_rows.lora_embedding_params() == 22 * 512 * 2
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  tx = optimizer.make_optimizer(sft_qwen2_5_32b_lora.get_config().optimizer)
  nbytes = lambda config: sum(  # noqa: E731
      x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
          state_lib.abstract_state(Transformer(config), tx, mesh).checkpointed()))
  assert nbytes(with_rows) - nbytes(preset) == 3 * 4 * 22 * 512 * 2
  assert pod_fit.with_tag_rows(preset.replace(lora_train_embeddings="none")).trained_token_ids == ()
