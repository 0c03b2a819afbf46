"""Float64 for this package's JAX computations, without touching the user's global setting.

PyMC's default ``floatX`` is float64, and the samplers need it (natural-units posteriors
reach condition numbers of 10¹²; see :mod:`pymc_sgmcmc.tuning.whitening`). JAX computes in
float32 unless ``jax_enable_x64`` is on. Setting it globally (``jax.config.update``) — as this
package did until now — changes every other JAX computation in the user's process. Instead
every entry point that runs JAX enters :func:`float64_scope`, JAX's thread-local
``jax.enable_x64`` context, for as long as it runs: the steps' methods (through
:class:`Float64Methods`), :func:`pymc_sgmcmc.sample` and its threads, and the model-checking
functions. Arrays made inside keep their float64 dtype outside.

PyTensor's JAX backend sets ``jax_enable_x64`` globally when it is imported; this package
imports it through :func:`import_pytensor_jax`, which puts the user's value back — and, as
PyMC's own JAX samplers (``nuts_sampler="numpyro"``) rely on that import's setting, applies
it when they are imported later.

The one place a user meets it: the callables of ``MinibatchProblem.jax_functions()`` compute
in float32 when called outside a scope; call them inside ``with jax.enable_x64(True):`` (or
``pymc_sgmcmc.float64_scope()``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import jax
import pytensor

__all__ = [
    "Float64Methods",
    "callers_x64",
    "float64_scope",
    "import_pytensor_jax",
    "in_float64",
    "in_float64_of_step",
    "step_dtype",
]

F = TypeVar("F", bound=Callable[..., Any])


def float64_scope(dtype: str | None = None) -> contextlib.AbstractContextManager:
    """JAX's float64 for the ``with`` block (thread-local), when ``dtype`` — PyTensor's
    ``floatX`` if None — is float64; else nothing changes."""
    if dtype is None:
        dtype = str(pytensor.config.floatX)
    if dtype != "float64":
        return contextlib.nullcontext()
    return jax.enable_x64(True)


def in_float64(function: F) -> F:
    """``function`` run inside :func:`float64_scope` (PyTensor's current ``floatX``)."""
    return _scoped(function, lambda *args, **kwargs: None)


def in_float64_of_step(function: F) -> F:
    """``function(..., step=...)`` (or with the step first) run inside :func:`float64_scope`
    of the step's model's dtype — the ``floatX`` the model was built with, not the current
    one (the current one for a step not bound to a model yet)."""
    return _scoped(function, lambda *args, **kwargs: step_dtype(kwargs.get("step", args[:1])))


def step_dtype(step: Any) -> str | None:
    """The dtype of ``step``'s model (``problem.dtype``), None when it has none (yet)."""
    if isinstance(step, tuple):
        step = step[0] if step else None
    return getattr(getattr(step, "__dict__", {}).get("problem"), "dtype", None)


def callers_x64() -> Callable[[], contextlib.AbstractContextManager]:
    """Read in the calling thread: a factory of contexts with its effective float64 setting,
    for a worker thread to enter (``jax.enable_x64`` is thread-local: a pool thread starts
    from the global value)."""
    x64 = bool(jax.config.jax_enable_x64)
    return lambda: jax.enable_x64(x64)


def _scoped(function: F, dtype_of: Callable[..., str | None]) -> F:
    @functools.wraps(function)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with float64_scope(dtype_of(*args, **kwargs)):
            return function(*args, **kwargs)

    return scoped  # type: ignore[return-value]


class Float64Methods:
    """Mixin: the methods named in ``FLOAT64_METHODS`` run inside :func:`float64_scope`, in
    this class and in every subclass that defines its own."""

    FLOAT64_METHODS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.FLOAT64_METHODS:
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "_in_float64", False):
                scoped = _in_own_float64(method)
                scoped._in_float64 = True  # type: ignore[attr-defined]
                setattr(cls, name, scoped)


def _in_own_float64(method: F) -> F:
    """``method`` inside :func:`float64_scope` of its object's model's dtype."""
    return _scoped(method, lambda self, *args, **kwargs: step_dtype(self))


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
