r"""Minibatch layout and index draws: the one place that decides how rows are picked.

Two schemes, both unbiased for the full-data gradient:

``"blocks"`` (default)
    The rows are shuffled **once** (a fixed permutation) and the first ``B − 1`` rows are
    appended at the end. A minibatch is ``B / s`` contiguous sub-blocks of ``s`` rows, each
    starting at an offset drawn uniformly from ``0..N−1`` (read with a vmapped
    ``lax.dynamic_slice``). Every row is included with probability ``B/N`` per sub-block
    draw, so the minibatch gradient is unbiased.

    Why sub-blocks and not one block of ``B`` rows: with a single fixed permutation there are
    only ``N`` distinct blocks, and neighbouring rows of the permutation always travel
    together. The gradient-noise covariance over blocks then deviates from ``(N²/B)·C`` by a
    random relative error of about ``√(2s/N)`` for blocks of ``s`` rows (measured: with
    ``s = B = 100`` and ``N = 10⁴``, constant SGD's stationary variances were 8–22% too small,
    and exact with i.i.d. rows). Constant SGD and IASG *are* their gradient noise, so the
    sub-block length is chosen as the largest divisor of ``B`` with ``√(2s/N) ≤ 1%``
    (``s ≤ N/20 000``; ``s = 1``, plain uniform draws, for ``N < 40 000``). Rows inside a
    sub-block are distinct, so the noise covariance is ``(N²/B)·C·(N − s)/(N − 1)`` —
    :func:`noise_factor`. Reading ``s`` contiguous rows at a time keeps a pass over large data
    close to the speed of a full-data gradient.
``"random"``
    ``B`` indices drawn uniformly **with replacement** every step and gathered
    (``jnp.take``). This is the textbook scheme the theory assumes; it is slower per pass on
    large ``N`` because of the random-access gather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MinibatchScheme",
    "default_batch_size",
    "block_rows",
    "draw_minibatch",
    "full_data_chunks",
    "layout_data",
    "layout_shards",
    "local_batch",
    "minibatch_indices",
    "minibatch_row_ids",
    "noise_factor",
    "stack_pieces",
    "take_minibatch",
]

MinibatchScheme = Literal["blocks", "random"]
SHUFFLE_SEED = 20170101
UNROLLED_SLICES = 8  # the data permutation is part of the problem, not of a chain


DEFAULT_BATCH_SIZE = 256  # the smallest default minibatch (see default_batch_size)
FULL_BATCH_MAX_ROWS = 4096
"""Up to this many rows the default minibatch is the whole data set (see default_batch_size)."""


def default_batch_size(data_size: int) -> int:
    r"""The default ``batch_size`` for ``N`` rows.

    - ``N ≤ 4096``: ``B = N``, the full data. There is then no minibatch noise and every sampler
      runs Metropolis-adjusted Langevin (:mod:`pymc_sgmcmc.kernels.mala`), which is exact; a
      full-data gradient costs about what a pass of minibatches does at these sizes.
    - above: ``B = max(256, 2^round(log₂ √N))`` (256 up to N = 65 536 rows, 1024 at 10⁶, 8192
      at 10⁸). With the tuned step ``h ≈ 2B/N`` a chain relaxes in about half a pass whatever
      ``B``, so a larger ``B`` costs no mixing per pass and spreads the per-iteration overhead
      over more rows; ``N/B ≥ √N ≥ 64`` keeps the step small (``h ≲ 0.03``) and IASG's window
      long.

    Examples
    --------
    >>> [default_batch_size(n) for n in (50, 4096, 4097, 10**5, 10**6, 10**8)]
    [50, 4096, 256, 256, 1024, 8192]
    """
    data_size = int(data_size)
    if data_size <= FULL_BATCH_MAX_ROWS:
        return max(data_size, 1)
    return min(data_size, max(DEFAULT_BATCH_SIZE, 2 ** round(math.log2(math.sqrt(data_size)))))


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


def layout_shards(
    arrays: Sequence[np.ndarray], batch_size: int, scheme: MinibatchScheme, shards: int
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Host-side layout for data-parallel minibatches over ``shards`` devices.

    The rows are shuffled with the same fixed permutation as :func:`layout_data` and cut into
    ``shards`` contiguous pieces of ``N_d`` rows (sizes differ by at most one); each piece is
    laid out like :func:`layout_data` for a local batch of ``B / shards`` rows and padded to a
    common length. Returns the stacked ``(shards, L, ...)`` arrays and the ``N_d``.

    Each device draws its local minibatch from its own piece, and the gradient estimate
    ``Σ_d (N_d / B_d) Σ_{i ∈ S_d} ∇ log p(x_i | θ)`` is unbiased for the full-data one — a
    stratified version of the single-device estimator: its noise lacks the spread between the
    pieces' mean gradients (negligible for these shuffled pieces; large for row shards split
    by an outcome), and the tuning measures it piece by piece
    (:func:`pymc_sgmcmc.sharding.sharded_gradient_noise`)."""
    local_b = local_batch(batch_size, shards)
    n = arrays[0].shape[0]
    perm = np.random.default_rng(SHUFFLE_SEED).permutation(n) if scheme == "blocks" else None
    bounds = np.linspace(0, n, shards + 1).astype(np.int64)
    sizes = np.diff(bounds)
    if sizes.min() < local_b:
        raise ValueError(
            f"{shards} devices leave {int(sizes.min())} rows per device, fewer than the local "
            f"batch of {local_b} rows; use fewer devices or a smaller batch_size."
        )
    extra = local_b - 1 if scheme == "blocks" else 0
    length = int(sizes.max()) + extra
    out = []
    for a in arrays:
        a = a[perm] if perm is not None else a
        pieces = [a[bounds[d] : bounds[d + 1]] for d in range(shards)]
        out.append(stack_pieces(pieces, length, extra))
    return tuple(out), sizes


