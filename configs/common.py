"""Defaults shared by experiment configs (the one place they live)."""

import dataclasses

import ml_collections

from coa_jax.model import ModelConfig

# Numerics and execution fields of ModelConfig, listed here so that the command line can
# override them (--config.model.remat=full); their defaults stay in ModelConfig.
NUMERICS = ("dtype", "param_dtype", "remat", "attention_impl", "attention_block",
            "attention_block_kv", "scan_unroll")


def model(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """Model preset name plus numerics; any ModelConfig field may be added as an override."""
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in NUMERICS}
  values = dict(preset=preset, **defaults)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def mesh(data: int = 1, fsdp: int = -1, tensor: int = 1) -> ml_collections.ConfigDict:
  """Mesh axis sizes; -1 takes all remaining devices."""
  return ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))


def tokenizer(path: str = "default", template: str = "plain") -> ml_collections.ConfigDict:
  """The tokenizer: 'default' (built-in BPE) or a local HF folder, and the chat template."""
  return ml_collections.ConfigDict(dict(path=path, template=template))


def data(path: str, **overrides) -> ml_collections.ConfigDict:
  """The SFT data source and how it is read (see coa_jax.data_pipeline); shards=0: one per
  process (set it to keep the same batches on any number of processes); upsample_by: a
  metadata key whose values `upsample` repeats ({"mixed": 2}: each such trajectory twice an
  epoch; "": off)."""
  values = dict(path=path, num_epochs=1, overlong="truncate", max_drop_fraction=0.05, shards=0,
                upsample_by="", upsample=ml_collections.ConfigDict())
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def train(steps: int, **overrides) -> ml_collections.ConfigDict:
  """Training-loop settings; stop_after=N ends one invocation after N steps (0: never);
  nonfinite_skips: steps whose update was non-finite that the run skips before it stops."""
  values = dict(steps=steps, micro_batches=1, z_loss=0.0, log_every=10, stop_after=0,
                nonfinite_skips=0)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def checkpoint(directory: str, **overrides) -> ml_collections.ConfigDict:
  """Orbax checkpointing: where (a folder or a gs://... URL), how often (steps), how many to
  keep, async or not, and whether a folder whose every step is damaged may be set aside for a
  run from step 0 (otherwise an error)."""
  values = dict(directory=directory, every=200, max_to_keep=3, async_save=True,
                start_over_if_all_damaged=False)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def sampling(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
             ) -> ml_collections.ConfigDict:
  """How rollouts sample their tokens (coa_jax.rollout.sampler; top_k 0 and top_p 1: off)."""
  return ml_collections.ConfigDict(dict(temperature=temperature, top_k=top_k, top_p=top_p))


def rollout(*, group_size: int, max_prompt_tokens: int, max_response_tokens: int,
            max_turns: int, max_observation_tokens: int, tool_workers: int = 8,
            tool_timeout_s: float = 30.0) -> ml_collections.ConfigDict:
  """The tool loop's limits (coa_jax.rollout.settings): samples per task, the prompt's and the
  response's token budgets, tool calls per sample, an observation's tokens, the threads that run
  tools and a call's timeout."""
  return ml_collections.ConfigDict(dict(
      group_size=group_size, max_prompt_tokens=max_prompt_tokens,
      max_response_tokens=max_response_tokens, max_turns=max_turns,
      max_observation_tokens=max_observation_tokens, tool_workers=tool_workers,
      tool_timeout_s=tool_timeout_s))


