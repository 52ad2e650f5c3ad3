"""The end-to-end recipe (`job`: distil -> SFT -> evaluate -> DAPO -> evaluate over seeds), its
results (`results`) and the copy curve (`copy_curve`)."""

from coa_jax.pipeline.copy_curve import copy_curve
from coa_jax.pipeline.job import (STAGE_SETTINGS, PipelineSettings, StageConfigs, Stages,
                                  StageStopped, StageTimes, rl_tasks, run, run_stages,
                                  stage_section, trained)
from coa_jax.pipeline.results import (SYSTEMS, aggregate, combine, family_means, format_summary,
                                      metric_names, per_seed_table, plot, plot_spread, pyplot,
                                      results_of, write_results_page)
