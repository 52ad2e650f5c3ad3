"""The worked example's result: the SQL shop's agent built with the OpenAI Agents SDK
(tools_env/examples/shop_agents_sdk.py), trained with DAPO through the trainer's endpoint, beside
the built-in loop's DAPO from the same SFT models.

  make pipeline ARGS="--config=configs/pipeline_sql_cpu.py --seeds 3"  # first: the SFT models
  python experiments/agents_sdk_shop.py [--seeds=3] [--pipeline_dir=runs/pipeline_sql]
      [--output=runs/agents_sdk_shop] [--k=3]

Per seed, from the shop pipeline's SFT model:
1. DAPO through the endpoint: the pipeline's DAPO stage (steps, batch, learning rate, sampling
   unchanged) with `rl.agent = "tools_env.examples.shop_agents_sdk:solve"`: every rollout is an
   SDK agent run whose `sql` calls the SDK executes, rewarded 1 for the right total.
2. Held-out pass@1 of the SFT model, the built-in loop's DAPO model (the pipeline's) and the SDK's
   DAPO model, two ways: the pipeline's evaluation (the built-in loop, every held-out task x 3 at
   temperature 0.6: the pipeline's own figures for the first two), and the SDK agent itself
   against the model served by `experiments/serve.py` (`make serve`), every held-out task x `k`.
Writes results.json, results.md and results.png to --output (progress lines as it goes); a
re-run skips what is done.
"""

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from absl import app, flags, logging

from coa_jax.evaluation import job as evaluation
from coa_jax.rl import job as rl_job
from configs import pipeline_sql_cpu
from tools_env.examples import shop_agents_sdk
from tools_env.examples.sqlite_shop import Sql

_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0 .. n-1 of the shop pipeline")
_PIPELINE = flags.DEFINE_string("pipeline_dir", "runs/pipeline_sql", "the shop pipeline's output")
_OUTPUT = flags.DEFINE_string("output", "runs/agents_sdk_shop", "where to write")
_K = flags.DEFINE_integer("k", 3, "SDK agent runs per held-out task")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 32, "SDK agent sessions at once")
_QUICK = flags.DEFINE_bool("quick", False, "on the quick shop pipeline (a smoke test: make "
                           "pipeline ARGS=\"--config=configs/pipeline_sql_cpu.py --quick\")")

AGENT = "tools_env.examples.shop_agents_sdk:solve"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"sft": "SFT", "dapo_builtin": "DAPO (built-in loop)", "dapo_sdk": "DAPO (SDK agent)"}
EVALUATED = {"builtin": "built-in loop's pass@1", "sdk": "SDK agent's pass@1"}


def _stages(seed: int) -> dict:
  config = pipeline_sql_cpu.get_config()
  config.output_dir = _PIPELINE.value
  if _QUICK.value:
    config = pipeline_sql_cpu.quick(config)  # its output_dir gains "_quick"
  return pipeline_sql_cpu.stage_configs(config, seed)


def _train_sdk(seed: int, folder: str) -> str:
  """Runs DAPO through the endpoint with the SDK agent and its built-in evaluation unless done;
  returns the export."""
  stages = _stages(seed)
  config, evaluate = stages["dapo"], stages["eval_dapo"]
  sft_export = config.model.checkpoint
  if not os.path.isdir(sft_export):
    raise SystemExit(f"{sft_export} is missing: run the shop pipeline first (make pipeline "
                     f"ARGS=\"--config=configs/pipeline_sql_cpu.py --seeds {_SEEDS.value}\")")
  config.rl.agent = AGENT
  config.workdir, config.export_dir = folder, os.path.join(folder, "hf_export")
  config.checkpoint.directory = os.path.join(folder, "checkpoints")
  evaluate.model.checkpoint, evaluate.output_dir = config.export_dir, os.path.join(folder, "eval")
  if not os.path.exists(os.path.join(evaluate.output_dir, "metrics.json")):
    rl_job.run(config)
    # what `make serve` reads: the SFT model's settings (tokenizer, tools, prompt, sampling)
    shutil.copy(os.path.join(sft_export, "coa_evaluation.json"), config.export_dir)
    evaluation.run(evaluate)
  return config.export_dir


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _sdk_pass(model_dir: str, tasks_path: str, out: str) -> float:
  """Returns the SDK agent's held-out pass@1 against `model_dir` served by experiments/serve.py
  (run unless `out` holds it)."""
  if os.path.exists(out):
    with open(out) as f:
      return json.load(f)["pass@1"]
  port = _free_port()
  server = subprocess.Popen([sys.executable, "experiments/serve.py", f"--model={model_dir}",
                             f"--config.port={port}", f"--config.batch_size={_CONCURRENCY.value}"],
                            cwd=ROOT, start_new_session=True)
  try:
    for _ in range(600):
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        break
      except OSError:
        if server.poll() is not None:
          raise SystemExit(f"experiments/serve.py --model={model_dir} exited ({server.returncode})")
        time.sleep(1)
    else:
      raise SystemExit(f"experiments/serve.py --model={model_dir} did not answer /health in 600 s")
    import openai
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                timeout=600)
    tasks = [json.loads(line) for line in open(tasks_path)]
    with open(os.path.join(os.path.dirname(tasks_path), "tools.json")) as f:
      sql = Sql(**json.load(f)["sql"]["options"])

    async def run():
      model = (await client.models.list()).data[0].id
      return await shop_agents_sdk.evaluate(client, model, tasks, sql, _K.value,
                                            _CONCURRENCY.value)

    outcomes = asyncio.run(run())
  finally:
    os.killpg(server.pid, signal.SIGTERM)  # the server finishes what is in flight and exits
    server.wait(timeout=120)
  result = {"pass@1": sum(map(sum, outcomes)) / (len(tasks) * _K.value), "k": _K.value,
            "model": model_dir, "outcomes": {t["id"]: o for t, o in zip(tasks, outcomes)}}
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  return result["pass@1"]


