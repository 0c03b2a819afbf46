"""Preconditioners shared by every kernel: identity, diagonal or dense matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_preconditioner", "preconditioned_noise", "standard_normal"]


def apply_preconditioner(preconditioner: jax.Array | None, vector: jax.Array) -> jax.Array:
    """``P @ vector`` for ``P`` None (identity), ``(D,)`` (diagonal) or ``(D, D)``."""
    if preconditioner is None:
        return vector
    preconditioner = jnp.asarray(preconditioner)
    if preconditioner.ndim <= 1:
        return preconditioner * vector
    return preconditioner @ vector


def preconditioned_noise(
    rng_key: jax.Array | None,
    preconditioner: jax.Array | None,
    like: jax.Array,
    normal: jax.Array | None = None,
) -> jax.Array:
    """A draw of ``N(0, P)`` for ``P`` None (identity), ``(D,)`` or a dense SPD ``(D, D)``.

    ``normal`` is a pre-drawn standard normal shaped like ``like``; without it one is drawn
    from ``rng_key``."""
    noise = standard_normal(rng_key, like, normal)
    if preconditioner is None:
        return noise
    preconditioner = jnp.asarray(preconditioner)
    if preconditioner.ndim <= 1:
        return jnp.sqrt(preconditioner) * noise
    return jnp.linalg.cholesky(preconditioner) @ noise


def standard_normal(
    rng_key: jax.Array | None, like: jax.Array, normal: jax.Array | None = None
) -> jax.Array:
    """``normal`` if given (drivers draw a whole draw's noise in one call), else a fresh
    ``N(0, I)`` draw shaped like ``like`` from ``rng_key``."""
    if normal is not None:
        return jnp.asarray(normal, dtype=like.dtype)
    if rng_key is None:
        raise ValueError("Pass either rng_key or a pre-drawn standard normal `normal`.")
    return jax.random.normal(rng_key, like.shape, dtype=like.dtype)
