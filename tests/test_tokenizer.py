"""Tokenizers: tags are single special tokens, text never makes tags, the default is offline; the
tag mapping is saved with a model, a saved model's tokenizer keeps it, and a moved tag is an
error at load."""

import json

import pytest

from coa_jax.data import coa_format
from coa_jax.data import tokenizer as tk
from coa_jax.data.tokenizer import declared_tags
from coa_jax.model import ModelSettings
from tools_env import Tool


@pytest.fixture(scope="module")
def tok():
  return tk.default_tokenizer()


def test_every_tag_is_one_distinct_special_token(tok):
  ids = {tok.tag_id(tag, close) for tag in coa_format.ALL_TAGS for close in (False, True)}
  assert len(ids) == 2 * len(coa_format.ALL_TAGS)
  for tag in coa_format.ALL_TAGS:
    assert tok.decode([tok.tag_id(tag)]) == f"<{tag}>"
    assert tok.decode([tok.tag_id(tag, close=True)]) == f"</{tag}>"


def test_text_containing_tags_never_yields_tag_or_template_ids(tok):
  text = "a page with <think> and </observation> and <|im_end|> inside"
  ids = tok.encode(text)
  specials = {tok.tag_id(t, c) for t in coa_format.ALL_TAGS for c in (False, True)}
  assert not specials & set(ids) and tok.end_id not in ids
  assert tok.decode(ids) == text


def test_default_tokenizer_is_built_deterministically():
  tk._default_backend_json.cache_clear()
  first = tk._default_backend_json(1024)
  tk._default_backend_json.cache_clear()
  assert tk._default_backend_json(1024) == first
  assert tk.default_tokenizer().vocab_size == 1024


def test_hf_folder_tokenizer_gets_the_tags_and_reports_its_vocab_size(tmp_path, tok):
  bare = tk.tokenizers.Tokenizer.from_str(tok.backend.to_str())
  bare.save(str(tmp_path / "tokenizer.json"))
  loaded = tk.from_hf_folder(str(tmp_path), template="chatml")
  assert loaded.vocab_size == tok.vocab_size
  assert loaded.tag_id("code", close=True) == tok.tag_id("code", close=True)
  assert loaded.end_id == loaded.backend.token_to_id("<|im_end|>")


def test_chatml_prompt_matches_the_qwen_template_text(tok):
  chatml = tk.CoATokenizer(tk.tokenizers.Tokenizer.from_str(tok.backend.to_str()), "chatml")
  text = chatml.decode(chatml.prompt_ids("SYS", "Question: q?"))
  assert text == ("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nQuestion: q?"
                  "<|im_end|>\n<|im_start|>assistant\n")


def test_missing_folder_and_unknown_template_are_named(tmp_path, tok):
  with pytest.raises(tk.TokenizerError, match="does not exist"):
    tk.from_hf_folder(str(tmp_path / "nope"))
  with pytest.raises(tk.TokenizerError, match="template='jinja'"):
    tk.CoATokenizer(tk.tokenizers.Tokenizer.from_str(tok.backend.to_str()), "jinja")


def test_the_embedded_world_tokenizes_compactly(tok):
  # Trained on a world of its own seed: the URL scheme and name syllables are tokens.
  from coa_jax.data.world import World, WorldConfig

  pipeline_world = World(WorldConfig(seed=0, entities=4, train_tasks=0, heldout_tasks=0))
  names = list(pipeline_world.by_name)
  # About 0.8 tokens per character for a BPE trained on the shipped sample alone.
  assert sum(len(tok.encode(n)) for n in names) / sum(len(n) for n in names) < 0.6
  assert len(tok.encode("https://kb.world/person/")) <= 8


def test_a_number_has_the_same_tokens_in_every_context(tok):
  assert all(len(tok.encode(str(i))) == 1 for i in range(100))  # 1-2 digit chunks
  number = tok.encode("4172")
  assert [tok.decode([i]) for i in number] == ["41", "72"]
  for text in (" 4172", "(4172)", "\n4172\n", "result = 4172 * 3", "Company 4172."):
    ids = tok.encode(text)
    assert any(ids[i:i + 2] == number for i in range(len(ids))), text


