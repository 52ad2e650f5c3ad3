"""The grain SFT pipeline: packing keeps exact masks, shards by process, resumes exactly."""

import dataclasses

import jax
import numpy as np
import pytest

from coa_jax.data import coa_format, packing, sample_data
from coa_jax.data import tokenizer as tk
from coa_jax.data.importers import DataError, DropCounter
from coa_jax.train.batch import TokenBatch

TRAJECTORIES = [dataclasses.replace(t, question=f"{t.question} (#{i})")
                for i, t in enumerate(sample_data.make_trajectories(12))]


@pytest.fixture(scope="module")
def tok():
  return tk.default_tokenizer()


def _dataset(tok, counter=None, **overrides):
  defaults = dict(seq_len=1024, batch_size=2, seed=3)
  config = packing.PipelineConfig(**{**defaults, **overrides})
  return packing.build_dataset(TRAJECTORIES, tok, config, counter or DropCounter())


def _trained_text_by_segment(tok, batch):
  texts = []
  for row in range(batch.input_ids.shape[0]):
    seg = batch.segment_ids[row]
    for s in np.unique(seg[seg > 0]):
      where = (seg == s) & (batch.loss_mask[row] == 1)
      texts.append(tok.decode(batch.targets[row][where]))
  return texts


def test_packed_rows_keep_exact_masks_per_example(tok):
  expected = {coa_format.render_steps(s for s in t.steps if s.tag != "observation") +
              tok.decode([tok.end_id]) for t in TRAJECTORIES}
  seen = []
  for batch in _dataset(tok, num_epochs=1):
    assert isinstance(batch, TokenBatch)
    assert batch.input_ids.shape == (2, 1024)
    seen.extend(_trained_text_by_segment(tok, batch))
  assert len(seen) > 2 * len(list(_dataset(tok)))  # rows really hold several examples
  assert set(seen) <= expected


def test_positions_restart_for_each_packed_example(tok):
  batch = next(iter(_dataset(tok)))
  for seg, pos in zip(batch.segment_ids, batch.positions):
    assert len(np.unique(seg[seg > 0])) > 1  # the row really packs several examples
    # Each example counts 0, 1, 2, ... from its first token; padding (segment 0) is at 0.
    start = np.maximum.accumulate(np.where(np.r_[True, seg[1:] != seg[:-1]],
                                           np.arange(len(seg)), 0))
    np.testing.assert_array_equal(pos, np.where(seg > 0, np.arange(len(seg)) - start, 0))


def test_processes_read_disjoint_shards(tok):
  config = packing.PipelineConfig(seq_len=1024, batch_size=1, shuffle=False,
                                        packing_bins=1)
  questions = []
  for index in range(2):
    ds = packing.build_dataset(TRAJECTORIES, tok, config, DropCounter(), index, 2)
    ids = np.concatenate([b.input_ids[0] for b in ds])
    questions.append({t.question for t in TRAJECTORIES if tok.decode(ids).count(t.question)})
  assert not questions[0] & questions[1]  # disjoint, and together every example once
  assert questions[0] | questions[1] == {t.question for t in TRAJECTORIES}
  assert len(questions[0]) == len(questions[1]) == len(TRAJECTORIES) // 2


def test_batches_depend_on_the_shard_count_not_the_process_count(tok):
  config = packing.PipelineConfig(seq_len=256, batch_size=4, seed=3, num_epochs=4)
  one = packing.ShardedBatches(TRAJECTORIES, tok, config, DropCounter(), shards=2)
  halves = [packing.ShardedBatches(TRAJECTORIES, tok, dataclasses.replace(
      config, batch_size=2), DropCounter(), 2, index, 2) for index in range(2)]
  for _ in range(3):
    whole, parts = next(one), [next(h) for h in halves]
    jax.tree_util.tree_map(np.testing.assert_array_equal, whole, TokenBatch.concatenate(parts))
  state = {**halves[0].get_state(), **halves[1].get_state()}
  assert state == one.get_state()
  expected = next(one)
  resumed = packing.ShardedBatches(TRAJECTORIES, tok, config, DropCounter(), shards=2)
  resumed.set_state(state)
  np.testing.assert_array_equal(next(resumed).input_ids, expected.input_ids)


