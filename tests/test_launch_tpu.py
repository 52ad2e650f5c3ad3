"""The TPU pod-slice launcher: --dry-run prints exactly the commands it would run."""

import importlib.util
import pathlib

import pytest

# An entry point, not a package module: loaded from its file.
_SPEC = importlib.util.spec_from_file_location(
    "launch_tpu", pathlib.Path(__file__).resolve().parent.parent / "experiments" / "launch_tpu.py")
launch_tpu = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(launch_tpu)

_FLAGS = ["--tpu=coa-v5p-32", "--zone=us-east5-a", "--project=my-proj", "--workers=4"]
_SSH = "gcloud compute tpus tpu-vm ssh coa-v5p-32"
_WHERE = "--zone=us-east5-a --project=my-proj"
_RUN = ("'--command=cd ~/coa-jax && env COA_JAX_DISTRIBUTED=auto .venv/bin/python "
        "experiments/sft.py --config=configs/sft_qwen2_5_7b.py'")


def test_dry_run_for_a_4_worker_slice_prints_the_exact_commands(capsys):
  assert launch_tpu.main(_FLAGS + ["--sync", "--dry-run", "--", "experiments/sft.py",
                                   "--config=configs/sft_qwen2_5_7b.py"]) == 0
  assert capsys.readouterr().out.splitlines() == [
      "bash -c 'git ls-files -z | xargs -0 tar czf /tmp/coa-jax.tar.gz'",
      "gcloud compute tpus tpu-vm scp /tmp/coa-jax.tar.gz coa-v5p-32:/tmp/coa-jax.tar.gz "
      f"--worker=all {_WHERE}",
      f"{_SSH} --worker=all '--command=mkdir -p ~/coa-jax && tar xzf /tmp/coa-jax.tar.gz -C "
      f"~/coa-jax && cd ~/coa-jax && make install' {_WHERE}",
      *[f"{_SSH} --worker={i} {_RUN} {_WHERE}" for i in range(4)],
      "# if a worker fails, or on Ctrl-C:",
      f"{_SSH} --worker=all '--command=pkill -f experiments/sft.py || true' {_WHERE}",
  ]


def test_a_missing_experiment_or_bad_worker_count_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as exited:
    launch_tpu.main(_FLAGS + ["--dry-run"])
  assert exited.value.code == 2  # argparse's usage error
  assert "give the experiment after --" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exited:
    launch_tpu.main(_FLAGS[:3] + ["--workers=0", "--dry-run", "--", "experiments/sft.py"])
  assert exited.value.code == 2
  captured = capsys.readouterr()
  assert "--workers must be >= 1, got 0" in captured.err and not captured.out  # nothing to run
