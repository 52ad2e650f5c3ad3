"""Typed settings from config files: a job turns its ConfigDict into frozen dataclasses once, at
its top, and passes those (or plain values) down.

`build(cls, section, where)` checks a config section against the dataclass `cls`: every key must be
a field, every value of the field's type (an int where a float is asked is taken; a list where a
tuple is asked), nested dataclasses are built the same way, and then `cls`'s own checks run (its
`__post_init__`); a field whose class has a `from_section(section, where)` builds itself (the model
section: a preset's fields by name); a field's key is its name unless its metadata names another
(`key_of`). `to_section` turns settings back into a section. Each error is a ConfigError naming the
key as the command line does (`sft.optimizer.warmup_steps`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping, TypeVar

from coa_jax.model.config import ConfigError

T = TypeVar("T")


def as_dict(section: Any) -> dict[str, Any]:
  """Returns a config section (a ConfigDict, a FrozenConfigDict or a mapping) as a plain dict of
  its top-level keys."""
  if section is None:
    return {}
  if hasattr(section, "to_dict"):
    return section.to_dict()
  if isinstance(section, Mapping):
    return dict(section)
  raise ConfigError(f"expected a config section (a mapping), got {type(section).__name__}")


def build(cls: type[T], section: Any, where: str, **given: Any) -> T:
  """Returns `cls` built from `section` (plus `given`, values the job computed), or `section`
  itself when it already is a `cls` (a job's entry takes its config or its settings); raises
  ConfigError naming `where`.key for an unknown key, a missing required key, a value of the
  wrong type or one that `cls` rejects."""
  if isinstance(section, cls) and not given:
    return section
  values = {**as_dict(section), **given}
  fields = {key_of(f): f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                      f"known: {', '.join(sorted(fields))}")
  hints = typing.get_type_hints(cls)
  missing = sorted(name for name, f in fields.items() if name not in values and f.init and
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
  if missing:
    raise ConfigError(f"{where}: missing key(s) {', '.join(f'{where}.{k}' for k in missing)}")
  typed = {fields[key].name: _convert(value, hints[fields[key].name], f"{where}.{key}")
           for key, value in values.items()}
  try:
    return cls(**typed)
  except ConfigError as e:
    raise ConfigError(f"{where}: {e}") from None
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{where}: {e}") from None


def to_section(value: Any) -> Any:
  """Returns settings as the config section they were built from (plain dicts, lists and
  values, keys as `key_of` names them): `build` of the result gives the settings back. A
  settings class with free-form keys gives its own (`to_section()`)."""
  if hasattr(value, "to_section"):
    return value.to_section()
  if dataclasses.is_dataclass(value):
    return {key_of(f): to_section(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, (list, tuple)):
    return [to_section(v) for v in value]
  if isinstance(value, Mapping):
    return {k: to_section(v) for k, v in value.items()}
  return value


def key_of(field: dataclasses.Field) -> str:
  """Returns the config key of a settings field: its name, or `metadata["key"]` where the key
  is no Python name (rl.async: the field `async_`)."""
  return field.metadata.get("key", field.name)


def _convert(value: Any, kind: Any, key: str) -> Any:
  """Returns `value` as the annotation `kind` asks, or raises ConfigError naming `key`."""
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if kind is Any:
    return value
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    errors = []
    for option in (a for a in args if a is not type(None)):
      try:
        return _convert(value, option, key)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{key}={value!r}: expected {kind}")
  if dataclasses.is_dataclass(kind):
    if isinstance(value, kind):
      return value
    if hasattr(kind, "from_section"):  # settings with free-form keys build themselves
      return kind.from_section(value, key)
    return build(kind, value, key)
  if origin is tuple or kind is tuple:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}={value!r}: expected a list")
    if args and args[-1] is not Ellipsis and len(args) != len(value):
      raise ConfigError(f"{key}={value!r}: expected {len(args)} items")
    item_kinds = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
    if not args:
      return tuple(value)
    return tuple(_convert(v, k, f"{key}[{i}]") for i, (v, k) in enumerate(zip(value, item_kinds)))
  if origin is dict or kind is dict:
    if not isinstance(value, Mapping) and not hasattr(value, "to_dict"):
      raise ConfigError(f"{key}={value!r}: expected a mapping")
    items = as_dict(value)
    if not args:
      return items
    return {_convert(k, args[0], f"{key} key"): _convert(v, args[1], f"{key}.{k}")
            for k, v in items.items()}
  if kind is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}={value!r}: expected true or false")
    return value
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}={value!r}: expected an integer")
    return value
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}={value!r}: expected a number")
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}={value!r}: expected a string")
    return value
  if isinstance(kind, type) and not isinstance(value, kind):
    raise ConfigError(f"{key}={value!r}: expected {kind.__name__}")
  return value
