"""Model configuration: one frozen dataclass, named presets, and HF config.json conversion."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FAMILIES = ("qwen2", "llama")
# The projections LoRA adapters may sit on (HF and PEFT names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Which embedding and LM-head rows train beside LoRA adapters (ModelConfig.lora_train_embeddings).
LORA_EMBEDDINGS = ("added_tokens", "all", "none")
REMAT_POLICIES = ("none", "full", "minimal", "minimal_with_context", "qkv_context", "offload",
                  "dots")  # coa_jax/model/transformer.py says what each keeps
ATTENTION_IMPLS = ("xla", "cudnn", "blockwise", "splash")


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the field and the problem."""


# Attention kernels that run on one backend only.
_ATTENTION_BACKEND = {"cudnn": "gpu", "splash": "tpu"}


def check_backend(attention_impl: str, remat: str, platform: str) -> None:
  """Raises ConfigError if a model's numerics ask for what `platform` lacks: cuDNN attention
  (GPU only), splash attention (TPU only), activations offloaded to host memory (not CPU)."""
  needs = _ATTENTION_BACKEND.get(attention_impl, platform)
  if needs != platform:
    raise ConfigError(f"attention_impl={attention_impl!r} needs a {needs.upper()} backend, but "
                      f"the model runs on {platform!r}; use attention_impl='xla' or 'blockwise'")
  if remat == "offload" and platform == "cpu":
    raise ConfigError("remat='offload' moves activations to host memory, which a CPU backend "
                      "does not have apart; use remat='minimal_with_context' or 'full'")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3 RoPE frequency scaling (HF `rope_type: llama3`)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture plus numerics of a decoder-only transformer (Qwen2/Qwen2.5 or Llama 3)."""

  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0 means hidden_size // num_heads
  rope_theta: float = 10_000.0
  rope_scaling: Llama3RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 32_768
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  # Numerics and execution (not part of the architecture).
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  attention_impl: str = "xla"
  attention_block: int = 128  # query block of the "blockwise" and "splash" attention
  attention_block_kv: int = 0  # key block of the "splash" attention (0: attention_block)
  # layers per scan iteration; num_layers: no loop, each layer applies its slice of the stacked
  # weights (without a dropout rng, `transformer._unrolled_layers`)
  scan_unroll: int = 1
  # LoRA (lora_rank 0: none): beside each projection named in lora_targets, a low-rank update
  # x A B (A: in x rank, B: rank x out, B zero at init) scaled by lora_alpha / lora_rank; while
  # training (a "dropout" rng given), dropout of lora_dropout on the adapters' input.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0
  lora_targets: tuple[str, ...] = LORA_TARGETS
  # The embedding and LM-head rows that train beside the adapters: "added_tokens" the rows of
  # lora_trained_token_ids (the tokens the tokenizer added to the base checkpoint, which
  # `load_model` fills in), as PEFT's trainable_token_indices; "all" the whole embedding and
  # LM head (a trained copy beside the frozen one, as PEFT's modules_to_save); "none" no row.
  lora_train_embeddings: str = "added_tokens"
  lora_trained_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))  # lists from configs
    object.__setattr__(self, "lora_trained_token_ids",
                       tuple(int(i) for i in self.lora_trained_token_ids))
    if self.head_dim == 0 and self.num_heads > 0:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    self.validate()

  def validate(self) -> None:
    """Raises ConfigError naming the first invalid field."""
    if self.family not in FAMILIES:
      raise ConfigError(f"family={self.family!r}: expected one of {FAMILIES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                 "attention_block"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive integer")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim}: RoPE needs an even head dimension")
    if self.rope_theta <= 0:
      raise ConfigError(f"rope_theta={self.rope_theta}: expected a positive number")
    if not isinstance(self.attention_block_kv, int) or self.attention_block_kv < 0:
      raise ConfigError(f"attention_block_kv={self.attention_block_kv!r}: expected 0 (the "
                        f"attention_block) or a positive integer")
    if not 1 <= self.scan_unroll <= self.num_layers:
      raise ConfigError(f"scan_unroll={self.scan_unroll}: expected 1..num_layers")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"remat={self.remat!r}: expected one of {REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ConfigError(
          f"attention_impl={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}")
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ConfigError(f"lora_rank={self.lora_rank!r}: expected 0 (no LoRA) or a positive "
                        f"integer")
    if self.lora_alpha <= 0:
      raise ConfigError(f"lora_alpha={self.lora_alpha}: expected a positive number")
    if not 0 <= self.lora_dropout < 1:
      raise ConfigError(f"lora_dropout={self.lora_dropout}: expected a rate in [0, 1)")
    unknown = set(self.lora_targets) - set(LORA_TARGETS)
    if unknown or (self.lora_rank and not self.lora_targets):
      raise ConfigError(f"lora_targets={tuple(self.lora_targets)}: expected one or more of "
                        f"{LORA_TARGETS}")
    self._validate_token_rows()
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ConfigError(f"{name}={getattr(self, name)!r} is not a dtype name") from None

  def _validate_token_rows(self) -> None:
    if self.lora_train_embeddings not in LORA_EMBEDDINGS:
      raise ConfigError(f"lora_train_embeddings={self.lora_train_embeddings!r}: expected one of "
                        f"{LORA_EMBEDDINGS}")
    ids = self.lora_trained_token_ids
    if ids and self.lora_train_embeddings != "added_tokens":
      raise ConfigError(f"lora_trained_token_ids are set, but lora_train_embeddings="
                        f"{self.lora_train_embeddings!r}: they train only with 'added_tokens'")
    if ids and (list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.vocab_size):
      raise ConfigError(f"lora_trained_token_ids={ids}: expected increasing ids in "
                        f"[0, vocab_size={self.vocab_size})")

  def replace(self, **changes: Any) -> "ModelConfig":
    """Returns a copy with `changes` applied (and validated). head_dim derives from the width
    and the heads, so a change of either names head_dim too (0: derive it again)."""
    _check_fields(changes)
    if {"hidden_size", "num_heads"} & set(changes) and "head_dim" not in changes:
      raise ConfigError(f"changing {sorted({'hidden_size', 'num_heads'} & set(changes))} of a "
                        f"built ModelConfig keeps head_dim={self.head_dim}; pass head_dim too "
                        f"(0: hidden_size // num_heads)")
    return dataclasses.replace(self, **changes)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def lora_rank_of(self, projection: str) -> int:
    """Returns the rank of the LoRA adapter on `projection` (0: none)."""
    return self.lora_rank if projection in self.lora_targets else 0

  @property
  def trained_token_ids(self) -> tuple[int, ...]:
    """Returns the ids whose embedding and LM-head rows train beside the adapters (LoRA's
    "added_tokens"; none without LoRA)."""
    return self.lora_trained_token_ids if self.lora_rank else ()

  @property
  def trains_embeddings(self) -> bool:
    """Returns whether a LoRA model trains its whole embedding and LM head (a copy of each)."""
    return bool(self.lora_rank) and self.lora_train_embeddings == "all"

  def lora_params(self) -> int:
    """Returns the number of LoRA adapter parameters (rank x (in + out) per adapted
    projection per layer)."""
    d, h, f = self.hidden_size, self.head_dim, self.intermediate_size
    q, kv = self.num_heads * h, self.num_kv_heads * h
    sizes = dict(q_proj=d + q, k_proj=d + kv, v_proj=d + kv, o_proj=q + d, gate_proj=d + f,
                 up_proj=d + f, down_proj=f + d)
    return self.num_layers * sum(self.lora_rank_of(name) * sizes[name] for name in sizes)

  def lora_embedding_params(self) -> int:
    """Returns the number of embedding and LM-head parameters that train beside the adapters:
    a row of hidden_size per trained token id (or per vocabulary row with "all"), once for a
    tied embedding, else for the embedding and for the LM head."""
    rows = self.vocab_size if self.trains_embeddings else len(self.trained_token_ids)
    return rows * self.hidden_size * (1 if self.tie_embeddings else 2)

  def num_params(self) -> int:
    """Returns the exact number of parameters of this architecture (LoRA adapters aside)."""
    d, h = self.hidden_size, self.head_dim
    q, kv = self.num_heads * h, self.num_kv_heads * h
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
    mlp = 3 * d * self.intermediate_size
    per_layer = attn + mlp + 2 * d
    embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + embeddings + d


_QWEN2_5 = dict(family="qwen2", rope_theta=1_000_000.0, rms_norm_eps=1e-6, qkv_bias=True,
                max_position_embeddings=32_768, bos_token_id=151643, eos_token_id=151645)
_LLAMA3 = dict(family="llama", rope_theta=500_000.0, rms_norm_eps=1e-5, qkv_bias=False,
               max_position_embeddings=131_072, vocab_size=128_256, bos_token_id=128000,
               eos_token_id=128001)



def _qwen2_5(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
             tie: bool) -> dict[str, Any]:
  return dict(_QWEN2_5, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
              num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, tie_embeddings=tie)


# Figures of the published HF config.json files (Qwen2.5 *-Instruct, which the CoA recipe
# fine-tunes; the base checkpoints differ only in max_position_embeddings and, for 14B/32B,
# rms_norm_eps). Llama 3 figures from meta-llama/Llama-3.2-1B and Llama-3.1-8B.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(family="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=10_000.0,
                 rms_norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                 max_position_embeddings=2048),
    # Qwen2.5: vocabulary, hidden, intermediate, layers, heads, KV heads, tied embeddings.
    "qwen2_5_0_5b": _qwen2_5(151_936, 896, 4864, 24, 14, 2, True),
    "qwen2_5_1_5b": _qwen2_5(151_936, 1536, 8960, 28, 12, 2, True),
    "qwen2_5_3b": _qwen2_5(151_936, 2048, 11008, 36, 16, 2, True),
    "qwen2_5_7b": _qwen2_5(152_064, 3584, 18944, 28, 28, 4, False),
    "qwen2_5_14b": _qwen2_5(152_064, 5120, 13824, 48, 40, 8, False),
    "qwen2_5_32b": _qwen2_5(152_064, 5120, 27648, 64, 40, 8, False),
    "llama3_2_1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_layers=16,
                        num_heads=32, num_kv_heads=8, tie_embeddings=True,
                        rope_scaling=Llama3RopeScaling(factor=32.0)),
    "llama3_1_8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, tie_embeddings=False,
                        rope_scaling=Llama3RopeScaling(factor=8.0)),
}


def _check_fields(values: dict[str, Any]) -> None:
  unknown = set(values) - {f.name for f in dataclasses.fields(ModelConfig)}
  if unknown:
    raise ConfigError(f"unknown ModelConfig field(s): {sorted(unknown)}")


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """Returns the named preset's ModelConfig with `overrides` applied before anything derives
  from them: head_dim is hidden_size // num_heads of the overridden width and heads unless the
  overrides name it."""
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
  _check_fields(overrides)
  return ModelConfig(**{**PRESETS[name], **overrides})


_HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
  """Reads rope theta and scaling from either the old or the new (`rope_parameters`) layout."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or params
  theta = float(hf.get("rope_theta", params.get("rope_theta", 10_000.0)))
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ConfigError(f"rope scaling type {rope_type!r} is not supported (only 'llama3')")
  return theta, Llama3RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


