"""The SFT input pipeline on grain: source -> shard -> shuffle -> tokenize -> pack -> batch.

Each example is shifted into (inputs, targets, loss_mask) before packing, so a packed row
never predicts one example's token from another's; packing keeps per-token masks and adds
segment ids (1, 2, ... per example, 0 for padding) and positions restarting at 0.

The source is split into `shards` (default: one per process); shard s reads examples s, s +
shards, ... through its own pipeline, and a step's global batch stacks every shard's rows. A
process builds only its own shards (`ShardedBatches`), so it reads only its slice of the data,
and the batches depend on the shard count, not on how many processes share the shards. The
iterator's state (a small dict per shard) is what checkpoints store to resume the exact order.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Sequence

import grain
import grain.experimental
import numpy as np

from coa_jax.data import coa_format, importers
from coa_jax.data.coa_format import Trajectory
from coa_jax.data.importers import DataError, DropCounter
from coa_jax.data.tokenize import OVERLONG_POLICIES, DroppedExample, tokenize_trajectory
from coa_jax.data.tokenizer import CoATokenizer
from coa_jax.model.config import ConfigError
from coa_jax.train.batch import TokenBatch


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """An SFT job's data: the source (a JSON/JSONL or parquet file, or `tfds:NAME[:SPLIT]`), epochs,
  what to do with a trajectory longer than a row (`OVERLONG_POLICIES`), the share of invalid
  records tolerated, the shards (0: one per process; set it to keep the same batches on any
  number of processes), and the data mix: `upsample_by`, a metadata key whose values `upsample`
  repeats ({"mixed": 2}: each such trajectory twice an epoch; "": off)."""

  path: str
  num_epochs: int = 1
  overlong: str = "truncate"
  max_drop_fraction: float = 0.05
  shards: int = 0
  upsample_by: str = ""
  upsample: dict[str, int] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.overlong not in OVERLONG_POLICIES:
      raise ConfigError(f"overlong={self.overlong!r}: expected one of {OVERLONG_POLICIES}")
    if self.num_epochs < 1 or self.shards < 0 or not 0 <= self.max_drop_fraction <= 1:
      raise ConfigError(f"num_epochs={self.num_epochs}, shards={self.shards}, max_drop_fraction="
                        f"{self.max_drop_fraction}: expected >= 1, >= 0 and in [0, 1]")


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


def load_source(spec: str, counter: DropCounter,
                tool_tags: tuple[str, ...] = coa_format.TOOL_TAGS) -> list[Trajectory]:
  """Returns the valid trajectories of a JSON/JSONL file, a parquet file, or `tfds:NAME[:SPLIT]`,
  their tool steps those of the declared `tool_tags`.

  Invalid records are counted in `counter`.
  """
  if spec.startswith("tfds:"):
    return _from_tfds(spec, counter, tool_tags)
  if spec.endswith(".parquet"):
    return _from_parquet(spec, counter, tool_tags)
  return list(importers.read_trajectories(spec, counter, tool_tags))


def _from_parquet(path: str, counter: DropCounter, tool_tags: tuple[str, ...]
                  ) -> list[Trajectory]:
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError("reading parquet needs pyarrow (pip install pyarrow)") from None
  if not os.path.isfile(path):
    raise DataError(f"data file {path!r} does not exist")
  return list(importers.valid_trajectories(pq.read_table(path).to_pylist(), counter, tool_tags))


def _from_tfds(spec: str, counter: DropCounter, tool_tags: tuple[str, ...]) -> list[Trajectory]:
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise DataError("tfds sources need the `tfds` extra (pip install 'coa-jax[tfds]')") from None
  _, name, *rest = spec.split(":")
  source = tfds.data_source(name, split=rest[0] if rest else "train")

  def decode(record):
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in dict(record).items()}

  return list(importers.valid_trajectories((decode(source[i]) for i in range(len(source))),
                                           counter, tool_tags))


def upsample(trajectories: Sequence[Trajectory], key: str,
             weights: dict[str, int]) -> list[Trajectory]:
  """Returns the trajectories with each one repeated `weights[metadata[key]]` times (1 for a
  value not in `weights`): a data mix that shows a rare kind of trajectory more often, in the
  source's order, before the shuffle."""
  if not key:
    return list(trajectories)
  if any(not isinstance(w, int) or w < 1 for w in weights.values()):
    raise DataError(f"data.upsample weights must be whole numbers >= 1, got {dict(weights)}")
  values = {t.metadata.get(key) for t in trajectories}
  unknown = set(weights) - values
  if unknown:
    raise DataError(f"data.upsample names {sorted(unknown)}, which no trajectory's metadata "
                    f"{key!r} holds (it holds {sorted(map(str, values))})")
  return [t for t in trajectories for _ in range(weights.get(t.metadata.get(key), 1))]


