"""Preconditioners shared by every kernel: identity, diagonal or dense matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_preconditioner", "preconditioned_noise"]


def apply_preconditioner(preconditioner: jax.Array | None, vector: jax.Array) -> jax.Array:
    """``P @ vector`` for ``P`` None (identity), ``(D,)`` (diagonal) or ``(D, D)``."""
    if preconditioner is None:
        return vector
    preconditioner = jnp.asarray(preconditioner)
    if preconditioner.ndim <= 1:
        return preconditioner * vector
    return preconditioner @ vector


def preconditioned_noise(
    rng_key: jax.Array, preconditioner: jax.Array | None, like: jax.Array
) -> jax.Array:
    """A draw of ``N(0, P)`` for ``P`` None (identity), ``(D,)`` or a dense SPD ``(D, D)``."""
    noise = jax.random.normal(rng_key, like.shape, dtype=like.dtype)
    if preconditioner is None:
        return noise
    preconditioner = jnp.asarray(preconditioner)
    if preconditioner.ndim <= 1:
        return jnp.sqrt(preconditioner) * noise
    return jnp.linalg.cholesky(preconditioner) @ noise