def _sliding_layers(hf: dict[str, Any], num_layers: int, max_positions: int) -> list[int]:
  """Returns the layers an HF config gives a sliding attention window shorter than its
  positions, as transformers reads it (Qwen2: `use_sliding_window`, then `layer_types`, or
  the layers from `max_window_layers` on)."""
  window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
  if window is None or int(window) >= max_positions:
    return []
  if hf.get("layer_types"):
    return [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
  if "use_sliding_window" not in hf:
    return []
  return list(range(int(hf.get("max_window_layers") or 0), num_layers))


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
  """Returns the ModelConfig described by an HF config.json dict."""
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise ConfigError(f"HF model_type {family!r} is not supported; expected one of {FAMILIES}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
  try:
    theta, scaling = _rope_from_hf(hf)
    num_heads = int(hf["num_attention_heads"])
    fields = dict(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or 0),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf["rms_norm_eps"]),
        qkv_bias=family == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32_768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_first(hf.get("eos_token_id")),
    )
  except KeyError as e:
    raise ConfigError(f"HF config is missing the field {e.args[0]!r}") from None
  if family == "llama" and (hf.get("mlp_bias") or hf.get("attention_bias")):
    raise ConfigError("Llama configs with mlp_bias or attention_bias set are not supported")
  sliding = _sliding_layers(hf, fields["num_layers"], fields["max_position_embeddings"])
  if sliding:
    raise ConfigError(f"HF config gives layers {sliding} sliding-window attention (window "
                      f"{hf['sliding_window']}), which is not supported: every layer here "
                      f"attends to all earlier positions")
  config = ModelConfig(**fields)
  # The checkpoint fixes the architecture; overrides may change numerics (dtype, remat,
  # attention) and grow the vocabulary (for added tag tokens), not reshape the weights.
  conflicts = {k: (v, getattr(config, k)) for k, v in overrides.items()
               if k in fields and k != "vocab_size" and v != getattr(config, k)}
  if conflicts:
    raise ConfigError("the model config contradicts the checkpoint's config.json: " + ", ".join(
        f"{k}={mine!r} (checkpoint: {theirs!r})" for k, (mine, theirs) in conflicts.items()) +
                      "; remove these fields or use the matching checkpoint")
  return config.replace(**{k: v for k, v in overrides.items()
                           if k not in fields or k == "vocab_size"})


