"""One tokenizer interface over HF `tokenizers`, with every CoA tag as a special token.

Each `<tag>` and `</tag>` is one added special token, so stopping on a closing tool tag is a
token-id comparison. Text is always encoded with special-token parsing off: a question, an
observation or a page that contains `<think>` or `<|im_end|>` yields ordinary text tokens
(docs/design.md, invariant 2). Special tokens enter sequences only as explicit ids.

Two sources: `from_hf_folder` (any local HF tokenizer folder, e.g. a Qwen2.5 checkpoint's,
with the chat template the reference release uses) and `default_tokenizer` (a byte-level BPE
that the project trains itself, deterministically and offline, on its shipped sample and an
embedded world's pages).

The tag-to-id mapping is fixed at SFT and travels with the model (docs/design.md, invariant
12): `tag_map` (every tag token and its id, the tool tags in order, the template) is saved as
`TAGS_FILE` in every HF export and in every orbax checkpoint's data, and checked when
`load_tokenizer` and `load_model` read a saved model and when a run resumes (`check_tag_map`,
`check_saved`): a tag whose id moved is an error naming it. `load_tokenizer`
builds the tokenizer of a saved model in the saved order, from the saved mapping alone: a tool
server that now lists its tools in another order keeps their ids, and no server is started.

The default tokenizer splits numbers into chunks of 1-2 digits, each one token, with the space
before a number a token of its own: "709" is `70 9` wherever it stands (after a space, at the
start of a line, after a bracket). A number then has the same tokens in a question, in code and
in a tool's output, and a small model learns to copy it; with plain BPE merges the same number
splits differently by context, and 3-digit chunks are tokens too rare to learn.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

from coa_jax.data import coa_format, prompts, sample_data, world
from coa_jax.model.config import ConfigError
from coa_jax.runtime import paths
from tools_env import registry

TAG_TOKENS = tuple(t for tag in coa_format.ALL_TAGS
                   for t in (coa_format.opening(tag), coa_format.closing(tag)))
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATES = ("chatml", "plain")
# The saved tag mapping (`CoATokenizer.tag_map`), in an HF export folder and a checkpoint's data.
TAGS_FILE = "coa_tags.json"
TAGS_VERSION = 1


class TokenizerError(ValueError):
  """A tokenizer folder is missing or lacks a token the chosen template needs."""


class TagMapError(TokenizerError):
  """A tokenizer's tags differ from the ones a saved model was trained with."""


