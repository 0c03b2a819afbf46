"""The globals' marginal under the joint curvature (pymc_sgmcmc.tuning.marginal): exact
columns of H⁻¹ by conjugate gradients, checked against a dense solve."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pymc_sgmcmc.tuning.marginal import solve_columns


def _random_intercepts_curvature(groups: int, seed: int) -> np.ndarray:
    """The joint curvature of y = θ + u[g] + ε (unit variances, θ ~ N(0, 10²)) with group
    sizes from 1 to 30: a star coupling θ to every u_j."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 30, groups).astype(float)
    h = np.zeros((groups + 1, groups + 1))
    h[0, 0] = n.sum() + 0.01
    h[0, 1:] = h[1:, 0] = n
    h[np.arange(1, groups + 1), np.arange(1, groups + 1)] = n + 1.0
    return h


def test_columns_of_the_inverse_curvature_are_exact():
    with jax.enable_x64(True):
        h = _random_intercepts_curvature(500, seed=0)
        # a second global, coupled to the first and to every group effect
        h = np.pad(h, ((0, 1), (0, 1)))
        h[-1, -1] = 40.0
        h[-1, 0] = h[0, -1] = 3.0
        h[-1, 1:-1] = h[1:-1, -1] = 0.05
        dense = jnp.asarray(h)
        idx = np.array([0, h.shape[0] - 1])
        solved = solve_columns(lambda v: dense @ v, jnp.diag(dense), jnp.asarray(idx))
        exact = np.linalg.inv(h)[:, idx]
        assert bool(solved.converged)
        np.testing.assert_allclose(np.asarray(solved.columns), exact, rtol=1e-8, atol=1e-12)
        # Jacobi-preconditioned, the star is a low-rank perturbation of the identity
        assert int(solved.iterations) <= 10
        # the marginal variance of θ is larger than its conditional 1/H_θθ
        assert exact[0, 0] > 1.0 / h[0, 0]