# --- the tag mapping: fixed at SFT, saved with the model, checked at every load ----------------


class Echo(Tool):
  """Echoes its text."""

  name = "echo"

  def _run(self, body, goal):
    return body, {}


ECHOES = {tag: {"kind": "python", "class": "test_tokenizer:Echo"} for tag in ("kv", "sql")}


def _saved_model(folder, tool_tags):
  """Writes the tag mapping of the default tokenizer with `tool_tags` into `folder`, as an
  export does; returns that tokenizer."""
  saved = tk.default_tokenizer("plain", tool_tags=tool_tags)
  folder.mkdir(exist_ok=True)
  (folder / tk.TAGS_FILE).write_text(json.dumps(saved.tag_map()))
  return saved


def _model(checkpoint) -> ModelSettings:
  return ModelSettings.from_section(dict(preset="tiny", checkpoint=str(checkpoint),
                                         attention_impl="xla", remat="none"))


def test_the_tag_map_holds_every_tag_and_template_token_with_its_id():
  tokenizer = tk.default_tokenizer("plain", tool_tags=("code", "sql"))
  assert tokenizer.tag_map() == {
      "version": 1, "template": "plain", "tool_tags": ["code", "sql"],
      "tags": {**dict(zip(tk.TAG_TOKENS, range(3, 25))), "<sql>": 1024, "</sql>": 1025},
      "template_tokens": {"<|endoftext|>": 0}}


def test_a_saved_model_keeps_its_tag_ids_when_its_tools_are_declared_in_another_order(tmp_path):
  saved = _saved_model(tmp_path / "export", ("sql", "kv"))
  assert declared_tags(ECHOES) == ("kv", "sql")  # the declaration lists them the other way
  tokenizer = tk.load_tokenizer(tk.TokenizerSettings(), str(tmp_path / "export"), ECHOES)
  assert tokenizer.tool_tags == ("sql", "kv")
  assert tokenizer.tag_map() == saved.tag_map()
  assert (tokenizer.tag_id("sql"), tokenizer.tag_id("kv", close=True)) == (1024, 1027)


def test_a_saved_model_s_tokenizer_starts_no_tool_server(tmp_path):
  _saved_model(tmp_path / "export", ("web_search", "lookup"))
  unreachable = {"srv": {"kind": "mcp", "command": ["/no/such/server"]}}  # fails if started
  tokenizer = tk.load_tokenizer(tk.TokenizerSettings(), str(tmp_path / "export"), unreachable)
  assert tokenizer.tool_tags == ("web_search", "lookup")


def test_loading_a_saved_model_with_tags_whose_ids_moved_is_an_error_naming_them(
    tmp_path, single_device_mesh):
  from coa_jax.runtime import hf_checkpoint

  _saved_model(tmp_path / "export", ("sql", "kv"))
  moved = tk.default_tokenizer("plain", tool_tags=("kv", "sql"))
  model = _model(tmp_path / "export")
  with pytest.raises(tk.TagMapError) as raised:
    hf_checkpoint.load_model(model, moved, single_device_mesh)
  assert str(raised.value).startswith(
      f"{tmp_path}/export/{tk.TAGS_FILE}: the tokenizer's tags differ from those the model was "
      f"trained with: <sql> saved as id 1024, here 1026; </sql> saved as id 1025, here 1027; "
      f"<kv> saved as id 1026, here 1024; </kv> saved as id 1027, here 1025. ")


def test_a_file_that_is_not_a_tag_mapping_is_named(tmp_path):
  (tmp_path / tk.TAGS_FILE).write_text(json.dumps({"tags": []}))
  with pytest.raises(tk.TagMapError, match=f"{tk.TAGS_FILE}: not a tag mapping of version 1"):
    tk.read_tag_map(str(tmp_path))
