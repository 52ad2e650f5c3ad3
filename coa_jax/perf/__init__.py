"""Performance: analytic FLOPs, benchmarks against PyTorch, ahead-of-time compiles and memory
reports for TPU topologies."""

from coa_jax.perf import aot, bench, flops