def local_batch(batch_size: int, devices: int) -> int:
    """Each device's share ``B / k`` of the minibatch; refuses a ``B`` that ``k`` does not
    divide."""
    if batch_size % devices:
        raise ValueError(
            f"batch_size={batch_size} must be a multiple of the number of devices ({devices}) "
            "so that each device takes the same share of the minibatch."
        )
    return batch_size // devices


def stack_pieces(pieces: Sequence[np.ndarray], length: int, extra: int) -> np.ndarray:
    """Pieces of one array as ``(len(pieces), length, ...)``: each piece followed by its own
    first ``extra`` rows (the ``"blocks"`` scheme's wrap-around, ``extra = B_d − 1``) and zeros."""
    first = pieces[0]
    stacked = np.zeros((len(pieces), length, *first.shape[1:]), dtype=first.dtype)
    for d, piece in enumerate(pieces):
        stacked[d, : len(piece)] = piece
        stacked[d, len(piece) : len(piece) + extra] = piece[:extra]
    return stacked


def block_rows(data_size: int, batch_size: int, max_relative_error: float = 0.01) -> int:
    """Sub-block length ``s``: the largest divisor of ``B`` with ``√(2s/N) ≤ max_relative_error``,
    or ``N`` when ``B = N``: one block of ``N`` contiguous rows of the shuffled layout is every
    row exactly once (the exact full-data gradient, rotated), not ``N`` rows drawn with
    replacement."""
    if batch_size >= data_size:
        return data_size
    limit = max(1, int(data_size * max_relative_error**2 / 2))
    return max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= limit)


def noise_factor(data_size: int, batch_size: int, scheme: MinibatchScheme) -> float:
    """Ratio of the minibatch-gradient noise covariance to ``(N²/B)·C`` for ``scheme``."""
    if scheme == "random":
        return 1.0
    s = block_rows(data_size, batch_size)
    return (data_size - s) / (data_size - 1) if data_size > 1 else 1.0


def minibatch_indices(
    rng_key: jax.Array,
    data_size: int,
    batch_size: int,
    scheme: MinibatchScheme,
    shape: tuple[int, ...] = (),
) -> jax.Array:
    """Index draws for ``shape`` minibatches in one vectorised call.

    ``"blocks"``: ``shape + (B/s,)`` sub-block offsets; ``"random"``: ``shape + (B,)`` rows.
    Drivers draw a whole draw's indices before the ``lax.scan`` (one PRNG call instead of one
    per iteration, which dominated small-batch iterations on CPU)."""
    per_batch = (
        batch_size // block_rows(data_size, batch_size) if scheme == "blocks" else batch_size
    )
    return jax.random.randint(rng_key, (*shape, per_batch), 0, data_size)


def take_minibatch(
    indices: jax.Array,
    data: Sequence[jax.Array],
    data_size: int,
    batch_size: int,
    scheme: MinibatchScheme,
) -> tuple[jax.Array, ...]:
    """The minibatch for one row of :func:`minibatch_indices`."""
    if scheme == "blocks":
        s = block_rows(data_size, batch_size)

        def take(a: jax.Array) -> jax.Array:
            if indices.shape[0] <= UNROLLED_SLICES:
                # A few slices: concatenated dynamic slices compile to plain copies, which
                # XLA's CPU backend runs ~1.5x faster than the gather a vmap lowers to.
                slices = [
                    jax.lax.dynamic_slice_in_dim(a, indices[i], s, axis=0)
                    for i in range(indices.shape[0])
                ]
                return jnp.concatenate(slices, axis=0)
            blocks = jax.vmap(lambda st: jax.lax.dynamic_slice_in_dim(a, st, s, axis=0))(indices)
            return blocks.reshape((batch_size, *a.shape[1:]))

        return tuple(take(a) for a in data)
    return tuple(jnp.take(a, indices, axis=0) for a in data)


def minibatch_row_ids(
    indices: jax.Array, data_size: int, batch_size: int, scheme: MinibatchScheme
) -> jax.Array:
    """``(B,)`` row indices in ``0..N−1`` (of the laid-out, shuffled data) of the minibatch
    that :func:`take_minibatch` reads for one row of :func:`minibatch_indices`."""
    if scheme == "blocks":
        s = block_rows(data_size, batch_size)
        return ((indices[:, None] + jnp.arange(s)[None, :]) % data_size).reshape(batch_size)
    return indices


def full_data_chunks(data_size: int, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """Starts and row masks that cover rows ``0..N−1`` exactly once in chunks of ``B`` rows.

    Chunk ``k`` starts at ``min(kB, N − B)`` (so that every read stays inside the data of
    either layout); its mask keeps the rows at or after ``kB``, which a clamped final chunk
    would otherwise count twice."""
    n_chunks = -(-data_size // batch_size)
    k = jnp.arange(n_chunks)
    starts = jnp.minimum(k * batch_size, data_size - batch_size)
    masks = (starts[:, None] + jnp.arange(batch_size)[None, :]) >= (k * batch_size)[:, None]
    return starts, masks


def draw_minibatch(
    rng_key: jax.Array,
    data: Sequence[jax.Array],
    data_size: int,
    batch_size: int,
    scheme: MinibatchScheme,
) -> tuple[jax.Array, ...]:
    """Draw one minibatch of ``batch_size`` rows from data laid out by :func:`layout_data`."""
    indices = minibatch_indices(rng_key, data_size, batch_size, scheme)
    return take_minibatch(indices, data, data_size, batch_size, scheme)
