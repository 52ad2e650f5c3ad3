"""The prepared GPU check (experiments/device_check.py): its steps share one budget and each
becomes a row of the table against the issue's targets, whatever the step does. Fake steps
stand in for the benches (a few short Python processes, no JAX)."""

import importlib.util
import json
import os
import pathlib
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# An entry point, not a package module: loaded from its file.
_SPEC = importlib.util.spec_from_file_location("device_check",
                                               ROOT / "experiments" / "device_check.py")
device_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(device_check)

_INFO = dict(when="now", smi="not found", versions={"jax": "0"})


def _decode_figures(of_roofline: float, ratio: float) -> dict:
  """A bench_rollout JSON of one batch, as the decode steps write it."""
  return dict(bandwidth_bytes_per_s=3.35e12, decode=[dict(
      ours_tokens_per_s=6000.0 * ratio, ours_of_roofline=of_roofline, bound="memory",
      step_bytes=4.0e9, hf_tokens_per_s=6000.0, hf_of_roofline=of_roofline / ratio,
      ratio=ratio)])


def _step(tmp_path, name: str, code: str, share_s: float = 60, min_s: float = 1,
          target=device_check.Target(of_roofline=0.6, ratio=3.0)):
  """A decode step running `code` (its JSON's path in sys.argv[1])."""
  output = str(tmp_path / f"{name}.json")
  return device_check.Step(name, f"fake {name}", "decode", ("-c", code, output), output,
                           share_s, min_s, target, peer="HF generate")


def _writes(figures: dict) -> str:
  return f"import json, sys\njson.dump({figures!r}, open(sys.argv[1], 'w'))"


