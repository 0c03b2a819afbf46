"""Step-size adaptation of the full-batch MALA chains: dual averaging on the acceptance rate
(Nesterov 2009; Hoffman & Gelman 2014, as Stan and PyMC's NUTS adapt their step)."""

from __future__ import annotations

import math

__all__ = ["MALA_TARGET_ACCEPTANCE", "StepSizeAdaptation", "initial_mala_step"]

MALA_TARGET_ACCEPTANCE = 0.65
"""Above the asymptotically optimal 0.574 (Roberts & Rosenthal 1998): a little safer on the
skewed posteriors of small data sets, at a small cost in step."""


def initial_mala_step(dim: int) -> float:
    """``h₀`` in whitened units (``P = h A⁻¹``): MALA's optimal proposal variance on a
    ``D``-dimensional standard Gaussian is about ``1.65² D^(-1/3)`` = ``2h``."""
    return min(1.0, 0.5 * 1.65**2 * max(dim, 1) ** (-1.0 / 3.0))


class StepSizeAdaptation:
    """Dual averaging of ``log h`` towards a target acceptance probability; ``update`` once per
    tuning draw with the draw's mean acceptance, ``final`` the averaged step."""

    def __init__(
        self,
        initial: float,
        target: float = MALA_TARGET_ACCEPTANCE,
        gamma: float = 0.05,
        t0: float = 10.0,
        kappa: float = 0.75,
    ) -> None:
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
        self.mu = math.log(10.0 * initial)
        self.log_step = math.log(initial)
        self.log_step_bar = 0.0
        self.error_sum = 0.0
        self.count = 0

    @property
    def current(self) -> float:
        return math.exp(self.log_step)

    def update(self, acceptance: float) -> float:
        if not math.isfinite(acceptance):
            acceptance = 0.0
        self.count += 1
        t = self.count
        self.error_sum += self.target - acceptance
        self.log_step = self.mu - math.sqrt(t) / self.gamma * self.error_sum / (t + self.t0)
        eta = t ** (-self.kappa)
        self.log_step_bar = eta * self.log_step + (1.0 - eta) * self.log_step_bar
        return self.current

    def final(self) -> float:
        if self.count:
            self.log_step = self.log_step_bar
        return self.current
