"""Typed settings from config sections (coa_jax.runtime.settings.build): an unknown key, a
missing one, a wrong type and a value the settings reject are each a ConfigError naming the key
as the command line writes it; values are converted to the annotated types."""

import dataclasses

import ml_collections
import pytest

from coa_jax.model import ConfigError
from coa_jax.runtime.settings import build


@dataclasses.dataclass(frozen=True)
class Inner:
  directory: str
  every: int = 200


@dataclasses.dataclass(frozen=True)
class Outer:
  steps: int
  learning_rate: float = 1e-3
  schedule: str = "wsd"
  shuffle: bool = True
  families: tuple[str, ...] = ()
  weights: dict[str, int] = dataclasses.field(default_factory=dict)
  checkpoint: Inner | None = None

  def __post_init__(self):
    if self.steps <= 0:
      raise ConfigError(f"steps={self.steps}: expected a positive integer")


def _section(**values):
  return ml_collections.ConfigDict(values)


def test_a_section_builds_typed_frozen_settings():
  out = build(Outer, _section(steps=10, learning_rate=1, families=["a", "b"], weights={"x": 2},
                              checkpoint=dict(directory="runs/c")), "sft")
  assert out == Outer(steps=10, learning_rate=1.0, families=("a", "b"), weights={"x": 2},
                      checkpoint=Inner("runs/c"))
  assert isinstance(out.learning_rate, float)
  with pytest.raises(dataclasses.FrozenInstanceError):
    out.steps = 3


@pytest.mark.parametrize("values,message", [
    (dict(steps=10, learning_rat=1e-3), r"sft: unknown key\(s\) sft\.learning_rat"),
    (dict(), r"sft: missing key\(s\) sft\.steps"),
    (dict(steps="10"), r"sft\.steps='10': expected an integer"),
    (dict(steps=10.0), r"sft\.steps=10\.0: expected an integer"),
    (dict(steps=10, shuffle=1), r"sft\.shuffle=1: expected true or false"),
    (dict(steps=10, families="ab"), r"sft\.families='ab': expected a list"),
    (dict(steps=10, weights={"x": "2"}), r"sft\.weights\.x='2': expected an integer"),
    (dict(steps=10, checkpoint=dict(directory="c", evry=5)),
     r"sft\.checkpoint: unknown key\(s\) sft\.checkpoint\.evry"),
    (dict(steps=0), r"sft: steps=0: expected a positive integer"),
])
def test_a_bad_section_names_the_key(values, message):
  with pytest.raises(ConfigError, match=message):
    build(Outer, _section(**values), "sft")


def test_values_the_job_computes_join_the_section():
  assert build(Inner, _section(every=5), "checkpoint", directory="runs/x").directory == "runs/x"
