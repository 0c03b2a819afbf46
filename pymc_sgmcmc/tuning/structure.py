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
by a third, with weights ``(j + 1)²``): ``O(N)`` work and memory, no per-row gradients.
Couplings the rows cannot show — a prior tying one group's effect to another's — are caught
by :func:`verify`: two random Hessian-vector products against the arrowhead's.

Crossed factors (students and lecturers: each row touches one group of each). Variables
that group the rows differently are separate factors, and their groups are all blocks of
one arrowhead — exact within each factor and between each factor and the globals, the
couplings *between* factors left out (block Jacobi between the factors; every factor must
have the same ``k``). Eliminating them exactly would fill the Schur complement onto a
factor (dense, ``J_f²``). What is left out is the ridge along which one factor's effects
rise as another's fall, which the likelihood does not see and only the priors bound; the
chain moves along it at the pace of the priors' curvature, which IASG's relaxation check and
the self-check on the globals' marginal measure (docs/hierarchical.md has the measurement).

Levels above the groups (counties within states). A state effect that enters the rows beside
the county effect (``v[state[county]] + z[county]``: nested factors, each county's rows in
one state) or only the counties' prior (``c ~ Normal(s[state], τ)``) couples each county
with its state alone. The states' effects join the globals, and each county's block again
meets the globals only: the arrowhead is exact, with ``G`` grown by the number of states
(at most :data:`PROMOTED_GLOBALS_MAX` globals in all; above that the reason is returned).
:func:`verify` still checks it against the model's Hessian-vector products.

