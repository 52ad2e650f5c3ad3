"""Serving a coa-jax model: a continuous-batching engine over the JAX sampler (`engine`)."""