class CoATokenizer:
  """Encodes text (special-token parsing off) and names the ids of tags and template tokens.

  `tool_tags`: the declared tools' tags (default: the four CoA tools), which the rollout stops
  on and the parser reads; the four CoA tools' tags are special tokens whatever is declared, and
  any other declared tag is added after them.

  template: "chatml" (Qwen2.5: `<|im_start|>system ... <|im_end|>` turns, the whole
  trajectory as one assistant message ended by `<|im_end|>`) or "plain" (system, question
  and response separated by blank lines, ended by `<|endoftext|>`).
  """

  def __init__(self, backend: tokenizers.Tokenizer, template: str,
               tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS):
    if template not in TEMPLATES:
      raise TokenizerError(f"template={template!r}: expected one of {TEMPLATES}")
    self.tool_tags = coa_format.check_tool_tags(tool_tags)
    # The CoA tags always (their ids stay put whatever is declared), then declared tool tags.
    tag_tokens = TAG_TOKENS + tuple(t for tag in self.tool_tags if tag not in coa_format.TOOL_TAGS
                                    for t in (coa_format.opening(tag), coa_format.closing(tag)))
    self.tag_tokens = tag_tokens
    missing = [t for t in tag_tokens if backend.token_to_id(t) is None]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in tag_tokens])
    # The tags that the source tokenizer lacked: a base model has never trained their rows.
    self.added_ids = tuple(sorted(backend.token_to_id(t) for t in missing))
    self.backend = backend
    self.template = template
    self._text = tokenizers.Tokenizer.from_str(backend.to_str())
    self._text.encode_special_tokens = True  # specials in text are plain text
    needed = ("<|im_start|>", "<|im_end|>") if template == "chatml" else ("<|endoftext|>",)
    self._ids = {}
    for token in tag_tokens + needed:
      token_id = backend.token_to_id(token)
      if token_id is None:
        raise TokenizerError(f"the tokenizer has no {token!r} token, needed by the "
                             f"{template!r} template")
      self._ids[token] = token_id
    self.template_tokens = needed

  @property
  def vocab_size(self) -> int:
    """Returns the vocabulary size including added tokens (the model needs at least this)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str) -> int:
    """Returns the id of a special token (a CoA tag or a template token)."""
    return self._ids[token]

  def tag_id(self, tag: str, close: bool = False) -> int:
    """Returns the id of `<tag>` or, with close=True, `</tag>`."""
    return self._ids[coa_format.closing(tag) if close else coa_format.opening(tag)]

  @property
  def end_id(self) -> int:
    """Returns the id that ends an assistant response in this template."""
    return self._ids["<|im_end|>" if self.template == "chatml" else "<|endoftext|>"]

  def encode(self, text: str) -> list[int]:
    """Returns the ids of `text` with special-token parsing off (tags in text stay text)."""
    return self._text.encode(text, add_special_tokens=False).ids if text else []

  def decode(self, ids) -> str:
    """Returns the text of `ids`, special tokens written out."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

  def tag_map(self) -> dict[str, Any]:
    """Returns the mapping saved with the model (`TAGS_FILE`): the template, the tool tags in
    order, every tag token with its id (in id order) and the template's tokens with theirs."""
    by_id = lambda tokens: dict(sorted(((t, self._ids[t]) for t in tokens),  # noqa: E731
                                       key=lambda item: item[1]))
    return {"version": TAGS_VERSION, "template": self.template,
            "tool_tags": list(self.tool_tags), "tags": by_id(self.tag_tokens),
            "template_tokens": by_id(self.template_tokens)}

  def check_tag_map(self, saved: dict[str, Any], where: str) -> None:
    """Raises TagMapError naming every tag (or template token) whose id differs between `saved`
    (a `tag_map` read from `where`) and this tokenizer, a tag one side lacks, a tool tag one
    side does not declare, or another template; returns when they agree. The tool tags' order
    alone is no error: the ids are what the model learnt."""
    mine = self.tag_map()
    problems = []
    if saved.get("template") != mine["template"]:
      problems.append(f"template saved {saved.get('template')!r}, here {mine['template']!r}")
    for key in ("tags", "template_tokens"):
      have, want = mine[key], dict(saved.get(key) or {})
      for token, token_id in want.items():
        if token not in have:
          problems.append(f"{token} saved as id {token_id}, missing here")
        elif have[token] != token_id:
          problems.append(f"{token} saved as id {token_id}, here {have[token]}")
      problems += [f"{token} is id {token_id} here, not in the saved mapping"
                   for token, token_id in have.items() if token not in want]
    saved_tools = list(saved.get("tool_tags") or ())
    for tag in saved_tools:
      if tag not in mine["tool_tags"]:
        problems.append(f"tool tag {tag!r} saved, not declared here")
    problems += [f"tool tag {tag!r} declared here, not saved" for tag in mine["tool_tags"]
                 if tag not in saved_tools]
    if problems:
      raise TagMapError(
          f"{where}: the tokenizer's tags differ from those the model was trained with: "
          f"{'; '.join(problems)}. Build the tokenizer with load_tokenizer on a config whose "
          f"model.checkpoint is the saved model (it takes the saved tags), or declare the tools "
          f"that were declared when the model was saved")

  def check_saved(self, folder: str) -> None:
    """Checks this tokenizer against the tag mapping saved in `folder` (an HF export, local or
    a URL; `check_tag_map`); a folder without one (a model not exported by coa-jax) passes."""
    saved = read_tag_map(folder)
    if saved is not None:
      self.check_tag_map(saved, os.path.join(folder, TAGS_FILE))

  def prompt_ids(self, system: str, question: str) -> list[int]:
    """Returns the ids before the assistant response: system and user turns, assistant header."""
    if self.template == "plain":
      return self.encode(f"{system}\n\n{question}\n\n")
    start, end = self._ids["<|im_start|>"], self._ids["<|im_end|>"]
    return ([start] + self.encode(f"system\n{system}") + [end] + self.encode("\n") +
            [start] + self.encode(f"user\n{question}") + [end] + self.encode("\n") +
            [start] + self.encode("assistant\n"))


def read_tag_map(folder: str) -> dict[str, Any] | None:
  """Returns the tag mapping saved in `folder` (`TAGS_FILE`; local or a URL), or None when it
  has none; raises TagMapError when the file is not a tag mapping."""
  path = os.path.join(folder, TAGS_FILE)
  file = paths.to_epath(path)
  if not file.is_file():
    return None
  try:
    saved = json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TagMapError(f"{path}: not a tag mapping ({e})") from None
  if (not isinstance(saved, dict) or saved.get("version") != TAGS_VERSION
      or not isinstance(saved.get("tags"), dict) or not isinstance(saved.get("tool_tags"), list)):
    raise TagMapError(f"{path}: not a tag mapping of version {TAGS_VERSION} (expected "
                      f"version, template, tool_tags, tags and template_tokens)")
  return saved


