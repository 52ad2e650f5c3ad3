"""Runs one experiment on every worker of a TPU VM pod slice at once.

  python experiments/launch_tpu.py --tpu=NAME --zone=ZONE --project=PROJECT --workers=4 \
      [--sync] [--dry-run] -- experiments/sft.py --config=configs/sft_qwen2_5_7b.py

Steps (each a `gcloud compute tpus tpu-vm` command; --dry-run prints them and runs none):
1. with --sync: pack the repository's tracked files (`git ls-files`), copy the archive to
   every worker, unpack it into ~/coa-jax and install there (`make install`);
2. start the experiment on every worker at once (one ssh per worker, so each worker's output
   streams to the terminal with a `[worker i]` prefix and to logs/<tpu>/worker-<i>.log);
3. when any worker fails or on Ctrl-C: stop the experiment on all workers together.

Every worker runs the very same command: with COA_JAX_DISTRIBUTED=auto the experiment joins
JAX's multi-host runtime (`coa_jax.distributed.initialize_from_env`), which finds the other
workers of a TPU slice by itself.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time

from coa_jax.runtime.distributed import ENV

REMOTE_DIR = "~/coa-jax"
ARCHIVE = "/tmp/coa-jax.tar.gz"


def _gcloud(args: argparse.Namespace, verb: str, *rest: str) -> list[str]:
  return ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}",
          f"--project={args.project}"]


def _ssh(args: argparse.Namespace, worker: str, command: str) -> list[str]:
  return _gcloud(args, "ssh", args.tpu, f"--worker={worker}", f"--command={command}")


def sync_commands(args: argparse.Namespace) -> list[list[str]]:
  """Returns the commands that put the current code on every worker and install it."""
  pack = ["bash", "-c", f"git ls-files -z | xargs -0 tar czf {ARCHIVE}"]
  copy = _gcloud(args, "scp", ARCHIVE, f"{args.tpu}:{ARCHIVE}", "--worker=all")
  install = _ssh(args, "all", f"mkdir -p {REMOTE_DIR} && tar xzf {ARCHIVE} -C {REMOTE_DIR} "
                              f"&& cd {REMOTE_DIR} && make install")
  return [pack, copy, install]


def run_commands(args: argparse.Namespace) -> list[list[str]]:
  """Returns one command per worker, started together, each running the experiment."""
  experiment = shlex.join(["env", f"{ENV}=auto", ".venv/bin/python"] + args.command)
  remote = f"cd {REMOTE_DIR} && {experiment}"
  return [_ssh(args, str(worker), remote) for worker in range(args.workers)]


def stop_command(args: argparse.Namespace) -> list[str]:
  """Returns the command that stops the experiment on every worker."""
  return _ssh(args, "all", f"pkill -f {shlex.quote(args.command[0])} || true")


def _stream(worker: int, process: subprocess.Popen, log_path: str) -> None:
  with open(log_path, "w") as log:
    for line in process.stdout:
      log.write(line)
      log.flush()
      sys.stdout.write(f"[worker {worker}] {line}")
      sys.stdout.flush()


def launch(args: argparse.Namespace) -> int:
  """Runs the experiment on all workers; returns 0 when every worker succeeded."""
  if args.sync:
    for command in sync_commands(args):
      subprocess.run(command, check=True)
  log_dir = os.path.join("logs", args.tpu)
  os.makedirs(log_dir, exist_ok=True)
  processes, threads = [], []
  for worker, command in enumerate(run_commands(args)):
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    thread = threading.Thread(target=_stream, daemon=True, args=(
        worker, process, os.path.join(log_dir, f"worker-{worker}.log")))
    thread.start()
    processes.append(process)
    threads.append(thread)
  failed = None  # a failed worker's index, or -1 on Ctrl-C
  try:
    while failed is None and any(p.poll() is None for p in processes):
      failed = next((w for w, p in enumerate(processes) if p.poll() not in (None, 0)), None)
      time.sleep(1.0)
  except KeyboardInterrupt:
    failed = -1
  if failed is None:
    failed = next((w for w, p in enumerate(processes) if p.returncode != 0), None)
  if failed is not None:
    reason = "interrupted" if failed == -1 else f"worker {failed} failed"
    print(f"{reason}: stopping the experiment on every worker", file=sys.stderr)
    subprocess.run(stop_command(args), check=False)
    for process in processes:
      process.terminate()
  for thread in threads:
    thread.join(timeout=5.0)
  print(f"logs: {log_dir}/worker-*.log")
  return 0 if failed is None else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tpu", required=True, help="the TPU VM slice name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", required=True)
  parser.add_argument("--workers", type=int, required=True,
                      help="hosts in the slice (e.g. 4 for v5p-32 or v4-32)")
  parser.add_argument("--sync", action="store_true", help="copy and install the code first")
  parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="after --: the experiment script and its flags")
  args = parser.parse_args(argv)
  if args.command[:1] == ["--"]:
    args.command = args.command[1:]
  if not args.command or not args.command[0].endswith(".py"):
    parser.error("give the experiment after --, e.g. -- experiments/sft.py --config=...")
  if args.workers < 1:
    parser.error(f"--workers must be >= 1, got {args.workers}")
  return args


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  if args.dry_run:
    commands = (sync_commands(args) if args.sync else []) + run_commands(args)
    for command in commands:
      print(shlex.join(command))
    print(f"# if a worker fails, or on Ctrl-C:\n{shlex.join(stop_command(args))}")
    return 0
  return launch(args)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
