"""The trajectory viewer's page for a run directory, written again (coa_jax.evaluation.viewer).

  python experiments/view.py --run=runs/pipeline_tiny [--tasks=path/to/tasks.jsonl]
  make view RUN=runs/pipeline_tiny

Detects the kind of run (an evaluation's output_dir, an RL workdir with rollouts.jsonl, or a
pipeline's output_dir), writes trajectories.html into it and prints its path.
"""

from absl import app, flags

from coa_jax.evaluation import viewer

_RUN = flags.DEFINE_string("run", None, "the run directory", required=True)
_TASKS = flags.DEFINE_string("tasks", None, "the task file for questions, gold answers and "
                             "families (default: the pipeline's held-out tasks beside the run)")


def main(argv):
  del argv
  print(viewer.write_page(_RUN.value, tasks=_TASKS.value))


if __name__ == "__main__":
  app.run(main)
