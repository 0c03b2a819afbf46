r"""Minibatch layout and index draws: the one place that decides how rows are picked.

Two schemes, both unbiased for the full-data gradient:

``"blocks"`` (default)
    The rows are shuffled **once** (a fixed permutation) and the first ``B − 1`` rows are
    appended at the end. A minibatch is the contiguous block of ``B`` rows starting at an
    offset drawn uniformly from ``0..N−1``, read with ``lax.dynamic_slice``. Each row lies in
    exactly ``B`` of the ``N`` possible blocks, so it is included with probability ``B/N`` and
    the minibatch gradient is unbiased. Within a block the rows are distinct (sampling without
    replacement), so the gradient-noise covariance is ``(N²/B)·C·(N − B)/(N − 1)`` rather than
    ``(N²/B)·C``: identical for ``B ≪ N`` and never larger. Only ``N`` distinct minibatches
    exist (instead of ``C(N, B)``); because the permutation is random this adds no bias, and
    it makes one pass over the data about as fast as a full-data gradient (contiguous memory
    reads, no gather).
``"random"``
    ``B`` indices drawn uniformly **with replacement** every step and gathered
    (``jnp.take``). This is the textbook scheme the theory assumes; it is several times slower
    per pass on large ``N`` because of the random-access gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MinibatchScheme", "draw_minibatch", "layout_data"]

MinibatchScheme = Literal["blocks", "random"]
SHUFFLE_SEED = 20170101  # the data permutation is part of the problem, not of a chain


def layout_data(
    arrays: Sequence[np.ndarray], batch_size: int, scheme: MinibatchScheme
) -> tuple[np.ndarray, ...]:
    """Host-side layout of the row-aligned arrays for :func:`draw_minibatch`."""
    if scheme == "random":
        return tuple(arrays)
    if scheme != "blocks":
        raise ValueError(f"minibatch scheme must be 'blocks' or 'random', got {scheme!r}.")
    n = arrays[0].shape[0]
    perm = np.random.default_rng(SHUFFLE_SEED).permutation(n)
    out = []
    for a in arrays:
        shuffled = a[perm]
        out.append(np.concatenate([shuffled, shuffled[: batch_size - 1]], axis=0))
    return tuple(out)


def draw_minibatch(
    rng_key: jax.Array,
    data: Sequence[jax.Array],
    data_size: int,
    batch_size: int,
    scheme: MinibatchScheme,
) -> tuple[jax.Array, ...]:
    """Draw one minibatch of ``batch_size`` rows from data laid out by :func:`layout_data`."""
    if scheme == "blocks":
        start = jax.random.randint(rng_key, (), 0, data_size)
        return tuple(
            jax.lax.dynamic_slice_in_dim(a, start, batch_size, axis=0) for a in data
        )
    idx = jax.random.randint(rng_key, (batch_size,), 0, data_size)
    return tuple(jnp.take(a, idx, axis=0) for a in data)
