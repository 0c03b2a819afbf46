r"""Stochastic-gradient Langevin dynamics (Welling & Teh 2011) and pSGLD (Li et al. 2016).

.. math::

    \theta_{t+1} = \theta_t + \frac{\epsilon_t}{2} G_t \nabla \log \hat p(\theta_t)
                 + \mathcal N(0,\ \epsilon_t\, T\, G_t)

with :math:`G_t = I` (plain SGLD [1]_), a fixed preconditioner ``G`` (diagonal or dense,
e.g. the inverse Hessian of the potential estimated while tuning; fixed, so no correction term
is needed) or the RMSprop preconditioner (pSGLD, Li et al. eq. 4–5)

.. math::

    V_{t} = \alpha V_{t-1} + (1-\alpha)\, \hat g_t \odot \hat g_t, \qquad
    G_t = \operatorname{diag}\!\big(1 / (\lambda + \sqrt{V_t})\big),

dropping the :math:`\Gamma` correction term as Li et al. [2]_ recommend. ``T`` is the
temperature (``T = 1`` samples the posterior; Smith et al. 2018). With a constant step the
stationary covariance is inflated over the posterior by a term proportional to
:math:`\epsilon N^2 C / B` (Mandt et al. 2017, §5.1); a decreasing schedule
:math:`\epsilon_t = a (b + t)^{-\gamma}` removes it asymptotically.

References
----------
.. [1] Welling, M., Teh, Y. W. (2011). Bayesian learning via stochastic gradient Langevin
   dynamics. ICML.
.. [2] Li, C., Chen, C., Carlson, D., Carin, L. (2016). Preconditioned stochastic gradient
   Langevin dynamics for deep neural networks. AAAI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

import pymc_sgmcmc.kernels.langevin as langevin
from pymc_sgmcmc.kernels.preconditioning import (
    apply_preconditioner,
    preconditioned_noise,
    standard_normal,
)

__all__ = ["SGLDInfo", "SGLDState", "init", "step"]


class SGLDState(NamedTuple):
    position: jax.Array
    square_avg: jax.Array
    iteration: jax.Array


class SGLDInfo(NamedTuple):
    step_size: jax.Array
    grad_norm: jax.Array


def init(position: jax.Array) -> SGLDState:
    """Start at ``position`` with a zero RMSprop accumulator and iteration 0."""
    position = jnp.asarray(position)
    return SGLDState(position, jnp.zeros_like(position), jnp.zeros((), dtype=jnp.int32))


def step(
    rng_key: jax.Array,
    state: SGLDState,
    grad_fn: Callable[[jax.Array], jax.Array],
    step_size: jax.Array | float,
    temperature: float = 1.0,
    rmsprop: bool = False,
    alpha: float = 0.99,
    damping: float = 1e-5,
    normal: jax.Array | None = None,
    preconditioner: jax.Array | None = None,
    preconditioner_sqrt: jax.Array | None = None,
) -> tuple[SGLDState, SGLDInfo]:
    """One (p)SGLD step.

    Parameters
    ----------
    rng_key
        Key for the injected Gaussian noise (unused when ``normal`` is given).
    state
        Current position, RMSprop accumulator and iteration.
    grad_fn
        ``position -> ∇ log p̂``, the gradient of the minibatch estimate of the log
        posterior (as in BlackJAX's SG-MCMC kernels; the log-density value is not needed,
        and computing it every iteration can cost as much as the gradient).
    step_size
        :math:`\\epsilon_t` at this iteration.
    temperature
        Scales the injected noise variance; 1 samples the posterior.
    rmsprop, alpha, damping
        pSGLD's diagonal preconditioner, its averaging rate α and damping λ.
    normal
        A pre-drawn standard normal shaped like the position, used instead of ``rng_key``
        (drivers draw all of a draw's noise in one vectorised call).
    preconditioner, preconditioner_sqrt
        A fixed ``G``: ``(D,)`` diagonal or ``(D, D)`` SPD, and optionally a square root
        ``S`` with ``S Sᵀ = G`` for the noise (else ``√G`` or its Cholesky factor is taken
        at every step). Ignored with ``rmsprop``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> state = init(jnp.zeros(2))
    >>> new, info = step(jax.random.key(0), state, lambda x: -x, 0.01)
    >>> new.position.shape
    (2,)
    """
    grad = grad_fn(state.position)
    if rmsprop:
        square_avg = alpha * state.square_avg + (1.0 - alpha) * grad * grad
        precond = 1.0 / (damping + jnp.sqrt(square_avg))
        drive = precond * grad
        noise = preconditioned_noise(rng_key, precond, grad, normal)
    else:
        square_avg = state.square_avg
        drive = apply_preconditioner(preconditioner, grad)
        if preconditioner_sqrt is not None:
            noise = apply_preconditioner(
                preconditioner_sqrt, standard_normal(rng_key, grad, normal)
            )
        else:
            noise = preconditioned_noise(rng_key, preconditioner, grad, normal)
    # The Langevin move in its first form, with G ĝ and S ξ.
    position = langevin.move(state.position, drive, noise, step_size, temperature)
    info = SGLDInfo(jnp.asarray(step_size), jnp.linalg.norm(grad))
    return SGLDState(position, square_avg, state.iteration + 1), info
