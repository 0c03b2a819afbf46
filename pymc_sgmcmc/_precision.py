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
imports it without changing the user's setting (:mod:`pymc_sgmcmc.adapter.precision`).

The one place a user meets it: the callables of ``MinibatchProblem.jax_functions()`` compute
in float32 when called outside a scope; call them inside ``with jax.enable_x64(True):`` (or
``pymc_sgmcmc.float64_scope()``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import jax

__all__ = [
    "Float64Methods",
    "callers_x64",
    "float64_scope",
    "step_dtype",
]

F = TypeVar("F", bound=Callable[..., Any])


def float64_scope(dtype: str | None) -> contextlib.AbstractContextManager:
    """JAX's float64 for the ``with`` block (thread-local) when ``dtype`` is float64 (a
    model's dtype; None, for a step with no model yet: nothing changes). The public
    ``pmsg.float64_scope()`` defaults to PyTensor's ``floatX``
    (:func:`pymc_sgmcmc.adapter.precision.float64_scope`)."""
    if dtype != "float64":
        return contextlib.nullcontext()
    return jax.enable_x64(True)


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
