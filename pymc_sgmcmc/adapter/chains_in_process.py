"""How ``pm.sample`` runs the chains of a stochastic-gradient step: in this process.

A ``pm.sample`` call whose step is, or contains, one of this package's steps runs its chains
one after another in the calling process, whatever ``cores`` says; PyMC's worker processes
are not started. A call without one of our steps (plain NUTS, Metropolis, ...) is left
exactly as PyMC runs it: its start method and workers are never touched.

Why not worker processes (as until 0.1): JAX's CPU client owns thread pools, and a child
``fork``\\ ed after they started inherits their locks but not their threads, so its first JAX
computation deadlocks. The way round — ``forkserver`` once JAX was running — re-executes an
unguarded script (no ``if __name__ == "__main__":``) from the top in every worker:
``RuntimeError: An attempt has been made to start a new process before the ... bootstrapping
phase``, or every earlier fit re-run in each worker (273 s instead of ~10 s); it also
switched plain NUTS to forkserver after any SG run (8.9 s instead of 3.4 s), and each
worker compiled the step again, so that ``cores=2`` cost more than ``cores=1`` (10.3 s
against ~4 s). In this process a chain's compilation is reused by the next, Ctrl-C and a
diverging chain behave as with ``cores=1``, and the same ``random_seed`` gives the same
draws for every ``cores``. Chains side by side: :func:`pymc_sgmcmc.sample` (vectorised
chains, one compilation, threads).

A compound step (one of ours with PyMC's steps, e.g. Metropolis for a discrete variable) is
run the same way: its chains in this process, one after another.
"""

from __future__ import annotations

import logging
import sys

import pymc.sampling.mcmc as mcmc

__all__ = ["jax_backend_started", "sample_in_this_process"]

_log = logging.getLogger("pymc.sampling.mcmc")


def jax_backend_started() -> bool:
    """True when a JAX backend (and its thread pools) exists in this process."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # private API moved: assume the worst
        return True


def sample_in_this_process(kwargs: dict) -> None:
    """Run what PyMC passed to ``_mp_sample`` through its sequential ``_sample_many``."""
    args = {k: v for k, v in kwargs.items() if k not in ("mp_ctx", "blas_cores")}
    _log.info(
        "pymc_sgmcmc: the %d chains of a stochastic-gradient step run one after another "
        "in this process (cores=%s does not start worker processes for them; "
        "pymc_sgmcmc.sample runs chains side by side)",
        args.get("chains", 0),
        args.get("cores"),
    )
    mcmc._sample_many(**args)
