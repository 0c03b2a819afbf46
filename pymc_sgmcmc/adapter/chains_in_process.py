r"""How ``pm.sample`` runs the chains of a stochastic-gradient step: never in PyMC's worker
processes.

A ``pm.sample`` call whose step is one of ours over every variable runs its chains side by
side with ``cores > 1`` (:func:`pymc_sgmcmc.adapter.sampling.sample_side_by_side`: the engine
of ``pmsg.sample``, in threads or in its own pinned worker processes); otherwise — a compound
step (ours with PyMC's, e.g. Metropolis for a discrete variable), out-of-core ``data=``,
``devices=`` — one after another in the calling process (:func:`sample_in_this_process`). A
call without one of our steps (plain NUTS, Metropolis, ...) is left exactly as PyMC runs it:
its start method and workers are never touched.

Why not PyMC's workers: JAX's CPU client owns thread pools, and a child ``fork``\ ed after
they started inherits their locks but not their threads, so its first JAX computation
deadlocks. The way round — ``forkserver`` once JAX was running — re-executes an unguarded
script (no ``if __name__ == "__main__":``) from the top in every worker: ``RuntimeError: An
attempt has been made to start a new process before the ... bootstrapping phase``, or every
earlier fit re-run in each worker (273 s instead of ~10 s); it also switched plain NUTS to
forkserver after any SG run (8.9 s instead of 3.4 s), and each worker compiled the step
again, so that ``cores=2`` cost more than ``cores=1`` (10.3 s against ~4 s). The worker
processes of :mod:`pymc_sgmcmc._chain_processes` are fresh interpreters started by
``subprocess`` instead, which run no script of the user's.
"""

from __future__ import annotations

import logging

import pymc.sampling.mcmc as mcmc

__all__ = ["sample_in_this_process"]

_log = logging.getLogger("pymc.sampling.mcmc")


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
