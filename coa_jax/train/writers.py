"""Metric writers (clu's `metric_writers`): one JSON line per step, and TensorBoard events.

Imported by the job loop when a job starts, not with the package: clu's TensorBoard writer
brings TensorFlow, whose import takes seconds.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up notices

from clu import metric_writers  # noqa: E402


class JsonlWriter(metric_writers.MetricWriter):
  """Appends {"step", scalars...} per `write_scalars` to a JSONL file; other kinds of values
  (images, texts, histograms) go to TensorBoard only."""

  def __init__(self, path: str, append: bool = False):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    self.path = path
    self._file = open(path, "a" if append else "w")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()  # a killed job keeps every step it logged

  def write_summaries(self, step, values, metadata=None) -> None:
    pass

  def write_images(self, step, images) -> None:
    pass

  def write_videos(self, step, videos) -> None:
    pass

  def write_audios(self, step, audios, *, sample_rate) -> None:
    pass

  def write_texts(self, step, texts) -> None:
    pass

  def write_histograms(self, step, arrays, num_buckets=None) -> None:
    pass

  def write_hparams(self, hparams) -> None:
    pass

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def open_writer(workdir: str, append: bool, active: bool) -> metric_writers.MetricWriter:
  """Returns the writer of a job's metrics: workdir/metrics.jsonl and TensorBoard events under
  workdir/tensorboard when `active` (process 0), else one that writes nothing."""
  if not active:
    return metric_writers.MultiWriter([])
  return metric_writers.MultiWriter([
      JsonlWriter(os.path.join(workdir, "metrics.jsonl"), append),
      metric_writers.SummaryWriter(os.path.join(workdir, "tensorboard"))])
