"""Pure-JAX kernels, one algorithm per module; no PyMC import here.

Each module exports a ``State`` and an ``Info`` NamedTuple, ``init(position, ...)`` and
``step(rng_key, state, logdensity_grad_fn, ...) -> (State, Info)`` where
``logdensity_grad_fn(position) -> (logdensity_estimate, gradient)`` is the minibatch estimate
of the log posterior (already bound to the minibatch) and its gradient.
"""

from pymc_sgmcmc.kernels import sgd, sgld

__all__ = ["sgd", "sgld"]
