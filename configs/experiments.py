"""The named experiments of `make experiment NAME=...` (docs/experiments.md), each a sweep over
the main job's config (configs/pipeline_tiny_cpu.py): cells of config overrides (dotted paths;
"options.<name>" sets the kind's option for one cell) times seeds. A new ablation is a few
lines here, as the learning-rate search "dapo-lr" below. Cell names are folder names. A cell
that overrides output_dir runs on another main job's outputs (scaling-distractors).
"""

from coa_jax.experiments import Experiment, filters
from configs import pipeline_distractors_cpu, pipeline_tiny_cpu

_SELECTION = {"selection.max_tasks": 1000, "selection.k": 4}


def _sized(size: dict) -> dict:
  """Returns a cell's overrides of the model config for a size of `MODEL_SIZES`."""
  return {f"model.{k}": v for k, v in size.items()}


# The main job's model (3 layers x 128, 8 heads of 16: queries and keys as wide as the model;
# 0.56M parameters) and two larger ones of its shape family (heads of 16, queries as wide as
# the model, MLP twice the width): 4 x 192 (12 heads) and 6 x 256 (16 heads). Each trains the
# main job's SFT steps of the same batches (equal tokens) with the same schedule, then its DAPO
# stage (`model-size`). On the earlier 4-head recipe (queries half the width), at equal tokens
# the larger models copied later and worse (4x192's SFT loss 0.307 at step 800 against 3x128's
# 0.17), so `model-size-2x` trains every size twice the steps (the same warm-up and decay),
# towards convergence.
_MAIN_SFT_STEPS = pipeline_tiny_cpu.get_config().sft.steps
MODEL_SIZES = {
    "4x192": dict(num_layers=4, hidden_size=192, intermediate_size=384, num_heads=12,
                  num_kv_heads=12),
    "6x256": dict(num_layers=6, hidden_size=256, intermediate_size=512, num_heads=16,
                  num_kv_heads=16),
}

# The levers issue 56 lists for RL to learn, from outcome rewards alone, what its teacher gets
# wrong on the near-miss world (the figure of the entity itself, not its look-alike): none of
# them knows about near-miss pages. On those pages the SFT model's pass@16 was about 0.03 at
# the rollout temperature 0.6: the levers raise how often a group holds a right answer to learn
# from (a hotter sampler, more samples per task, the solved tasks dropped) or push the wrong
# answers down.
_MORE_SAMPLES = {"dapo.group_size": 16, "dapo.batch_size": 64, "dapo.rl.batch_groups": 4,
                 "dapo.rl.prompts_per_round": 4, "dapo.rl.mini_batch_groups": 2}
_NEAR_MISS_LEVERS = {
    "dapo": {},  # the main job's DAPO, three times as long
    "temperature-1": {"options.temperature": 1.0},
    "16-samples": _MORE_SAMPLES,
    "drop-solved": {**_SELECTION, "selection.high": 0.75},
    "negatives": {"dapo.rl.negative_weight": 1.0},
    "all": {"options.temperature": 1.0, **_MORE_SAMPLES, **_SELECTION, "selection.high": 0.75,
            "dapo.rl.negative_weight": 1.0},
}

EXPERIMENTS = {e.name: e for e in [
    Experiment(
        "rl-ceiling", "rl", {"dapo": {"dapo.rl.steps": 96},
                             "ppo": {"dapo.rl.steps": 96, "options.stage": "ppo"}},
        options={"every": 12},
        about="DAPO and PPO from the main job's SFT models until the held-out curve flattens"),
    Experiment(
        "rl-curves", "rl", {"dapo": {"options.stage": "dapo"}, "ppo": {"options.stage": "ppo"}},
        options={"every": 4}, about="DAPO and PPO (critic, GAE) at the same sample budget"),
    Experiment(
        "query-selection", "rl",
        {"drop-solved": {"dapo.rl.steps": 48, **_SELECTION, "selection.high": 0.75},
         "mixed-only": {"dapo.rl.steps": 48, **_SELECTION, "selection.low": 0.25,
                        "selection.high": 0.75},
         # with every group mixed, failures pushed down too (the main job's DAPO does not)
         "mixed-only-negatives": {"dapo.rl.steps": 48, **_SELECTION, "selection.low": 0.25,
                                  "selection.high": 0.75, "dapo.rl.negative_weight": 1.0},
         "all-tasks": {"dapo.rl.steps": 48}},  # last: its runs are rl-ceiling's first updates
        options={"every": 12},
        about="RL query selection by the SFT model's pass rate over 4 samples, 48 DAPO updates"),
    Experiment(
        "ablate-filters", "sft", {stage: {"options.data": stage} for stage in filters.DATA},
        about="SFT on each progressive filter stage's output, equal steps"),
    Experiment(
        "scaling", "scaling", {s: {"options.system": s} for s in ("teacher", "sft", "dapo")},
        options={"k": 16}, about="pass@k and maj@k, k = 1..16, teacher system vs AFM"),
    Experiment(  # needs the main job on that world first (configs/pipeline_distractors_cpu.py)
        "scaling-distractors", "scaling",
        {s: {"options.system": s, **pipeline_distractors_cpu.OVERRIDES}
         for s in ("teacher", "sft", "dapo")},
        options={"k": 16},
        about="pass@k and maj@k, k = 1..16, on a world with near-miss figures on its pages"),
    Experiment(
        "lora-sft", "lora", {"full": {"options.rank": 0}, "lora-r8": {"options.rank": 8},
                             "lora-r8-lr3x": {"options.rank": 8, "options.lr_scale": 3.0}},
        options={"from_step": 900, "lr_scale": 1.0},
        about="LoRA (rank 8) against full fine-tuning for the main job's last 800 SFT steps"),
    Experiment(
        "model-size", "recipe",
        {"3x128": {"options.main_job": True},
         **{name: _sized(size) for name, size in MODEL_SIZES.items()}},
        about="the main job's recipe at 3 model sizes, equal SFT tokens"),
    Experiment(
        "model-size-2x", "recipe",
        {f"{name}-2x": {**_sized(size), "sft.steps": 2 * _MAIN_SFT_STEPS}
         for name, size in {"3x128": {}, **MODEL_SIZES}.items()},
        about="the main job's recipe at 3 model sizes, twice the SFT steps"),
    Experiment(  # needs the main job on that world first (configs/pipeline_distractors_cpu.py)
        "near-miss-rl", "rl", {
            name: {**pipeline_distractors_cpu.OVERRIDES, "dapo.rl.steps": 48, **cell}
            for name, cell in _NEAR_MISS_LEVERS.items()},
        options={"every": 16},
        about="levers that may let DAPO read the figure its teacher misreads, 48 updates"),
    Experiment(
        "dapo-lr", "rl", {f"lr-{lr:g}": {"dapo.learning_rate": lr} for lr in (2e-5, 5e-5, 1e-4)},
        options={"every": 8}, about="DAPO's learning rate, 16 updates"),
]}
