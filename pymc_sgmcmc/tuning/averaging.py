"""Averages of tuning measurements over doubling windows."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from pymc_sgmcmc.minibatch import full_data_chunks

__all__ = [
    "NoiseEstimate",
    "WindowedMean",
    "arrowhead_moments_along",
    "chunked_gradient_noise",
    "gradient_noise",
]


def gradient_noise(per_example_grads, full: bool = False):
    """Unbiased sample (co)variance of per-example gradients ``(B, D)``: ``(D,)`` or ``(D, D)``."""
    centred = per_example_grads - per_example_grads.mean(axis=0)
    denom = max(per_example_grads.shape[0] - 1, 1)
    if full:
        return centred.T @ centred / denom
    return jnp.sum(centred * centred, axis=0) / denom


def chunked_gradient_noise(rows_fn, rows: int, dim: int, full: bool, chunk_work: int):
    """:func:`gradient_noise` of the ``(rows, dim)`` values ``rows_fn(start, size)`` returns
    for rows ``start .. start + size − 1``, about ``chunk_work / dim`` rows at a time (every row
    of a large data set would not fit at once): sums of g and g gᵀ about a shift (the first
    chunk's mean, against cancellation), in one compiled scan."""
    import jax

    size = min(rows, max(256, chunk_work // max(dim, 1)))
    if size >= rows:
        return gradient_noise(rows_fn(0, rows), full=full)
    # Chunks of equal length: with ``size`` itself the last chunk is clamped back over rows
    # already counted (masked out, but computed) — 12 573 rows in chunks of 10 754 computed
    # 21 508, and the D x D products of a 390-parameter model took 0.1 s instead of 0.055 s.
    chunks = -(-rows // size)
    size = -(-rows // chunks)
    starts, masks = full_data_chunks(rows, size)
    shift = jnp.mean(rows_fn(0, size), axis=0)

    def chunk(carry, xs):
        total, square = carry
        start, mask = xs
        g = (rows_fn(start, size) - shift) * mask[:, None]
        square = square + (g.T @ g if full else jnp.sum(g * g, axis=0))
        return (total + jnp.sum(g, axis=0), square), None

    zero_sq = jnp.zeros((dim, dim) if full else (dim,), dtype=shift.dtype)
    (total, square), _ = jax.lax.scan(chunk, (jnp.zeros_like(shift), zero_sq), (starts, masks))
    mean = total / rows
    outer = jnp.outer(mean, mean) if full else mean * mean
    return (square - rows * outer) / max(rows - 1, 1)


def arrowhead_moments_along(
    along, rows: int, probes, id_probes, local_idx, pairs, chunk_work, row_work=None
):
    """The uncentred second moment ``(1/rows) Σ gᵢgᵢᵀ`` of the rows' gradients in the
    block-arrowhead layout of :mod:`pymc_sgmcmc.tuning.structure` — ``(G, G)``, ``(J, k, G)``,
    ``(J, k, k)``, and with crossed factors the couplings between them as
    :class:`~pymc_sgmcmc.tuning.structure.StructuredCurvature` keeps them (for each pair of
    slots ``B 1`` on the first's coordinates, ``Bᵀ 1`` on the second's, and ``1ᵀ B 1``) —
    from directional derivatives: ``along(start, size, tangents)`` returns ``(T, size)``,
    each row's derivative along each of ``T`` tangents. A row touches the globals and, per
    factor, one group's ``k`` slots, so its gradient is known from ``G + F·k`` of them —
    ``probes``
    (:meth:`~pymc_sgmcmc.tuning.structure.GroupStructure.probes`: the globals' unit vectors,
    then ones on a slot of every group of a factor) — and which group it touches from
    ``F·k`` more, ``id_probes`` (:meth:`~pymc_sgmcmc.tuning.structure.GroupStructure.
    id_probes`: weight ``j + 1`` on group ``j``'s slot, whose ratio to the slot's own
    derivative is ``j + 1``). ``pairs``: the static ``(f, s, f', s')`` of
    :meth:`~pymc_sgmcmc.tuning.structure.GroupStructure.pairs` (crossed factors).

    Work ``O(rows · (G + 2F·k))`` forward-mode products instead of ``rows × D`` gradient
    entries: at 20 000 groups (D = 20 001, 320 000 tuning rows) a measurement took 24.8 s
    with per-row gradients and 0.2 s this way. In chunks of about ``chunk_work / (16 T)``
    rows, or ``chunk_work / row_work``."""
    import jax

    j, k = local_idx.shape
    f_count = id_probes.shape[0] // k
    g = probes.shape[0] - f_count * k
    dim = probes.shape[1]
    tangents = jnp.concatenate([probes, id_probes], axis=0)
    # A row's forward-mode product keeps a few of the model's intermediates per tangent:
    # chunks of chunk_work / (16 T) rows hold about what chunk_work gradient entries did
    # (row_work: a caller's own cost per row, e.g. SAGA-LD's stored rows of D entries).
    per_row = max(16 * tangents.shape[0], row_work or 0)
    size = min(rows, max(64, chunk_work // per_row))
    starts, masks = full_data_chunks(rows, size)

    def chunk(carry, xs):
        gg, ug, uu, pa, pb, ps = carry
        start, mask = xs
        d = along(start, size, tangents) * mask[None, :]  # (T, m)
        dg = d[:g].T  # (m, G)
        dl = d[g : g + f_count * k].reshape(f_count, k, size)  # (F, k, m)
        numbered = d[g + f_count * k :].reshape(f_count, k, size)
        # each row's group from its slot with the largest derivative (zero: the row touches
        # no group of the factor, and adds nothing wherever it is put)
        top = jnp.argmax(jnp.abs(dl), axis=1)[:, None, :]  # (F, 1, m)
        den = jnp.take_along_axis(dl, top, axis=1)[:, 0]
        ratio = jnp.take_along_axis(numbered, top, axis=1)[:, 0] / jnp.where(den != 0, den, 1.0)
        gid = jnp.clip(jnp.round(ratio) - 1, 0, j - 1).astype(jnp.int32)  # (F, m)
        gg = gg + dg.T @ dg
        for f in range(f_count):
            lf = dl[f].T  # (m, k): the row's own group's slots
            ug = ug.at[gid[f]].add(lf[:, :, None] * dg[:, None, :])
            uu = uu.at[gid[f]].add(lf[:, :, None] * lf[:, None, :])
        for p, (f, s, h, t) in enumerate(pairs):
            both = dl[f, s] * dl[h, t]
            pa = pa.at[p, local_idx[gid[f], s]].add(both)
            pb = pb.at[p, local_idx[gid[h], t]].add(both)
            ps = ps.at[p].add(jnp.sum(both))
        return (gg, ug, uu, pa, pb, ps), None

    dtype = jax.eval_shape(lambda: along(0, size, tangents)).dtype
    n_pairs = len(pairs)
    zero = (
        jnp.zeros((g, g), dtype),
        jnp.zeros((j, k, g), dtype),
        jnp.zeros((j, k, k), dtype),
        jnp.zeros((n_pairs, dim), dtype),
        jnp.zeros((n_pairs, dim), dtype),
        jnp.zeros((n_pairs,), dtype),
    )
    out, _ = jax.lax.scan(chunk, zero, (starts, masks))
    return tuple(part / rows for part in out)


@dataclass
class WindowedMean:
    """Running mean of measurements over doubling windows, on the host.

    Early measurements are taken far from the posterior's bulk, so the mean is restarted after
    1, 2, 4, 8, … updates (as Stan restarts its adaptation windows). The value in force pools
    the last completed window with the current one, so that it does not jump back to a single
    noisy measurement when a window starts.
    """

    count: int = 0
    window: int = 1
    current: np.ndarray | None = field(default=None)
    previous: np.ndarray | None = field(default=None)
    previous_count: int = 0

    @property
    def value(self) -> np.ndarray | None:
        if self.current is None:
            return self.previous
        if self.previous is None:
            return self.current
        total = self.count + self.previous_count
        return (self.count * self.current + self.previous_count * self.previous) / total

    def update(self, estimate: np.ndarray) -> np.ndarray:
        if isinstance(estimate, np.ndarray) or np.isscalar(estimate):
            estimate = np.asarray(estimate, dtype=np.float64)
        # (else a structured measurement: pymc_sgmcmc.tuning.structure.StructuredCurvature)
        if self.count >= self.window:
            self.previous, self.previous_count = self.current, self.count
            self.current, self.count, self.window = None, 0, 2 * self.window
        self.count += 1
        if self.current is None:
            self.current = estimate.copy()
        else:
            self.current = self.current + (estimate - self.current) / self.count
        return self.value

    def reset(self) -> None:
        self.count, self.window, self.current = 0, 1, None
        self.previous, self.previous_count = None, 0


NoiseEstimate = WindowedMean  # the former name (pymc_sgmcmc.tuning.NoiseEstimate)
