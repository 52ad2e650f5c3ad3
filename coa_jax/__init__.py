"""coa-jax: Chain-of-Agents training (distillation, observation-masked SFT, DAPO) in JAX/Flax."""

__version__ = "0.1.0"
