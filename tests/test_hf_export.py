"""An HF export is a folder transformers loads whole: the tokenizer with the tags as added special
tokens, a chat template that renders a CoA trajectory to the ids SFT trains on, the generation
defaults and the tag mapping; transformers decodes greedily as coa-jax does."""

import os

import jax
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

from coa_jax.data import coa_format, hf_tokenizer, sample_data
from coa_jax.data import tokenizer as tk
from coa_jax.data.tokenize import tokenize_trajectory
from coa_jax.model import Transformer, build_config
from coa_jax.rollout.sampler import Sampler, SamplingConfig
from coa_jax.runtime import hf_checkpoint
from coa_jax.runtime.sharding import init_params

TOOLS = ("web_search", "code", "sql")  # a declared tag beyond the CoA tools' too
SAMPLING = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _write(folder, files):
  os.makedirs(folder, exist_ok=True)
  for name, text in files.items():
    with open(os.path.join(folder, name), "w") as f:
      f.write(text)
  return folder


def _trajectories(count=12):
  """Sample trajectories whose text holds no tag (transformers would read one as the tag's
  token: hf_tokenizer's docstring), the question of each a different one."""
  specials = tk.TAG_TOKENS + tk.CHATML_SPECIALS
  out = []
  for t in sample_data.make_trajectories(4 * count, seed=3):
    texts = [t.system, t.question] + [s.content for s in t.steps]
    if not any(s in text for s in specials for text in texts):
      out.append(t)
  assert len(out) >= count
  return out[:count]


@pytest.fixture(scope="module", params=["plain", "chatml"])
def template_files(request, tmp_path_factory):
  """(tokenizer, folder of its export files alone) for each template."""
  tokenizer = tk.default_tokenizer(request.param, tool_tags=TOOLS)
  folder = str(tmp_path_factory.mktemp(f"tokenizer_{request.param}"))
  return tokenizer, _write(folder, hf_tokenizer.export_files(tokenizer, SAMPLING))


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory, single_device_mesh):
  """(tokenizer, model config, params, export folder) of a tiny random Llama model."""
  tokenizer = tk.default_tokenizer("plain", tool_tags=TOOLS)
  config = build_config({"preset": "tiny", "family": "llama", "qkv_bias": False,
                         "vocab_size": tokenizer.vocab_size, "num_layers": 2})
  mesh = single_device_mesh
  params = init_params(Transformer(config), mesh, jax.random.key(0))
  folder = str(tmp_path_factory.mktemp("llama_export"))
  hf_checkpoint.save_checkpoint(folder, config, params, dtype="float32",
                                files=hf_tokenizer.export_files(tokenizer, SAMPLING))
  return tokenizer, config, params, mesh, folder


def test_an_export_holds_the_tokenizer_files_beside_the_weights(llama_export):
  *_, folder = llama_export
  assert sorted(os.listdir(folder)) == [
      "coa_tags.json", "config.json", "generation_config.json", "model.safetensors",
      "tokenizer.json", "tokenizer_config.json"]


def test_the_tags_are_added_special_tokens_with_their_ids(template_files):
  tokenizer, folder = template_files
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  for token, token_id in tokenizer.tag_map()["tags"].items():
    assert hf.convert_tokens_to_ids(token) == token_id
    assert hf.added_tokens_decoder[token_id].special, token
  assert hf.convert_tokens_to_ids("</sql>") == 1025  # past the 1,024 ids of the BPE
  assert hf.eos_token_id == tokenizer.end_id


@pytest.mark.parametrize("tool_messages", [True, False], ids=["tool-messages", "one-message"])
def test_the_chat_template_renders_a_trajectory_to_the_ids_sft_trains_on(template_files,
                                                                        tool_messages):
  tokenizer, folder = template_files
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  for trajectory in _trajectories():
    rendered = hf.apply_chat_template(hf_tokenizer.messages(trajectory, tool_messages),
                                      return_dict=False)
    assert rendered == tokenize_trajectory(trajectory, tokenizer, 10_000).input_ids.tolist()


def test_the_generation_prompt_is_the_rollout_s_prompt(template_files):
  tokenizer, folder = template_files
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  for trajectory in _trajectories(4):
    prompt = hf.apply_chat_template(hf_tokenizer.messages(trajectory)[:2],
                                    add_generation_prompt=True, return_dict=False)
    assert prompt == tokenizer.prompt_ids(trajectory.system, trajectory.question)


def test_a_response_continues_after_an_observation_without_a_header(template_files):
  # After a tool message the model writes the newline that opens its next step.
  tokenizer, folder = template_files
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  trajectory = coa_format.Trajectory("S", "Q", (coa_format.Step("code", "print(1)"),
                                                coa_format.Step("observation", "1")))
  rendered = hf.apply_chat_template(hf_tokenizer.messages(trajectory),
                                    add_generation_prompt=True, return_dict=False)
  example = tokenize_trajectory(trajectory, tokenizer, 1000)
  assert rendered == example.input_ids.tolist()[:-1]  # all but the end token


