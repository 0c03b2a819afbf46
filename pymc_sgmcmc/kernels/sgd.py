r"""Constant-rate SGD (optionally with momentum) as an approximate posterior sampler.

.. math::

    v_{t+1} = (1 - \mu)\, v_t + P\, \nabla \log \hat p(\theta_t), \qquad
    \theta_{t+1} = \theta_t + v_{t+1}

with :math:`\mu = 1` for plain SGD, i.e. :math:`\theta \leftarrow \theta - P \hat g` with
:math:`\hat g = -\nabla \log \hat p` the minibatch gradient of the potential. ``P`` is a
scalar ``step_size`` times an optional preconditioner (``(D,)`` diagonal or ``(D, D)``
matrix). Near a mode the iterates are an Ornstein–Uhlenbeck process whose stationary
covariance Σ solves :math:`P A_U \Sigma + \Sigma A_U P = P (N^2 C / B) P` (Mandt, Hoffman &
Blei 2017 [1]_, §4.1, eq. 12); with momentum damping μ the stationary covariance is that of
plain SGD with :math:`P / \mu` (§4.3), so the KL-optimal rate with momentum is
:math:`\mu P^*`.

References
----------
.. [1] Mandt, S., Hoffman, M. D., Blei, D. M. (2017). Stochastic Gradient Descent as
   Approximate Bayesian Inference. JMLR 18(134).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pymc_sgmcmc.kernels.preconditioning import apply_preconditioner, standard_normal

__all__ = ["SGDInfo", "SGDState", "init", "step"]


class SGDState(NamedTuple):
    position: jax.Array
    velocity: jax.Array
    iteration: jax.Array


class SGDInfo(NamedTuple):
    step_size: jax.Array
    grad_norm: jax.Array


def init(position: jax.Array) -> SGDState:
    """Start at ``position`` with zero velocity and iteration 0."""
    position = jnp.asarray(position)
    return SGDState(position, jnp.zeros_like(position), jnp.zeros((), dtype=jnp.int32))


def step(
    rng_key: jax.Array,
    state: SGDState,
    grad_fn: Callable[[jax.Array], jax.Array],
    step_size: jax.Array | float,
    preconditioner: jax.Array | None = None,
    momentum: jax.Array | float | None = None,
    injected_noise_scale: jax.Array | None = None,
    normal: jax.Array | None = None,
    injected_noise: jax.Array | None = None,
    position_noise: jax.Array | None = None,
) -> tuple[SGDState, SGDInfo]:
    """One constant-SGD step.

    Parameters
    ----------
    rng_key
        Key for the injected noise; unused without it (SGD is then deterministic given the
        minibatch) or when ``normal`` is given.
    state
        Current position, velocity and iteration.
    grad_fn
        ``position -> ∇ log p̂``, the gradient of the minibatch estimate of the log posterior.
    step_size
        Scalar factor of ``P``.
    preconditioner
        ``None`` (identity), a ``(D,)`` diagonal or a ``(D, D)`` matrix.
    momentum
        Damping ``μ ∈ (0, 1]``; ``None`` is plain SGD (``μ = 1``).
    injected_noise_scale
        Extra gradient noise ``e ~ N(0, E)`` added to ``ĝ``: a ``(D,)`` vector of sds
        (diagonal ``E``) or a ``(D, D)`` square root ``L`` with ``L Lᵀ = E``
        (``pymc_sgmcmc.preconditioned_sgd._PreconditionedSGD._tuned`` says why).
    normal
        A pre-drawn standard normal shaped like the position for the injected noise, used
        instead of ``rng_key``.
    injected_noise
        A pre-drawn ``e`` itself (already scaled), instead of ``injected_noise_scale`` and a
        normal: drivers with a dense ``L`` multiply a whole draw's normals by it in one
        matrix product before the loop rather than one matrix-vector product per step.
    position_noise
        Gaussian noise added to the step itself (θ units, already scaled): the form the tuned
        samplers use, ``v ← (1 − μ) v + P ∇log p̂ + ξ`` (see :mod:`pymc_sgmcmc.tuning.rates`).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> state = init(jnp.array([1.0]))
    >>> new, info = step(None, state, lambda x: -x, 0.1)
    >>> float(new.position[0])
    0.9
    """
    if injected_noise is not None and injected_noise_scale is not None:
        raise ValueError("Pass injected_noise (e itself) or injected_noise_scale, not both.")
    grad = grad_fn(state.position)
    drive = grad
    if injected_noise is not None:
        drive = grad + injected_noise
    elif injected_noise_scale is not None:
        z = standard_normal(rng_key, grad, normal)
        drive = grad + apply_preconditioner(injected_noise_scale, z)
    update = step_size * apply_preconditioner(preconditioner, drive)
    if position_noise is not None:
        update = update + position_noise
    if momentum is None:
        velocity = update
    else:
        velocity = (1.0 - momentum) * state.velocity + update
    position = state.position + velocity
    info = SGDInfo(jnp.asarray(step_size), jnp.linalg.norm(grad))
    return SGDState(position, velocity, state.iteration + 1), info
