"""Package `coa-jax`: Chain-of-Agents agent foundation models in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="coa-jax",
    version="0.1.0",
    description="Chain-of-Agents (multi-agent distillation, observation-masked SFT, DAPO) "
                "in JAX/Flax, TPU-native",
    python_requires=">=3.10",
    # configs: the shipped experiment configs that the entry points in experiments/ load.
    packages=find_packages(include=["coa_jax", "coa_jax.*", "tools_env", "tools_env.*", "configs"]),
    package_data={"coa_jax": ["assets/*.jsonl", "assets/*.html", "perf/gpu_targets/*.txtpb"],
                  "tools_env": ["data/*.jsonl"]},
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "transformers>=5.0",
        "tokenizers>=0.22",
        "safetensors>=0.7",
        "ml-collections>=1.1",
        "absl-py",
        "grain>=0.2.18",
        "bm25s>=0.2",
        "tensorboard>=2.20",  # its event-file writer (coa_jax.train.writers); no TensorFlow
        "ml_dtypes",
        "numpy",
        # The benchmarks' graders and files (coa_jax.data.benchmark_files): math answers by
        # math-verify, the reference release's parquet task files.
        "math-verify>=0.9",
        "pyarrow",
    ],
    extras_require={
        # torch must stay pinned: an unpinned torch pulls a multi-GB CUDA build.
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "torch==2.13.0",
                 "peft>=0.13", "mcp==2.3.0", "openai>=1.40", "fastapi>=0.110",
                 "uvicorn>=0.30", "openai-agents>=0.2"],
        # coa_jax.serving.api: the OpenAI-compatible server (`make serve`).
        "serve": ["fastapi>=0.110", "uvicorn>=0.30"],
        # tools_env/examples/shop_agents_sdk.py: an agent built with the OpenAI Agents SDK.
        "agents": ["openai-agents>=0.2"],
        "tpu": ["jax[tpu]>=0.10.2"],
        "tfds": ["tensorflow-datasets>=4.9", "array_record", "tensorflow-cpu>=2.20"],
        "plots": ["matplotlib"],
        # tools_env.mcp_tools: MCP servers' tools as CoA tools (the 2.x client API).
        "mcp": ["mcp==2.3.0"],
        # gs:// paths (runtime.paths) where TensorFlow is not installed.
        "gcs": ["gcsfs"],
        # Ahead-of-time compiles for NVIDIA GPUs on a machine without one (`make pod-fit`):
        # XLA:GPU as a PJRT plugin, and cuDNN, which JAX asks for before it lowers cuDNN
        # attention. Not for running on GPUs: install jax[cuda12] there (docs/gpus.md).
        "gpu-aot": ["jax-cuda12-plugin>=0.10.2", "nvidia-cudnn-cu12>=9.8"],
    },
)
