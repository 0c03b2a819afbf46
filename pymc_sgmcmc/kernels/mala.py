r"""Preconditioned Metropolis-adjusted Langevin (MALA) for full-batch gradients.

.. math::

    y = \theta + P\,\nabla\log p(\theta) + R\,\xi,\qquad R R^\top = 2P,

accepted with probability :math:`\min\big(1,\ \frac{p(y)\,q(\theta\mid y)}{p(\theta)\,q(y\mid
\theta)}\big)`, :math:`q(y\mid\theta) \propto \exp\{-\tfrac14 (y-\theta-P\nabla\log
p(\theta))^\top P^{-1} (y-\theta-P\nabla\log p(\theta))\}` (Roberts & Tweedie 1996). With
every row in every gradient there is no minibatch noise to exploit, and the Metropolis step
makes the chain exact: this is what every sampler of the package runs when ``batch_size ≥ N``
(see :mod:`pymc_sgmcmc.adapter.step`). ``P = h A⁻¹`` with ``A`` the measured curvature, so
``P⁻¹ = A/h`` is passed as ``inverse_preconditioner``.

With ``adjust = 0`` the proposal is always accepted: the driver's search for the mode runs the
same kernel with ``R = 0`` (preconditioned gradient ascent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pymc_sgmcmc.kernels.preconditioning import apply_preconditioner

__all__ = ["MALAInfo", "MALAState", "init", "step"]


class MALAState(NamedTuple):
    position: jax.Array
    logdensity: jax.Array
    grad: jax.Array
    iteration: jax.Array


class MALAInfo(NamedTuple):
    step_size: jax.Array
    grad_norm: jax.Array
    acceptance: jax.Array


def init(
    position: jax.Array, logdensity_and_grad: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
) -> MALAState:
    """Start at ``position`` with its log density and gradient."""
    position = jnp.asarray(position)
    value, grad = logdensity_and_grad(position)
    return MALAState(position, value, grad, jnp.zeros((), dtype=jnp.int32))


def _quadratic(inverse: jax.Array, d: jax.Array) -> jax.Array:
    return jnp.dot(d, apply_preconditioner(inverse, d))


def step(
    state: MALAState,
    logdensity_and_grad: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
    noise: jax.Array,
    log_uniform: jax.Array,
    preconditioner: jax.Array,
    inverse_preconditioner: jax.Array,
    adjust: jax.Array | float = 1.0,
    step_size: jax.Array | float = 0.0,
) -> tuple[MALAState, MALAInfo]:
    """One MALA step.

    Parameters
    ----------
    state
        Position with its log density and gradient.
    logdensity_and_grad
        ``θ -> (log p(θ), ∇log p(θ))`` on the full data.
    noise
        ``R ξ``: the proposal's Gaussian part, already scaled (``R Rᵀ = 2P``).
    log_uniform
        ``log u``, ``u ~ U(0, 1)``: the acceptance test's draw.
    preconditioner, inverse_preconditioner
        ``P`` and ``P⁻¹`` (``(D,)`` or ``(D, D)``).
    adjust
        1: Metropolis-adjusted; 0: always accept (the mode search).
    step_size
        Reported in the info only.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> f = lambda x: (-0.5 * jnp.sum(x**2), -x)
    >>> s = init(jnp.ones(2), f)
    >>> s2, info = step(s, f, jnp.zeros(2), jnp.log(0.5), jnp.full(2, 0.5), jnp.full(2, 2.0))
    >>> s2.position.tolist(), float(info.acceptance)
    ([0.5, 0.5], 1.0)
    """
    x = state.position
    forward = apply_preconditioner(preconditioner, state.grad)
    y = x + forward + noise
    value, grad = logdensity_and_grad(y)
    backward = apply_preconditioner(preconditioner, grad)
    d_fwd = y - x - forward
    d_bwd = x - y - backward
    log_ratio = (
        value
        - state.logdensity
        - 0.25 * _quadratic(inverse_preconditioner, d_bwd)
        + 0.25 * _quadratic(inverse_preconditioner, d_fwd)
    )
    log_ratio = jnp.where(jnp.isfinite(log_ratio), log_ratio, -jnp.inf)
    probability = jnp.where(adjust > 0, jnp.minimum(1.0, jnp.exp(log_ratio)), 1.0)
    accept = (adjust <= 0) | (log_uniform < log_ratio)
    new = MALAState(
        jnp.where(accept, y, x),
        jnp.where(accept, value, state.logdensity),
        jnp.where(accept, grad, state.grad),
        state.iteration + 1,
    )
    info = MALAInfo(jnp.asarray(step_size), jnp.linalg.norm(state.grad), probability)
    return new, info
