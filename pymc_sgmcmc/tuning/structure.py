r"""Curvature with the structure of a nested hierarchical posterior: dense in the globals,
one dense block per group's locals, and the global–local cross terms.

Why. Above :data:`~pymc_sgmcmc.tuning.whitening.DENSE_MAX_DIM` coordinates a dense whitening
does not fit, and a diagonal one cannot see the ridge along which the globals and the group
effects move together: the chain then explores the globals' *conditional*, not their
marginal (on ``J = 2 000`` random intercepts IASG's θ had 0.33× its sd). The posterior of a
model with one grouping factor has a curvature of block-arrowhead form — group ``j``'s locals
``u_j`` (``k`` coordinates) meet only themselves and the ``G`` globals:

.. math::

    A = \begin{pmatrix} A_{uu} & A_{ug} \\ A_{gu} & A_{gg} \end{pmatrix},\qquad
    A_{uu} = \operatorname{blockdiag}(A_{u_1u_1}, \dots, A_{u_Ju_J}).

Its Cholesky factor has no fill-in (:class:`~pymc_sgmcmc.kernels.preconditioning.
ArrowheadCholesky`): ``J·k² + J·k·G + G²`` numbers, products and solves in as many operations,
and the Schur complement :math:`S = A_{gg} - A_{gu}A_{uu}^{-1}A_{ug}` — the globals' marginal
precision — is exact where the posterior is Gaussian.

Finding the structure (:func:`find_groups`). From the rows, not the graph's syntax: whatever
the parameterisation (``u[idx]``, ``mu + sigma * z[idx]``, ``(mu + sigma * z)[idx]``, a
one-hot ``Z @ u``, a ``(J, 2)`` intercept and slope), each row's log-likelihood depends on
one group's coordinates of each group-level variable. Two directional derivatives of every
row's log-likelihood along one slot of a variable, with weights ``1`` and ``j + 1`` on group
``j``'s coordinate, have the ratio ``j + 1`` exactly when the row touches one group (checked
by a third, with weights ``(j + 1)²``): ``O(N)`` work and memory, no per-row gradients. The
group-level variables must share one grouping of the rows (crossed factors do not: they
keep today's diagonal whitening, with a warning). Couplings the rows cannot show — a prior
tying one group's effect to another's — are caught by :func:`verify`: two random
Hessian-vector products against the arrowhead's.

Measuring it (:func:`probes`). ``G + k`` Hessian-vector products give all of it: one per
global (its column: ``A_gg`` and the cross terms) and one per local slot ``s`` with ones on
every group's slot ``s`` (the groups do not couple, so each group's entries of the product
are its block's column ``s``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pymc_sgmcmc.kernels.preconditioning import (
    ArrowheadCholesky,
    ArrowheadFactor,
    ArrowheadMetric,
    ArrowheadPrecision,
)

__all__ = [
    "GroupStructure",
    "StructuredCurvature",
    "StructuredWhitening",
    "find_groups",
    "verify",
]

GROUP_LEVEL_MIN = 17
"""A variable is group-level when one axis has at least this many entries (the self-check's
globals are the variables of at most 16 coordinates)."""
SLOTS_MAX = 16
"""At most this many coordinates per group and variable (an intercept and slopes)."""
RATIO_TOLERANCE = 1e-6
VERIFY_TOLERANCE = 1e-6
"""Relative error of the arrowhead's Hessian-vector products against the model's."""


@dataclass(frozen=True)
class GroupStructure:
    """Where the globals and each group's locals sit in the raveled position."""

    global_idx: np.ndarray
    """``(G,)``"""
    local_idx: np.ndarray
    """``(J, k)``: group ``j``'s coordinates."""
    description: str
    """For messages: the variables and groups, e.g. ``u: 2000 groups of 1``."""

    @property
    def dim(self) -> int:
        return int(self.global_idx.size + self.local_idx.size)

    @property
    def n_groups(self) -> int:
        return int(self.local_idx.shape[0])

    @property
    def k(self) -> int:
        return int(self.local_idx.shape[1])

    def probes(self, dtype=np.float64) -> np.ndarray:
        """``(G + k, D)``: the unit vectors of the globals, then one vector per local slot
        with ones on every group's coordinate in that slot."""
        out = np.zeros((self.global_idx.size + self.k, self.dim), dtype=dtype)
        out[np.arange(self.global_idx.size), self.global_idx] = 1.0
        for s in range(self.k):
            out[self.global_idx.size + s, self.local_idx[:, s]] = 1.0
        return out

    def curvature_from_products(self, products: np.ndarray) -> StructuredCurvature:
        """The arrowhead from the Hessian-vector products of :meth:`probes` (``(G + k, D)``)."""
        products = np.asarray(products, dtype=np.float64)
        g = self.global_idx.size
        cols = products[:g]  # H e_g: rows are the probes
        gg = cols[:, self.global_idx].T
        ug = np.transpose(cols[:, self.local_idx], (1, 2, 0))  # (J, k, G)
        slots = products[g:]  # (k, D)
        uu = np.transpose(slots[:, self.local_idx], (1, 2, 0))  # (J, k_row, k_col)
        return StructuredCurvature(self, 0.5 * (gg + gg.T), ug, 0.5 * (uu + np.swapaxes(uu, 1, 2)))


