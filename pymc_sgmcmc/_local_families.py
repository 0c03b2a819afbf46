"""The local variables' side of :class:`pymc_sgmcmc.variational.Hybrid`: where they sit in the
problem's ``fixed`` values (:class:`LocalLayout`) and the two families of ``q(z | θ)`` —
mean-field Gaussian, and a Gaussian whose precision is tridiagonal ("markov": independent
Normal effects, random walks, AR(1) priors) — with the check that a prior has that structure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pymc_sgmcmc._tridiagonal import (
    _colour_probes,
    _tridiagonal_from_products,
    _tridiagonal_inverse_diagonal,
    _tridiagonal_matvec,
    tridiagonal_cholesky,
    tridiagonal_solve_lower,
    tridiagonal_solve_upper,
)
from pymc_sgmcmc.errors import ModelNotSupportedError

__all__ = ["LOCAL_FAMILIES", "LocalLayout", "check_markov_prior", "hessian_structure"]

LOCAL_FAMILIES = ("meanfield", "markov")
MARKOV_CHECK_RTOL = 1e-6  # relative mismatch of a probed Hessian-vector product that fails


# ---------------------------------------------------------------------------------------
# Layout of the local variables inside the problem's ``fixed`` tuple
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalLayout:
    """Where the local variables sit in a problem's ``fixed`` values, raveled into one
    vector ``z`` of length ``size`` (in the order of ``names``)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    slots: tuple[int, ...]  # index of each local in the problem's fixed tuple

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=int)) for s in self.shapes)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def ravel(self, fixed: Sequence[Any]) -> jax.Array:
        parts = [jnp.reshape(jnp.asarray(fixed[s]), (-1,)) for s in self.slots]
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def unravel(self, z: Any) -> list[Any]:
        out, start = [], 0
        for shape, size in zip(self.shapes, self.sizes, strict=True):
            out.append(z[start : start + size].reshape(shape))
            start += size
        return out

    def insert(self, fixed: Sequence[Any], z: jax.Array) -> tuple[Any, ...]:
        """``fixed`` with the locals replaced by the raveled ``z``."""
        out = list(fixed)
        for slot, part, dtype in zip(self.slots, self.unravel(z), self.dtypes, strict=True):
            out[slot] = part.astype(dtype)
        return tuple(out)


# ---------------------------------------------------------------------------------------
# The families
# ---------------------------------------------------------------------------------------


class _MeanField:
    """``q(z) = N(m, diag(exp(2ω)))``; parameters ``{"mean": m, "log_sd": ω}``.

    Natural-gradient update (the Gaussian's natural parameters, precision ``p = e^{-2ω}`` and
    shift ``p m``, move a fraction ρ towards their fixed point under the log joint f):
    ``p ← (1−ρ) p + ρ E_q[−diag ∇²f]``, ``p m ← (1−ρ) p m + ρ (E_q[∇f] + E_q[−diag ∇²f] m)``.
    """

    name = "meanfield"
    lik_only = False  # the update's f is the whole log joint in z

    def __init__(self, layout: LocalLayout, prior_logp: Callable, z_ref: Any) -> None:
        self.layout = layout

    def init(self, z0: jax.Array, curvature: jax.Array, theta, fixed) -> dict[str, jax.Array]:
        return {"mean": z0, "log_sd": -0.5 * jnp.log(curvature)}

    def sample(self, params, theta, fixed, eps: jax.Array):
        """``(z, log q(z), mean)`` for standard normals ``eps`` ``(K, L)``."""
        z = params["mean"] + jnp.exp(params["log_sd"]) * eps
        log_q = -jnp.sum(params["log_sd"]) - 0.5 * jnp.sum(eps * eps, axis=-1)
        return z, log_q - 0.5 * eps.shape[-1] * jnp.log(2 * jnp.pi), params["mean"]

    def precision_times(self, params, theta, fixed, eps: jax.Array) -> jax.Array:
        """``Λ (z − μ)`` for the draws of :meth:`sample` (Stein's lemma)."""
        return eps * jnp.exp(-params["log_sd"])

    def covariance_times(self, params, theta, fixed, v: jax.Array) -> jax.Array:
        """``Σ_q v`` for ``v`` ``(L,)`` or ``(L, m)``."""
        var = jnp.exp(2 * params["log_sd"])
        return var.reshape(var.shape + (1,) * (v.ndim - 1)) * v

    def natural_update(self, params, mean, grad, curvature, rho):
        precision = jnp.exp(-2 * params["log_sd"])
        new_precision = (1 - rho) * precision + rho * curvature
        shift = (1 - rho) * precision * mean + rho * (grad + curvature * mean)
        return {"mean": shift / new_precision, "log_sd": -0.5 * jnp.log(new_precision)}

    def moments(self, params, theta, fixed) -> tuple[jax.Array, jax.Array]:
        """Marginal means and sds of ``q`` (given θ)."""
        return params["mean"], jnp.exp(params["log_sd"])


