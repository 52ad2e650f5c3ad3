"""The SFT input pipeline on grain: source -> shard -> shuffle -> tokenize -> pack -> batch.

Each example is shifted into (inputs, targets, loss_mask) before packing, so a packed row
never predicts one example's token from another's; packing keeps per-token masks and adds
segment ids (1, 2, ... per example, 0 for padding) and positions restarting at 0. Every
process reads only its own slice of the source. The iterator's state (a small dict) is what
checkpoints store to resume the exact data order.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import grain
import grain.experimental
import numpy as np

from coa_jax import importers
from coa_jax.coa_format import Trajectory
from coa_jax.importers import DataError, DropCounter
from coa_jax.sft_tokenize import DroppedExample, tokenize_trajectory
from coa_jax.tokenizer import CoATokenizer

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """What the SFT pipeline reads and how it shapes batches (per process)."""

  seq_len: int
  batch_size: int  # rows per step on this process
  seed: int = 0
  num_epochs: int = 1
  shuffle: bool = True
  overlong: str = "truncate"
  packing_bins: int = 0  # 0: as many as batch rows


def load_source(spec: str, counter: DropCounter) -> list[Trajectory]:
  """Returns the valid trajectories of a JSON/JSONL file, a parquet file, or `tfds:NAME[:SPLIT]`.

  Invalid records are counted in `counter`.
  """
  if spec.startswith("tfds:"):
    return _from_tfds(spec, counter)
  if spec.endswith(".parquet"):
    return _from_parquet(spec, counter)
  return list(importers.read_trajectories(spec, counter))


def _from_parquet(path: str, counter: DropCounter) -> list[Trajectory]:
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError("reading parquet needs pyarrow (pip install pyarrow)") from None
  if not os.path.isfile(path):
    raise DataError(f"data file {path!r} does not exist")
  return list(importers.valid_trajectories(pq.read_table(path).to_pylist(), counter))


def _from_tfds(spec: str, counter: DropCounter) -> list[Trajectory]:
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise DataError("tfds sources need the `tfds` extra (pip install 'coa-jax[tfds]')") from None
  _, name, *rest = spec.split(":")
  source = tfds.data_source(name, split=rest[0] if rest else "train")

  def decode(record):
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in dict(record).items()}

  return list(importers.valid_trajectories((decode(source[i]) for i in range(len(source))),
                                           counter))


def _shifted(example) -> dict[str, np.ndarray]:
  ids, mask = example.input_ids, example.loss_mask
  return dict(inputs=ids[:-1], targets=ids[1:], loss_mask=mask[1:])


def build_dataset(trajectories: Sequence[Trajectory], tokenizer: CoATokenizer,
                  config: PipelineConfig, counter: DropCounter,
                  process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """Returns the packed, batched dataset of this process: dicts of (batch, seq_len) int32
  arrays with keys BATCH_KEYS. Examples dropped while tokenizing are counted in `counter`."""
  if config.seq_len < 2 or config.batch_size < 1:
    raise DataError(f"seq_len={config.seq_len} and batch_size={config.batch_size} must be "
                    f">= 2 and >= 1")
  ds = grain.MapDataset.source(list(trajectories))[process_index::process_count]
  if len(ds) == 0:
    raise DataError(f"process {process_index} of {process_count} got no examples")
  if config.shuffle:
    ds = ds.shuffle(seed=config.seed)
  ds = ds.repeat(config.num_epochs)

  def tokenize(trajectory):
    try:  # seq_len + 1 tokens give seq_len (input, target) pairs
      return _shifted(tokenize_trajectory(trajectory, tokenizer, config.seq_len + 1,
                                          config.overlong))
    except DroppedExample as e:
      counter.drop(e.reason)
      return None

  ds = ds.map(tokenize).filter(lambda x: x is not None).to_iter_dataset()
  lengths = {k: config.seq_len for k in ("inputs", "targets", "loss_mask")}
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct=lengths, num_packing_bins=config.packing_bins or config.batch_size,
      shuffle_bins=False)
  ds = ds.batch(config.batch_size, drop_remainder=True)
  return ds.map(lambda row: dict(
      input_ids=row["inputs"], targets=row["targets"], loss_mask=row["loss_mask"],
      positions=row["inputs_positions"], segment_ids=row["inputs_segment_ids"]))
