r"""The globals' marginal under the joint curvature: columns of :math:`H^{-1}` for a few
coordinates, by conjugate gradients on Hessian-vector products.

In a hierarchical posterior the globals :math:`\theta_g` and the group effects :math:`u` move
together along a ridge: the marginal covariance of the globals under the curvature
:math:`H` of the joint log density is

.. math::

    [H^{-1}]_{gg} = S^{-1},\qquad S = H_{gg} - H_{gu} H_{uu}^{-1} H_{ug}

(the Schur complement onto the globals), larger than the conditional :math:`H_{gg}^{-1}` that
a diagonal metric, or a variational :math:`q(u)` fitted at one value of the globals, sees.
The columns :math:`r_g = H^{-1} e_g` are what the self-check needs
(:mod:`pymc_sgmcmc.diagnostics`): with them as the globals' rows of its Stein matrix, the
check measures the draws' *marginal* variance of each global, and :math:`[H^{-1}]_{gg}` is
the marginal variance it is compared with.

:func:`solve_columns` solves :math:`H R = E_g` for all the columns at once, by preconditioned
conjugate gradients: one Hessian-vector product of every column per iteration (one data pass
when ``hvp`` sums over every row), Jacobi-preconditioned by an estimate of :math:`H`'s
diagonal. No structure is assumed; on a nested random-effects posterior the preconditioned
system is a rank-few perturbation of the identity and converges in a few tens of iterations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ColumnSolve", "solve_columns"]

CG_TOLERANCE = 1e-6  # relative residual of every column
CG_MAX_ITERATIONS = 500


class ColumnSolve(NamedTuple):
    """``columns``: ``(D, m)`` solutions of ``H x = e_g``; ``iterations`` taken; the largest
    relative ``residual`` left; ``converged`` whether it is below the tolerance."""

    columns: jax.Array
    iterations: jax.Array
    residual: jax.Array
    converged: jax.Array


def solve_columns(
    hvp: Callable[[jax.Array], jax.Array],
    diagonal: jax.Array,
    indices: jax.Array,
    *,
    tol: float = CG_TOLERANCE,
    maxiter: int = CG_MAX_ITERATIONS,
) -> ColumnSolve:
    """Columns ``indices`` of :math:`H^{-1}` by Jacobi-preconditioned conjugate gradients.

    Parameters
    ----------
    hvp
        ``v (D,) -> H v``: the product with the (positive definite) curvature of the negative
        log density.
    diagonal
        ``(D,)``: positive estimates of :math:`H`'s diagonal (the preconditioner is its
        inverse; a rough estimate only slows convergence).
    indices
        ``(m,)`` integer coordinates whose columns are wanted.
    tol, maxiter
        Stop when every column's residual is below ``tol`` times its right-hand side, or
        after ``maxiter`` iterations.
    """
    dim = diagonal.shape[0]
    m = indices.shape[0]
    rhs = jnp.zeros((dim, m), dtype=diagonal.dtype).at[indices, jnp.arange(m)].set(1.0)
    inverse_diag = (1.0 / jnp.maximum(diagonal, jnp.finfo(diagonal.dtype).tiny))[:, None]
    products = jax.vmap(hvp, in_axes=1, out_axes=1)

    x = jnp.zeros_like(rhs)
    r = rhs
    z = inverse_diag * r
    p = z
    rz = jnp.sum(r * z, axis=0)
    norm_b = jnp.linalg.norm(rhs, axis=0)

    def relative(r):
        return jnp.max(jnp.linalg.norm(r, axis=0) / norm_b)

    def cond(carry):
        _, r, _, _, k = carry
        return (k < maxiter) & (relative(r) > tol)

    def body(carry):
        x, r, p, rz, k = carry
        hp = products(p)
        alpha = rz / jnp.sum(p * hp, axis=0)
        x = x + alpha * p
        r = r - alpha * hp
        z = inverse_diag * r
        rz_new = jnp.sum(r * z, axis=0)
        p = z + (rz_new / rz) * p
        return x, r, p, rz_new, k + 1

    x, r, _, _, k = jax.lax.while_loop(cond, body, (x, r, p, rz, jnp.asarray(0)))
    residual = relative(r)
    return ColumnSolve(x, k, residual, residual <= tol)
