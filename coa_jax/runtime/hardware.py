"""Per-chip figures of TPU generations (HBM and dense bf16 peak), keyed by JAX device kind."""

from __future__ import annotations

import dataclasses
import math
import re

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip: HBM bytes, peak dense bf16 FLOP/s and HBM bandwidth (public spec
  sheets)."""

  name: str
  hbm_bytes: int
  peak_bf16_flops: float
  hbm_bytes_per_s: float


CHIPS = {
    "TPU v4": Chip("v4", 32 * GIB, 275e12, 1228e9),
    "TPU v5 lite": Chip("v5e", 16 * GIB, 197e12, 819e9),
    "TPU v5": Chip("v5p", 95 * GIB, 459e12, 2765e9),
    "TPU v6 lite": Chip("v6e", 32 * GIB, 918e12, 1640e9),
}


def chip_for(device_kind: str) -> Chip:
  """Returns the Chip of a JAX device kind such as 'TPU v5 lite'."""
  if device_kind not in CHIPS:
    raise ValueError(f"no chip figures for device kind {device_kind!r}; known: {sorted(CHIPS)}")
  return CHIPS[device_kind]


def chips_in_topology(topology: str) -> int:
  """Returns the number of chips in a topology name such as 'v5p:2x2x1' (product of dims)."""
  match = re.fullmatch(r"[a-zA-Z0-9_ ]+[:=_]([0-9x]+)", topology)
  if not match:
    raise ValueError(f"topology {topology!r} is not of the form 'v5p:2x2x1'")
  return math.prod(int(d) for d in match.group(1).split("x"))
