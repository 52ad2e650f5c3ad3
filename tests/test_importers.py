"""Importers: our JSONL and LLaMA-Factory layouts, counted drops, clear errors on bad files."""

import json

import pytest

from coa_jax.data import coa_format, importers, sample_data
from coa_jax.data.importers import DataError, DropCounter

TRAJ = sample_data.make_trajectories(3)[1]
TEXT = TRAJ.response_text()


def _write(path, records, as_lines=True):
  with open(path, "w") as f:
    if as_lines:
      f.write("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    else:
      json.dump(records, f)
  return str(path)


def test_all_layouts_read_to_the_same_trajectory(tmp_path):
  records = [
      TRAJ.to_json(),
      {"instruction": TRAJ.question, "input": "", "output": TEXT, "system": TRAJ.system},
      {"conversations": [{"from": "system", "value": TRAJ.system},
                         {"from": "human", "value": TRAJ.question},
                         {"from": "gpt", "value": TEXT}]},
      {"messages": [{"role": "user", "content": TRAJ.question},
                    {"role": "assistant", "content": TEXT}], "system": TRAJ.system},
  ]
  for as_lines, name in ((True, "d.jsonl"), (False, "d.json")):
    got = list(importers.read_trajectories(_write(tmp_path / name, records, as_lines)))
    assert [(t.system, t.question, t.steps) for t in got] == [
        (TRAJ.system, TRAJ.question, TRAJ.steps)] * 4


def test_invalid_records_are_dropped_and_counted_by_reason(tmp_path):
  bad_transition = TEXT.replace("<reflection>", "<observation>").replace(
      "</reflection>", "</observation>")
  records = [TRAJ.to_json(), "{not json", {"foo": 1}, "[1, 2]",
             {"instruction": "q", "output": "<think>\nunclosed"},
             {"instruction": "q", "output": bad_transition},
             {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}]
  counter = DropCounter()
  kept = list(importers.read_trajectories(_write(tmp_path / "d.jsonl", records), counter))
  assert len(kept) == 1 and counter.kept == 1
  assert dict(counter.dropped) == {"bad_json": 1, "unknown_layout": 1, "not_an_object": 1,
                                   coa_format.UNCLOSED_TAG: 1,
                                   coa_format.OBSERVATION_WITHOUT_TOOL: 1, "not_single_turn": 1}
  assert "kept 1 of 7" in counter.summary()
  with pytest.raises(DataError, match="dropped 85.7% of examples, more than the allowed 50.0%"):
    counter.check(0.5)


def test_missing_and_empty_files_are_named(tmp_path):
  with pytest.raises(DataError, match="does not exist"):
    list(importers.read_trajectories(str(tmp_path / "nope.jsonl")))
  (tmp_path / "empty.jsonl").write_text("")
  with pytest.raises(DataError, match="is empty"):
    list(importers.read_trajectories(str(tmp_path / "empty.jsonl")))
  (tmp_path / "broken.json").write_text("[{\"a\": ")
  with pytest.raises(DataError, match="not valid JSON"):
    list(importers.read_trajectories(str(tmp_path / "broken.json")))


def test_nothing_kept_fails_clearly():
  counter = DropCounter()
  counter.drop("bad_json")
  with pytest.raises(DataError, match="no usable examples"):
    counter.check(1.0)


def test_shipped_sample_is_the_deterministic_generator_output(tmp_path):
  shipped = sample_data.SAMPLE_PATH
  sample_data.write_jsonl(str(tmp_path / "fresh.jsonl"),
                          sample_data.make_trajectories(sample_data.SHIPPED_COUNT))
  assert open(shipped).read() == (tmp_path / "fresh.jsonl").read_text()
  counter = DropCounter()
  assert len(list(importers.read_trajectories(shipped, counter))) == sample_data.SHIPPED_COUNT


def test_a_step_whose_content_holds_a_tag_is_dropped_not_trained_as_text(tmp_path):
  leaked = TRAJ.to_json()
  leaked["steps"][0]["content"] = "x <observation>a tool's output</observation> y"
  counter = DropCounter()
  kept = list(importers.read_trajectories(_write(tmp_path / "d.jsonl", [leaked, TRAJ.to_json()]),
                                          counter))
  assert len(kept) == 1 and dict(counter.dropped) == {coa_format.NESTED_TAG: 1}


def test_nulls_bad_turns_a_bom_bad_bytes_and_windows_line_ends(tmp_path):
  nulls = {**TRAJ.to_json(), "system": None}
  no_question = {**TRAJ.to_json(), "question": None}
  crlf = {"instruction": TRAJ.question, "output": TEXT.replace("\n", "\r\n"),
          "system": TRAJ.system}
  path = tmp_path / "d.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + b"\n".join([
      json.dumps(TRAJ.to_json()).encode(), json.dumps(nulls).encode(),
      json.dumps(no_question).encode(), json.dumps({"messages": ["hi", "there"]}).encode(),
      json.dumps({**TRAJ.to_json(), "question": "q"}).encode()[:-2] + b'\xff"}',
      json.dumps(crlf).encode()]) + b"\n")
  counter = DropCounter()
  kept = list(importers.read_trajectories(str(path), counter))
  assert dict(counter.dropped) == {"no_question": 1, "bad_turn": 1, "bad_json": 1}
  assert [(t.system, t.question, t.steps) for t in kept] == [
      (TRAJ.system, TRAJ.question, TRAJ.steps), ("", TRAJ.question, TRAJ.steps),
      (TRAJ.system, TRAJ.question, TRAJ.steps)]  # the BOM's line, the null system, the CRLFs