@dataclass(frozen=True)
class StructuredCurvature:
    """A measured arrowhead curvature of ``structure``: ``gg`` ``(G, G)``, ``ug``
    ``(J, k, G)`` (``A_{u_j g}``) and ``uu`` ``(J, k, k)``. Averaged by
    :class:`~pymc_sgmcmc.tuning.averaging.WindowedMean` like an array (sums and scalar
    products)."""

    structure: GroupStructure
    gg: np.ndarray
    ug: np.ndarray
    uu: np.ndarray

    def _map(self, other, op):
        s = self.structure
        if isinstance(other, StructuredCurvature):
            return StructuredCurvature(
                s, op(self.gg, other.gg), op(self.ug, other.ug), op(self.uu, other.uu)
            )
        return StructuredCurvature(s, op(self.gg, other), op(self.ug, other), op(self.uu, other))

    def __add__(self, other):
        return self._map(other, np.add)

    def __sub__(self, other):
        return self._map(other, np.subtract)

    def __mul__(self, other):
        return self._map(other, np.multiply)

    __rmul__ = __mul__

    def __truediv__(self, other):
        return self._map(other, np.divide)

    def copy(self) -> StructuredCurvature:
        return StructuredCurvature(self.structure, self.gg.copy(), self.ug.copy(), self.uu.copy())

    def diagonal(self) -> np.ndarray:
        """``(D,)`` the curvature's diagonal in the raveled coordinates."""
        structure = self.structure
        out = np.zeros(structure.dim)
        out[structure.global_idx] = np.diag(self.gg)
        out[structure.local_idx] = np.diagonal(self.uu, axis1=1, axis2=2)
        return out

    def matvec(self, v: np.ndarray) -> np.ndarray:
        """``A v`` (for :func:`verify`)."""
        structure = self.structure
        v = np.asarray(v, dtype=np.float64)
        vu, vg = v[structure.local_idx], v[structure.global_idx]
        out = np.zeros_like(v)
        out[structure.local_idx] = np.einsum("jab,jb->ja", self.uu, vu) + self.ug @ vg
        out[structure.global_idx] = self.gg @ vg + np.einsum("jkg,jk->g", self.ug, vu)
        return out


def _clip(matrix: np.ndarray, floor: float) -> np.ndarray:
    """Symmetric eigenvalues in absolute value and floored (the saddle-free choice of
    :class:`~pymc_sgmcmc.tuning.whitening.Whitening`), batched over leading axes."""
    w, v = np.linalg.eigh(0.5 * (matrix + np.swapaxes(matrix, -1, -2)))
    w = np.maximum(np.abs(w), floor)
    return (v * w[..., None, :]) @ np.swapaxes(v, -1, -2)


