"""The suite-time A/B's reading of pytest's report (experiments/suite_time.py)."""

import importlib.util
import pathlib

# An entry point, not a package module: loaded from its file.
_SPEC = importlib.util.spec_from_file_location(
    "suite_time", pathlib.Path(__file__).resolve().parent.parent / "experiments" / "suite_time.py")
suite_time = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(suite_time)

REPORT = """\
============================= slowest durations =============================
211.94s call     tests/test_copy_guard.py::test_sft_learns_to_copy
197.78s setup    tests/test_multihost.py::test_sft_resumes
12.50s call     tests/test_multihost.py::test_two_processes_equal_one
0.01s teardown tests/test_multihost.py::test_two_processes_equal_one
1 failed, 1255 passed, 10 skipped, 6 warnings in 1574.11s (0:26:14)
"""


def test_the_report_gives_each_files_seconds_and_the_summary():
  assert suite_time.seconds_by_file(REPORT) == {"tests/test_copy_guard.py": 211.9,
                                                "tests/test_multihost.py": 210.3}
  assert suite_time.summary_line(REPORT) == (
      "1 failed, 1255 passed, 10 skipped, 6 warnings in 1574.11s (0:26:14)")
  assert suite_time.summary_line("collected 0 items") == ""