def test_the_generation_config_holds_the_end_id_and_the_sampling_defaults(template_files):
  tokenizer, folder = template_files
  config = transformers.GenerationConfig.from_pretrained(folder)
  assert (config.eos_token_id, config.pad_token_id, config.do_sample, config.temperature,
          config.top_k, config.top_p) == (tokenizer.end_id, tokenizer.end_id, True, 0.6, 20, 0.95)


def test_greedy_decoding_in_transformers_equals_coa_jax(llama_export):
  tokenizer, config, params, mesh, folder = llama_export
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  trajectory = _trajectories(1)[0]
  prompt = hf.apply_chat_template(hf_tokenizer.messages(trajectory)[:2],
                                  add_generation_prompt=True, return_dict=False)
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
  theirs = out[0, len(prompt):].tolist()

  sampler = Sampler(config, mesh, batch_size=1, cache_size=256, chunk=24,
                    stop_ids=(tokenizer.end_id,), sampling=SamplingConfig(temperature=0.0))
  state = sampler.prefill_groups(params, sampler.init_state(), [([0], prompt)],
                                 [len(prompt) + 24])
  _, chunk = sampler.decode_chunk(params, state, jax.random.key(0))
  ours = np.asarray(chunk.tokens_BxK)[0, :int(np.asarray(chunk.counts_B)[0])].tolist()
  assert len(ours) == 24 and theirs == ours
  # Not a tie broken by rounding: the two best logits of every step are apart.
  logits = np.asarray(Transformer(config).apply({"params": params},
                                                np.asarray([prompt + ours[:-1]])))
  best = np.sort(logits[0, len(prompt) - 1:], axis=-1)[:, -2:]
  assert (best[:, 1] - best[:, 0]).min() > 1e-4


def _qwen_pipeline_tokenizer() -> tk.CoATokenizer:
  """A small BPE with the Qwen2 tokenizer's own normalizer and pre-tokenizer, as a Qwen2.5
  checkpoint's tokenizer.json has them (transformers' Qwen2Tokenizer rebuilds exactly these)."""
  split = Regex(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
  backend = tokenizers.Tokenizer(models.BPE())
  backend.normalizer = normalizers.NFC()
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(split, "isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  texts = [text for t in sample_data.make_trajectories(50, seed=1)
           for text in [t.system, t.question] + [s.content for s in t.steps]]
  backend.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      special_tokens=list(tk.CHATML_SPECIALS)))
  return tk.CoATokenizer(backend, "chatml", TOOLS)


def test_a_qwen2_export_of_a_qwen_tokenizer_renders_the_sft_ids_in_auto_tokenizer(
    tmp_path, single_device_mesh):
  # transformers loads a qwen2 model's tokenizer as Qwen2Tokenizer, which keeps the vocabulary
  # and merges of tokenizer.json and rebuilds Qwen's own pipeline: the same for a Qwen tokenizer.
  tokenizer = _qwen_pipeline_tokenizer()
  config = build_config({"preset": "tiny", "vocab_size": tokenizer.vocab_size, "num_layers": 1})
  params = init_params(Transformer(config), single_device_mesh, jax.random.key(0))
  hf_checkpoint.save_checkpoint(str(tmp_path), config, params, dtype="float32",
                                files=hf_tokenizer.export_files(tokenizer))
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert type(hf).__name__ == "Qwen2Tokenizer"
  for trajectory in _trajectories():
    rendered = hf.apply_chat_template(hf_tokenizer.messages(trajectory), return_dict=False)
    assert rendered == tokenize_trajectory(trajectory, tokenizer, 10_000).input_ids.tolist()


def test_a_qwen2_export_of_the_default_tokenizer_loads_exactly_as_pretrained_tokenizer_fast(
    tmp_path, single_device_mesh):
  # The default tokenizer splits numbers its own way, which Qwen2Tokenizer (AutoTokenizer's pick
  # for a qwen2 model) would not: PreTrainedTokenizerFast reads tokenizer.json as it is.
  tokenizer = tk.default_tokenizer("plain", tool_tags=TOOLS)
  config = build_config({"preset": "tiny", "vocab_size": tokenizer.vocab_size, "num_layers": 1})
  params = init_params(Transformer(config), single_device_mesh, jax.random.key(0))
  hf_checkpoint.save_checkpoint(str(tmp_path), config, params, dtype="float32",
                                files=hf_tokenizer.export_files(tokenizer))
  hf = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
  for trajectory in _trajectories():
    rendered = hf.apply_chat_template(hf_tokenizer.messages(trajectory), return_dict=False)
    assert rendered == tokenize_trajectory(trajectory, tokenizer, 10_000).input_ids.tolist()