def _shifted(example) -> dict[str, np.ndarray]:
  ids, mask = example.input_ids, example.loss_mask
  return dict(inputs=ids[:-1], targets=ids[1:], loss_mask=mask[1:])


def build_dataset(trajectories: Sequence[Trajectory], tokenizer: CoATokenizer,
                  config: PipelineConfig, counter: DropCounter,
                  shard: int = 0, shards: int = 1) -> grain.IterDataset:
  """Returns the packed, batched dataset of one shard of the source: TokenBatches of
  (batch, seq_len) int32 arrays. Examples dropped while tokenizing are counted in `counter`."""
  if config.seq_len < 2 or config.batch_size < 1:
    raise DataError(f"seq_len={config.seq_len} and batch_size={config.batch_size} must be "
                    f">= 2 and >= 1")
  ds = grain.MapDataset.source(list(trajectories))[shard::shards]
  if len(ds) == 0:
    raise DataError(f"data shard {shard} of {shards} got no examples")
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

  # Two threads tokenize a few dozen examples ahead (the batches are the same). grain's default
  # (16 threads, 500 ahead) scans its whole buffer on every element: on a busy 2-core machine,
  # a third of a small model's step (guard config: 300 steps 48 s -> 31 s); idle, it was hidden.
  ds = ds.map(tokenize).filter(lambda x: x is not None).to_iter_dataset(
      grain.ReadOptions(num_threads=2, prefetch_buffer_size=32))
  lengths = {k: config.seq_len for k in ("inputs", "targets", "loss_mask")}
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct=lengths, num_packing_bins=config.packing_bins or config.batch_size,
      shuffle_bins=False)
  ds = ds.batch(config.batch_size, drop_remainder=True)
  return ds.map(lambda row: TokenBatch(
      input_ids=row["inputs"], targets=row["targets"], loss_mask=row["loss_mask"],
      positions=row["inputs_positions"], segment_ids=row["inputs_segment_ids"]))


class ShardedBatches:
  """This process's shards of the source, batched side by side: each step, the rows of shard
  p * k, ..., p * k + k - 1 (k = shards / processes) stacked, `batch_size` rows in all."""

  def __init__(self, trajectories: Sequence[Trajectory], tokenizer: CoATokenizer,
               config: PipelineConfig, counter: DropCounter, shards: int = 0,
               process_index: int = 0, process_count: int = 1):
    shards = shards or process_count
    if shards % process_count or config.batch_size % (shards // process_count):
      raise DataError(f"data.shards={shards} must be a multiple of the {process_count} "
                      f"process(es), and each process's {config.batch_size} rows must split "
                      f"over its shards")
    per_process = shards // process_count
    self.shards = range(process_index * per_process, (process_index + 1) * per_process)
    shard_config = dataclasses.replace(config, batch_size=config.batch_size // per_process)
    self._iterators = [iter(build_dataset(trajectories, tokenizer, shard_config, counter, s,
                                          shards)) for s in self.shards]

  def __iter__(self) -> Iterator[TokenBatch]:
    return self

  def __next__(self) -> TokenBatch:
    return TokenBatch.concatenate([next(iterator) for iterator in self._iterators])

  def get_state(self) -> dict[str, Any]:
    """Returns the position of each of this process's shards, keyed by shard index."""
    return {str(s): iterator.get_state() for s, iterator in zip(self.shards, self._iterators)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes this process's shards from `state` (which may hold other processes' too)."""
    missing = [s for s in self.shards if str(s) not in state]
    if missing:
      raise DataError(f"the data state has no position for shard(s) {missing}; was the run "
                      f"saved with another data.shards?")
    for s, iterator in zip(self.shards, self._iterators):
      iterator.set_state(state[str(s)])