def test_each_step_is_a_row_whether_it_meets_its_target_fails_hangs_or_does_not_fit(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  steps = [
      _step(tmp_path, "met", _writes(_decode_figures(0.65, 3.2))),
      _step(tmp_path, "missed", _writes(_decode_figures(0.65, 2.5))),
      _step(tmp_path, "no_target", _writes(_decode_figures(0.1, 0.5)),
            target=device_check.Target()),
      _step(tmp_path, "crashes",
            "import sys\nprint('step output')\nsys.exit('boom: out of memory')"),
      _step(tmp_path, "silent", "print('finished, wrote nothing')"),
      _step(tmp_path, "hangs", "import time\nprint('started', flush=True)\ntime.sleep(60)",
            share_s=1),
      _step(tmp_path, "too_big", _writes(_decode_figures(0.9, 9.0)), min_s=1e6),
  ]
  results = device_check.run_steps(steps, time.monotonic() + 120, str(out),
                                   dict(os.environ), _INFO)
  assert [r["status"] for r in results] == ["ok", "ok", "ok", "failed", "failed", "timeout",
                                            "skipped: budget"]
  assert results[5]["seconds"] < 30  # killed at its share, not left to sleep
  summary = json.loads((out / "device_check.json").read_text())
  rows = {r["step"]: r for r in summary["rows"]}
  assert [rows[s.name]["met"] for s in steps] == ["yes", "no", "-", "not measured",
                                                  "not measured", "not measured",
                                                  "not measured"]
  assert rows["met"]["coa_jax"].startswith("19,200 tok/s, 65.0% of the roofline (memory-bound")
  assert rows["met"]["peer"] == "6,000 tok/s HF generate (20.3% of the roofline)"
  assert rows["met"]["ratio"] == "3.20x"
  assert rows["met"]["target"] == ">= 60% of the HBM roofline, >= 3x the peer"
  assert rows["crashes"]["coa_jax"] == "failed (exit 1)"
  assert rows["hangs"]["coa_jax"] == "timed out at 1 s"
  assert rows["too_big"]["coa_jax"] == "skipped: budget"
  assert summary["steps"][0]["figures"] == _decode_figures(0.65, 3.2)
  table = (out / "device_check.md").read_text()
  assert "| met | fake met | 19,200 tok/s" in table and "| yes |" in table
  # the steps that did not finish show their log's tail under the table
  for name, line in [("crashes", "boom: out of memory"), ("silent", "exit 0 but no figures"),
                     ("hangs", "started"), ("too_big", "the step needs at least 1000000 s")]:
    assert f"## {name}: " in table and line in table.split(f"## {name}: ")[1]
  log = (out / "device_check.log").read_text()
  assert all(f"===== {s.name} " in log for s in steps[:-1]) and "step output" in log
  assert sorted(os.listdir(out)) == ["device_check.json", "device_check.log", "device_check.md"]


def test_a_step_runs_under_its_share_or_what_is_left_and_is_skipped_below_its_minimum(tmp_path):
  now = [0.0]
  limits = {}

  def run(step, limit_s, log, env):  # each fake step takes all of its limit
    limits[step.name] = limit_s
    now[0] += limit_s
    return dict(name=step.name, status="ok", seconds=limit_s, limit_s=limit_s, rc=0, tail="",
                figures=_decode_figures(0.5, 1.0))

  steps = [_step(tmp_path, "a", "", share_s=100, min_s=10),
           _step(tmp_path, "b", "", share_s=200, min_s=10),
           _step(tmp_path, "c", "", share_s=50, min_s=40),  # 20 s left: skipped
           _step(tmp_path, "d", "", share_s=50, min_s=10),  # gets the 20 s left
           _step(tmp_path, "e", "", share_s=50, min_s=0)]  # none left: skipped
  results = device_check.run_steps(steps, 320.0, str(tmp_path), {}, _INFO, run=run,
                                   clock=lambda: now[0])
  assert limits == {"a": 100, "b": 200, "d": 20}
  assert [r["status"] for r in results] == ["ok", "ok", "skipped: budget", "ok",
                                            "skipped: budget"]


@pytest.mark.parametrize("smoke", [False, True])
def test_the_plan_runs_the_issues_benches_in_order_of_value_and_keeps_few_files(smoke):
  steps = device_check.plan(smoke, "/scratch")
  assert [s.name for s in steps] == [
      "env", "ceilings", "decode_b16", "profile_decode_b16", "decode_b16_graphs", "train_1p5b",
      "decode_b128", "sft_7b_lora", "train_1p5b_lora", "serve_1p5b", "profile_train_1p5b"]
  for step in steps[1:]:
    assert (ROOT / step.argv[0]).is_file() and step.output.startswith("/scratch/")
  by_name = {s.name: s for s in steps}
  assert "--batches=16" in by_name["decode_b16"].argv
  assert "--batches=128" in by_name["decode_b128"].argv
  graphs = by_name["decode_b16_graphs"]
  assert "--skip_hf" in graphs.argv and "+WHILE" in dict(graphs.env)["XLA_FLAGS"]
  # the step's XLA flags come after the inherited ones, which they do not drop
  inherited = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HOME": "/root"}
  env = device_check.step_variables(inherited, graphs)
  assert env["XLA_FLAGS"] == f"{inherited['XLA_FLAGS']} {device_check.GRAPHS_FLAGS}"
  assert env["HOME"] == "/root" and env["JAX_COMPILATION_CACHE_DIR"].startswith("/scratch/")
  assert "--config=configs/sft_qwen2_5_7b_lora_gpu.py" in by_name["sft_7b_lora"].argv
  assert dict(by_name["sft_7b_lora"].env)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".95"
  caches = {dict(s.env)["JAX_COMPILATION_CACHE_DIR"] for s in steps}  # one a step, none shared
  assert len(caches) == len(steps) and all(c.startswith("/scratch/") for c in caches)
  if not smoke:
    assert "--config=configs/bench_model_gpu.py" in by_name["decode_b16"].argv
    assert "--models=qwen2_5_1_5b_lora" in by_name["train_1p5b_lora"].argv
    assert "--steps=2" in by_name["sft_7b_lora"].argv
    assert {"--preset=qwen2_5_1_5b", "--sessions=16,64,128", "--peers"} <= set(
        by_name["serve_1p5b"].argv)
    assert "--target=train_1p5b" in by_name["profile_train_1p5b"].argv
    assert by_name["decode_b16"].target.text() == ">= 60% of the HBM roofline, >= 3x the peer"
    assert by_name["decode_b128"].target.text() == ">= 70% of the HBM roofline"
    assert by_name["train_1p5b"].target.text() == by_name["sft_7b_lora"].target.text() == (
        ">= 45% MFU")
  # the summary's json, md and log, and what the steps keep: within what the device tool
  # brings back, with room for none more
  kept = [os.path.basename(k) for s in steps for k in s.keep]
  assert len(set(kept)) == len(kept) and 3 + len(kept) < device_check.OUTPUT_FILES


def test_the_env_step_runs_here_and_names_the_devices_and_runtimes(tmp_path):
  (step,) = [s for s in device_check.plan(True, str(tmp_path)) if s.name == "env"]
  env = device_check.step_environment(str(tmp_path / "site"))
  (result,) = device_check.run_steps([step], time.monotonic() + 120, str(tmp_path), env, _INFO)
  assert result["status"] == "ok", result["tail"]
  assert result["figures"]["jax_runtime"] and result["figures"]["torch_cuda"] is None  # a CPU
  (row,) = json.loads((tmp_path / "device_check.json").read_text())["rows"]
  assert row["coa_jax"].startswith("JAX: cpu: cpu") and row["coa_jax"].endswith(
      f" ({result['figures']['jax_runtime']}); PyTorch: cpu")


def test_the_ceilings_step_runs_here_at_small_shapes_and_reads_as_a_row(tmp_path):
  (step,) = [s for s in device_check.plan(True, str(tmp_path)) if s.name == "ceilings"]
  env = device_check.step_environment(str(tmp_path / "site"))
  (result,) = device_check.run_steps([step], time.monotonic() + 120, str(tmp_path), env, _INFO)
  assert result["status"] == "ok", result["tail"]
  assert set(result["figures"]["gemm_chain"]["rows"]) == set(result["figures"]["mlp"]["rows"]) == {
      "16", "128"} and result["figures"]["kernel_seconds"] > 0
  (row,) = json.loads((tmp_path / "device_check.json").read_text())["rows"]
  assert row["coa_jax"].startswith("copy ") and "16 rows " in row["coa_jax"], row


def test_a_decode_without_its_peer_is_a_row_against_the_roofline_alone(tmp_path):
  figures = _decode_figures(0.65, 3.2)
  for key in ("hf_tokens_per_s", "hf_of_roofline", "ratio"):
    del figures["decode"][0][key]
  steps = [_step(tmp_path, "alone", _writes(figures), target=device_check.Target(of_roofline=0.6))]
  device_check.run_steps(steps, time.monotonic() + 60, str(tmp_path), dict(os.environ), _INFO)
  (row,) = json.loads((tmp_path / "device_check.json").read_text())["rows"]
  assert (row["peer"], row["ratio"], row["met"]) == ("-", "-", "yes")
  assert row["coa_jax"].startswith("19,200 tok/s, 65.0% of the roofline")
