"""Experiments as sweeps: a grid of pipeline-config overrides (cells) times seeds.

An `Experiment` names a kind (what one cell and seed runs: "rl" curves, "sft" on filtered data,
test-time "scaling"), its cells (cell name -> overrides of the pipeline config, dotted paths
such as "dapo.learning_rate"; a path under "options." sets one of the kind's options for that
cell) and the kind's options. `run` runs every (cell, seed) in order,
each on the pipeline config with the cell's overrides, and writes under
<output_dir>/experiments/<name>/:

- cells/<cell>/seed-<seed>.json: the cell's result, cached under its settings (the overridden
  config, the seed, the options): a re-run reuses it, a changed setting recomputes it;
- results.json (every result, the summary, the table), results.md (the table), results.png.

The work behind a cell is cached where it is content-addressed (`shared_dir`): an RL run, an
SFT run or an evaluation lives in a folder named after the fingerprint of its settings, so
experiments and cells that need the same run share it, and the main job's models are reused
where the settings are the main job's. `publish` copies the small results files into the
repository's docs/results/<name>/.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import textwrap
import time
from typing import Any, Mapping

import jax
import ml_collections

from coa_jax.model import ConfigError
from coa_jax.pipeline import StageConfigs, Stages, pyplot
from coa_jax.runtime.cache import cached_json, canonical, fingerprint, write_json
from coa_jax.runtime.distributed import say
from coa_jax.runtime.settings import to_section

OPTION = "options."  # a cell override under this prefix sets the kind's option, not the config


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A sweep: `kind` runs each of `cells` (name -> pipeline-config overrides) for `seeds` seeds
  (config.seed, config.seed + 1, ...), with the kind's `options`."""

  name: str
  kind: str
  cells: Mapping[str, Mapping[str, Any]]
  seeds: int = 3
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  about: str = ""  # one line: what the experiment asks

  def __post_init__(self):
    if not self.cells or self.seeds < 1:
      raise ConfigError(f"experiment {self.name}: needs at least one cell and one seed")


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Returns a copy of `config` with each dotted path set; a path that names no field of the
  config is an error (a typo would otherwise run the base config under the cell's name)."""
  out = ml_collections.ConfigDict(config.to_dict())
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    node = out
    for i, part in enumerate(parents):
      if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
        raise ConfigError(f"override {path!r}: {'.'.join(parents[:i + 1])} is not a section "
                          f"of the pipeline config")
      node = node[part]
    if leaf not in node:
      raise ConfigError(f"override {path!r}: {leaf!r} is not a field of "
                        f"{'.'.join(parents) or 'the pipeline config'} (fields: "
                        f"{sorted(node.keys())})")
    node[leaf] = dict(value) if isinstance(value, Mapping) else value
  return out


def shared_dir(stages: Stages, kind: str, settings: Any) -> str:
  """Returns the folder of a run (an RL run, an SFT run, an evaluation) named after the
  fingerprint of its settings (`to_section` turns typed settings into plain values), shared
  by every experiment on the same main job that needs the same run."""
  return os.path.join(os.path.abspath(stages.settings.output_dir), "experiments", "runs",
                      f"{kind}-{fingerprint(to_section(settings))}")


def without(section: dict[str, Any], *keys: str) -> dict[str, Any]:
  """Returns `section` without `keys` (a run's paths, which do not change what it computes)."""
  return {k: v for k, v in section.items() if k not in keys}


def mean_sd(values: list[float]) -> dict[str, Any]:
  """Returns the values, their mean and their sample standard deviation (0 for one value)."""
  mean = sum(values) / len(values)
  var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
  return dict(values=values, mean=mean, sd=var ** 0.5)


def cell(stat: Mapping[str, Any], digits: int = 3) -> str:
  """Returns a table cell: mean +- sd."""
  return f"{stat['mean']:.{digits}f} +- {stat['sd']:.{digits}f}"


def run(experiment: Experiment, config: ml_collections.ConfigDict, stage_configs: StageConfigs,
        kinds: Mapping[str, Any], output_dir: str = "") -> dict[str, Any]:
  """Runs every (cell, seed) of `experiment` (cached, see the module docstring) and writes
  results.json, results.md and results.png; returns what results.json holds. `kinds` maps a
  kind's name to its module: run_cell(stages, seed, options) -> a JSON result (`stages`: the
  cell's `pipeline.Stages`, every stage's settings checked before any cell runs);
  summarize({cell: {seed: result}}) -> summary; table(summary) -> markdown;
  plot(report, path)."""
  if experiment.kind not in kinds:
    raise ConfigError(f"experiment {experiment.name}: kind {experiment.kind!r} is not one of "
                      f"{sorted(kinds)}")
  kind = kinds[experiment.kind]
  out = output_dir or os.path.join(config.output_dir, "experiments", experiment.name)
  cells = {}  # every override, and every stage it moves, is checked before anything runs
  for name, overrides in experiment.cells.items():
    options = {**experiment.options, **{k.removeprefix(OPTION): v for k, v in overrides.items()
                                        if k.startswith(OPTION)}}
    stages = Stages(with_overrides(config, {k: v for k, v in overrides.items()
                                            if not k.startswith(OPTION)}), stage_configs)
    stages.of()
    cells[name] = (stages, options)
  seeds = list(range(config.seed, config.seed + experiment.seeds))
  results: dict[str, dict[str, Any]] = {}
  start = time.perf_counter()
  for done, (name, (stages, options)) in enumerate(cells.items()):
    results[name] = {}
    for seed in seeds:
      say(f"=== {experiment.name}: cell {name} ({done + 1}/{len(cells)}), seed {seed}")
      key = {"kind": experiment.kind, "options": options, "seed": seed,
             "config": stages.section()}
      results[name][str(seed)] = cached_json(
          os.path.join(out, "cells", name, f"seed-{seed}.json"), key,
          lambda: kind.run_cell(stages, seed, options))
  summary = canonical(kind.summarize(results))
  table = kind.table(summary)
  report = {"name": experiment.name, "kind": experiment.kind, "about": experiment.about,
            "cells": {n: dict(o) for n, o in experiment.cells.items()}, "seeds": seeds,
            "options": dict(experiment.options), "results": results, "summary": summary,
            "table": table, "wall_s": round(time.perf_counter() - start, 1)}
  say(f"{experiment.name}: {experiment.about}\n{table}\nresults in {out}")
  if jax.process_index() == 0:
    write_json(os.path.join(out, "results.json"), report)
    with open(os.path.join(out, "results.md"), "w") as f:
      f.write(table + "\n")
    kind.plot(report, os.path.join(out, "results.png"))
  return report


def new_figure(columns: int, size: tuple[float, float]) -> tuple[Any, Any, Any] | None:
  """Returns (pyplot, figure, axes) of a row of `columns` plots, or None without matplotlib."""
  plt = pyplot()
  if plt is None:
    return None
  fig, axes = plt.subplots(1, columns, figsize=size)
  return plt, fig, axes


def save_figure(plt: Any, fig: Any, report: Mapping[str, Any], path: str) -> str:
  """Titles a kind's figure with the experiment's name, question and seeds, writes it to
  `path` and closes it; returns the path."""
  title = f"{report['name']}: {report['about']} (mean +- sd over seeds {report['seeds']})"
  # about 14 characters an inch at this size: a long title wraps rather than run off the figure
  fig.suptitle(textwrap.fill(title, int(fig.get_figwidth() * 14)), fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def publish(source: str, destination: str) -> list[str]:
  """Copies an experiment's results.json, results.md and results.png (those that exist) from
  `source` to `destination` (e.g. docs/results/<name>); returns the copied paths."""
  os.makedirs(destination, exist_ok=True)
  copied = []
  for name in ("results.json", "results.md", "results.png"):
    if os.path.exists(os.path.join(source, name)):
      copied.append(shutil.copy(os.path.join(source, name), os.path.join(destination, name)))
  return copied

