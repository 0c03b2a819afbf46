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
JAX runtime). So PyMC's workers share a JAX persistent compilation cache: a temporary
directory that the parent names when PyMC sets up sampling (:func:`worker_cache_dir`; the
first worker to write creates it, and the parent removes it at exit), carried to the
workers in the pickled step (forkserver, spawn) or by the fork itself, and switched on in
each worker before it compiles (:func:`use_worker_cache`). The first ``cores`` workers start
together and each compiles; the chains after them load those executables. Measured with
IASG (N = 10⁵, D = 20, 100 + 300 draws), ``pm.sample(chains=4, cores=2)``: ~18 s per call
before, 13.4 s for the first call and 8.4–9.3 s for later ones after. Only PyMC's chain
workers (processes named ``worker_chain_*``) are touched: never the parent's JAX
configuration, nor a child process of the user's, nor a worker whose JAX has a cache
configured already (``jax_compilation_cache_dir``, e.g. through ``JAX_COMPILATION_CACHE_DIR``).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import multiprocessing
import os
import secrets
import shutil
import tempfile
from typing import Any

__all__ = ["install", "jax_backend_started", "use_worker_cache", "worker_cache_dir"]

_INSTALLED = False
_CACHE_DIR: str | None = None  # the workers' shared compilation cache, named by the parent
_CACHE_MAX_BYTES = 1 << 31  # a positive size makes JAX lock the cache around reads and writes


def worker_cache_dir() -> str | None:
    """The compilation cache this process's ``pm.sample`` workers share (None before PyMC
    first set up sampling here): what a pickled step carries to them."""
    return _CACHE_DIR


def _name_worker_cache() -> None:
    """Name (not create) the workers' cache directory, once per parent process, and remove
    it, if a worker created it, when this process exits."""
    global _CACHE_DIR
    if _CACHE_DIR is not None or _in_chain_worker():
        return
    _CACHE_DIR = os.path.join(
        tempfile.gettempdir(), f"pymc_sgmcmc-xla-cache-{os.getpid()}-{secrets.token_hex(4)}"
    )
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not in a forked child that runs exit handlers
            shutil.rmtree(_CACHE_DIR, ignore_errors=True)

    atexit.register(remove)


def _in_chain_worker() -> bool:
    """Whether this process is one of PyMC's chain workers (``pymc.sampling.parallel``)."""
    return multiprocessing.current_process().name.startswith("worker_chain_")


def use_worker_cache(path: str | None) -> None:
    """In one of PyMC's chain workers, compile through the shared cache at ``path`` unless
    JAX's cache is configured already. Called when a step is unpickled and when it first
    compiles, before the worker compiles anything for it."""
    if path is None or not _in_chain_worker():
        return
    import jax

    if jax.config.jax_compilation_cache_dir:
        return  # the user's own persistent cache, or set by an earlier step in this worker
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX caches only compilations over 1 s by default; a chain's tuning functions take less.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if importlib.util.find_spec("filelock") is not None:
        # Workers start together: with a size limit JAX takes a file lock around each read
        # and write, so that no worker reads an entry another is still writing.
        jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)
    try:  # the cache reads the configuration once, at the first compilation in the process
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except Exception:  # private API moved: the setting applies if nothing compiled yet
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
        _name_worker_cache()
        if mp_ctx is None and jax_backend_started():
            if multiprocessing.get_start_method(allow_none=True) in (None, "fork"):
                mp_ctx = "forkserver"
        return original(mp_ctx, quiet=quiet)

    mcmc._initialize_multiprocessing_context = initialize
    _INSTALLED = True
