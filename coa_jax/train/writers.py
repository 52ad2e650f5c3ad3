"""A job's metric writer: one JSON line per step (metrics.jsonl) and TensorBoard scalar events
(float32 tensors tagged for TensorBoard's scalars plugin, which its dashboard plots).

The events are TensorBoard's protos in its record framing, written to a plain file: TensorBoard's
own event-file writer (and clu's) opens its file through TensorFlow's file system when TensorFlow
is installed, and importing TensorFlow took about 5 s of every job's start.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Mapping

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.scalar import metadata
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from coa_jax.runtime import paths

_SCALAR = metadata.create_summary_metadata(display_name=None, description=None)


class MetricWriter:
  """Writes each step's scalars to workdir/metrics.jsonl ({"step", scalars...}, appended on a
  resumed run, flushed per step so a killed job keeps every step it logged) and as TensorBoard
  events under workdir/tensorboard; with `active` False (processes other than 0), nothing."""

  def __init__(self, workdir: str, append: bool, active: bool = True):
    self._file = self._events = None
    if active:
      folder = paths.to_epath(workdir)  # a local folder or a URL (gs://...)
      (folder / "tensorboard").mkdir(parents=True, exist_ok=True)
      self._file = (folder / "metrics.jsonl").open("a" if append else "w")
      # TensorBoard's naming: a resumed run starts a file of its own beside the earlier ones.
      name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}"
      self._events = RecordWriter((folder / "tensorboard" / name).open("wb"))
      self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))

  def _add(self, event: Event) -> None:
    self._events.write(event.SerializeToString())
    self._events.flush()

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}  # on every process
    if self._file is None:
      return
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    values = [Summary.Value(tag=k, metadata=_SCALAR,
                            tensor=tensor_util.make_tensor_proto(np.float32(v)))
              for k, v in row.items() if k != "step"]
    self._add(Event(wall_time=time.time(), step=row["step"], summary=Summary(value=values)))

  def close(self) -> None:
    """Closes the files (the last upload of a gs:// one); a second call does nothing."""
    if self._file is not None:
      file, events, self._file, self._events = self._file, self._events, None, None
      file.close()
      events.close()
