"""The trajectory viewer's page for a run directory, written again (coa_jax.evaluation.viewer).

  python experiments/view.py --run=runs/pipeline_tiny [--tasks=path/to/tasks.jsonl]
      [--out=path/to/page.html]
  make view RUN=runs/pipeline_tiny [ARGS="--tasks=... --out=..."]

Detects the kind of run (an evaluation's output_dir, an RL workdir with rollouts.jsonl, or a
pipeline's output_dir), writes its trajectories.html (or --out) and prints its path. It never
replaces a page with one that shows fewer questions or gold answers: questions the run's files
do not name are kept from the page it has, and a page it cannot read is left alone (name the
task file with --tasks, or write elsewhere with --out).
"""

from absl import app, flags

from coa_jax.evaluation import viewer

_RUN = flags.DEFINE_string("run", None, "the run directory (an evaluation, RL or pipeline run)")
_TASKS = flags.DEFINE_string("tasks", None, "the task file for questions, gold answers and "
                             "families (default: the pipeline's held-out tasks beside the run)")
_OUT = flags.DEFINE_string("out", None, "where to write the page (default: trajectories.html "
                           "in the run directory)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not _RUN.value:
    raise app.UsageError("name a run directory: --run=<dir> (make view RUN=<dir>)")
  try:
    print(viewer.write_page(_RUN.value, tasks=_TASKS.value, out=_OUT.value))
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  except viewer.PoorerPage as e:
    raise SystemExit(f"view: {e}") from None


if __name__ == "__main__":
  app.run(main)