class _Markov:
    """Site-parameterised Gaussian Markov family (see the module docstring); parameters
    ``{"site_shift": η, "log_site_precision": log d}``.

    Natural-gradient update: the sites are the Gaussian approximation of the likelihood
    (conjugate-computation VI, Khan & Lin 2017), moved a fraction ρ towards the fixed point of
    Opper & Archambeau (2009) under the minibatch log-likelihood f:
    ``d ← (1−ρ) d + ρ E_q[−diag ∇²f]``, ``η ← (1−ρ) η + ρ (E_q[∇f] + E_q[−diag ∇²f] μ(θ))``.
    """

    name = "markov"
    lik_only = True  # the prior is in Q(θ), b(θ) exactly; the sites approximate the rest

    def __init__(self, layout: LocalLayout, prior_logp: Callable, z_ref: Any) -> None:
        self.layout = layout
        self.prior_logp = prior_logp  # (z, theta, fixed) -> log p(θ, z) without the data
        self._z_ref = z_ref  # any point will do for a Gaussian prior: the initial one

    def prior_quadratic(self, theta, fixed, z_ref: jax.Array):
        """``(diag Q, sub Q, b)`` of the locals' Gaussian prior given θ, read off three
        Hessian-vector products at ``z_ref`` (exact for a Gaussian prior, whatever z_ref)."""
        grad = jax.grad(lambda z: self.prior_logp(z, theta, fixed))
        probes = _colour_probes(z_ref.shape[0], z_ref.dtype)
        products = jax.vmap(lambda v: jax.jvp(grad, (z_ref,), (v,))[1])(probes)
        diag, sub = _tridiagonal_from_products(-products)
        b = grad(z_ref) + _tridiagonal_matvec(diag, sub, z_ref)
        return diag, sub, b

    def _factor(self, params, theta, fixed):
        diag, sub, b = self.prior_quadratic(theta, fixed, jnp.asarray(self._z_ref))
        l_diag, c = tridiagonal_cholesky(diag + jnp.exp(params["log_site_precision"]), sub)
        y = tridiagonal_solve_lower(l_diag, c, b + params["site_shift"])
        return l_diag, c, y

    def init(self, z0: jax.Array, curvature: jax.Array, theta, fixed) -> dict[str, jax.Array]:
        # Sites at the initial point with the likelihood's curvature there (prior excluded):
        # q starts at the prior conditioned on pseudo-observations z0 of that precision.
        diag, sub, b = self.prior_quadratic(theta, fixed, z0)
        lik_curvature = jnp.maximum(curvature - diag, 1e-3 * jnp.maximum(curvature, 1e-12))
        mean_shift = _tridiagonal_matvec(diag, sub, z0) - b  # makes μ = z0 at θ0
        return {
            "site_shift": lik_curvature * z0 + mean_shift,
            "log_site_precision": jnp.log(lik_curvature),
        }

    def sample(self, params, theta, fixed, eps: jax.Array):
        l_diag, c, y = self._factor(params, theta, fixed)
        # One solve for the mean and the draws: z_k = L⁻ᵀ(y + ε_k), μ = L⁻ᵀ y.
        rhs = jnp.concatenate([y[:, None], y[:, None] + eps.T], axis=1)
        solved = tridiagonal_solve_upper(l_diag, c, rhs).T
        log_q = jnp.sum(jnp.log(l_diag)) - 0.5 * jnp.sum(eps * eps, axis=-1)
        return solved[1:], log_q - 0.5 * eps.shape[-1] * jnp.log(2 * jnp.pi), solved[0]

    def precision_times(self, params, theta, fixed, eps: jax.Array) -> jax.Array:
        # z − μ = L⁻ᵀ ε, so Λ (z − μ) = L ε (L lower bidiagonal).
        l_diag, c, _ = self._factor(params, theta, fixed)
        out = eps * l_diag
        return out.at[:, 1:].add(eps[:, :-1] * c)

    def covariance_times(self, params, theta, fixed, v: jax.Array) -> jax.Array:
        """``Λ(θ)⁻¹ v`` for ``v`` ``(L,)`` or ``(L, m)`` (two bidiagonal solves)."""
        l_diag, c, _ = self._factor(params, theta, fixed)
        return tridiagonal_solve_upper(l_diag, c, tridiagonal_solve_lower(l_diag, c, v))

    def natural_update(self, params, mean, grad, curvature, rho):
        d = jnp.exp(params["log_site_precision"])
        new_d = (1 - rho) * d + rho * curvature
        shift = (1 - rho) * params["site_shift"] + rho * (grad + curvature * mean)
        return {"site_shift": shift, "log_site_precision": jnp.log(new_d)}

    def moments(self, params, theta, fixed) -> tuple[jax.Array, jax.Array]:
        l_diag, c, y = self._factor(params, theta, fixed)
        mean = tridiagonal_solve_upper(l_diag, c, y)
        return mean, jnp.sqrt(_tridiagonal_inverse_diagonal(l_diag, c))


# ---------------------------------------------------------------------------------------
# The hybrid: state, ELBO, natural-gradient updates of q, draws of the locals
# ---------------------------------------------------------------------------------------


def hessian_structure(f: Callable, z: jax.Array) -> str:
    """``"diagonal"``, ``"tridiagonal"`` or ``"stein"``: the cheapest way to read the
    diagonal of the Hessian of ``f`` at ``z`` exactly (checked with a random probe; one
    compiled call)."""

    @jax.jit
    def residuals(z, probe):
        grad = jax.grad(f)
        exact = jax.jvp(grad, (z,), (probe,))[1]
        ones = jax.jvp(grad, (z,), (jnp.ones_like(z),))[1]
        products = jax.vmap(lambda v: jax.jvp(grad, (z,), (v,))[1])(
            _colour_probes(z.shape[0], z.dtype)
        )
        diag, sub = _tridiagonal_from_products(products)
        scale = jnp.max(jnp.abs(exact)) + 1e-300
        return (
            jnp.max(jnp.abs(exact - ones * probe)) / scale,
            jnp.max(jnp.abs(exact - _tridiagonal_matvec(diag, sub, probe))) / scale,
        )

    probe = jnp.asarray(np.random.default_rng(1).normal(size=z.shape[0]), dtype=z.dtype)
    diagonal, banded = (float(r) for r in residuals(z, probe))
    if diagonal <= MARKOV_CHECK_RTOL:
        return "diagonal"
    if banded <= MARKOV_CHECK_RTOL:
        return "tridiagonal"
    return "stein"


def check_markov_prior(
    prior_logp: Callable, z0: np.ndarray, theta0: Any, fixed0: tuple, layout: LocalLayout
) -> None:
    """Refuse ``local_family="markov"`` unless the locals' prior is Gaussian in z with a
    tridiagonal precision (checked with random probes at two points)."""
    z0 = jnp.asarray(z0)
    grad = jax.grad(lambda z: prior_logp(z, theta0, fixed0))
    size = z0.shape[0]
    probes = _colour_probes(size, z0.dtype)
    rng = np.random.default_rng(0)
    checks = jnp.asarray(rng.normal(size=(2, size)), dtype=z0.dtype)
    names = ", ".join(repr(n) for n in layout.names)
    fix = (
        "local_family='markov' needs a prior that is Gaussian in the locals with a "
        "tridiagonal precision (a first-order Markov chain along the last axis such as "
        "pm.GaussianRandomWalk or pm.AR with one lag, or independent Normal effects, given "
        "the globals); use local_family='meanfield' for this model."
    )

    @jax.jit
    def banded_hessian(z, check):
        products = jax.vmap(lambda v: jax.jvp(grad, (z,), (v,))[1])(probes)
        diag, sub = _tridiagonal_from_products(products)
        exact = jax.jvp(grad, (z,), (check,))[1]
        banded = _tridiagonal_matvec(diag, sub, check)
        return diag, sub, jnp.max(jnp.abs(exact - banded)), jnp.max(jnp.abs(exact))

    hessians = []
    for z in (z0, z0 + checks[0]):
        diag, sub, residual, scale = banded_hessian(z, checks[1])
        if not float(residual) <= MARKOV_CHECK_RTOL * (float(scale) + 1e-300):
            raise ModelNotSupportedError(
                f"The prior of the local variable(s) {names} couples elements that are not "
                f"neighbours in their raveled order. {fix}"
            )
        hessians.append((np.asarray(diag), np.asarray(sub)))
    (d0, s0), (d1, s1) = hessians
    scale = max(float(np.max(np.abs(d0))), 1e-300)
    if not (
        np.allclose(d0, d1, rtol=0, atol=MARKOV_CHECK_RTOL * scale)
        and np.allclose(s0, s1, rtol=0, atol=MARKOV_CHECK_RTOL * scale)
    ):
        raise ModelNotSupportedError(
            f"The prior of the local variable(s) {names} is not Gaussian in their "
            f"(unconstrained) values: its curvature changes with them. {fix}"
        )
    if not np.all(d0 <= 0):
        raise ModelNotSupportedError(
            f"The prior of the local variable(s) {names} is not log-concave along every "
            f"element. {fix}"
        )
