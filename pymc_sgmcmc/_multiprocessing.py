"""Keep ``pm.sample(cores>1)`` from forking a process whose JAX runtime is running.

JAX's CPU client owns thread pools; a child created by ``fork`` after they started inherits
their locks but not their threads, and its first JAX computation deadlocks (checked here
with jax 0.10: children hang, or abort in ``mutex.cc`` if the backend is cleared first).
PyMC picks the ``fork`` start method on Linux when ``mp_ctx`` is not given. This module wraps
PyMC's choice: when the caller left ``mp_ctx`` unset and this process has already started a
JAX backend, the workers are started with ``forkserver`` instead (PyMC's own default on
Intel macOS; the step method is pickled and JAX is compiled lazily inside the worker).
When JAX has not started (a fresh process), ``fork`` is kept: it is faster, and the step
methods do not touch JAX until their first draw, which happens in the worker.
"""

from __future__ import annotations

import functools
import multiprocessing
from typing import Any

__all__ = ["install", "jax_backend_started"]

_INSTALLED = False


def jax_backend_started() -> bool:
    """True when a JAX backend (and its thread pools) exists in this process."""
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # private API moved: assume the worst
        return True


def install() -> None:
    """Wrap ``pymc.sampling.mcmc._initialize_multiprocessing_context`` once."""
    global _INSTALLED
    if _INSTALLED:
        return
    import pymc.sampling.mcmc as mcmc

    original = mcmc._initialize_multiprocessing_context

    @functools.wraps(original)
    def initialize(mp_ctx: Any, quiet: bool = False) -> multiprocessing.context.BaseContext:
        if mp_ctx is None and jax_backend_started():
            if multiprocessing.get_start_method(allow_none=True) in (None, "fork"):
                mp_ctx = "forkserver"
        return original(mp_ctx, quiet=quiet)

    mcmc._initialize_multiprocessing_context = initialize
    _INSTALLED = True
