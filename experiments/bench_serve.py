"""Serving throughput and latency against the offline sampler (`make bench-serve`).

  python experiments/bench_serve.py [--model=runs/pipeline_tiny/seed-0/dapo/hf_export]
      [--sessions=64] [--max_tokens=128] [--out=docs/results/bench_serve/results.json]
  # on a GPU (experiments/device_check.py): the 1.5B bench model's shape, several batches,
  # against the decode roofline and HF transformers `generate`
  python experiments/bench_serve.py --preset=qwen2_5_1_5b --dtype=bfloat16 \
      --sessions=16,64,128 --peers --nosecond_turn --out=runs/bench/serve_gpu.json

The main job's model (its trained weights when `make pipeline` has run, else a fresh model of its
shape, said in the output), or with --preset a preset's shape with random weights and the
embedded tokenizer's vocabulary, on this machine's first device; see
coa_jax/perf/serve_bench.py for what each row measures. Prints the table and writes the results
file.
"""

import json
import os
import platform
import shutil
import sys
import tempfile

import jax
from absl import app, flags

from coa_jax.data import prompts
from coa_jax.data.tokenizer import default_tokenizer
from coa_jax.evaluation import model_settings
from coa_jax.model import ModelSettings, Transformer, build_config
from coa_jax.perf import bench, serve_bench
from coa_jax.rollout.tool_loop import stop_ids
from coa_jax.runtime import cache, cli, hf_checkpoint, sharding
from coa_jax.runtime.distributed import say
from coa_jax.runtime.hf_checkpoint import load_model
from configs import common, pipeline_tiny_cpu

_MODEL = flags.DEFINE_string("model", "runs/pipeline_tiny/seed-0/dapo/hf_export",
                             "a trained model's folder; missing: a fresh model of the main job's shape")
_PRESET = flags.DEFINE_string("preset", "", "a model preset's shape with random weights in place "
                              "of --model (the embedded tokenizer's vocabulary)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "--preset's compute dtype")
_SESSIONS = flags.DEFINE_list("sessions", ["64"], "concurrent sessions (and the offline batch); "
                              "several: a row each")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "tokens a session samples at most")
_SECOND_TURN = flags.DEFINE_bool("second_turn", True, "a session's second turn against a cold "
                                 "prompt, at the first --sessions")
_PEERS = flags.DEFINE_bool("peers", False, "the decode roofline and HF transformers `generate` "
                           "at each --sessions")
_OUT = flags.DEFINE_string("out", "docs/results/bench_serve/results.json", "the results file")


def model(tokenizer, mesh):
  """Returns (model config, params, where they come from)."""
  if _PRESET.value:
    model_config = build_config(dict(common.model(
        _PRESET.value, dtype=_DTYPE.value, attention_impl="xla",
        vocab_size=tokenizer.vocab_size)))
    params = sharding.init_params(Transformer(model_config), mesh, jax.random.key(0))
    return model_config, params, (f"preset {_PRESET.value} ({model_config.num_params() / 1e9:.3g}B "
                                  f"parameters, random weights, {_DTYPE.value})")
  trained = os.path.isdir(_MODEL.value)
  spec = dict(pipeline_tiny_cpu.get_config().model)
  saved = os.path.join(_MODEL.value, model_settings.FILE)
  if os.path.isfile(saved):  # the shape the run that trained it saved (make serve reads it too)
    with open(saved) as f:
      spec.update(json.load(f)["model"])
  spec["checkpoint"] = _MODEL.value if trained else ""
  model_config, params = load_model(ModelSettings.from_section(spec), tokenizer, mesh)
  if params is None:
    params = sharding.init_params(Transformer(model_config), mesh, jax.random.key(0))
  return model_config, params, (_MODEL.value if trained else
                                "a fresh model of the main job's shape (no export found)")


def measure(args: tuple, work: serve_bench.Work, second_turn: bool) -> tuple[dict, dict | None]:
  """Returns the served run's figures and, with `second_turn`, the second turn's."""
  with serve_bench.serving(*args) as (url, server):
    if not second_turn:
      serve_bench.served(url, server, work, offset=10_000)  # compiles what the run uses
      return serve_bench.served(url, server, work)[0], None
    with serve_bench.serving(*args, prefix_cache=False) as (cold_url, cold):
      cold.transcripts = server.transcripts  # the same history ids on both
      # A whole run of other questions first: every program the measured run uses is compiled.
      _, warm_up = serve_bench.served(url, server, work, offset=10_000)
      serve_bench.second_turn(url, server, cold_url, cold, warm_up, work)
      served, firsts = serve_bench.served(url, server, work)
      return served, serve_bench.second_turn(url, server, cold_url, cold, firsts, work)


