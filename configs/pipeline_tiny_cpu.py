"""The end-to-end recipe on the embedded world with a tiny model, on a CPU (the README's main
job): distil with the scripted teacher, SFT from scratch, DAPO, evaluate on held-out tasks.

`stage_configs(config, seed)` derives every stage's config from it (the pipeline's per-seed
directories and the shared settings); `quick(config)` shrinks it to a smoke test (a few
minutes) for CI.
"""

import os
from typing import Any

import ml_collections

from coa_jax.data import load_tools_spec, prompts
from configs import common, dapo_tiny_cpu, distill_tiny, evaluate_tiny, sft_tiny_cpu

# The recipe before eight heads and the longer anneal (see get_config), as overrides of this
# config: the derived worlds (configs/pipeline_sql_cpu.py, pipeline_distractors_cpu.py) were
# measured on it, and keep it so that their published figures reproduce.
FOUR_HEADS = {"model.num_heads": 4, "model.num_kv_heads": 4, "sft.steps": 1700,
              "sft.decay_steps": 500}


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.output_dir = "runs/pipeline_tiny"
  config.system_prompt = prompts.WORLD
  config.workers = 4
  config.log_every = 20
  config.mesh = common.mesh(data=1, fsdp=-1, tensor=1)
  distill = distill_tiny.get_config()  # the world, the teacher's error rates, the filters
  config.world, config.teacher, config.filters = distill.world, distill.teacher, distill.filters
  config.model = ml_collections.ConfigDict(dict(
      # 8 heads of 16 (queries and keys 128 wide, the width's). With 4 heads, 1.56x faster a
      # main-job SFT step, whether SFT learned to copy values out of observations and the
      # question's factor into the code was a coin toss over seeds: over 10 seeds one never
      # copied from observations (0.017 after DAPO) and mixed tasks ended at 0.68 on two
      # others; with 8 heads (and the longer anneal below) every seed holds
      # (docs/pipeline.md, "How the recipe was chosen").
      # 3 layers (1.4x a step of 2), chosen while mixed questions still wrote "* k" (the
      # factor two tokens after " *"; world.times): on 60 held-out tasks, seed 2's SFT solved
      # 0 of 51 mixed samples with 2 layers and 42 of 51 with 3 (pass@1 0.644 -> 0.889), and
      # with 2 layers seed 1 did not learn to copy the code's output into its answer
      # (arithmetic 0.022). 2 layers with "*k" were not measured.
      # Query blocks of 64 (exact, as any block size): a step took 318 ms against 370 with
      # blocks of 128 (median of 6 interleaved rounds of 8 steps): more of the causal mask's
      # upper triangle is skipped.
      preset="tiny", hidden_size=128, intermediate_size=256, num_layers=3, num_heads=8,
      num_kv_heads=8, head_dim=16, attention_impl="blockwise", attention_block=64,
      rope_theta=10_000.0))  # the tiny preset's; named here so a command line can move it
  # Rows of 512 pack the same tokens per step as 4 x 1024 at 1.7x the speed (attention's cost
  # grows with the row); the 8% of trajectories longer than a row are truncated.
  # Copying (values out of observations; the question's names and factor into tool calls)
  # forms abruptly, at a step that the seed and float rounding move, and how sure each copied
  # token is decides pass@1: sampling at temperature 0.6 compounds over a task's 10-20 copied
  # tokens (the copy probes, coa_jax/evaluation/copy_probe.py). The warm-up-stable-decay
  # schedule holds the peak of 1e-3 through the steps where copying forms (about 700-1,100) to
  # step 1,200, then anneals to zero over 800 steps, which makes the copies sure: with 8 heads
  # and a 500-step decay (1,700 steps), one seed in three ended at 0.71 on mixed tasks after
  # DAPO, long observed values miscopied. A cosine, higher or lower peaks, a 200-step warm-up,
  # a longer stable phase and mixed tasks twice an epoch (`upsample_by="family"`, off) each
  # moved which seed failed rather than the failure (docs/pipeline.md, "Why a seed fails").
  config.sft = ml_collections.ConfigDict(dict(steps=2000, seq_len=512, batch_size=8,
                                              learning_rate=1e-3, warmup_steps=20,
                                              schedule="wsd", decay_steps=800,
                                              final_lr_fraction=0.0, weight_decay=0.0,
                                              upsample_by="", upsample={"mixed": 2}))
  config.rollout = common.rollout(
      group_size=4, max_prompt_tokens=128, max_response_tokens=512, max_turns=12,
      max_observation_tokens=256)
  # DAPO's rollouts and the evaluations sample alike.
  config.sampling = common.sampling(temperature=0.6)
  # Every held-out task (200 x 3 samples, all 600 rows in one decode batch: each row has its
  # own sampling key, so the batch size does not change the samples). With the first 60 tasks
  # only, sampling noise alone moved pass@1 by about 0.03-0.05 between evaluations of the
  # same model, as much as the spread over seeds that the recipe must stay under.
  config.eval = ml_collections.ConfigDict(dict(k=3, max_tasks=200, batch_size=600))
  # DAPO's learning rate: 5e-5. Its gain is moving mental arithmetic to the code tool, and at
  # 1e-4 the same 16 steps also unlearned copying elsewhere: on seed 0's 200 held-out tasks
  # (mixed questions then wrote "* k"), SFT 0.802 -> DAPO 0.823 at 1e-4 (lookup samples
  # solved 178 -> 165, mixed 114 -> 102), 0.855 at 5e-5 (176, 111; mental arithmetic 42 -> 5
  # samples in both) and 0.670 at 2e-4.
  # After a good SFT most groups are uniform, and Adam's step size does not shrink with the
  # gradient, so each step moves every weight by about the learning rate whatever the signal.
  config.dapo = ml_collections.ConfigDict(dict(
      batch_size=32, group_size=4, learning_rate=5e-5,
      format_penalty=0.5,  # subtracted from a malformed sample's reward
      # Groups whose samples all fail or all succeed carry no gradient; after a good SFT, 6-7 of
      # a step's 8 groups are uniform. Dynamic sampling would skip them, but on the training
      # tasks (which SFT has seen) 53 of 64 groups were all correct: 4 rounds of 16 prompts did
      # not fill 4 mixed groups, and each round cost a step's time. Responses are capped at 512
      # tokens (no correct one is longer) and the overlong penalty starts at 448.
      # Failed samples get no push down (negative_weight 0): with 32 samples a step, pushing
      # down the wrong digits of failed look-ups also weakened the copying that every family
      # uses (arithmetic fell). Successes alone move the policy to the code tool.
      # agent: "" rolls out with the built-in tool loop; "coa_jax.serving.agent:coa_loop", the
      # same loop as an agent program through the trainer's own endpoint (docs/serving.md).
      rl=dict(steps=16, batch_groups=8, prompts_per_round=8, max_rounds=1, mini_batch_groups=4,
              overlong_cache=64, eval_every=1000, dynamic_sampling=False, negative_weight=0.0,
              agent="")))
  # RL query selection (coa_jax.rl.query_selection): before DAPO, the SFT model samples k
  # solutions of each of the first max_tasks training tasks, and DAPO trains on the tasks whose
  # pass rate lies in [low, high]. [0, 1]: off (every task, nothing sampled).
  config.selection = ml_collections.ConfigDict(dict(k=4, low=0.0, high=1.0, max_tasks=1000))
  # PPO with a critic (rl.advantage = "gae"), the side-by-side of `make rl-curves`
  # (docs/ppo.md): the DAPO stage turned into PPO at the same budget (`common.as_ppo`: 32
  # sampled responses and 2 updates a step, one response per prompt as verl's PPO samples,
  # failures pushed down); the critic (the SFT model with a value head, at 10x the actor's
  # learning rate) with these overrides of the `rl.critic` defaults.
  config.ppo = ml_collections.ConfigDict(dict(critic=dict()))
  return config


