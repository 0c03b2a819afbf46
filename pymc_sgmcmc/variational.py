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
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pymc_sgmcmc._local_families import (
    LOCAL_FAMILIES,
    LocalLayout,
    _Markov,
    _MeanField,
    check_markov_prior,
    hessian_structure,
)
from pymc_sgmcmc._tridiagonal import (
    _colour_probes,
    _tridiagonal_from_products,
    tridiagonal_cholesky,
    tridiagonal_solve_lower,
    tridiagonal_solve_upper,
)
from pymc_sgmcmc.errors import ModelNotSupportedError

__all__ = [
    "LOCAL_FAMILIES",
    "Hybrid",
    "HybridState",
    "LocalFamily",
    "LocalLayout",
    "check_markov_prior",
    "hessian_structure",
    "tridiagonal_cholesky",
    "tridiagonal_solve_lower",
    "tridiagonal_solve_upper",
]

LocalFamily = Literal["meanfield", "markov", "auto"]


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
        # Whether q's updates (full batch) also refresh its linear response to the globals;
        # a frozen q gets it when it is refit (refine). Set by the step method.
        self.response_each_step = False

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
        params = self._with_response(self.family.init(z0, curvature, theta, fixed), theta)
        return {
            "params": params,
            "average": params,
            "count": jnp.zeros((), dtype=jnp.int32),
            "elbo_sum": jnp.zeros((), dtype=z0.dtype),
            "key": jax.random.PRNGKey(0),  # replaced at the start of every draw
        }

    # -- the locals' linear response to the globals ------------------------------------------
    @staticmethod
    def _with_response(params: dict[str, Any], theta, gain=None) -> dict[str, Any]:
        """q's parameters with a linear response anchored at ``theta``: ``gain`` ``(L, D)``
        (zero: none yet)."""
        if gain is None:
            gain = jnp.zeros((params[next(iter(params))].shape[0], theta.shape[0]), theta.dtype)
        return {**params, "gain": gain, "anchor": jnp.asarray(theta)}

    @staticmethod
    def _shift(params: dict[str, Any], theta) -> jax.Array:
        """``K (θ − θ_ref)``: how far the locals' mean has moved with the globals since q was
        fitted at ``θ_ref``."""
        return params["gain"] @ (theta - params["anchor"])

    def response(self, theta, params, fixed, joint_loglik: Callable) -> jax.Array:
        r"""``K = dμ/dθ`` that q's fit at ``theta`` leaves out: the conditional mode's
        derivative :math:`\mathrm{d}z^*/\mathrm{d}\theta = (-\nabla^2_{zz}F)^{-1}
        \nabla^2_{z\theta}F` with q's covariance for the first factor and the cross
        derivatives of the part of the log joint ``F`` that q's mean does not follow by
        construction — the likelihood for ``"markov"`` (its mean follows the prior's
        parameters exactly), the whole log joint for ``"meanfield"`` (its mean is fixed).
        ``D`` forward-mode products of the full-data gradient in z. Exact where the
        conditional posterior of the locals is Gaussian (a Gaussian likelihood in z).

        Why. With q fitted at one θ the ELBO is the log joint at the locals' conditional
        *at that θ*: as θ moves along the ridge it shares with the locals, the locals stay
        put and the ELBO is as curved in θ as the conditional density — the globals' draws
        come out too narrow and pulled to the fit's θ (IASG on 2 000 random-intercept groups:
        θ 5.9 sd off). Moving q's mean by K(θ − θ_ref) makes the ELBO in θ the profile of
        the joint over the locals, which for a Gaussian conditional is the marginal."""
        mean = self.family.moments(params, theta, fixed)[0]

        def grad_z(th):
            def f(z):
                value = joint_loglik(th, z)
                if not self.family.lik_only:
                    value = value + self._prior_logp(z, th, fixed)
                return value

            return jax.grad(f)(mean)

        cross = jax.jacfwd(grad_z)(theta)  # (L, D)
        return self.family.covariance_times(params, theta, fixed, cross)

    # -- traced, every iteration ---------------------------------------------------------------
    def elbo_and_draws(self, theta, params, fixed, batch, eps):
        """``(elbo, (z, μ))``: the K-sample reparameterised estimate of the ELBO
        (minibatch-scaled rows) and, without gradient, its draws and q's mean. q's mean
        follows θ linearly from where it was fitted (:meth:`response`)."""
        z, log_q, mean = self.family.sample(params, theta, fixed, eps)
        shift = self._shift(params, theta)
        z, mean = z + shift, mean + shift
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

            new = self._natural_step(params, z, mean, target, eps, rate, theta, fixed)
            gain = params["gain"]
            if self.response_each_step:
                # every row in the batch: the response at θ, exact, at D more products
                def batch_loglik(th, zk):
                    value = self._logdensity(th, self.layout.insert(fixed, zk), batch)
                    return value - self._prior_logp(zk, th, fixed)

                gain = self.response(theta, new, fixed, batch_loglik)
            return self._with_response(new, theta, gain)  # fitted at θ: anchored there

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
        return {**params, **self.family.natural_update(params, mean, g, h, rate)}

    def refine(self, theta, local, fixed, joint_loglik: Callable, key, steps: int = 2):
        """q's parameters before they are frozen: their running average, then ``steps`` full
        natural-gradient steps (ρ = 1) with full-data expectations — exact fixed-point steps
        where the likelihood is Gaussian in z — so that no minibatch noise is frozen into q
        (chains would otherwise disagree by it), anchored at ``theta`` with the locals' linear
        response to the globals (:meth:`response`). ``joint_loglik(θ, z)`` is the full-data
        log-likelihood. Costs about ``steps · K · 4 + 3·D`` data passes."""

        def target_fn(z):
            value = joint_loglik(theta, z)
            if not self.family.lik_only:
                value = value + self._prior_logp(z, theta, fixed)
            return value

        # refit at θ itself: the average's mean, moved to θ by the response it had
        average = local["average"]
        params = self._with_response(average, theta)
        if "mean" in average:  # meanfield: its mean is the fit's own, move it along
            params = {**params, "mean": average["mean"] + self._shift(average, theta)}
        for i in range(steps):
            eps = self.draw_eps(jax.random.fold_in(key, i), theta.dtype)
            z, _, mean = self.family.sample(params, theta, fixed, eps)
            params = self._natural_step(params, z, mean, target_fn, eps, 1.0, theta, fixed)
        params = self._with_response(
            params, theta, self.response(theta, params, fixed, joint_loglik)
        )
        return {**local, "params": params, "average": params}

    def draw_locals(self, theta, params, fixed, key) -> jax.Array:
        """One draw ``z ~ q(· | θ)`` (raveled)."""
        eps = jax.random.normal(key, (1, self.layout.size), dtype=theta.dtype)
        return self.family.sample(params, theta, fixed, eps)[0][0] + self._shift(params, theta)

    def moments(self, theta, params, fixed) -> tuple[jax.Array, jax.Array]:
        mean, sd = self.family.moments(params, theta, fixed)
        return mean + self._shift(params, theta), sd
