"""Minimal, torch-free safetensors reader (memory-mapped, lazy) and streaming writer.

Reading maps a local file and returns NumPy views, so slicing a tensor reads only the bytes it
touches; bfloat16 comes back as `ml_dtypes.bfloat16`. A file in a store (gs://...) is read
through `runtime.paths`, one tensor's byte range at a time (the last tensor read is kept: the
device shards of one parameter read it in turn). Writing streams one tensor at a time, to a
local file or a store.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from coa_jax.runtime import paths

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
  """A safetensors file is missing, truncated or malformed; the message names the file."""


class SafetensorsFile:
  """A lazily read safetensors file: `names()`, `shape(name)`, `get(name)` (a NumPy view)."""

  def __init__(self, path: str):
    self.path = path
    self._remote = paths.is_remote(path)
    try:
      size = paths.to_epath(path).stat().length if self._remote else os.path.getsize(path)
      with self._open() as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, _MAX_HEADER):
          raise SafetensorsError(f"{path}: header length {header_len} exceeds the file")
        header = json.loads(f.read(header_len))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
      raise SafetensorsError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    self._data_start = 8 + header_len
    self._entries = header
    for name, entry in header.items():
      begin, end = entry["data_offsets"]
      if entry["dtype"] not in _DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
      expected = int(np.prod(entry["shape"], dtype=np.int64)) * _DTYPES[entry["dtype"]].itemsize
      if end - begin != expected or self._data_start + end > size:
        raise SafetensorsError(f"{path}: tensor {name!r} is truncated or has bad offsets")
    local = size > 0 and not self._remote
    self._map = np.memmap(path, dtype=np.uint8, mode="r") if local else None
    self._last: tuple[str, np.ndarray] | None = None  # a store's last tensor read

  def _open(self):
    return paths.to_epath(self.path).open("rb") if self._remote else open(self.path, "rb")

  def names(self) -> list[str]:
    """Returns the tensor names stored in this file."""
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    """Returns the shape of tensor `name` (read from the header only)."""
    return tuple(self._entries[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    """Returns tensor `name` as a read-only NumPy view of the mapped file."""
    entry = self._entries[name]
    begin, end = entry["data_offsets"]
    if not self._remote:
      raw = self._map[self._data_start + begin:self._data_start + end]
      return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    if self._last is None or self._last[0] != name:
      with self._open() as f:
        f.seek(self._data_start + begin)
        raw = f.read(end - begin)
      if len(raw) != end - begin:
        raise SafetensorsError(f"{self.path}: tensor {name!r} is truncated")
      array = np.frombuffer(raw, _DTYPES[entry["dtype"]]).reshape(entry["shape"])
      self._last = (name, array)
    return self._last[1]


def dtype_name(dtype: np.dtype) -> str:
  """Returns the safetensors dtype tag (e.g. 'BF16') of a NumPy dtype."""
  try:
    return _NAMES[np.dtype(dtype)]
  except KeyError:
    raise SafetensorsError(f"dtype {dtype} cannot be stored in safetensors") from None


def write_safetensors(path: str,
                      tensors: Iterable[tuple[str, tuple[int, ...], np.dtype,
                                              Callable[[], np.ndarray]]],
                      metadata: dict[str, str] | None = None) -> int:
  """Writes tensors given as (name, shape, dtype, produce) one at a time; returns data bytes.

  `produce()` is called once per tensor, in order, so only one tensor is in host memory.
  """
  tensors = list(tensors)
  header: dict[str, object] = {"__metadata__": metadata or {"format": "np"}}
  offset = 0
  for name, shape, dtype, _ in tensors:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  tmp = paths.to_epath(path + ".tmp")  # a local file or an object in the store a URL names
  with tmp.open("wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype, produce in tensors:
      array = np.ascontiguousarray(produce(), dtype=dtype)
      if array.shape != tuple(shape):
        raise SafetensorsError(f"tensor {name!r}: produced shape {array.shape}, "
                               f"declared {tuple(shape)}")
      f.write(array.tobytes())
  tmp.replace(paths.to_epath(path))
  return offset