def _builtin_pass(eval_dir: str) -> float:
  with open(os.path.join(eval_dir, "metrics.json")) as f:
    return json.load(f)["pass@1"]


def _mean_sd(values: list[float]) -> str:
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  return f"{statistics.fmean(values):.3f} +- {sd:.3f}"


def markdown(rows: dict[int, dict[str, float]]) -> str:
  """Returns the per-seed table and the mean +- sd row."""
  columns = [(f"{how}_{model}", f"{MODELS[model]}, {EVALUATED[how]}") for how in EVALUATED
             for model in MODELS if (how, model) != ("sdk", "dapo_builtin")]
  lines = ["| seed | " + " | ".join(title for _, title in columns) + " |",
           "|---" * (len(columns) + 1) + "|"]
  for seed, row in rows.items():
    lines.append(f"| {seed} | " + " | ".join(f"{row[key]:.3f}" for key, _ in columns) + " |")
  lines.append("| mean +- sd | " + " | ".join(
      _mean_sd([row[key] for row in rows.values()]) for key, _ in columns) + " |")
  return "\n".join(lines)


def plot(rows: dict[int, dict[str, float]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for ax, how, title in ((axes[0], "builtin", "held-out pass@1, built-in loop"),
                         (axes[1], "sdk", "held-out pass@1, the SDK agent")):
    models = [m for m in MODELS if f"{how}_{m}" in next(iter(rows.values()))]
    for seed, row in rows.items():
      ax.plot([MODELS[m] for m in models], [row[f"{how}_{m}"] for m in models], marker="o",
              label=f"seed {seed}")
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("pass@1")
  axes[1].legend()
  fig.suptitle("the shop: SFT, DAPO with the built-in loop, DAPO through the endpoint with an "
               "OpenAI Agents SDK agent")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  out = _OUTPUT.value
  os.makedirs(out, exist_ok=True)
  rows, start = {}, time.perf_counter()
  for seed in range(_SEEDS.value):
    stages = _stages(seed)
    folder = os.path.join(out, f"seed-{seed}")
    sdk_export = _train_sdk(seed, os.path.join(folder, "dapo_sdk"))
    heldout = stages["eval_sft"].tasks
    rows[seed] = {
        "builtin_sft": _builtin_pass(stages["eval_sft"].output_dir),
        "builtin_dapo_builtin": _builtin_pass(stages["eval_dapo"].output_dir),
        "builtin_dapo_sdk": _builtin_pass(os.path.join(folder, "dapo_sdk", "eval")),
        "sdk_sft": _sdk_pass(stages["dapo"].model.checkpoint, heldout,
                             os.path.join(folder, "sdk_eval_sft.json")),
        "sdk_dapo_sdk": _sdk_pass(sdk_export, heldout,
                                  os.path.join(folder, "sdk_eval_dapo_sdk.json"))}
    elapsed = time.perf_counter() - start
    print(f"seed {seed}: {rows[seed]} ({elapsed:.0f} s, ETA "
          f"{elapsed / (seed + 1) * (_SEEDS.value - seed - 1):.0f} s)", flush=True)
  text = markdown(rows)
  print(text)
  command = " ".join(["python", *sys.argv])
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"rows": rows, "k": _K.value, "agent": AGENT, "command": command,
               "pipeline_dir": _PIPELINE.value}, f, indent=1)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"<!-- {command} -->\n{text}\n")
  plot(rows, os.path.join(out, "results.png"))


if __name__ == "__main__":
  app.run(main)
