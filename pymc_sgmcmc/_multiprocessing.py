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

Every worker compiles the step's functions again (one process per chain, each with its own
JAX runtime): 4 chains on 2 workers compiled four times, which made ``pm.sample(chains=4,
cores=2)`` cost ~18 s against ~7.6 s once the workers shared their compilations (IASG,
N = 10⁵, D = 20, 100 + 300 draws). So the workers share a JAX persistent compilation cache: a
temporary directory made by the parent when PyMC sets up its worker processes, named in the
pickled step (:func:`worker_cache_dir`), used by each worker from its unpickling on
(:func:`use_worker_cache`) and removed when the parent exits. A cache the user configured
(``jax_compilation_cache_dir``) is left alone, and so is the parent's own JAX configuration.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import shutil
import tempfile
from typing import Any

__all__ = ["install", "jax_backend_started", "use_worker_cache", "worker_cache_dir"]

_INSTALLED = False
_CACHE_DIR: str | None = None  # the workers' shared compilation cache, made by the parent


def worker_cache_dir() -> str | None:
    """The compilation cache this process's ``pm.sample`` workers share (None before PyMC
    first set up worker processes here): what a pickled step carries to them."""
    return _CACHE_DIR


def _make_worker_cache() -> None:
    global _CACHE_DIR
    if _CACHE_DIR is not None or multiprocessing.parent_process() is not None:
        return  # one per parent; a worker never makes one (its steps carry the parent's)
    _CACHE_DIR = tempfile.mkdtemp(prefix="pymc_sgmcmc-xla-cache-")
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not in a forked child that runs exit handlers
            shutil.rmtree(_CACHE_DIR, ignore_errors=True)

    atexit.register(remove)


def use_worker_cache(path: str | None) -> None:
    """In a worker process (not in the parent), compile through the shared cache at ``path``
    unless JAX's cache is configured already. Called when a step is unpickled, before the
    worker compiles anything for it."""
    if path is None or multiprocessing.parent_process() is None or not os.path.isdir(path):
        return
    import jax

    if jax.config.jax_compilation_cache_dir:
        return  # the user's own persistent cache
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX caches only compilations over 1 s by default; a chain's tuning functions take less.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:  # the cache reads the configuration once, at the first compilation in the process
        from jax._src import compilation_cache

        if compilation_cache.is_initialized():
            compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # private API moved: the setting may apply later
        pass


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
        _make_worker_cache()
        if mp_ctx is None and jax_backend_started():
            if multiprocessing.get_start_method(allow_none=True) in (None, "fork"):
                mp_ctx = "forkserver"
        return original(mp_ctx, quiet=quiet)

    mcmc._initialize_multiprocessing_context = initialize
    _INSTALLED = True