def from_hf_folder(folder: str, template: str = "chatml",
                   tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> CoATokenizer:
  """Returns the tokenizer of an HF folder (tokenizer.json, local or a URL, or any local format
  transformers converts) with the CoA tags and `tool_tags`' added."""
  path = os.path.join(folder, "tokenizer.json")
  if paths.to_epath(path).is_file():
    backend = tokenizers.Tokenizer.from_str(paths.to_epath(path).read_text())
  elif os.path.isdir(folder):
    import transformers

    try:
      hf = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
      raise TokenizerError(f"{folder}: no loadable tokenizer ({e})") from None
    backend = hf.backend_tokenizer
  else:
    raise TokenizerError(f"tokenizer folder {folder!r} does not exist")
  return CoATokenizer(backend, template, tool_tags)


def _corpus() -> list[str]:
  """The shipped sample's text and an embedded world's pages, URLs and questions (a world of its
  own seed: the name syllables become tokens, no pipeline world's names do)."""
  texts = [prompts.AGENT]
  for t in sample_data.make_trajectories(600, seed=1234):
    texts.append(t.question)
    texts.extend(step.content for step in t.steps)
  kb = world.World(world.WorldConfig(seed=1234, train_tasks=400, heldout_tasks=0))
  texts.extend(f"Page: {page['url']}\n{page['title']}\n\n{page['text']}" for page in kb.corpus())
  texts.extend(task["question"] for task in kb.tasks["train"])
  texts.extend([" ".join(str(i) for i in range(100))] * 100)  # every 1-2 digit chunk a token
  return texts


@functools.lru_cache(maxsize=None)
def _default_backend_json(vocab_size: int) -> str:
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(r"\d{1,2}"), "isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False)])
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      special_tokens=list(CHATML_SPECIALS) + list(TAG_TOKENS))
  backend.train_from_iterator(_corpus(), trainer)
  return backend.to_str()


def default_tokenizer(template: str = "plain", vocab_size: int = 1024,
                      tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> CoATokenizer:
  """Returns the project's own byte-level BPE tokenizer (built offline, deterministically): a
  declared tag beyond the CoA tools' adds its two tokens past `vocab_size`."""
  return CoATokenizer(tokenizers.Tokenizer.from_str(_default_backend_json(vocab_size)),
                      template, tool_tags)


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
  """A job's tokenizer section: "default" (the built-in BPE) or a local HF folder, and the chat
  template."""

  path: str = "default"
  template: str = "plain"

  def __post_init__(self):
    if self.template not in TEMPLATES:
      raise ConfigError(f"template={self.template!r}: expected one of {TEMPLATES}")
    if not self.path:
      raise ConfigError("path is empty: expected 'default' or a tokenizer folder")


def load_tokenizer(settings: TokenizerSettings, checkpoint: str = "",
                   tools: Any = None) -> CoATokenizer:
  """Returns the tokenizer `settings` name ('default' or an HF folder) with the tags of a saved
  model: the mapping saved in the HF folder `checkpoint` (or in the tokenizer's folder), its
  tool tags in their saved order, checked against the ids built (`TagMapError`); without a
  saved mapping (a base model, a fresh one), the tags of the tools the `tools` spec declares
  (`tools_env.registry.declare`, which starts MCP servers to list theirs; None: the four CoA
  tools)."""
  saved, where = saved_tag_map(settings, checkpoint)
  tool_tags = tuple(saved["tool_tags"]) if saved else declared_tags(tools)
  if settings.path == "default":
    tokenizer = default_tokenizer(settings.template, tool_tags=tool_tags)
  else:
    tokenizer = from_hf_folder(settings.path, settings.template, tool_tags)
  if saved:
    tokenizer.check_tag_map(saved, where)
  return tokenizer


def saved_tag_map(settings: TokenizerSettings,
                  checkpoint: str = "") -> tuple[dict[str, Any] | None, str]:
  """Returns (the tag mapping, its path) saved with the HF folder `checkpoint`, else in the
  tokenizer's HF folder, or (None, "") when neither holds one."""
  folders = [checkpoint, "" if settings.path == "default" else settings.path]
  for folder in filter(None, folders):
    saved = read_tag_map(folder)
    if saved is not None:
      return saved, os.path.join(folder, TAGS_FILE)
  return None, ""


def declared_tags(tools_spec: Any) -> tuple[str, ...]:
  """Returns the tool tags a config's `tools` spec declares, in order (None: the four CoA
  tools); raises ConfigError naming a tag that cannot be one or a tool that cannot be
  declared."""
  if tools_spec is None:
    return coa_format.TOOL_TAGS
  spec = tools_spec.to_dict() if hasattr(tools_spec, "to_dict") else dict(tools_spec)
  try:
    return coa_format.check_tool_tags(tool.tag for tool in registry.declare(spec))
  except ValueError as e:
    raise ConfigError(str(e)) from None