def quick(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns `config` shrunk to a smoke test of every stage."""
  config.output_dir = config.output_dir + "_quick"
  config.world.update(entities=6, train_tasks=48, heldout_tasks=8)
  config.sft.update(steps=4, seq_len=1024, batch_size=4, warmup_steps=1, decay_steps=2)
  config.rollout.update(max_response_tokens=128, max_observation_tokens=96, max_turns=3)
  config.eval.update(k=2, max_tasks=4, batch_size=8)
  config.dapo.update(batch_size=8, group_size=2)
  config.dapo.rl.update(steps=1, batch_groups=2, prompts_per_round=2, mini_batch_groups=2,
                        overlong_cache=32, dynamic_sampling=False)
  return config


def stage_configs(config: Any, seed: int | None = None) -> dict[str, ml_collections.ConfigDict]:
  """Returns the configs of every stage for `seed` (default config.seed), derived from the
  pipeline config."""
  seed = config.seed if seed is None else seed
  out = os.path.abspath(config.output_dir)
  world_dir = os.path.join(out, "distill", "world")
  run_dir = os.path.join(out, f"seed-{seed}")
  model = dict(config.model)

  distill_config = ml_collections.ConfigDict(dict(
      world=config.world, teacher=config.teacher, filters=config.filters,
      system_prompt=config.system_prompt, workers=config.workers,
      output_dir=os.path.join(out, "distill")))
  # A user's environment (tasks and tools, `distill.environment`), tools and rewards, when
  # declared: configs/pipeline_sql_cpu.py.
  for name in ("environment", "tools", "rewards"):
    if name in config:
      distill_config[name] = config[name]

  sft_config = sft_tiny_cpu.get_config()
  sft_config.seed = seed
  sft_config.model = common.model(**model)
  sft_config.mesh = config.mesh
  sft_config.data = common.data(os.path.join(out, "distill", "trajectories.jsonl"),
                                num_epochs=1000, upsample_by=config.sft.upsample_by,
                                upsample=dict(config.sft.upsample))
  sft_config.seq_len, sft_config.batch_size = config.sft.seq_len, config.sft.batch_size
  sft_config.optimizer = common.optimizer(
      learning_rate=config.sft.learning_rate, warmup_steps=config.sft.warmup_steps,
      schedule=config.sft.schedule, decay_steps=config.sft.decay_steps,
      total_steps=config.sft.steps, final_lr_fraction=config.sft.final_lr_fraction,
      weight_decay=config.sft.weight_decay)
  sft_config.train = common.train(steps=config.sft.steps, log_every=config.log_every)
  sft_config.checkpoint = common.checkpoint(os.path.join(run_dir, "sft", "checkpoints"),
                                            every=config.sft.steps, max_to_keep=1)
  sft_config.workdir = os.path.join(run_dir, "sft")
  sft_config.export_dir = os.path.join(run_dir, "sft", "hf_export")
  sft_config.sampling = config.sampling  # the export's generation_config.json

  # Every stage's tools: config.tools when the pipeline config declares them, else the world's
  # or environment's, once distillation has written them.
  tools = ml_collections.ConfigDict()
  if config.get("tools"):
    tools = ml_collections.ConfigDict(config.tools.to_dict())
  elif os.path.exists(os.path.join(world_dir, "tools.json")):
    tools = ml_collections.ConfigDict(load_tools_spec(world_dir))
  if tools:
    sft_config.tools = tools  # their tags are the tokenizer's

  def evaluation(system: str, checkpoint: str, name: str) -> ml_collections.ConfigDict:
    cfg = evaluate_tiny.get_config()
    cfg.system, cfg.seed, cfg.k = system, seed, config.eval.k
    cfg.model = common.model(**model)
    cfg.model.checkpoint = checkpoint
    cfg.mesh = config.mesh
    cfg.tasks = os.path.join(world_dir, "heldout.jsonl")
    cfg.copy_probe = os.path.join(out, "distill", "heldout_trajectories.jsonl")
    cfg.max_tasks = config.eval.max_tasks
    cfg.batch_size = config.eval.batch_size
    cfg.rollout.update(dict(config.rollout), group_size=config.eval.k)
    cfg.sampling, cfg.system_prompt = config.sampling, config.system_prompt
    cfg.tools = tools
    cfg.teacher = config.teacher
    if "rewards" in config:
      cfg.rewards = config.rewards
    # The scripted teacher's samples do not depend on the seed: it is evaluated once.
    cfg.output_dir = os.path.join(out if system == "teacher" else run_dir, name)
    return cfg

  dapo_config = dapo_tiny_cpu.get_config()
  dapo_config.seed = seed
  dapo_config.model = common.model(**model)
  dapo_config.mesh = config.mesh
  dapo_config.model.checkpoint = sft_config.export_dir
  dapo_config.tasks = os.path.join(world_dir, "train.jsonl")
  dapo_config.eval_tasks = ""  # the pipeline evaluates after DAPO
  dapo_config.batch_size = config.dapo.batch_size
  dapo_config.sampling, dapo_config.system_prompt = config.sampling, config.system_prompt
  dapo_config.rollout = ml_collections.ConfigDict(dict(config.rollout))
  dapo_config.rollout.group_size = config.dapo.group_size
  dapo_config.tools = tools
  if "rewards" in config:
    dapo_config.rewards = ml_collections.ConfigDict(config.rewards.to_dict())
  dapo_config.rewards.format_penalty = config.dapo.get("format_penalty", 0.0)
  dapo_config.rl = common.rl(**dict(config.dapo.rl))
  dapo_config.optimizer = common.optimizer(learning_rate=config.dapo.learning_rate,
                                           schedule="constant", weight_decay=0.0)
  dapo_config.checkpoint = common.checkpoint(os.path.join(run_dir, "dapo", "checkpoints"),
                                             every=config.dapo.rl.steps, max_to_keep=1)
  dapo_config.workdir = os.path.join(run_dir, "dapo")
  dapo_config.export_dir = os.path.join(run_dir, "dapo", "hf_export")

  ppo_config = common.as_ppo(ml_collections.ConfigDict(dapo_config.to_dict()))
  ppo_config.rl.critic.update(dict(config.ppo.critic))
  ppo_config.checkpoint.directory = os.path.join(run_dir, "ppo", "checkpoints")
  ppo_config.workdir = os.path.join(run_dir, "ppo")
  ppo_config.export_dir = os.path.join(run_dir, "ppo", "hf_export")

  return {"distill": distill_config, "sft": sft_config, "dapo": dapo_config, "ppo": ppo_config,
          "eval_teacher": evaluation("teacher", "", "eval_teacher"),
          "eval_sft": evaluation("model", sft_config.export_dir, "eval_sft"),
          "eval_dapo": evaluation("model", dapo_config.export_dir, "eval_dapo")}
