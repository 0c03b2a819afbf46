"""Pure-JAX kernels, one algorithm per module; no PyMC import here.

Each module exports a ``State`` and an ``Info`` NamedTuple, ``init(position, ...)`` and
``step(rng_key, state, grad_fn, ..., normal=None) -> (State, Info)`` where
``grad_fn(position) -> gradient`` is the gradient of the minibatch estimate of the log
posterior (already bound to the minibatch). ``normal`` optionally supplies the step's
standard-normal draw so that a driver can draw a whole scan's noise in one call.
"""

from pymc_sgmcmc.kernels import langevin, preconditioning, saga, sgd, sgld, svrg

__all__ = ["langevin", "preconditioning", "saga", "sgd", "sgld", "svrg"]
