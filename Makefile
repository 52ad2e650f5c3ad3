# Two commands do all the set-up on a fresh machine (see README): `make pipeline` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MAIN_STAMP := $(VENV)/.installed-main
GPU_AOT_STAMP := $(VENV)/.installed-gpu-aot
# JAX picks the accelerator when there is one; on a machine without, say so up front (libtpu,
# installed for ahead-of-time TPU compiles, would otherwise probe for a TPU at start-up).
ACCELERATOR := $(wildcard /dev/accel0 /dev/vfio/0 /dev/nvidia0)
export JAX_PLATFORMS ?= $(if $(ACCELERATOR),,cpu)

# XLA:CPU takes a step's buffers afresh every step, and glibc's malloc hands the large ones back
# to the kernel, which faults every page in again: ~50,000 faults (200 MB) a step of the main
# job's SFT. tcmalloc keeps freed memory for the next step: the CPU train step runs 1.3x faster
# (docs/benchmarks.md). Installed like bubblewrap; where it is missing, jobs run as before.
# (Read when a recipe runs, after the install, so a first `make pipeline` has it too.)
TCMALLOC = $(firstword $(wildcard /usr/lib/*/libtcmalloc_minimal.so.4))
PY = $(if $(TCMALLOC),LD_PRELOAD=$(TCMALLOC) )$(BIN)/python

# Every package the install brings, at the exact versions the README's results were measured with.
# `make lock` re-resolves it from setup.py; upgrading is a deliberate change that re-runs the
# main job (docs/pipeline.md).
LOCK := requirements.lock
EXTRAS := test,tpu,plots,tfds,mcp,serve
MAIN_EXTRAS := plots
# `make pod-fit` adds gpu-aot (XLA:GPU and cuDNN for ahead-of-time GPU compiles, 2 GB) to the
# same locked environment; `make lock` resolves it too.
LOCK_EXTRAS := $(EXTRAS),gpu-aot

.PHONY: lock install demo lm-demo test sft rollout dapo pipeline fingerprint chaos experiment distill evaluate serve bench bench-tools bench-rollout bench-sampler bench-async bench-serve aot pod-fit profile suite-time device-check view benchmark clean

# The main job's install: what `make pipeline` and the other jobs import (plots for their
# figures), from the same lock; `make test`, the benchmarks and the ahead-of-time compiles add
# every extra ($(STAMP)).
$(MAIN_STAMP): setup.py $(LOCK)
	@# bubblewrap gives the code sandbox its strongest isolation; without it the sandbox falls
	@# back, with a warning, to `unshare`, then to resource limits only (CI=true tests fail).
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "bubblewrap not installed: the code sandbox will fall back to unshare or resource limits"
	@ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; }; }; } || \
	  echo "tcmalloc not installed: CPU jobs run with glibc's malloc (their train steps ~1.3x slower)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[$(MAIN_EXTRAS)]"
	touch $(MAIN_STAMP)

$(STAMP): $(MAIN_STAMP)
	@# chromium renders the trajectory viewer's pages headless in its tests (CI=true tests fail
	@# without it).
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium not installed: the trajectory viewer's browser tests will be skipped"
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[$(EXTRAS)]"
	touch $(STAMP)

lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet --upgrade pip
	.lock-venv/bin/pip install --quiet -e ".[$(LOCK_EXTRAS)]"
	{ echo "# pip constraints: the exact versions 'make install' installs; regenerate with 'make lock'."; \
	  echo "# Resolved $$(date -u +%Y-%m-%d) with $$(.lock-venv/bin/python --version) on $$(uname -m)."; \
	  .lock-venv/bin/pip freeze --exclude-editable; } > $(LOCK)
	rm -rf .lock-venv

install: $(STAMP)

# Observation-masked SFT of a tiny model on the shipped CoA sample (about a minute).
demo: $(MAIN_STAMP)
	$(PY) experiments/sft.py --config=configs/sft_tiny_cpu.py $(ARGS)

# The foundation smoke job: sharded LM training on synthetic data, HF export and reload.
lm-demo: $(MAIN_STAMP)
	$(PY) experiments/demo.py $(ARGS)

# One worker per core, a test file at a time per worker (module fixtures are built once), in
# conftest's order (the slowest files first); the workers share conftest's compilation cache.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 tests $(ARGS)

sft: $(MAIN_STAMP)
	$(PY) experiments/sft.py $(ARGS)

# Rollouts of the SFT demo's exported model with the embedded tools (run `make demo` first).
rollout: $(MAIN_STAMP)
	$(PY) experiments/rollout.py $(ARGS)

# The main job: the end-to-end recipe on the embedded world (ARGS=--quick: a smoke test).
pipeline: $(MAIN_STAMP)
	$(PY) experiments/pipeline.py $(ARGS)

# The main job's fingerprint (experiments/fingerprint.py): md5s of the quick job's and of a
# 12-step SFT + 2-step DAPO main job's data and exports, equal before and after a change that is
# meant not to move the main job.
fingerprint: $(MAIN_STAMP)
	$(PY) experiments/fingerprint.py $(ARGS)

# The suite's time at ARGS=--base=<commit> and at HEAD, back to back (docs/testing.md).
suite-time: $(STAMP)
	$(PY) experiments/suite_time.py $(ARGS)

# The chaos run (docs/pipeline.md): the quick main job SIGKILLed in every stage, re-launched until
# it completes, then compared with an uninterrupted quick run (runs/chaos/chaos_report.json).
chaos: $(MAIN_STAMP)
	$(PY) experiments/chaos.py $(ARGS)

# One of the paper's experiments in miniature (configs/experiments.py, docs/experiments.md):
# make experiment NAME=rl-ceiling [ARGS="--publish"]; needs `make pipeline ARGS="--seeds 3"`.
experiment: $(MAIN_STAMP)
	$(PY) experiments/experiment.py --name=$(NAME) $(ARGS)

distill: $(MAIN_STAMP)
	$(PY) experiments/distill.py $(ARGS)

evaluate: $(MAIN_STAMP)
	$(PY) experiments/evaluate.py $(ARGS)

# DAPO of the SFT demo's exported model with tools and rewards (run `make demo` first).
dapo: $(MAIN_STAMP)
	$(PY) experiments/dapo.py $(ARGS)

bench-rollout: $(STAMP)
	$(PY) experiments/bench_rollout.py $(ARGS)

# The sampler's host overhead: its decode loop against the decode step alone (tiny model, batch 16).
bench-sampler: $(STAMP)
	$(PY) experiments/bench_rollout.py --host_overhead_only $(ARGS)

# Serving: 64 concurrent streaming sessions of the official client against the offline sampler,
# latencies, a session's second turn (docs/benchmarks.md, "Serving").
bench-serve: $(STAMP)
	$(PY) experiments/bench_serve.py $(ARGS)

bench: $(STAMP)
	$(PY) experiments/bench_model.py $(ARGS)

bench-tools: $(STAMP)
	$(PY) experiments/bench_tools.py $(ARGS)

# Asynchronous vs synchronous DAPO with slow tools (docs/async_rl.md); needs `make pipeline`.
bench-async: $(STAMP)
	$(PY) experiments/bench_async.py $(ARGS)

aot: $(STAMP)
	$(PY) experiments/aot_compile.py $(ARGS)

$(GPU_AOT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[$(LOCK_EXTRAS)]"
	touch $(GPU_AOT_STAMP)

# The pod-fit table: every shipped TPU and GPU config compiled ahead of time for its slice, on
# this CPU (docs/tpu.md); writes runs/pod_fit/pod_fit.json and pod_fit.md.
pod-fit: $(GPU_AOT_STAMP)
	$(PY) experiments/pod_fit.py $(ARGS)

# A per-kernel table of a benchmark's step (docs/benchmarks.md#per-kernel-profiles): traced on
# this machine's devices, or ahead of time for a topology: make profile ARGS="--target=sft_7b"
profile: $(GPU_AOT_STAMP)
	$(PY) experiments/profile_step.py $(ARGS)

# Every GPU figure of issue 53 in one prepared call (docs/benchmarks.md): on a lent GPU through
# the device tool (see experiments/device_check.py); here ARGS=--smoke runs it on tiny shapes,
# ARGS=--fetch_wheels downloads the wheels the GPU machine lacks.
device-check: $(STAMP)
	$(PY) experiments/device_check.py $(ARGS)

# The main job's model (or MODEL=<dir>, a coa-jax export or a local HF checkpoint folder) behind
# an OpenAI-compatible API (docs/serving.md): make serve [MODEL=<dir>] [ARGS="--config.port=8001"].
MODEL ?= runs/pipeline_tiny/seed-0/dapo/hf_export
SERVE_STAMP := $(VENV)/.installed-serve
$(SERVE_STAMP): $(MAIN_STAMP)
	$(BIN)/pip install --quiet -c $(LOCK) -e ".[$(MAIN_EXTRAS),serve]"
	touch $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	@test -d "$(MODEL)" || { echo "no model folder $(MODEL): run 'make pipeline' first, or give MODEL=<dir>" >&2; exit 2; }
	$(PY) experiments/serve.py --model=$(MODEL) $(ARGS)

# The trajectory viewer's page of a run (an evaluation, RL or pipeline folder), written again:
# make view RUN=runs/pipeline_tiny [ARGS="--tasks=<task file> --out=<page>"] (prints its path).
view: $(MAIN_STAMP)
	@test -n "$(RUN)" || { echo 'usage: make view RUN=<run folder> [ARGS="--tasks=<task file> --out=<page>"]' >&2; exit 2; }
	$(PY) experiments/view.py --run=$(RUN) $(ARGS)

# The paper's benchmarks from their local files, graded as the paper grades them
# (docs/benchmarks_eval.md): make benchmark ARGS="--model=DIR --benchmarks=aime25,math500,lcb_v5"
benchmark: $(MAIN_STAMP)
	$(PY) experiments/benchmark.py $(ARGS)

clean:
	rm -rf $(VENV) runs
