"""PyTensor's side of float64 (:mod:`pymc_sgmcmc._precision`): its ``floatX`` as the
default dtype, and the import of its JAX backend without changing the user's
``jax_enable_x64``.

PyTensor's JAX backend sets ``jax_enable_x64`` globally when it is imported; this package
imports it through :func:`import_pytensor_jax`, which puts the user's value back — and, as
PyMC's own JAX samplers (``nuts_sampler="numpyro"``) rely on that import's setting, applies
it when they are imported later.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import pytensor

import pymc_sgmcmc._precision as _precision

__all__ = ["float64_scope", "import_pytensor_jax", "in_float64", "in_float64_of_step"]

F = TypeVar("F", bound=Callable[..., Any])


def float64_scope(dtype: str | None = None) -> contextlib.AbstractContextManager:
    """JAX's float64 for the ``with`` block (thread-local), when ``dtype`` — PyTensor's
    ``floatX`` if None — is float64; else nothing changes."""
    return _precision.float64_scope(dtype or str(pytensor.config.floatX))


def in_float64(function: F) -> F:
    """``function`` run inside :func:`float64_scope` (PyTensor's current ``floatX``)."""
    return _precision._scoped(function, lambda *args, **kwargs: str(pytensor.config.floatX))


def in_float64_of_step(function: F) -> F:
    """``function(..., step=...)`` (or with the step first) inside :func:`float64_scope` of
    the step's model's dtype (:func:`pymc_sgmcmc._precision.step_dtype`), or of PyTensor's
    current ``floatX`` for a step not bound to a model yet (it is bound to one built now)."""

    def dtype(*args: Any, **kwargs: Any) -> str:
        step = kwargs.get("step", args[:1])
        return _precision.step_dtype(step) or str(pytensor.config.floatX)

    return _precision._scoped(function, dtype)


def import_pytensor_jax() -> Any:
    """Import PyTensor's JAX backend (returns ``pytensor.link.jax.dispatch``), keeping the
    user's ``jax_enable_x64``.

    ``pytensor.link.jax.dispatch`` sets ``jax_enable_x64`` globally on import (to whether
    ``floatX`` is float64). Imported first by this package, it would change the setting of
    the user's process; the value from before the import is put back. (Imported earlier by
    the user or by PyMC's JAX samplers, it has already done so and nothing changes here.)"""
    if "pytensor.link.jax.dispatch" in sys.modules:
        return sys.modules["pytensor.link.jax.dispatch"]

    # The global value (inside a float64_scope, jax.config reads the thread-local one).
    before = bool(jax.enable_x64.get_global())
    try:
        dispatch = importlib.import_module("pytensor.link.jax.dispatch")
    finally:
        jax.config.update("jax_enable_x64", before)
    if "pymc.sampling.jax" not in sys.modules:
        sys.meta_path.insert(0, _PyMCJaxSamplers())
    return dispatch


class _PyMCJaxSamplers(importlib.abc.MetaPathFinder):
    """PyMC's JAX samplers (``pymc.sampling.jax``: ``pm.sample(nuts_sampler="numpyro")``,
    ``"blackjax"``) rely on the import of PyTensor's JAX backend to switch ``jax_enable_x64``
    on. After :func:`import_pytensor_jax` that import has happened and been undone, so when
    PyMC's JAX samplers are imported later this finder applies PyTensor's setting then — what
    the user's process would have had at that point without this package. One use, then it
    leaves ``sys.meta_path``."""

    NAME = "pymc.sampling.jax"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            jax.config.update("jax_enable_x64", str(pytensor.config.floatX) == "float64")
            run(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
