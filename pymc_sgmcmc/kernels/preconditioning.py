r"""Preconditioners shared by every kernel: identity, diagonal, dense matrix, or a
block-arrowhead operator.

The block-arrowhead operators are those of a curvature with the structure of a nested
hierarchical posterior (:mod:`pymc_sgmcmc.tuning.structure`): ``J`` groups of ``k`` local
coordinates, each group coupled to itself and to ``G`` global coordinates only. Ordered locals
first, its Cholesky factor is

.. math::

    A = C C^\top,\qquad C = \begin{pmatrix} C_u & 0 \\ C_{gu} & C_g \end{pmatrix}

with :math:`C_u` block diagonal (``J`` lower-triangular ``k × k`` blocks), :math:`C_{gu}`
``G × Jk`` and :math:`C_g` ``G × G`` lower triangular (the Cholesky factor of the Schur
complement onto the globals): no fill-in, and a product or solve costs
:math:`O(Jk^2 + JkG + G^2)`. :class:`ArrowheadMetric` (``C^{-T} diag(w) C^{-1}``: the
preconditioner ``P`` and ``A^{-1}``), :class:`ArrowheadFactor` (``C^{-T} diag(w)``: the noise
factor ``R`` of noise diagonal in the whitened coordinates), :class:`ArrowheadInjection`
(``P K^{1/2}``: the injected noise ``L Q L^T`` whose whitened covariance ``Q`` is not
diagonal) and :class:`ArrowheadPrecision` (``C diag(w) C^T``: ``A`` and ``P^{-1}``) are
pytrees, so they pass through ``jax.jit`` and ``lax.scan`` as any parameter does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ArrowheadCholesky",
    "ArrowheadFactor",
    "ArrowheadInjection",
    "ArrowheadMetric",
    "ArrowheadPrecision",
    "apply_preconditioner",
    "apply_to_rows",
    "as_parameter",
    "is_operator",
    "preconditioned_noise",
    "standard_normal",
]


class ArrowheadCholesky(NamedTuple):
    """The factor ``C P`` of a block-arrowhead curvature with a low-rank correction, in the
    raveled coordinates: ``local_idx`` ``(J, k)`` and ``global_idx`` ``(G,)`` say where each
    block's coordinates sit; ``chol_u`` ``(J, k, k)``, ``cross`` ``(J, G, k)`` (``C_gu``'s
    blocks) and ``chol_g`` ``(G, G)`` are the arrowhead factor ``C``'s parts, and
    ``P = I + V X Vᵀ`` (symmetric; ``low_v`` ``(D, r)``, ``low_x`` ``(r, r)``, ``P⁻¹ = I +
    V X' Vᵀ`` with ``low_x_inverse`` ``X'``) the correction: ``C P² Cᵀ = C Cᵀ + U S Uᵀ``
    (:meth:`pymc_sgmcmc.tuning.structure.StructuredWhitening.from_curvature`; the couplings
    between crossed factors). ``r = 0``: none."""

    global_idx: jax.Array
    local_idx: jax.Array
    chol_u: jax.Array
    cross: jax.Array
    chol_g: jax.Array
    low_v: jax.Array
    low_x: jax.Array
    low_x_inverse: jax.Array

    def _split(self, v):
        return v[..., self.local_idx], v[..., self.global_idx]

    def _join(self, u, g, like):
        out = jnp.zeros_like(like)
        return out.at[..., self.local_idx].set(u).at[..., self.global_idx].set(g)

    def _low_rank(self, v, x):
        """``(I + V x Vᵀ) v`` along the last axis."""
        if self.low_v.shape[-1] == 0:
            return v
        return v + jnp.einsum("dr,rs,...s->...d", self.low_v, x, v @ self.low_v)

    def _arrow_solve(self, v):
        u, g = self._split(v)
        y_u = _block_solve(self.chol_u, u, transpose=False)
        rhs = g - jnp.einsum("jgk,...jk->...g", self.cross, y_u)
        y_g = _solve(self.chol_g, rhs, transpose=False)
        return self._join(y_u, y_g, v)

    def _arrow_solve_transpose(self, v):
        u, g = self._split(v)
        x_g = _solve(self.chol_g, g, transpose=True)
        rhs = u - jnp.einsum("jgk,...g->...jk", self.cross, x_g)
        x_u = _block_solve(self.chol_u, rhs, transpose=True)
        return self._join(x_u, x_g, v)

    def _arrow_multiply(self, v):
        u, g = self._split(v)
        y_u = jnp.einsum("jab,...jb->...ja", self.chol_u, u)
        y_g = jnp.einsum("jgk,...jk->...g", self.cross, u) + jnp.einsum(
            "ab,...b->...a", self.chol_g, g
        )
        return self._join(y_u, y_g, v)

    def _arrow_multiply_transpose(self, v):
        u, g = self._split(v)
        y_u = jnp.einsum("jba,...jb->...ja", self.chol_u, u) + jnp.einsum(
            "jgk,...g->...jk", self.cross, g
        )
        y_g = jnp.einsum("ba,...b->...a", self.chol_g, g)
        return self._join(y_u, y_g, v)

    def solve(self, v):
        """``(C P)⁻¹ v = P⁻¹ C⁻¹ v``."""
        return self._low_rank(self._arrow_solve(v), self.low_x_inverse)

    def solve_transpose(self, v):
        """``(C P)⁻ᵀ v = C⁻ᵀ P⁻¹ v``."""
        return self._arrow_solve_transpose(self._low_rank(v, self.low_x_inverse))

    def multiply(self, v):
        """``C P v``."""
        return self._arrow_multiply(self._low_rank(v, self.low_x))

    def multiply_transpose(self, v):
        """``(C P)ᵀ v = P Cᵀ v``."""
        return self._low_rank(self._arrow_multiply_transpose(v), self.low_x)

    def gram_diagonal(self, d):
        """The diagonal of ``(C P) diag(d) (C P)ᵀ`` (on the host)."""
        d = np.asarray(d, dtype=np.float64)
        du, dg = d[self.local_idx], d[self.global_idx]
        out = np.zeros_like(d)
        out[self.local_idx] = np.einsum("jab,jb->ja", np.asarray(self.chol_u) ** 2, du)
        out[self.global_idx] = (
            np.einsum("jab,jb->a", np.asarray(self.cross) ** 2, du)
            + (np.asarray(self.chol_g) ** 2) @ dg
        )
        v = np.asarray(self.low_v, dtype=np.float64)
        if v.shape[-1]:
            # P D P = D + V X Vᵀ D + D V X Vᵀ + V X (Vᵀ D V) X Vᵀ, each term through C
            x = np.asarray(self.low_x, dtype=np.float64)
            cv = np.asarray(self._arrow_multiply(v.T)).T  # (D, r)
            cdv = np.asarray(self._arrow_multiply((d[:, None] * v).T)).T
            out = out + 2.0 * np.einsum("dr,rs,ds->d", cv, x, cdv)
            out = out + np.einsum("dr,rs,ds->d", cv, x @ (v.T @ (d[:, None] * v)) @ x, cv)
        return out

    def astype(self, dtype) -> ArrowheadCholesky:
        # on the host, as the draw's other parameters are
        return self._replace(
            chol_u=np.asarray(self.chol_u, dtype),
            cross=np.asarray(self.cross, dtype),
            chol_g=np.asarray(self.chol_g, dtype),
            low_v=np.asarray(self.low_v, dtype),
            low_x=np.asarray(self.low_x, dtype),
            low_x_inverse=np.asarray(self.low_x_inverse, dtype),
        )


def _solve(lower, rhs, transpose):
    # a (G, G) lower-triangular solve along the last axis of rhs (any leading axes)
    flat = rhs.reshape(-1, rhs.shape[-1]).T
    out = jax.scipy.linalg.solve_triangular(lower, flat, lower=True, trans=1 if transpose else 0)
    return out.T.reshape(rhs.shape)


def _block_solve(lower, rhs, transpose):
    # J (k, k) lower-triangular solves, rhs (..., J, k)
    if lower.shape[-1] == 1:
        return rhs / lower[:, :1, 0]  # (J, 1)
    lead = rhs.shape[:-2]
    flat = jnp.moveaxis(rhs.reshape((-1,) + rhs.shape[-2:]), 0, -1)  # (J, k, m)
    out = jax.scipy.linalg.solve_triangular(lower, flat, lower=True, trans=1 if transpose else 0)
    return jnp.moveaxis(out, -1, 0).reshape(lead + rhs.shape[-2:])


class ArrowheadMetric(NamedTuple):
    """``v ↦ C⁻ᵀ (w ⊙ C⁻¹ v)``: ``A⁻¹`` with unit weights, the preconditioner ``L P_z Lᵀ``
    of a diagonal ``P_z`` otherwise."""

    chol: ArrowheadCholesky
    weights: jax.Array

    def apply(self, v):
        return self.chol.solve_transpose(self.weights * self.chol.solve(v))

    def root(self) -> ArrowheadFactor:
        """``F`` with ``F Fᵀ`` this metric."""
        return ArrowheadFactor(self.chol, jnp.sqrt(self.weights))

    def scaled(self, factor) -> ArrowheadMetric:
        return self._replace(weights=self.weights * factor)

    def __mul__(
        self, factor
    ) -> ArrowheadMetric:  # a scalar times the operator (not tuple repetition)
        return self.scaled(factor)

    __rmul__ = __mul__

    def astype(self, dtype) -> ArrowheadMetric:
        return ArrowheadMetric(self.chol.astype(dtype), np.asarray(self.weights, dtype))


class ArrowheadFactor(NamedTuple):
    """``v ↦ C⁻ᵀ (w ⊙ v)``: the θ-space factor ``L diag(w)`` of noise whose covariance in the
    whitened coordinates is ``diag(w²)``."""

    chol: ArrowheadCholesky
    weights: jax.Array

    def apply(self, v):
        return self.chol.solve_transpose(self.weights * v)

    def apply_transpose(self, v):
        """``diag(w) C⁻¹ v``."""
        return self.weights * self.chol.solve(v)

    def scaled(self, factor) -> ArrowheadFactor:
        return self._replace(weights=self.weights * factor)

    def __mul__(
        self, factor
    ) -> ArrowheadFactor:  # a scalar times the operator (not tuple repetition)
        return self.scaled(factor)

    __rmul__ = __mul__

    def astype(self, dtype) -> ArrowheadFactor:
        return ArrowheadFactor(self.chol.astype(dtype), np.asarray(self.weights, dtype))


class ArrowheadInjection(NamedTuple):
    """``v ↦ P R (w ⊙ v)``: the θ-space factor of the injected noise ``L Q Lᵀ = P K P`` with
    ``Q = diag(budgets) − P_z S P_z`` — not diagonal in the whitened coordinates, because the
    minibatch's noise ``S`` is not (``P = L P_z Lᵀ`` the preconditioner, ``metric``, and
    ``K = R Rᵀ = P⁻¹ L diag(budgets) Lᵀ P⁻¹ − N`` with ``N`` the gradient noise in θ units: a
    block arrowhead, ``root`` its Cholesky factor;
    :meth:`pymc_sgmcmc.tuning.structure.StructuredWhitening.injection_factor`)."""

    metric: ArrowheadMetric
    root: ArrowheadCholesky
    weights: jax.Array

    def apply(self, v):
        return self.metric.apply(self.root.multiply(self.weights * v))

    def apply_transpose(self, v):
        """``diag(w) Rᵀ P v``."""
        return self.weights * self.root.multiply_transpose(self.metric.apply(v))

    def scaled(self, factor) -> ArrowheadInjection:
        return self._replace(weights=self.weights * factor)

    def __mul__(
        self, factor
    ) -> ArrowheadInjection:  # a scalar times the operator (not tuple repetition)
        return self.scaled(factor)

    __rmul__ = __mul__

    def astype(self, dtype) -> ArrowheadInjection:
        return ArrowheadInjection(
            self.metric.astype(dtype), self.root.astype(dtype), np.asarray(self.weights, dtype)
        )


class ArrowheadPrecision(NamedTuple):
    """``v ↦ C (w ⊙ Cᵀ v)``: ``A`` with unit weights, the inverse of an
    :class:`ArrowheadMetric` with inverse weights."""

    chol: ArrowheadCholesky
    weights: jax.Array

    def apply(self, v):
        return self.chol.multiply(self.weights * self.chol.multiply_transpose(v))

    def scaled(self, factor) -> ArrowheadPrecision:
        return self._replace(weights=self.weights * factor)

    def __mul__(
        self, factor
    ) -> ArrowheadPrecision:  # a scalar times the operator (not tuple repetition)
        return self.scaled(factor)

    __rmul__ = __mul__

    def astype(self, dtype) -> ArrowheadPrecision:
        return ArrowheadPrecision(self.chol.astype(dtype), np.asarray(self.weights, dtype))


OPERATORS = (ArrowheadMetric, ArrowheadFactor, ArrowheadInjection, ArrowheadPrecision)


def is_operator(value) -> bool:
    """Whether ``value`` is a block-arrowhead operator (not an array)."""
    return isinstance(value, OPERATORS)


def as_parameter(value, dtype):
    """A preconditioner or noise factor as a draw parameter of ``dtype``: a NumPy array, or
    the operator with its floating parts cast."""
    if is_operator(value):
        return value.astype(dtype)
    return np.asarray(value, dtype=dtype)


def apply_to_rows(factor, rows: jax.Array) -> jax.Array:
    """``factor`` applied to each row of ``rows`` ``(m, D)``: ``rows @ Fᵀ`` for a dense
    ``F``, ``rows * F`` for a diagonal, the operator along the last axis."""
    if is_operator(factor):
        return factor.apply(rows)
    return rows @ factor.T if factor.ndim == 2 else rows * factor


def apply_preconditioner(preconditioner: jax.Array | None, vector: jax.Array) -> jax.Array:
    """``P @ vector`` for ``P`` None (identity), ``(D,)`` (diagonal), ``(D, D)`` or a
    block-arrowhead operator; ``vector`` may carry leading batch axes with the operators."""
    if preconditioner is None:
        return vector
    if isinstance(preconditioner, OPERATORS):
        return preconditioner.apply(vector)
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
    if isinstance(preconditioner, ArrowheadMetric):
        return preconditioner.root().apply(noise)
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