def main(argv):
  del argv
  cli.start()
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  tokenizer = default_tokenizer("plain")
  model_config, params, source = model(tokenizer, mesh)
  stops = stop_ids(tokenizer)
  peers = {}
  if _PEERS.value:
    (bandwidth, bandwidth_source), (peak, peak_source) = bench.memory_bandwidth(), bench.peak_flops()
    peers = dict(bandwidth_bytes_per_s=bandwidth, bandwidth_source=bandwidth_source,
                 peak_flops=peak, peak_source=peak_source)
    folder = tempfile.mkdtemp(prefix="bench_serve_hf_")
    hf_checkpoint.save_checkpoint(folder, model_config, params, dtype=model_config.dtype)
  rows, turn = [], None
  for number, sessions in enumerate(map(int, _SESSIONS.value)):
    work = serve_bench.Work(sessions=sessions, max_tokens=_MAX_TOKENS.value)
    args = (model_config, mesh, params, tokenizer, prompts.WORLD, work, stops)
    say(f"model: {source}; {work.sessions} sessions x {work.max_tokens} tokens at temperature "
        f"{work.temperature}, chunk {work.chunk}")
    offline = serve_bench.offline(*args)
    served, this_turn = measure(args, work, second_turn=_SECOND_TURN.value and number == 0)
    turn = turn or this_turn
    row = dict(sessions=sessions, offline=offline, served=served,
               served_over_offline=served["tokens_per_s"] / offline["tokens_per_s"])
    if peers:
      prompt = serve_bench.prompt_len(tokenizer, prompts.WORLD, sessions)
      row.update(prompt_len=prompt, **serve_bench.roofline(
          model_config, sessions, prompt, work, peers["bandwidth_bytes_per_s"],
          peers["peak_flops"]))
      row["served_of_roofline"] = served["tokens_per_s"] / row["roofline_tokens_per_s"]
      row["hf_tokens_per_s"] = serve_bench.hf_generate(folder, model_config, sessions, prompt,
                                                       work)
      row["served_over_hf"] = served["tokens_per_s"] / row["hf_tokens_per_s"]
    rows.append(row)
    say(f"{sessions} sessions: offline sampler {offline['tokens_per_s']:,.0f} tokens/s "
        f"({offline['tokens']} tokens); served {served['tokens_per_s']:,.0f} tokens/s "
        f"({row['served_over_offline']:.2f}x offline); time to first token p50 "
        f"{served['ttft_p50_s'] * 1e3:.0f} ms, p99 {served['ttft_p99_s'] * 1e3:.0f} ms (in the "
        f"engine {served['engine_ttft_p50_s'] * 1e3:.0f} / "
        f"{served['engine_ttft_p99_s'] * 1e3:.0f} ms); per "
        f"token p50 {served['per_token_p50_s'] * 1e3:.1f} ms, p99 "
        f"{served['per_token_p99_s'] * 1e3:.1f} ms" + (
            f"; {row['served_of_roofline']:.1%} of the {row['bound']}-bound roofline, "
            f"{row['served_over_hf']:.2f}x HF generate ({row['hf_tokens_per_s']:,.0f} tokens/s)"
            if peers else ""))
  if peers:
    shutil.rmtree(folder, ignore_errors=True)
  if turn:
    say(f"second turn ({rows[0]['sessions']} sessions): {turn['warm_prefill_tokens']} tokens "
        f"prefilled (cold: {turn['cold_prefill_tokens']}); time to first token p50 "
        f"{turn['warm_ttft_p50_s'] * 1e3:.0f} ms against {turn['cold_ttft_p50_s'] * 1e3:.0f} ms "
        f"cold ({turn['cold_ttft_p50_s'] / turn['warm_ttft_p50_s']:.1f}x); in the engine "
        f"{turn['warm_engine_ttft_p50_s'] * 1e3:.0f} ms against "
        f"{turn['cold_engine_ttft_p50_s'] * 1e3:.0f} ms "
        f"({turn['cold_engine_ttft_p50_s'] / turn['warm_engine_ttft_p50_s']:.1f}x); programs "
        f"compiled meanwhile {turn['warm_programs_compiled']} and {turn['cold_programs_compiled']}")
  results = {"model": source, "max_tokens": _MAX_TOKENS.value, "rows": rows, "second_turn": turn,
             **peers, "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
             "jax": jax.__version__, "python": platform.python_version(),
             "command": " ".join(["python", *sys.argv])}
  cache.write_json(_OUT.value, results)
  say(f"results: {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
