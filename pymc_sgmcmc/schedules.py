"""Step-size schedules: callables ``t -> step size`` that JAX can trace.

A hyperparameter that may be a number or a schedule (as in Optax) is normalised with
:func:`as_schedule`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp

__all__ = ["Schedule", "as_schedule", "constant", "polynomial_decay"]

Schedule = Callable[[object], object]


@dataclass(frozen=True)
class constant:  # noqa: N801  (a schedule, named like the Optax ones)
    """The same step size at every iteration."""

    value: float

    def __call__(self, iteration: object) -> object:
        return jnp.asarray(self.value)


@dataclass(frozen=True)
class polynomial_decay:  # noqa: N801
    r"""Welling & Teh's decreasing schedule :math:`\epsilon_t = a (b + t)^{-\gamma}`.

    Robbins–Monro conditions (:math:`\sum \epsilon_t = \infty`, :math:`\sum \epsilon_t^2 <
    \infty`) hold for :math:`\gamma \in (0.5, 1]`, which is checked.
    """

    a: float
    b: float = 1.0
    gamma: float = 0.55

    def __post_init__(self) -> None:
        if not (0.5 < self.gamma <= 1.0):
            raise ValueError(f"polynomial_decay needs gamma in (0.5, 1], got gamma={self.gamma}.")
        if self.a <= 0 or self.b <= 0:
            raise ValueError(f"polynomial_decay needs a > 0 and b > 0, got a={self.a}, b={self.b}.")

    def __call__(self, iteration: object) -> object:
        return self.a * (self.b + jnp.asarray(iteration)) ** (-self.gamma)


def as_schedule(value: float | Schedule, name: str = "step_size") -> Schedule:
    """Wrap a positive number in :class:`constant`; pass schedules through."""
    if callable(value):
        return value
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a positive number or a schedule t -> value "
            f"(e.g. pmsg.schedules.polynomial_decay(a=1e-4, b=10, gamma=0.55)), got {value!r}."
        ) from None
    if not number > 0:
        raise ValueError(f"{name} must be positive, got {value!r}.")
    return constant(number)
