"""What a running step needs to know from around it: which chain ``pm.sample`` is sampling
(set by the wrappers in :mod:`pymc_sgmcmc.adapter.hooks`), and one BLAS thread while our chains run.

A module of its own so that the steps read it without importing the PyMC wrappers (which
import the steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from threadpoolctl import threadpool_limits

__all__ = ["current_chain", "host_blas_threads", "set_current_chain"]

_CHAIN: int | None = None  # the chain this process is sampling (see current_chain)


def current_chain() -> int | None:
    """The index of the chain ``pm.sample`` is sampling in this process, when known: set for
    sequential chains by the ``_sample`` wrapper and in worker processes by
    ``pymc_sgmcmc.adapter.hooks._run_process_with_chain`` (steps with ``devices="chains"`` place
    chain ``c`` on device ``c mod k``)."""
    return _CHAIN


def set_current_chain(chain: int | None) -> None:
    global _CHAIN
    _CHAIN = chain


@contextlib.contextmanager
def host_blas_threads() -> Iterator[None]:
    """One BLAS thread while our chains run (restored after).

    The tuning does its linear algebra on the host between compiled draws: eigendecompositions
    and Cholesky factors of the D × D curvature, several per tuning draw. A multithreaded
    OpenBLAS spins its threads against XLA's and against any other process for the same
    cores: measured on radon (D = 390) on 2 loaded cores, one ``eigh`` took 0.62 s in the
    sampling process, 0.13 s alone and 0.013 s with one thread, and a 200-draw ConstantSGD
    run took 94 s instead of 24 s. The matrices are small enough that one thread is the
    fast choice."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield
