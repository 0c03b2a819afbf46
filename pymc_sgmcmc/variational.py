r"""Local latent variables with reparameterised variational distributions (the hybrid).

In a hierarchical model some latent variables are *local* — a volatility path with one value
per time step, one random effect per group or per row — and their number grows with the data.
With ``local_vars=[...]`` a stochastic-gradient sampler samples only the *global* variables
θ; the locals z get a variational distribution :math:`q_\phi(z \mid \theta)` drawn by
reparameterisation, and θ moves along the gradient of the evidence lower bound

.. math::

    \mathcal L(\theta, \phi) = \log p(\theta)
        + \mathbb E_{q_\phi(z\mid\theta)}\big[\log p(x, z \mid \theta) - \log q_\phi(z \mid \theta)\big]

estimated with ``K = num_mc_samples`` draws :math:`z_k = g_\phi(\theta, \varepsilon_k)` in
antithetic pairs (and with the sampler's minibatch for the rows of x). At every iteration φ
takes a natural-gradient step on the same objective, a conjugate-computation update [4]_ over
the same draws (:class:`Hybrid`), so that q keeps following the globals and θ is sampled
from :math:`\max_\phi \mathcal L(\theta, \phi)` — as in stochastic variational inference
[2]_ with the global step replaced by an SG-MCMC one. Each saved θ is paired with one draw
:math:`z \sim q_\phi(\cdot \mid \theta)`. q starts at the Laplace approximation of
:math:`p(z \mid \theta_0, x)`. A q frozen for the draws (``freeze_locals``) takes no
minibatch steps under automatic tuning: it is refit with full-data steps at the chain's
position before each tuning measurement, and at the tuning draws' mean at the end.

Why the family must follow θ. :math:`\max_\phi \mathcal L(\theta, \phi) = \log p(\theta, x) -
\min_\phi \mathrm{KL}(q_\phi \,\|\, p(z \mid \theta, x))`: the globals are sampled from their
marginal posterior only where that gap does not depend on θ. A family whose parameters do not
involve θ (mean-field, or the blog post's) fits :math:`p(z \mid \bar\theta, x)` at one θ̄ and the
gap grows as θ moves away from it. For a random-walk volatility path of T steps this makes
:math:`\mathcal L` as curved in :math:`\log\sigma` as the *conditional* density given z —
curvature ``2T`` — instead of the marginal's, so σ's posterior comes out far too narrow and
shifted (the blog's SGLD + VI found σ ≈ 0.025 where NUTS finds ≈ 0.09). Two families; the
default (``"auto"``) is ``"markov"`` wherever the locals' prior allows it, else ``"meanfield"``:

``"meanfield"``
    :math:`q(z) = \mathcal N(m, \operatorname{diag}(e^{2\omega}))`, φ = (m, ω), independent of
    θ: the classic Bayes-by-backprop family [3]_. Cheap and adequate when the locals are nearly
    independent of each other and of the globals a posteriori; otherwise the globals coupled
    to them get too narrow a posterior (measured in the tests and the docs).
``"markov"``
    The Gaussian whose precision is the local prior's precision given the globals plus a
    learned diagonal, with learned pseudo-observations for the mean (the "site"
    parameterisation of Opper & Archambeau [1]_):

    .. math::

        \Lambda(\theta) = Q(\theta) + \operatorname{diag}(d), \qquad
        \mu(\theta) = \Lambda(\theta)^{-1}\big(b(\theta) + \eta\big), \qquad
        q(z \mid \theta) = \mathcal N\big(\mu(\theta), \Lambda(\theta)^{-1}\big),

    where :math:`\log p(z \mid \theta) = \text{const} + b(\theta)^\top z - \tfrac12 z^\top
    Q(\theta) z` is the prior of the locals (Gaussian in z: ``GaussianRandomWalk``, ``AR``,
    ``Normal`` random effects) and φ = (η, log d) are per-element site parameters. When the
    likelihood factorises over the elements of z, the optimal Gaussian approximation has
    exactly this form (Opper & Archambeau 2009), and because the likelihood terms do not
    involve the prior's parameters, the same sites stay near-optimal as θ moves: q tracks
    :math:`p(z \mid \theta, x)` across the globals' posterior, which fixes the σ collapse.
    For a linear-Gaussian model it contains the exact conditional posterior for every θ.
    ``Q`` must be tridiagonal in the raveled order of the locals (a first-order Markov chain
    along the last axis, or independent elements): it is read off three Hessian-vector
    products of the log-prior (``Q v`` for the probes :math:`v_c = \sum_{j \equiv c \bmod 3}
    e_j`), checked at build time, and sampled through a tridiagonal Cholesky factor in
    :math:`O(L)` per draw.

References
----------
.. [1] Opper, M., Archambeau, C. (2009). The variational Gaussian approximation revisited.
   Neural Computation 21(3), 786–792.
.. [2] Hoffman, M. D., Blei, D. M., Wang, C., Paisley, J. (2013). Stochastic variational
   inference. JMLR 14, 1303–1347.
.. [3] Blundell, C., Cornebise, J., Kavukcuoglu, K., Wierstra, D. (2015). Weight uncertainty in
   neural networks. ICML.
.. [4] Khan, M. E., Lin, W. (2017). Conjugate-computation variational inference: converting
   variational inference in non-conjugate models to inferences in conjugate models. AISTATS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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

__all__ = [
    "Hybrid",
    "HybridState",
    "LocalFamily",
    "LocalLayout",
    "tridiagonal_cholesky",
    "tridiagonal_solve_lower",
    "tridiagonal_solve_upper",
]

LocalFamily = Literal["meanfield", "markov", "auto"]
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

AVERAGE_HORIZON = 200  # iterations over which q's parameters are averaged before freezing
EXACT_CURVATURE_MAX = 256  # locals up to this size get their initial curvature exactly
CURVATURE_FLOOR = 1e-8  # relative floor of the curvature targets (q's precision stays > 0)


@jax.tree_util.register_pytree_node_class
class HybridState:
    """Kernel state of the globals plus the variational state of the locals.

    ``local`` holds q's parameters, their running average (what is frozen at the end of
    tuning), the number of updates, the running sum of the draw's ELBO estimates and the
    draw's PRNG key. ``position`` and ``iteration`` are the kernel's, so the drivers treat
    this like any kernel state."""

    def __init__(self, kernel: Any, local: dict[str, Any]) -> None:
        self.kernel = kernel
        self.local = local

    @property
    def position(self) -> jax.Array:
        return self.kernel.position

    @property
    def iteration(self) -> jax.Array:
        return self.kernel.iteration

    def _replace(self, **changes: Any) -> HybridState:
        kernel, local = self.kernel, self.local
        if "kernel" in changes:
            kernel = changes.pop("kernel")
        if "local" in changes:
            local = changes.pop("local")
        if changes:
            kernel = kernel._replace(**changes)
        return HybridState(kernel, local)

    def tree_flatten(self):
        return (self.kernel, self.local), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> HybridState:
        return cls(*children)


class Hybrid:
    """The variational treatment of a problem's local variables (built by the step method).

    Each iteration (i) estimates the ELBO and its gradient in the globals θ with ``K``
    reparameterised draws of the locals (the sampler's kernel moves θ with it), and (ii),
    while tuning, moves q's natural parameters a fraction ρ towards their fixed point, with
    the expected gradient and Hessian diagonal of the minibatch log-density in z over the
    same draws. Natural-gradient steps in the natural parameters (Khan & Lin 2017; for
    conjugate Gaussian parts they are exact fixed-point steps) converge in a few dozen
    iterations where Adam on the reparameterisation gradient — whose noise grows with q's
    spread — wandered: on a 40-group random-effects model its site precisions were still off
    by factors 1.3–10 after 1500 steps. The Hessian diagonal is read off three Hessian-vector
    products when the Hessian in z is tridiagonal (checked at build time: each row of data
    touches one element of the locals, or neighbours), else estimated by Stein's lemma,
    ``E_q[∇²f] = E_q[Λ(z − μ) ∇fᵀ]``.

    Parameters
    ----------
    layout
        Where the locals sit in the problem's ``fixed`` values.
    family
        ``"meanfield"``, ``"markov"`` or ``"auto"`` (resolved by :meth:`build`).
    num_mc_samples
        ``K``, reparameterised draws per estimate, in antithetic pairs (:meth:`draw_eps`).
    learning_rate
        ρ ∈ (0, 1], the natural-gradient step (a float or a schedule of the iteration).
    """

    def __init__(
        self,
        layout: LocalLayout,
        family: LocalFamily,
        num_mc_samples: int,
        learning_rate: Any,
    ) -> None:
        self.layout = layout
        self.family_name = family
        self.num_mc_samples = int(num_mc_samples)
        self.learning_rate = learning_rate
        self.family: Any = None
        self.curvature_probes = "tridiagonal"  # set by build: diagonal / tridiagonal / stein

    # -- built once per compilation ----------------------------------------------------------
    def build(
        self,
        fns: dict[str, Callable],
        fixed0: Sequence[Any],
        theta0: Any,
        batch0: Sequence[Any] | None = None,
    ) -> None:
        """Bind the problem's JAX functions; for ``"markov"``, check the prior's structure
        at the initial point (raises :class:`ModelNotSupportedError`); with ``batch0`` (a
        minibatch), find whether the update's Hessian in z is tridiagonal."""
        layout = self.layout
        logprior = fns["logprior"]
        logdensity = fns["logdensity"]

        def prior_logp(z, theta, fixed):
            return logprior(theta, layout.insert(fixed, z))

        self._prior_logp = prior_logp
        self._logdensity = logdensity
        z0 = np.asarray(layout.ravel(fixed0))
        if self.family_name == "auto":
            # The default: "markov" wherever the locals' prior allows it (it follows the
            # globals; on radon "meanfield" was 4.4 sds off, "markov" right), else "meanfield".
            try:
                check_markov_prior(prior_logp, z0, theta0, tuple(fixed0), layout)
                self.family_name = "markov"
            except ModelNotSupportedError:
                self.family_name = "meanfield"
        elif self.family_name == "markov":
            check_markov_prior(prior_logp, z0, theta0, tuple(fixed0), layout)
        if self.family_name == "markov":
            self.family = _Markov(layout, prior_logp, z0)
        else:
            self.family = _MeanField(layout, prior_logp, z0)
        if batch0 is not None:
            fixed0 = tuple(fixed0)
            self.curvature_probes = hessian_structure(
                lambda z: self._update_target(z, theta0, fixed0, batch0), jnp.asarray(z0)
            )

    def _update_target(self, z, theta, fixed, batch) -> jax.Array:
        """The log-density in z whose expected gradient and curvature drive q's update:
        the minibatch log-likelihood for ``"markov"`` (the prior is exact in Q(θ), b(θ)),
        the whole minibatch log joint for ``"meanfield"``."""
        with_z = self.layout.insert(fixed, z)
        value = self._logdensity(theta, with_z, batch)
        if self.family.lik_only:
            value = value - self._prior_logp(z, theta, fixed)
        return value

    def curvature(self, theta, fixed, full_loglik: Callable) -> jax.Array:
        """Diagonal of the negative Hessian of ``log p(θ, z) + full_loglik(z)`` in z at the
        point's locals (floored at a small positive value): unit probes up to
        ``EXACT_CURVATURE_MAX`` locals, else the three colour probes (exact for a
        tridiagonal Hessian)."""
        z0 = self.layout.ravel(fixed)

        def log_joint(z):
            return self._prior_logp(z, theta, fixed) + full_loglik(z)

        grad = jax.grad(log_joint)
        size = z0.shape[0]
        if size <= EXACT_CURVATURE_MAX:
            products = jax.lax.map(
                lambda v: jax.jvp(grad, (z0,), (v,))[1], jnp.eye(size, dtype=z0.dtype)
            )
            diag = -jnp.diagonal(products)
        else:
            products = jax.vmap(lambda v: jax.jvp(grad, (z0,), (v,))[1])(
                _colour_probes(size, z0.dtype)
            )
            diag, _ = _tridiagonal_from_products(-products)
        floor = 1e-6 * jnp.maximum(jnp.max(jnp.abs(diag)), 1e-12)
        return jnp.maximum(diag, floor)

    def conditional_mode(self, theta, fixed, full_loglik: Callable, iterations: int = 60):
        """The mode of ``log p(z | θ, x)`` from the point's locals, by Levenberg–Marquardt
        Newton steps: the Hessian of ``log p(θ, z) + full_loglik(z)`` in z is read off the
        three colour probes as a tridiagonal matrix (exact when it is tridiagonal, a
        preconditioner otherwise), its eigen-sign clipped, damped by λ, and solved in O(L);
        a step is kept only if it raises the log-density (λ/3), else λ ×3.

        q starts at the Laplace approximation there. From the model's initial point (the
        volatility path at 0 where the data say ≈ −4.6) the likelihood's curvature is near
        zero, and the first natural-gradient step then moved q's mean by the inverse of the
        random walk's nearly singular precision: non-finite at the first iteration."""
        z0 = self.layout.ravel(fixed)

        def log_joint(z):
            return self._prior_logp(z, theta, fixed) + full_loglik(z)

        grad = jax.grad(log_joint)
        probes = _colour_probes(z0.shape[0], z0.dtype)

        def body(_, carry):
            z, value, lam = carry
            g = grad(z)
            products = jax.vmap(lambda v: jax.jvp(grad, (z,), (v,))[1])(probes)
            diag, sub = _tridiagonal_from_products(-products)
            diag = jnp.abs(diag)
            # Marquardt's damping; a matrix that is still not positive definite gives a
            # non-finite step, which is rejected (λ grows until it is).
            l_diag, c = tridiagonal_cholesky(diag + lam * (1.0 + diag), sub)
            step = tridiagonal_solve_upper(l_diag, c, tridiagonal_solve_lower(l_diag, c, g))
            candidate = z + step
            new_value = log_joint(candidate)
            accept = jnp.isfinite(new_value) & (new_value > value) & jnp.all(jnp.isfinite(step))
            return (
                jnp.where(accept, candidate, z),
                jnp.where(accept, new_value, value),
                jnp.where(accept, lam / 3.0, lam * 3.0),
            )

        start = (z0, log_joint(z0), jnp.asarray(1e-3, z0.dtype))
        z, _, _ = jax.lax.fori_loop(0, iterations, body, start)
        return z

    def init_local(self, theta, fixed, curvature: jax.Array) -> dict[str, Any]:
        z0 = self.layout.ravel(fixed)
        params = self.family.init(z0, curvature, theta, fixed)
        return {
            "params": params,
            "average": params,
            "count": jnp.zeros((), dtype=jnp.int32),
            "elbo_sum": jnp.zeros((), dtype=z0.dtype),
            "key": jax.random.PRNGKey(0),  # replaced at the start of every draw
        }

    # -- traced, every iteration ---------------------------------------------------------------
    def elbo_and_draws(self, theta, params, fixed, batch, eps):
        """``(elbo, (z, μ))``: the K-sample reparameterised estimate of the ELBO
        (minibatch-scaled rows) and, without gradient, its draws and q's mean."""
        z, log_q, mean = self.family.sample(params, theta, fixed, eps)
        log_joint = jax.vmap(
            lambda zk: self._logdensity(theta, self.layout.insert(fixed, zk), batch)
        )(z)
        draws = (jax.lax.stop_gradient(z), jax.lax.stop_gradient(mean))
        return jnp.mean(log_joint - log_q), draws

    def elbo(self, theta, params, fixed, batch, eps) -> jax.Array:
        """The K-sample reparameterised estimate of the ELBO (minibatch-scaled rows)."""
        return self.elbo_and_draws(theta, params, fixed, batch, eps)[0]

    def step(self, theta, local: dict[str, Any], fixed, batch, key, rate):
        """``(elbo, ∇_θ elbo, local')``: the ELBO estimate and its θ-gradient at the current
        q, and the local state after q's natural-gradient update over the same draws (none
        when ``rate = 0``)."""
        eps = self.draw_eps(key, theta.dtype)
        params = local["params"]
        (elbo, (z, mean)), grad = jax.value_and_grad(self.elbo_and_draws, has_aux=True)(
            theta, params, fixed, batch, eps
        )

        def update(params):
            def target(zk):
                return self._update_target(zk, theta, fixed, batch)

            return self._natural_step(params, z, mean, target, eps, rate, theta, fixed)

        updated = jax.lax.cond(rate > 0, update, lambda p: p, params)
        # An update that is not finite (q's precision lost positivity far from the mode) is
        # dropped: q keeps its parameters, and the kernel's own divergence checks decide.
        finite = jnp.all(
            jnp.asarray([jnp.all(jnp.isfinite(v)) for v in jax.tree_util.tree_leaves(updated)])
        )
        updated = jax.tree_util.tree_map(
            lambda new, old: jnp.where(finite, new, old), updated, params
        )
        count = local["count"] + (rate > 0).astype(local["count"].dtype)
        weight = 1.0 / jnp.minimum(1.0 + count.astype(theta.dtype) / 2.0, AVERAGE_HORIZON)
        average = jax.tree_util.tree_map(
            lambda a, p: jnp.where(rate > 0, a + weight * (p - a), a), local["average"], updated
        )
        local = {
            **local,
            "params": updated,
            "average": average,
            "count": count,
            "elbo_sum": local["elbo_sum"] + elbo,
        }
        return elbo, grad, local

    def draw_eps(self, key, dtype) -> jax.Array:
        """``(K, L)`` standard normals in antithetic pairs ``(ε, −ε)`` (the last unpaired
        when K is odd): expectations of functions linear in z — the gradient of a Gaussian
        likelihood, the first-order part of any other — have no Monte Carlo error."""
        k = self.num_mc_samples
        half = jax.random.normal(key, ((k + 1) // 2, self.layout.size), dtype=dtype)
        return jnp.concatenate([half, -half], axis=0)[:k]

    def _natural_step(self, params, z, mean, target_fn: Callable, eps, rate, theta, fixed):
        """One natural-gradient step of q's parameters towards the fixed point under the
        log-density ``target_fn(z)``, with expectations over q's draws ``z`` (from ``eps``)
        and q's mean ``mean``. The Hessian diagonal: one Hessian-vector product with the
        ones vector when the Hessian in z is diagonal, three colour probes when tridiagonal,
        else Stein's lemma (see :meth:`build`)."""
        target = jax.grad(target_fn)
        grads = jax.vmap(target)(z)
        if self.curvature_probes == "diagonal":
            ones = jnp.ones_like(z[0])
            hess = jax.vmap(lambda zk: jax.jvp(target, (zk,), (ones,))[1])(z)
        elif self.curvature_probes == "tridiagonal":
            probes = _colour_probes(z.shape[1], z.dtype)
            products = jax.vmap(
                lambda zk: jax.vmap(lambda v: jax.jvp(target, (zk,), (v,))[1])(probes)
            )(z)
            hess = jax.vmap(lambda pr: _tridiagonal_from_products(pr)[0])(products)
        else:
            hess = self.family.precision_times(params, theta, fixed, eps) * grads
        g, h = jnp.mean(grads, axis=0), -jnp.mean(hess, axis=0)
        h = jnp.maximum(h, CURVATURE_FLOOR * jnp.maximum(jnp.max(jnp.abs(h)), 1e-300))
        return self.family.natural_update(params, mean, g, h, rate)

    def refine(self, theta, local, fixed, full_loglik: Callable, key, steps: int = 2):
        """q's parameters before they are frozen: their running average, then ``steps`` full
        natural-gradient steps (ρ = 1) with full-data expectations — exact fixed-point steps
        where the likelihood is Gaussian in z — so that no minibatch noise is frozen into q
        (chains would otherwise disagree by it). Costs about ``steps · K · 4`` data passes."""

        def target_fn(z):
            value = full_loglik(z)
            if not self.family.lik_only:
                value = value + self._prior_logp(z, theta, fixed)
            return value

        params = local["average"]
        for i in range(steps):
            eps = self.draw_eps(jax.random.fold_in(key, i), theta.dtype)
            z, _, mean = self.family.sample(params, theta, fixed, eps)
            params = self._natural_step(params, z, mean, target_fn, eps, 1.0, theta, fixed)
        return {**local, "params": params, "average": params}

    def draw_locals(self, theta, params, fixed, key) -> jax.Array:
        """One draw ``z ~ q(· | θ)`` (raveled)."""
        eps = jax.random.normal(key, (1, self.layout.size), dtype=theta.dtype)
        return self.family.sample(params, theta, fixed, eps)[0][0]

    def moments(self, theta, params, fixed) -> tuple[jax.Array, jax.Array]:
        return self.family.moments(params, theta, fixed)


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