Measuring it (:func:`probes`). ``G + F·k`` Hessian-vector products give all of it: one per
global (its column: ``A_gg`` and the cross terms) and, for each factor, one per local slot
``s`` with ones on the factor's groups' coordinate in that slot (groups of one factor share
no row, so each group's entries of the product are its block's column ``s``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pymc_sgmcmc.kernels.preconditioning import (
    ArrowheadCholesky,
    ArrowheadFactor,
    ArrowheadInjection,
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
PROMOTED_GLOBALS_MAX = 256
"""At most this many globals once an outer factor's effects (states above counties) or a
level that only a prior ties to the rows have joined them: the globals' block is dense and
measured by one Hessian-vector product each."""
LANCZOS_STEPS = 40
"""Lanczos iterations for the gradient noise's largest ratio to the injection's budgets."""
RATIO_TOLERANCE = 1e-6
VERIFY_TOLERANCE = 1e-6
LOW_RANK_FLOOR = 1e-6
"""The whitened curvature along the couplings between crossed factors is kept at least this
(relative to the arrowhead's): their skeleton may overshoot where a coupling is far from
rank one."""
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
    factor: np.ndarray | None = None
    """``(J,)``: the grouping factor of each group where there are several (crossed factors:
    students and lecturers), else None (one factor)."""

    @property
    def n_factors(self) -> int:
        return 1 if self.factor is None else int(self.factor.max()) + 1

    @property
    def dim(self) -> int:
        return int(self.global_idx.size + self.local_idx.size)

    @property
    def n_groups(self) -> int:
        return int(self.local_idx.shape[0])

    @property
    def k(self) -> int:
        return int(self.local_idx.shape[1])

    def _factors(self) -> np.ndarray:
        return np.zeros(self.n_groups, dtype=np.int64) if self.factor is None else self.factor

    def pairs(self) -> list[tuple[int, int, int, int]]:
        """``(f, s, f', s')`` for every slot ``s`` of factor ``f`` and slot ``s'`` of a later
        factor ``f'``: the couplings between crossed factors, one rank-two term each."""
        k, n = self.k, self.n_factors
        return [
            (f, s, h, t)
            for f in range(n)
            for h in range(f + 1, n)
            for s in range(k)
            for t in range(k)
        ]

    def probes(self, dtype=np.float64) -> np.ndarray:
        """``(G + F·k, D)``: the unit vectors of the globals, then for each factor and local
        slot one vector with ones on the slot's coordinate of every group of that factor
        (groups of one factor share no row, so each group's entries of the product are its
        block's column)."""
        g, k = self.global_idx.size, self.k
        out = np.zeros((g + self.n_factors * k, self.dim), dtype=dtype)
        out[np.arange(g), self.global_idx] = 1.0
        factors = self._factors()
        for f in range(self.n_factors):
            for s in range(k):
                out[g + f * k + s, self.local_idx[factors == f, s]] = 1.0
        return out

    def id_probes(self, dtype=np.float64) -> np.ndarray:
        """``(F·k, D)``: for each factor and slot, weight ``j + 1`` on that slot of the
        factor's group ``j`` (``j`` counts the groups of every factor, in :attr:`local_idx`'s
        order) — :meth:`probes`' slot rows with the groups numbered. A row's derivative along
        it, over its derivative along the slot's probe, is ``j + 1`` for the group it touches
        (:func:`~pymc_sgmcmc.tuning.averaging.arrowhead_moments_along` reads the slot with
        the largest derivative: one product each, so the ratio's rounding is ``J`` units in
        the last place, whatever the covariates — a weighted sum of the slots, one probe per
        factor, vanished with an intercept and a slope at one value of the covariate)."""
        g = self.global_idx.size
        number = np.zeros(self.dim)
        number[self.local_idx] = np.arange(1.0, self.n_groups + 1.0)[:, None]
        return (self.probes(dtype=np.float64)[g:] * number[None, :]).astype(dtype)

    def curvature_from_products(self, products: np.ndarray) -> StructuredCurvature:
        """The arrowhead from the Hessian-vector products of :meth:`probes`."""
        products = np.asarray(products, dtype=np.float64)
        g, k = self.global_idx.size, self.k
        cols = products[:g]  # H e_g: rows are the probes
        gg = cols[:, self.global_idx].T
        ug = np.transpose(cols[:, self.local_idx], (1, 2, 0))  # (J, k, G)
        slots = products[g:].reshape(self.n_factors, k, self.dim)  # (F, k, D)
        # group j's block from its own factor's probes: (J, k_row (coordinate), k_col (probe))
        uu = slots[self._factors()[:, None], :, self.local_idx]
        # between crossed factors: the coupling block B (f's slot s × f''s slot s') acting on
        # the ones — B 1 (on f's coordinates) from f''s probe, Bᵀ 1 from f's — and 1ᵀ B 1
        factors, pairs = self._factors(), self.pairs()
        pair_a = np.zeros((len(pairs), self.dim))
        pair_b = np.zeros((len(pairs), self.dim))
        for p, (f, s, h, t) in enumerate(pairs):
            rows_f, rows_h = self.local_idx[factors == f, s], self.local_idx[factors == h, t]
            pair_a[p, rows_f] = slots[h, t, rows_f]
            pair_b[p, rows_h] = slots[f, s, rows_h]
        pair_sum = 0.5 * (pair_a.sum(axis=1) + pair_b.sum(axis=1))
        return StructuredCurvature(
            self,
            0.5 * (gg + gg.T),
            ug,
            0.5 * (uu + np.swapaxes(uu, 1, 2)),
            pair_a,
            pair_b,
            pair_sum,
        )


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
    pair_a: np.ndarray | None = None
    """``(P, D)`` (None: zeros) with crossed factors (:meth:`GroupStructure.pairs`): the coupling block
    ``B`` between two factors' slots times the ones, ``B 1``, on the first's coordinates."""
    pair_b: np.ndarray | None = None
    """``(P, D)``: ``Bᵀ 1`` on the second factor's coordinates."""
    pair_sum: np.ndarray | None = None
    """``(P,)``: ``1ᵀ B 1``. The coupling is kept as its skeleton ``B ≈ (B1)(1ᵀB)/(1ᵀB1)``
    — exact on the ridge along which one factor's effects rise as the other's fall."""

    def __post_init__(self) -> None:
        # couplings not given (none measured): zeros, one row per pair of the structure, so
        # that every instance of a structure has the same parts
        if self.pair_a is None:
            n = len(self.structure.pairs())
            object.__setattr__(self, "pair_a", np.zeros((n, self.structure.dim)))
            object.__setattr__(self, "pair_b", np.zeros((n, self.structure.dim)))
            object.__setattr__(self, "pair_sum", np.zeros(n))

    def _parts(self) -> tuple:
        return self.gg, self.ug, self.uu, self.pair_a, self.pair_b, self.pair_sum

    def _map(self, other, op):
        if isinstance(other, StructuredCurvature):
            parts = [op(x, y) for x, y in zip(self._parts(), other._parts(), strict=True)]
        else:
            parts = [op(a, other) for a in self._parts()]
        return StructuredCurvature(self.structure, *parts)

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
        return StructuredCurvature(self.structure, *(a.copy() for a in self._parts()))

    def low_rank(self, tiny: float = 1e-12) -> tuple[np.ndarray, np.ndarray]:
        """``U`` ``(D, 2P)`` and ``S`` ``(2P, 2P)`` with ``U S Uᵀ`` the couplings between
        crossed factors (their skeletons; a pair whose ``1ᵀB1`` vanishes contributes
        nothing)."""
        if not len(self.pair_a):
            return np.zeros((self.structure.dim, 0)), np.zeros((0, 0))
        n = len(self.pair_a)
        u = np.empty((self.structure.dim, 2 * n))
        u[:, 0::2], u[:, 1::2] = self.pair_a.T, self.pair_b.T
        total = np.abs(self.pair_a).sum(axis=1)
        inverse = np.where(
            np.abs(self.pair_sum) > tiny * np.maximum(total, 1e-300),
            1.0 / np.where(self.pair_sum == 0, 1.0, self.pair_sum),
            0.0,
        )
        s = np.zeros((2 * n, 2 * n))
        s[np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)] = inverse
        s[np.arange(1, 2 * n, 2), np.arange(0, 2 * n, 2)] = inverse
        return u, s

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
        u, s = self.low_rank()
        return out + u @ (s @ (u.T @ v))


def _clip(matrix: np.ndarray, floor: float, mirror: bool = True) -> np.ndarray:
    """Symmetric eigenvalues in absolute value and floored (the saddle-free choice of
    :class:`~pymc_sgmcmc.tuning.whitening.Whitening`), batched over leading axes; with
    ``mirror=False`` only floored (a covariance: a negative eigenvalue is where nothing can be
    added)."""
    w, v = np.linalg.eigh(0.5 * (matrix + np.swapaxes(matrix, -1, -2)))
    w = np.maximum(np.abs(w) if mirror else w, floor)
    return (v * w[..., None, :]) @ np.swapaxes(v, -1, -2)


def _largest_eigenvalue(product: Callable, dim: int, steps: int = LANCZOS_STEPS) -> float:
    """The largest eigenvalue of the symmetric positive semi-definite operator ``product`` by
    ``steps`` Lanczos iterations with full reorthogonalisation (the extreme Ritz value
    converges first: to a few digits in 30-40 steps), from a fixed random start (the same run
    gives the same tuning). Measured against ARPACK's ``eigsh`` on D = 40 003: the same value,
    without its failure on a zero start or a zero operator."""
    q = np.random.default_rng(0).standard_normal(dim)
    q /= np.linalg.norm(q)
    basis = np.empty((min(steps, dim), dim))
    alpha, beta = [], []
    last = np.inf
    for i in range(basis.shape[0]):
        basis[i] = q
        w = product(q)
        alpha.append(float(q @ w))
        w = w - basis[: i + 1].T @ (basis[: i + 1] @ w)
        w = w - basis[: i + 1].T @ (basis[: i + 1] @ w)  # twice is enough (Kahan)
        b = float(np.linalg.norm(w))
        if b <= 1e-12 * max(abs(alpha[-1]), 1e-300):
            break
        beta.append(b)
        q = w / b
        if i % 5 == 4:  # stop once the top Ritz value holds still
            top = _top_ritz_value(alpha, beta)
            if abs(top - last) <= 1e-6 * abs(top):
                return top
            last = top
    return _top_ritz_value(alpha, beta)


def _top_ritz_value(alpha: list, beta: list) -> float:
    m = len(alpha)
    tridiagonal = np.diag(alpha) + np.diag(beta[: m - 1], 1) + np.diag(beta[: m - 1], -1)
    return float(np.linalg.eigvalsh(tridiagonal)[-1])


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
    low_v: np.ndarray
    """``(D, r)``: ``V = C⁻¹ U``, the couplings between crossed factors (``r = 0``: none)."""
    low_x: np.ndarray
    """``(r, r)``: ``P = I + V X Vᵀ``, ``C P² Cᵀ = C Cᵀ + U S Uᵀ``."""
    low_x_inverse: np.ndarray
    """``(r, r)``: ``P⁻¹ = I + V X' Vᵀ``."""

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
        dim, lidx = structure.dim, structure.local_idx
        # With crossed factors the locals' block also holds their couplings, U S Uᵀ (zero on
        # the globals): A_uu + U S Uᵀ = C_u P² C_uᵀ with P = I + V X Vᵀ, V = C_u⁻¹ U, from the
        # r × r problem in Q = VᵀV — with Y = Q^½ X Q^½, (I + Y)² = I + Q^½ S Q^½ =: I + T.
        # (The whole matrix is positive where the couplings are in; the arrowhead without
        # them is not: both factors' groups would each explain the globals.)
        u, s = curvature.low_rank()
        r = u.shape[1]
        v, x, x_inverse, tw = np.zeros((dim, r)), np.zeros((r, r)), np.zeros((r, r)), np.ones(1)
        if r:
            v[lidx] = np.linalg.solve(chol_u, u[lidx])
            q = v.T @ v
            qw, qe = np.linalg.eigh(q)
            keep = qw > 1e-12 * max(float(qw.max()), 1e-300)
            root = (qe * np.sqrt(np.where(keep, qw, 0.0))) @ qe.T
            inverse_root = (qe * np.where(keep, 1 / np.sqrt(np.where(keep, qw, 1.0)), 0.0)) @ qe.T
            tw, te = np.linalg.eigh(np.eye(r) + root @ s @ root)
            # kept positive where the skeletons overshoot (a coupling far from rank one)
            tw = np.maximum(tw, LOW_RANK_FLOOR)
            y = (te * (np.sqrt(tw) - 1.0)) @ te.T
            x = inverse_root @ y @ inverse_root
            x = 0.5 * (x + x.T)
            x_inverse = -np.linalg.solve(np.eye(r) + x @ q, x)
            x_inverse = 0.5 * (x_inverse + x_inverse.T)

        def p_inverse(columns):
            return columns + v @ (x_inverse @ (v.T @ columns)) if r else columns

        # The factor [[C_u P, 0], [C_gu, C_g]] = [[C_u, 0], [C_gu P⁻¹, C_g]] · [[P, 0], [0, I]]:
        # with X = C_u⁻¹ A_ug, C_gu = (P⁻¹X)ᵀ, the Schur complement A_gg − Xᵀ P⁻² X, and the
        # arrowhead's cross blocks C_gu P⁻¹ = (P⁻² X)ᵀ (one factor: P = I, X itself).
        x_base = np.zeros((dim, curvature.gg.shape[0]))
        x_base[lidx] = np.linalg.solve(chol_u, curvature.ug)  # (J, k, G) into the rows
        p2x = p_inverse(p_inverse(x_base))
        cross = np.swapaxes(p2x[lidx], 1, 2)  # (J, G, k)
        schur = _clip(curvature.gg - x_base.T @ p2x, floor * top)
        chol_g = np.linalg.cholesky(schur)
        w = np.concatenate([np.linalg.eigvalsh(uu).ravel(), np.linalg.eigvalsh(schur).ravel()])
        spectrum = (
            float(w.min()) * min(1.0, float(tw.min())),
            float(w.max()) * max(1.0, float(tw.max())),
        )
        return cls(structure, chol_u, cross, chol_g, spectrum, v, x, x_inverse)

    def _solve(self, columns: np.ndarray) -> np.ndarray:
        """``C⁻¹`` applied to the columns of ``(D, m)`` (the arrowhead factor without ``P``,
        on the host)."""
        s = self.structure
        u = columns[s.local_idx]  # (J, k, m)
        y_u = np.linalg.solve(self.chol_u, u)
        rhs = columns[s.global_idx] - np.einsum("jgk,jkm->gm", self.cross, y_u)
        out = np.zeros_like(columns, dtype=np.float64)
        out[s.local_idx] = y_u
        out[s.global_idx] = np.linalg.solve(self.chol_g, rhs)
        return out

    def _solve_transpose(self, columns: np.ndarray) -> np.ndarray:
        """``C⁻ᵀ`` applied to the columns of ``(D, m)``."""
        s = self.structure
        x_g = np.linalg.solve(self.chol_g.T, columns[s.global_idx])
        rhs = columns[s.local_idx] - np.einsum("jgk,gm->jkm", self.cross, x_g)
        out = np.zeros_like(columns, dtype=np.float64)
        out[s.local_idx] = np.linalg.solve(np.swapaxes(self.chol_u, 1, 2), rhs)
        out[s.global_idx] = x_g
        return out

    @property
    def injects_exactly(self) -> bool:
        """Whether :meth:`injection_factor` applies (nested groups; not crossed factors): the
        rules may then give the minibatch's noise its whole budget, as with a dense
        whitening."""
        return not self.low_v.shape[1]

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
        return ArrowheadCholesky(
            s.global_idx,
            s.local_idx,
            self.chol_u,
            self.cross,
            self.chol_g,
            self.low_v,
            self.low_x,
            self.low_x_inverse,
        )

    def _inverse_parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``C⁻¹``'s parts: ``C_u⁻¹`` ``(J, k, k)``, ``Z_j = −C_g⁻¹ C_gu,j C_u,j⁻¹``
        ``(J, G, k)`` and ``C_g⁻¹`` ``(G, G)``."""
        k = self.structure.k
        inv_u = np.linalg.solve(self.chol_u, np.broadcast_to(np.eye(k), self.chol_u.shape))
        inv_g = np.linalg.solve(self.chol_g, np.eye(self.chol_g.shape[0]))
        z = -np.einsum("ab,jbk,jkl->jal", inv_g, self.cross, inv_u)
        return inv_u, z, inv_g

    def to_whitened(self, matrix: np.ndarray | StructuredCurvature) -> np.ndarray:
        """The diagonal of ``Lᵀ M L = (CP)⁻¹ M (CP)⁻ᵀ`` for an arrowhead ``M`` (a
        gradient-noise covariance measured with the structure) or a diagonal one (``(D,)``)."""
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
            u, coupling = matrix.low_rank()
            if u.shape[1]:  # its couplings between crossed factors: diag(C⁻¹ U S Uᵀ C⁻ᵀ)
                w = self._solve(u)
                out = out + np.sum((w @ coupling) * w, axis=1)
            return self._with_low_rank(out, lambda w: np.stack([matrix.matvec(c) for c in w.T], 1))
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 1:
            raise ValueError("a structured whitening takes diagonal covariances only")
        mu, mg = m[s.local_idx], m[s.global_idx]
        out = np.zeros(s.dim)
        out[s.local_idx] = np.einsum("jab,jb->ja", inv_u**2, mu)
        out[s.global_idx] = np.einsum("jak,jk->a", z**2, mu) + (inv_g**2) @ mg
        return self._with_low_rank(out, lambda w: m[:, None] * w)

    def _with_low_rank(self, diagonal: np.ndarray, times_m) -> np.ndarray:
        """``diag(P⁻¹ N P⁻¹)`` from ``diag(N)``, ``N = C⁻¹ M C⁻ᵀ`` (``times_m`` applies ``M``
        to columns): ``P⁻¹ = I + V X' Vᵀ`` adds ``2 diag(V X' (NV)ᵀ) + diag(V X' VᵀNV X' Vᵀ)``."""
        v, xi = self.low_v, self.low_x_inverse
        if not v.shape[1]:
            return diagonal
        nv = self._solve(times_m(self._solve_transpose(v)))  # (D, r)
        vx = v @ xi
        return diagonal + 2.0 * np.sum(vx * nv, axis=1) + np.sum((vx @ (v.T @ nv)) * vx, axis=1)

    def covariance_diagonal(self) -> np.ndarray:
        """``(D,)``: the diagonal of ``A⁻¹ = C⁻ᵀ P⁻² C⁻¹`` (column norms of ``(CP)⁻¹``)."""
        s = self.structure
        inv_u, z, inv_g = self._inverse_parts()
        out = np.zeros(s.dim)
        out[s.local_idx] = np.sum(inv_u**2, axis=1) + np.sum(z**2, axis=1)
        out[s.global_idx] = np.sum(inv_g**2, axis=0)
        v, xi = self.low_v, self.low_x_inverse
        if v.shape[1]:
            # P⁻² = I + V (2X' + X'QX') Vᵀ
            w = self._solve_transpose(v)
            y = 2.0 * xi + xi @ (v.T @ v) @ xi
            out = out + np.sum((w @ y) * w, axis=1)
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

    def injection_factor(
        self, steps: np.ndarray, budgets: np.ndarray, noise: StructuredCurvature
    ) -> tuple[ArrowheadInjection, float] | None:
        """The injected noise that makes the stationary covariance ``A⁻¹`` exactly (on a
        Gaussian), for the steps ``P_z = diag(steps)`` along the whitened coordinates:
        ``Q = diag(budgets) − P_z S P_z`` with the whitened gradient noise ``S = Lᵀ N L``
        whole. The rules see only ``diag(S)`` (:meth:`to_whitened`), and injecting
        ``diag(Q)`` leaves ``S``'s off-diagonal terms in the chain: a global coupled to every
        group (counties' means through their state's and a national one) sees the groups'
        noise through the whitening's cross terms, correlated between its coordinates, and
        the national mean's sd came out 0.88x (0.90x predicted by the Lyapunov equation of
        the chain, tests/test_large_dim.py's counties in states at B = 256).

        In θ units ``L Q Lᵀ = P K P`` with ``P = L P_z Lᵀ`` (the preconditioner) and
        ``K = C D Cᵀ − N``, ``D = diag(budgets / steps²)``: both terms are block
        arrowheads, so ``K``'s Cholesky factor is one too (one more factorisation per
        tuning). The rules keep each coordinate's gradient noise within its budget, but
        along a combination of coordinates it may exceed it (``K`` then has a negative
        eigenvalue): ``ρ = λmax(D^-½ C⁻¹ N C⁻ᵀ D^-½)`` (Lanczos on the operators) measures
        by how much, and above 1 the noise subtracted is ``N/ρ`` — every direction then gets
        at least its budget, too much by at most the factor ``ρ`` of its gradient noise's
        share (flooring ``K``'s eigenvalues instead would blow up the factor's cross terms).
        Returns ``(factor, ρ)``, or None with crossed factors (their couplings are low rank:
        the diagonal injection stays) or no gradient noise (it is then exact)."""
        s = self.structure
        if self.low_v.shape[1] or noise.low_rank()[0].shape[1]:
            return None
        if not any(np.any(part) for part in noise._parts()):
            return None  # no gradient noise (a full batch): the diagonal injection is exact
        h = np.asarray(steps, dtype=np.float64)
        d = np.asarray(budgets, dtype=np.float64) / np.maximum(h * h, 1e-300)
        du, dg = d[s.local_idx], d[s.global_idx]
        cu, cx, cg = self.chol_u, self.cross, self.chol_g
        excess = self._noise_over_budget(d, noise)
        shown = 1.0 / max(excess, 1.0)
        k_uu = np.einsum("jab,jb,jcb->jac", cu, du, cu) - shown * noise.uu
        k_ug = np.einsum("jab,jb,jgb->jag", cu, du, cx) - shown * noise.ug
        k_gg = np.einsum("jab,jb,jcb->ac", cx, du, cx) + (cg * dg) @ cg.T - shown * noise.gg
        top = max(
            float(np.max(np.abs(np.linalg.eigvalsh(k_uu)), initial=0.0)),
            float(np.max(np.abs(np.diag(k_gg)), initial=0.0)),
            1e-300,
        )
        # positive by construction; the floor catches rounding where the noise fills a budget
        chol_u = np.linalg.cholesky(_clip(k_uu, 1e-12 * top, mirror=False))
        x = np.linalg.solve(chol_u, k_ug)  # (J, k, G)
        schur = _clip(k_gg - np.einsum("jkg,jkh->gh", x, x), 1e-12 * top, mirror=False)
        root = ArrowheadCholesky(
            s.global_idx,
            s.local_idx,
            chol_u,
            np.swapaxes(x, 1, 2),
            np.linalg.cholesky(schur),
            np.zeros((s.dim, 0)),
            np.zeros((0, 0)),
            np.zeros((0, 0)),
        )
        metric = ArrowheadMetric(self.operator(), h)
        return ArrowheadInjection(metric, root, np.ones(s.dim)), excess

    def _noise_over_budget(self, d: np.ndarray, noise: StructuredCurvature) -> float:
        """``λmax(D^-½ C⁻¹ N C⁻ᵀ D^-½)``: the largest ratio of the gradient noise to the
        budget (``D = diag(budgets / steps²)``) over every direction of the whitened
        coordinates, by Lanczos (:func:`_largest_eigenvalue`; products ``O(Jk² + JkG + G²)``)."""
        root = 1.0 / np.sqrt(d)

        def product(v):
            w = self._solve_transpose((root * v)[:, None])[:, 0]
            return root * self._solve(noise.matvec(w)[:, None])[:, 0]

        return _largest_eigenvalue(product, self.dim)

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
    # one entry per grouping factor: its rows' groups, its number of groups, the (J, slots)
    # coordinate arrays of its variables, their names
    factors: list[dict] = []
    # group-level coordinates that join the globals: (label, coordinates)
    promoted: list[tuple[str, np.ndarray]] = []
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
        rows_group = _rows_group(directional, dim, name, by_group)
        label = f"{name}: {groups} groups of {by_group.shape[1]}"
        if rows_group is None:  # a level above the groups, tied to them by a prior only
            promoted.append((f"{name} (in a prior only)", coords.ravel()))
            continue
        if isinstance(rows_group, str):
            return rows_group
        for factor in factors:
            both = (factor["rows"] >= 0) & (rows_group >= 0)
            if factor["groups"] == groups and np.all(factor["rows"][both] == rows_group[both]):
                factor["rows"] = np.where(factor["rows"] >= 0, factor["rows"], rows_group)
                factor["blocks"].append(by_group)
                factor["names"].append(label)
                break
        else:  # a grouping of its own: crossed with (or nested in) the others
            factors.append(
                {"rows": rows_group, "groups": groups, "blocks": [by_group], "names": [label]}
            )
    # Nested factors (counties in states, both on the rows): the outer factor's effects join
    # the globals, so each inner group meets the globals only — an arrowhead again.
    while len(factors) > 1:
        pair = next(
            ((i, o) for i in factors for o in factors if i is not o and _nested(i, o)), None
        )
        if pair is None:
            break
        outer = pair[1]
        label = "; ".join(outer["names"])
        promoted.append((f"{label} (outer, nested)", np.concatenate(outer["blocks"], axis=1)))
        factors.remove(outer)
    if not factors:
        return "no variable has group-level coordinates"
    if promoted:
        for _, coords in promoted:
            global_idx.extend(coords.ravel().tolist())
        if len(global_idx) > PROMOTED_GLOBALS_MAX:
            names = ", ".join(label for label, _ in promoted)
            return (
                f"{names} would make {len(global_idx)} globals (at most "
                f"{PROMOTED_GLOBALS_MAX}, a dense block): a level above the groups too large "
                "to be among the globals, and a tree of blocks is not built yet"
            )
    blocks = [np.concatenate(f["blocks"], axis=1).astype(np.int64) for f in factors]
    description = " × ".join("; ".join(f["names"]) for f in factors)
    if promoted:
        description += ", with " + ", ".join(label for label, _ in promoted) + " among the globals"
    global_array = np.asarray(sorted(global_idx), dtype=np.int64)
    if len(factors) == 1:
        return GroupStructure(global_array, blocks[0], description)
    if len({b.shape[1] for b in blocks}) > 1:
        return f"crossed factors ({description}) with different numbers of coordinates per group"
    return GroupStructure(
        global_array,
        np.concatenate(blocks, axis=0),
        description + " (crossed: the couplings between the factors are left out)",
        np.repeat(np.arange(len(blocks)), [b.shape[0] for b in blocks]),
    )


def _nested(inner: dict, outer: dict) -> bool:
    """Whether ``inner``'s groups lie each within one group of ``outer`` (counties in states:
    every row of a county in the same state)."""
    both = (inner["rows"] >= 0) & (outer["rows"] >= 0)
    pairs = np.unique(inner["rows"][both] * outer["groups"] + outer["rows"][both])
    per_group = np.bincount(pairs // outer["groups"], minlength=inner["groups"])
    return bool(per_group.size and per_group.max() <= 1 and inner["groups"] > outer["groups"])


def _rows_group(
    directional: Callable[[np.ndarray], np.ndarray], dim: int, name: str, by_group: np.ndarray
) -> np.ndarray | str | None:
    """``(N,)``: the group of ``by_group``'s variable each row touches (−1: none), why the
    rows do not each touch one group, or None where no row touches the variable (a level
    that only a prior ties to the rows)."""
    groups = by_group.shape[0]
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
        return None
    return rows_group


def verify(
    structure: GroupStructure,
    curvature: StructuredCurvature,
    hvp: Callable[[np.ndarray], np.ndarray],
    rng: np.random.Generator,
    tries: int = 2,
) -> float:
    """The largest relative error ``‖Hv − A v‖ / ‖Hv‖`` of the arrowhead ``A`` over ``tries``
    Gaussian ``v`` (``H v`` by ``hvp``, on the rows the arrowhead was measured on).

    With crossed factors ``A`` leaves out the couplings between them by design: each ``v`` is
    then supported on the globals and one factor's groups, and compared there (``tries`` per
    factor) — a prior coupling the groups of one factor still fails it."""
    worst = 0.0
    factors = structure._factors()
    for f in range(structure.n_factors):
        if structure.factor is None:
            keep = np.ones(structure.dim, dtype=bool)
        else:
            keep = np.zeros(structure.dim, dtype=bool)
            keep[structure.global_idx] = True
            keep[structure.local_idx[factors == f].ravel()] = True
        for _ in range(tries):
            v = np.where(keep, rng.standard_normal(structure.dim), 0.0)
            hv = np.asarray(hvp(v), dtype=np.float64)[keep]
            err = np.linalg.norm(hv - curvature.matvec(v)[keep])
            worst = max(worst, float(err / max(np.linalg.norm(hv), 1e-300)))
    return worst
