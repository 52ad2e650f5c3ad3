"""Serving throughput and latency against the offline sampler (`make bench-serve`).

  python experiments/bench_serve.py [--model=runs/pipeline_tiny/seed-0/dapo/hf_export]
      [--sessions=64] [--max_tokens=128] [--out=docs/results/bench_serve/results.json]

The main job's model (its trained weights when `make pipeline` has run, else a fresh model of its
shape, said in the output) on this machine's devices; see coa_jax/perf/serve_bench.py for what
each row measures. Prints the table and writes the results file.
"""

import json
import os
import platform

import jax
from absl import app, flags

from coa_jax.data import prompts
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.model import ModelSettings, Transformer
from coa_jax.perf import serve_bench
from coa_jax.rollout.tool_loop import stop_ids
from coa_jax.runtime import cli, sharding
from coa_jax.runtime.distributed import say
from coa_jax.runtime.hf_checkpoint import load_model
from configs import pipeline_tiny_cpu

_MODEL = flags.DEFINE_string("model", "runs/pipeline_tiny/seed-0/dapo/hf_export",
                             "a trained model's folder; missing: a fresh model of the main job's shape")
_SESSIONS = flags.DEFINE_integer("sessions", 64, "concurrent sessions (and the offline batch)")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "tokens a session samples at most")
_OUT = flags.DEFINE_string("out", "docs/results/bench_serve/results.json", "the results file")


def main(argv):
  del argv
  cli.start()
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  tokenizer = default_tokenizer("plain")
  trained = os.path.isdir(_MODEL.value)
  model = dict(pipeline_tiny_cpu.get_config().model)
  model["checkpoint"] = _MODEL.value if trained else ""
  model_config, params = load_model(ModelSettings.from_section(model), tokenizer, mesh)
  if params is None:
    params = sharding.init_params(Transformer(model_config), mesh, jax.random.key(0))
  source = _MODEL.value if trained else "a fresh model of the main job's shape (no export found)"
  work = serve_bench.Work(sessions=_SESSIONS.value, max_tokens=_MAX_TOKENS.value)
  stops = stop_ids(tokenizer)
  args = (model_config, mesh, params, tokenizer, prompts.WORLD, work, stops)
  say(f"model: {source}; {work.sessions} sessions x {work.max_tokens} tokens at temperature "
      f"{work.temperature}, chunk {work.chunk}")
  offline = serve_bench.offline(*args)
  with serve_bench.serving(*args) as (url, server), \
       serve_bench.serving(*args, prefix_cache=False) as (cold_url, cold):
    cold.transcripts = server.transcripts  # the same history ids on both
    # A whole run of other questions first: every program the measured run uses is compiled.
    _, warm_up = serve_bench.served(url, server, work, offset=10_000)
    serve_bench.second_turn(url, server, cold_url, cold, warm_up, work)
    served, firsts = serve_bench.served(url, server, work)
    turn = serve_bench.second_turn(url, server, cold_url, cold, firsts, work)
  results = {"model": source, "work": work.__dict__, "offline": offline, "served": served,
             "second_turn": turn,
             "served_over_offline": served["tokens_per_s"] / offline["tokens_per_s"],
             "ttft_cold_over_warm": turn["cold_ttft_p50_s"] / turn["warm_ttft_p50_s"],
             "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
             "jax": jax.__version__, "python": platform.python_version(),
             "command": "make bench-serve"}
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1)
  say(f"offline sampler: {offline['tokens_per_s']:,.0f} tokens/s ({offline['tokens']} tokens)\n"
      f"served, {work.sessions} streaming sessions: {served['tokens_per_s']:,.0f} tokens/s "
      f"({results['served_over_offline']:.2f}x offline); time to first token p50 "
      f"{served['ttft_p50_s'] * 1e3:.0f} ms, p99 {served['ttft_p99_s'] * 1e3:.0f} ms; per token "
      f"p50 {served['per_token_p50_s'] * 1e3:.1f} ms, p99 {served['per_token_p99_s'] * 1e3:.1f} ms\n"
      f"second turn: {turn['warm_prefill_tokens']} tokens prefilled (cold: "
      f"{turn['cold_prefill_tokens']}); time to first token p50 "
      f"{turn['warm_ttft_p50_s'] * 1e3:.0f} ms against {turn['cold_ttft_p50_s'] * 1e3:.0f} ms cold "
      f"({results['ttft_cold_over_warm']:.1f}x)\nresults: {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