def optimizer(**overrides) -> ml_collections.ConfigDict:
  """AdamW settings (see coa_jax.train.optimizer)."""
  # decay_steps: how many of the last steps the "wsd" schedule decays over (unused otherwise).
  values = dict(learning_rate=1e-5, warmup_steps=0, schedule="cosine", total_steps=1000,
                final_lr_fraction=0.1, decay_steps=0, b1=0.9, b2=0.95, eps=1e-8,
                weight_decay=0.1, grad_clip=1.0)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def rl(steps: int, **overrides) -> ml_collections.ConfigDict:
  """DAPO settings; the defaults are the reference's (see docs/design.md, "Reference facts").

  A step gathers `batch_groups` prompt groups (dynamic sampling generates rounds of
  `prompts_per_round` prompts, at most `max_rounds`), then updates once per mini-batch of
  `mini_batch_groups` groups, each accumulated over `micro_batches`, `ppo_epochs` times over the
  batch. advantage="gae" is PPO: a critic (the `critic` block) estimates token advantages.
  """
  values = dict(
      steps=steps, batch_groups=512, prompts_per_round=512, max_rounds=8, mini_batch_groups=32,
      micro_batches=1, ppo_epochs=1, dynamic_sampling=True,
      # "std": (R - mean) / (std + eps); "mean": Dr.GRPO; "gae": PPO's, from the critic
      advantage="std", advantage_eps=1e-6,
      negative_weight=1.0,  # scales negative advantages (1: the reference)
      overlong_shaping=True, overlong_cache=4096, overlong_filter=False,
      # the policy loss (coa_jax.losses.dapo.PolicyLossConfig)
      eps_low=0.2, eps_high=0.28, dual_clip=10.0, aggregation="token-mean", norm_tokens=0,
      log_ratio_clamp=20.0, kl_coef=0.0, entropy_coef=0.0,
      eval_every=10, log_every=1, stop_after=0, nonfinite_skips=0,  # as in train()
      track_prompts=True,  # write the tasks always / never solved to workdir/prompts.json
      agent="")  # "module:function": an agent program trained through the endpoint (serving)
  # Asynchronous RL (coa_jax.rl.async_trainer): rollouts on their own devices overlap the
  # updates; a group is trained on only while its oldest token's policy is within `staleness`
  # updates of the trainer's. rollout_devices: devices (per host) given to rollouts, 0: half.
  # weight_cap truncates the importance weight of tokens an older policy sampled.
  values["async"] = dict(enabled=False, staleness=1, rollout_devices=0, weight_cap=2.0)
  # PPO's critic (coa_jax.rl.critic.CriticConfig), used when advantage="gae": a value model
  # initialized from the actor's checkpoint. learning_rate 0: 10x the actor's. truncation of
  # a sample cut by the response budget: "terminal" or "bootstrap" (from the critic's value
  # after its last token). adaptive_lambda: VAPO's alpha for lambda_actor = 1 - 1 / (alpha *
  # length) (0: off). warmup: first steps that train the critic only; pretrain_steps: at most
  # this many steps of value pre-training on Monte-Carlo returns, until a step's explained
  # variance reaches pretrain_explained_variance (0: none). The critic's learning-rate schedule
  # counts its own updates (it trains through warm-up and pre-training, the actor does not):
  # schedule, warmup_steps, total_steps (0: every critic update of the run), decay_steps and
  # final_lr_fraction as in optimizer(); default constant, as verl's critic.
  values["critic"] = dict(
      learning_rate=0.0, grad_clip=1.0, weight_decay=0.0, cliprange_value=0.5, gamma=1.0,
      lambda_actor=1.0, lambda_critic=1.0, adaptive_lambda=0.0, truncation="terminal",
      whiten=True, warmup=0, pretrain_steps=0, pretrain_explained_variance=0.5,
      schedule="constant", warmup_steps=0, total_steps=0, decay_steps=0, final_lr_fraction=0.1)
  values.update(overrides)
  return ml_collections.ConfigDict(values)


def as_ppo(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns an RL config turned into PPO with a critic at the same sample budget: one response
  per prompt (as verl's PPO samples), as many prompts a step as it sampled responses, the same
  rows per mini-batch; dynamic sampling off (a group of one is always uniform) and failures
  pushed down (negative_weight 1); the critic's defaults (config.rl.critic)."""
  n = config.rollout.group_size
  config.rollout.group_size = 1
  rl = config.rl
  rl.update(advantage="gae", batch_groups=rl.batch_groups * n,
            prompts_per_round=rl.prompts_per_round * n, mini_batch_groups=rl.mini_batch_groups * n,
            dynamic_sampling=False, negative_weight=1.0)
  return config
