"""Per-chip figures of TPU generations and NVIDIA data-centre GPUs (HBM, dense bf16 peak, HBM
bandwidth), keyed by JAX device kind."""

from __future__ import annotations

import dataclasses
import math
import re

GIB = 1 << 30
MIB = 1 << 20


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
# GPUs by a pattern of their device kind (CUDA's device name, e.g. 'NVIDIA H100 80GB HBM3');
# the first match wins, so the PCIe and NVL variants come before the SXM part. HBM is the
# total nvidia-smi reports; peaks are the spec sheets' dense figures.
GPUS = [
    (r"H100 PCIe", Chip("H100 PCIe", 81559 * MIB, 756e12, 2000e9)),
    (r"H100 NVL", Chip("H100 NVL", 95830 * MIB, 835e12, 3900e9)),
    (r"H100", Chip("H100 SXM", 81559 * MIB, 989e12, 3350e9)),
    (r"H200", Chip("H200", 143771 * MIB, 989e12, 4800e9)),
    (r"A100.*40GB", Chip("A100 40GB", 40960 * MIB, 312e12, 1555e9)),
    (r"A100", Chip("A100 80GB", 81920 * MIB, 312e12, 2039e9)),
]


def chip_for(device_kind: str) -> Chip:
  """Returns the Chip of a JAX device kind such as 'TPU v5 lite' or 'NVIDIA H100 80GB HBM3'."""
  if device_kind in CHIPS:
    return CHIPS[device_kind]
  for pattern, chip in GPUS:
    if re.search(pattern, device_kind):
      return chip
  raise ValueError(f"no chip figures for device kind {device_kind!r}; known: {sorted(CHIPS)} "
                   f"and GPUs matching {[pattern for pattern, _ in GPUS]}")


def chips_in_topology(topology: str) -> int:
  """Returns the number of chips in a topology name such as 'v5p:2x2x1' (product of dims)."""
  match = re.fullmatch(r"[a-zA-Z0-9_ ]+[:=_]([0-9x]+)", topology)
  if not match:
    raise ValueError(f"topology {topology!r} is not of the form 'v5p:2x2x1'")
  return math.prod(int(d) for d in match.group(1).split("x"))