def test_a_shard_without_examples_is_an_error(tok):
  config = packing.PipelineConfig(seq_len=256, batch_size=1)
  with pytest.raises(DataError) as raised:
    packing.build_dataset(TRAJECTORIES[:1], tok, config, DropCounter(), 1, 2)
  assert str(raised.value) == "data shard 1 of 2 got no examples"


def test_shards_that_do_not_split_over_the_processes_are_an_error(tok):
  config = packing.PipelineConfig(seq_len=256, batch_size=4)
  with pytest.raises(DataError) as raised:
    packing.ShardedBatches(TRAJECTORIES, tok, config, DropCounter(), 3, 0, 2)
  assert str(raised.value) == ("data.shards=3 must be a multiple of the 2 process(es), and each "
                               "process's 4 rows must split over its shards")


def test_a_data_state_without_this_processs_shards_is_an_error(tok):
  config = packing.PipelineConfig(seq_len=256, batch_size=2)
  batches = packing.ShardedBatches(TRAJECTORIES, tok, config, DropCounter(), shards=2)
  state = batches.get_state()
  del state["1"]
  with pytest.raises(DataError) as raised:
    batches.set_state(state)
  assert str(raised.value) == ("the data state has no position for shard(s) [1]; was the run "
                               "saved with another data.shards?")


def test_the_last_partial_batch_is_dropped(tok):
  config = packing.PipelineConfig(seq_len=256, batch_size=1, shuffle=False, num_epochs=1,
                                  packing_bins=1)
  rows = list(packing.build_dataset(TRAJECTORIES[:3], tok, config, DropCounter()))
  assert len(rows) == 3  # one example a row
  pairs = dataclasses.replace(config, batch_size=2)
  (batch,) = packing.build_dataset(TRAJECTORIES[:3], tok, pairs, DropCounter())
  np.testing.assert_array_equal(batch.input_ids,
                                np.concatenate([rows[0].input_ids, rows[1].input_ids]))


def test_restoring_iterator_state_resumes_the_same_data_order(tok):
  iterator = iter(_dataset(tok, num_epochs=3))
  first = [next(iterator).input_ids for _ in range(3)]
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(3)]
  resumed = iter(_dataset(tok, num_epochs=3))
  resumed.set_state(state)
  got = [next(resumed) for _ in range(3)]
  # A restore that did nothing would replay the first batches, which differ from these.
  assert not any(np.array_equal(a, b.input_ids) for a, b in zip(first, expected))
  for want, have in zip(expected, got):
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(want),
                                                    jax.tree_util.tree_leaves(have)))


def test_overlong_examples_are_counted_when_dropped(tok):
  counter = DropCounter()
  list(_dataset(tok, counter, seq_len=128, overlong="drop"))
  assert counter.dropped["too_long"] == len(TRAJECTORIES)


def test_parquet_source_reads_the_same_trajectories(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  records = [{"instruction": t.question, "output": t.response_text(), "system": t.system}
             for t in TRAJECTORIES[:4]] + [{"instruction": "q", "output": "<think>\nopen"}]
  pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
  counter = DropCounter()
  got = packing.load_source(str(tmp_path / "d.parquet"), counter)
  assert [t.steps for t in got] == [t.steps for t in TRAJECTORIES[:4]]
  assert dict(counter.dropped) == {"unclosed_tag": 1}


def test_upsampling_repeats_the_trajectories_a_metadata_value_names():
  step = (coa_format.Step("answer", "1"),)
  rows = [coa_format.Trajectory("s", f"Question: {i}?", step, {"family": family})
          for i, family in enumerate(("lookup", "mixed", "arithmetic"))]
  mixed = packing.upsample(rows, "family", {"mixed": 3})
  assert [t.question for t in mixed] == ["Question: 0?"] + ["Question: 1?"] * 3 + ["Question: 2?"]
  assert packing.upsample(rows, "", {"mixed": 3}) == rows  # off
  with pytest.raises(DataError, match="'mixd'"):
    packing.upsample(rows, "family", {"mixd": 2})  # a typo is not silently a no-op
  with pytest.raises(DataError, match="whole numbers"):
    packing.upsample(rows, "family", {"mixed": 0.5})
