"""Functions by name, so that a config string picks a variant (as Tunix registers its losses).

A module keeps one `Registry` per kind of variant (e.g. `coa_jax.losses.dapo.AGGREGATIONS`);
a new variant is a function and a name:

  @AGGREGATIONS.register("my-mean")
  def my_mean(mask_BxT, group_B, norm_tokens):
    ...

after which the config value "my-mean" selects it. The expected signature is the kind's, as
its module documents.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
  """The functions of one kind (named in errors, e.g. "aggregation") by name, in the order
  they were registered."""

  def __init__(self, kind: str):
    self.kind = kind
    self._functions: dict[str, F] = {}

  def register(self, name: str) -> Callable[[F], F]:
    """Returns a decorator that registers its function under `name` and returns it unchanged;
    a name already taken raises ValueError."""

    def decorator(function: F) -> F:
      if name in self._functions:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._functions[name] = function
      return function

    return decorator

  def unregister(self, name: str) -> F:
    """Returns the function registered under `name` after removing it (e.g. a test's own)."""
    function = self.get(name)
    del self._functions[name]
    return function

  def get(self, name: str) -> F:
    """Returns the function registered under `name`; an unknown name raises ValueError that
    names the kind and lists the registered names."""
    if name not in self._functions:
      raise ValueError(f"{self.kind}={name!r}: expected one of {self.names()}")
    return self._functions[name]

  def names(self) -> tuple[str, ...]:
    """Returns the registered names, in registration order."""
    return tuple(self._functions)
