r"""SVRG Langevin dynamics (Dubey et al. 2016, Algorithm 2).

Following [1]_: every ``anchor_every`` iterations the current position becomes the anchor
:math:`\tilde\theta` and the full-data log-likelihood gradient
:math:`\tilde g = \sum_n \nabla \log p(x_n \mid \tilde\theta)` is computed (one pass over
the data). In between,

.. math::

    \hat g_{\mathrm{SVRG}}(\theta) = \nabla \log p(\theta)
      + \frac{N}{B} \sum_{i \in S} \big(\nabla \log p(x_i \mid \theta)
      - \nabla \log p(x_i \mid \tilde\theta)\big) + \tilde g,

unbiased, with a variance that shrinks as :math:`\theta` stays near the anchor, and
:math:`\theta' = \theta + \frac{h}{2}\hat g_{\mathrm{SVRG}} + \mathcal N(0, hTI)`. Extra memory
is :math:`O(D)`; the cost is one extra minibatch gradient per step (at the anchor) plus a
full pass every ``anchor_every`` steps.

References
----------
.. [1] Dubey, K. A., Reddi, S. J., Williamson, S. A., Póczos, B., Smola, A. J., Xing, E. P.
   (2016). Variance reduction in stochastic gradient Langevin dynamics. NeurIPS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

import pymc_sgmcmc.kernels.langevin as langevin
from pymc_sgmcmc.kernels.preconditioning import standard_normal

__all__ = ["SVRGInfo", "SVRGState", "estimate", "estimator", "init", "step"]


class SVRGState(NamedTuple):
    position: jax.Array
    anchor: jax.Array
    anchor_grad: jax.Array  # Σ_n ∇log p(x_n | anchor)
    iteration: jax.Array


class SVRGInfo(NamedTuple):
    step_size: jax.Array
    grad_norm: jax.Array


def init(position: jax.Array) -> SVRGState:
    """Start at ``position``; the first step takes it as the anchor."""
    position = jnp.asarray(position)
    return SVRGState(position, position, jnp.zeros_like(position), jnp.zeros((), dtype=jnp.int32))


def estimator(
    prior_grad: jax.Array,
    row_grad_sum: jax.Array,
    anchor_row_grad_sum: jax.Array,
    anchor_grad: jax.Array,
    data_size: int,
    batch_size: int,
) -> jax.Array:
    """The SVRG estimate from the minibatch's summed row gradients at θ and at the anchor."""
    return (
        prior_grad + (data_size / batch_size) * (row_grad_sum - anchor_row_grad_sum) + anchor_grad
    )


def step(
    rng_key: jax.Array | None,
    state: SVRGState,
    prior_grad_fn: Callable[[jax.Array], jax.Array],
    batch_grad_fn: Callable[[jax.Array], jax.Array],
    full_grad_fn: Callable[[jax.Array], jax.Array],
    data_size: int,
    batch_size: int,
    step_size: jax.Array | float,
    anchor_every: int,
    temperature: float = 1.0,
    normal: jax.Array | None = None,
    preconditioner: jax.Array | None = None,
    noise_factor: jax.Array | None = None,
) -> tuple[SVRGState, SVRGInfo]:
    """One SVRG-LD step.

    ``batch_grad_fn(θ)`` is the summed log-likelihood gradient of the minibatch rows at θ,
    ``full_grad_fn(θ)`` the summed gradient over all ``N`` rows (run at anchor refreshes
    only, under ``lax.cond``).
    """
    grad, state = estimate(
        state, prior_grad_fn, batch_grad_fn, full_grad_fn, data_size, batch_size, anchor_every
    )
    noise = standard_normal(rng_key, state.position, normal)
    position = langevin.move(
        state.position, grad, noise, step_size, temperature, preconditioner, noise_factor
    )
    info = SVRGInfo(jnp.asarray(step_size), jnp.linalg.norm(grad))
    return state._replace(position=position, iteration=state.iteration + 1), info


def estimate(
    state: SVRGState,
    prior_grad_fn: Callable[[jax.Array], jax.Array],
    batch_grad_fn: Callable[[jax.Array], jax.Array],
    full_grad_fn: Callable[[jax.Array], jax.Array],
    data_size: int,
    batch_size: int,
    anchor_every: int,
) -> tuple[jax.Array, SVRGState]:
    """SVRG as a gradient estimator: the estimate at ``state.position``, and the state with
    the anchor moved there (and its full-data gradient taken) every ``anchor_every``
    iterations; position and iteration unchanged."""
    position = state.position
    refresh = state.iteration % anchor_every == 0
    anchor, anchor_grad = jax.lax.cond(
        refresh,
        lambda: (position, full_grad_fn(position)),
        lambda: (state.anchor, state.anchor_grad),
    )
    grad = estimator(
        prior_grad_fn(position),
        batch_grad_fn(position),
        batch_grad_fn(anchor),
        anchor_grad,
        data_size,
        batch_size,
    )
    return grad, state._replace(anchor=anchor, anchor_grad=anchor_grad)
