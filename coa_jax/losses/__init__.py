"""Losses: pure functions of arrays returning token-exact (sum, count) pairs."""

from coa_jax.losses.cross_entropy import (LossSums, token_cross_entropy,
                                          token_cross_entropy_and_z)

__all__ = ["LossSums", "token_cross_entropy", "token_cross_entropy_and_z"]