def _first(value):
  return value[0] if isinstance(value, list) and value else value


def to_hf_config(config: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
  """Returns an HF config.json dict that `transformers` loads as the same architecture."""
  hf: dict[str, Any] = dict(
      architectures=[_HF_ARCHITECTURES[config.family]],
      model_type=config.family,
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      num_key_value_heads=config.num_kv_heads,
      head_dim=config.head_dim,
      hidden_act="silu",
      max_position_embeddings=config.max_position_embeddings,
      rms_norm_eps=config.rms_norm_eps,
      rope_theta=config.rope_theta,
      tie_word_embeddings=config.tie_embeddings,
      torch_dtype=torch_dtype,
      use_cache=True,
      attention_dropout=0.0,
  )
  if config.bos_token_id is not None:
    hf["bos_token_id"] = config.bos_token_id
  if config.eos_token_id is not None:
    hf["eos_token_id"] = config.eos_token_id
  if config.family == "llama":
    if config.qkv_bias:
      raise ConfigError("HF Llama has no qkv-only bias; export a qkv_bias=True model as qwen2")
    hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  elif not config.qkv_bias:
    raise ConfigError("HF Qwen2 always has qkv bias; export a qkv_bias=False model as llama")
  else:
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
  if config.rope_scaling is not None:
    hf["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(config.rope_scaling))
  return hf


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """A job's model section, typed: a fresh model (`preset` plus ModelConfig fields by name) or an
  HF folder to start from (`checkpoint`) with the fields that may change on top of it (numerics,
  a vocabulary grown for added tags; `from_hf_config` rejects the others)."""

  preset: str = ""
  checkpoint: str = ""
  fields: tuple[tuple[str, Any], ...] = ()  # (name, value) of each ModelConfig field set

  @classmethod
  def from_section(cls, section: Any, where: str = "model") -> "ModelSettings":
    """Returns the settings of a config's model section; raises ConfigError naming
    `where`.key for a field ModelConfig lacks, and, for a fresh model, any invalid value."""
    values = dict(section.to_dict() if hasattr(section, "to_dict") else section)
    preset, checkpoint = values.pop("preset", ""), values.pop("checkpoint", "") or ""
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
      raise ConfigError(f"{where}: unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                        f"a model section holds preset, checkpoint and ModelConfig fields")
    settings = cls(preset, checkpoint, tuple(sorted(values.items())))
    if not checkpoint:
      try:
        settings.fresh_config()
      except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return settings

  @property
  def overrides(self) -> dict[str, Any]:
    return dict(self.fields)

  def to_section(self) -> dict[str, Any]:
    """Returns the model section these settings were built from (`from_section`)."""
    return {"preset": self.preset, "checkpoint": self.checkpoint, **self.overrides}

  def replace(self, **changes: Any) -> "ModelSettings":
    """Returns the settings with `changes` (a checkpoint, a preset, ModelConfig fields)
    applied, checked as `from_section` checks a section."""
    return ModelSettings.from_section({**self.to_section(), **changes})

  def get(self, name: str, default: Any = None) -> Any:
    """Returns the field `name` as the section set it, else `default`."""
    return self.overrides.get(name, default)

  def fresh_config(self) -> ModelConfig:
    """Returns the ModelConfig of a fresh model: the preset with the fields applied."""
    if not self.preset:
      raise ConfigError("the model config section needs a 'preset' name (or a 'checkpoint')")
    return get_preset(self.preset, **self.overrides)


def build_config(spec: Any) -> ModelConfig:
  """Returns the ModelConfig of a config section: `preset` plus any field overrides (a
  `checkpoint` entry, the HF folder that training starts from, is not a field and is ignored)."""
  return ModelSettings.from_section(spec).fresh_config()