@dataclass(frozen=True)
class StructuredWhitening:
    """``θ = c + L z`` with ``L = C⁻ᵀ``, ``C Cᵀ = A`` a block-arrowhead curvature: the
    :class:`~pymc_sgmcmc.tuning.whitening.Whitening` interface for diagonal rates in ``z``,
    whose θ-space matrices are operators (:mod:`pymc_sgmcmc.kernels.preconditioning`)."""

    structure: GroupStructure
    chol_u: np.ndarray
    cross: np.ndarray
    chol_g: np.ndarray
    spectrum: tuple[float, float]

    dense = False
    structured = True

    @classmethod
    def from_curvature(
        cls, curvature: StructuredCurvature, floor: float = 1e-14
    ) -> StructuredWhitening:
        structure = curvature.structure
        if not all(np.all(np.isfinite(a)) for a in (curvature.gg, curvature.ug, curvature.uu)):
            raise FloatingPointError("the measured curvature has non-finite entries")
        top = max(
            float(np.max(np.abs(np.linalg.eigvalsh(curvature.uu)), initial=0.0)),
            float(np.max(np.abs(np.diag(curvature.gg)), initial=0.0)),
            1e-300,
        )
        uu = _clip(curvature.uu, floor * top)
        chol_u = np.linalg.cholesky(uu)
        # X_j = C_u_j⁻¹ A_{u_j g} (k, G); C_gu's block j is X_jᵀ
        x = np.linalg.solve(chol_u, curvature.ug)
        cross = np.swapaxes(x, 1, 2)  # (J, G, k)
        schur = curvature.gg - np.einsum("jkg,jkh->gh", x, x)
        schur = _clip(schur, floor * top)
        chol_g = np.linalg.cholesky(schur)
        w = np.concatenate([np.linalg.eigvalsh(uu).ravel(), np.linalg.eigvalsh(schur).ravel()])
        return cls(structure, chol_u, cross, chol_g, (float(w.min()), float(w.max())))

    # -- the Whitening interface -------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.structure.dim

    @property
    def condition_number(self) -> float:
        """Of the groups' blocks and the globals' Schur complement (the factors' spectrum; the
        whole curvature's lies within a few times of it)."""
        low, high = self.spectrum
        return high / low

    def operator(self) -> ArrowheadCholesky:
        s = self.structure
        return ArrowheadCholesky(s.global_idx, s.local_idx, self.chol_u, self.cross, self.chol_g)

    def _inverse_parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``C⁻¹``'s parts: ``C_u⁻¹`` ``(J, k, k)``, ``Z_j = −C_g⁻¹ C_gu,j C_u,j⁻¹``
        ``(J, G, k)`` and ``C_g⁻¹`` ``(G, G)``."""
        k = self.structure.k
        inv_u = np.linalg.solve(self.chol_u, np.broadcast_to(np.eye(k), self.chol_u.shape))
        inv_g = np.linalg.solve(self.chol_g, np.eye(self.chol_g.shape[0]))
        z = -np.einsum("ab,jbk,jkl->jal", inv_g, self.cross, inv_u)
        return inv_u, z, inv_g

    def to_whitened(self, matrix: np.ndarray | StructuredCurvature) -> np.ndarray:
        """The diagonal of ``Lᵀ M L = C⁻¹ M C⁻ᵀ`` for an arrowhead ``M`` (a gradient-noise
        covariance measured with the structure) or a diagonal one (``(D,)``)."""
        s = self.structure
        inv_u, z, inv_g = self._inverse_parts()
        if isinstance(matrix, StructuredCurvature):
            out = np.zeros(s.dim)
            out[s.local_idx] = np.einsum("jab,jbc,jac->ja", inv_u, matrix.uu, inv_u)
            out[s.global_idx] = (
                np.einsum("jak,jkl,jal->a", z, matrix.uu, z)
                + 2.0 * np.einsum("jak,jkg,ag->a", z, matrix.ug, inv_g)
                + np.einsum("ag,gh,ah->a", inv_g, matrix.gg, inv_g)
            )
            return out
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 1:
            raise ValueError("a structured whitening takes diagonal covariances only")
        mu, mg = m[s.local_idx], m[s.global_idx]
        out = np.zeros(s.dim)
        out[s.local_idx] = np.einsum("jab,jb->ja", inv_u**2, mu)
        out[s.global_idx] = np.einsum("jak,jk->a", z**2, mu) + (inv_g**2) @ mg
        return out

    def covariance_diagonal(self) -> np.ndarray:
        """``(D,)``: the diagonal of ``A⁻¹ = C⁻ᵀ C⁻¹`` (column norms of ``C⁻¹``)."""
        s = self.structure
        inv_u, z, inv_g = self._inverse_parts()
        out = np.zeros(s.dim)
        out[s.local_idx] = np.sum(inv_u**2, axis=1) + np.sum(z**2, axis=1)
        out[s.global_idx] = np.sum(inv_g**2, axis=0)
        return out

    def metric_from_whitened(self, whitened_cov: np.ndarray) -> ArrowheadMetric:
        """``L diag(q) Lᵀ`` of a diagonal ``z`` covariance ``q``."""
        q = np.asarray(whitened_cov, dtype=np.float64)
        if q.ndim != 1:
            raise ValueError("a structured whitening takes diagonal rates only")
        return ArrowheadMetric(self.operator(), q)

    def position_noise_factor(self, whitened_cov: np.ndarray) -> ArrowheadFactor:
        """``L diag(√q)``: the θ-space factor of noise whose ``z`` covariance is ``diag(q)``."""
        q = np.asarray(whitened_cov, dtype=np.float64)
        if q.ndim != 1:
            raise ValueError("a structured whitening takes diagonal rates only")
        return ArrowheadFactor(self.operator(), np.sqrt(np.maximum(q, 0.0)))

    def covariance(self) -> ArrowheadMetric:
        """``A⁻¹`` as an operator."""
        return ArrowheadMetric(self.operator(), np.ones(self.dim))

    def factor(self) -> ArrowheadFactor:
        """``L`` as an operator."""
        return ArrowheadFactor(self.operator(), np.ones(self.dim))

    def precision(self) -> ArrowheadPrecision:
        """``A`` as an operator."""
        return ArrowheadPrecision(self.operator(), np.ones(self.dim))


def find_groups(
    directional: Callable[[np.ndarray], np.ndarray],
    variables: Sequence[tuple[str, tuple[int, ...], int]],
) -> GroupStructure | str:
    """The grouping of the rows' log-likelihood, or why none was found.

    Parameters
    ----------
    directional
        ``tangent (D,) -> (N,)``: every row's directional derivative of its log-likelihood
        along ``tangent`` (at a generic point).
    variables
        ``(name, shape, offset)`` of each sampled variable in the raveled position.
    """
    dim = sum(int(np.prod(shape, dtype=int)) for _, shape, _ in variables)
    global_idx: list[int] = []
    factor_rows: np.ndarray | None = None
    factor_groups = 0
    blocks: list[np.ndarray] = []  # (J, slots) coordinate arrays, one per variable
    names = []
    for name, shape, offset in variables:
        size = int(np.prod(shape, dtype=int))
        coords = offset + np.arange(size).reshape(shape if shape else (1,))
        if not shape or max(shape) < GROUP_LEVEL_MIN:
            global_idx.extend(coords.ravel().tolist())
            continue
        axis = int(np.argmax(shape))
        groups = shape[axis]
        by_group = np.moveaxis(coords, axis, 0).reshape(groups, -1)  # (J, slots)
        if by_group.shape[1] > SLOTS_MAX:
            return f"{name} has {by_group.shape[1]} coordinates per group (at most {SLOTS_MAX})"
        rows_group = None
        for s in range(by_group.shape[1]):
            idx = by_group[:, s]
            codes = np.arange(1, groups + 1, dtype=np.float64)
            tangent = np.zeros(dim)
            tangent[idx] = 1.0
            a = np.asarray(directional(tangent), dtype=np.float64)
            tangent[idx] = codes
            b = np.asarray(directional(tangent), dtype=np.float64)
            tangent[idx] = codes**2
            c = np.asarray(directional(tangent), dtype=np.float64)
            scale = max(float(np.max(np.abs(a), initial=0.0)), 1e-300)
            touched = np.abs(a) > 1e-9 * scale
            ratio = np.where(touched, b / np.where(touched, a, 1.0), 0.0)
            code = np.rint(ratio)
            one_group = (
                touched
                & (np.abs(ratio - code) <= RATIO_TOLERANCE * np.maximum(code, 1.0))
                & (np.abs(c / np.where(touched, a, 1.0) - code**2) <= RATIO_TOLERANCE * code**2 * 4)
                & (code >= 1)
                & (code <= groups)
            )
            if np.any(touched & ~one_group):
                return f"rows of the data touch several coordinates of {name} at once"
            slot_rows = np.where(touched, code.astype(np.int64) - 1, -1)
            if rows_group is None:
                rows_group = slot_rows
            else:
                both = (rows_group >= 0) & (slot_rows >= 0)
                if np.any(rows_group[both] != slot_rows[both]):
                    return f"the slots of {name} group the rows differently"
                rows_group = np.where(rows_group >= 0, rows_group, slot_rows)
        assert rows_group is not None
        if not np.any(rows_group >= 0):
            return f"{name} does not enter the rows' likelihood"
        if factor_rows is None:
            factor_rows, factor_groups = rows_group, groups
        else:
            both = (factor_rows >= 0) & (rows_group >= 0)
            if groups != factor_groups or np.any(factor_rows[both] != rows_group[both]):
                return f"{name} and {names[0]} group the rows differently (crossed factors)"
            factor_rows = np.where(factor_rows >= 0, factor_rows, rows_group)
        blocks.append(by_group)
        names.append(f"{name}: {groups} groups of {by_group.shape[1]}")
    if not blocks:
        return "no variable has group-level coordinates"
    local_idx = np.concatenate(blocks, axis=1).astype(np.int64)
    return GroupStructure(np.asarray(global_idx, dtype=np.int64), local_idx, "; ".join(names))


def verify(
    structure: GroupStructure,
    curvature: StructuredCurvature,
    hvp: Callable[[np.ndarray], np.ndarray],
    rng: np.random.Generator,
    tries: int = 2,
) -> float:
    """The largest relative error ``‖Hv − A v‖ / ‖Hv‖`` of the arrowhead ``A`` over ``tries``
    Gaussian ``v`` (``H v`` by ``hvp``, on the rows the arrowhead was measured on)."""
    worst = 0.0
    for _ in range(tries):
        v = rng.standard_normal(structure.dim)
        hv = np.asarray(hvp(v), dtype=np.float64)
        err = np.linalg.norm(hv - curvature.matvec(v))
        worst = max(worst, float(err / max(np.linalg.norm(hv), 1e-300)))
    return worst
