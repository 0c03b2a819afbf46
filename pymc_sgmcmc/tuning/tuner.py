r"""The one tuning interface both drivers call: ``init`` at the start of a chain, ``update``
with each measurement of a tuning draw, ``final`` when tuning ends (as BlackJAX's window
adaptation and PyMC's step-size adaptation are built).

A chain's tuning has two phases.

*Search* (the first ``search_draws`` tuning draws). The chain descends to the mode region with
the preconditioner :math:`P = h_s A^{-1}` (``h_s = 0.5``: a damped Newton step whatever the
units) and no injected noise, ``A`` re-measured at every draw's position.

*Estimation* (the other tuning draws). The sampler runs with its own rates while the curvature
``A`` and the gradient-noise covariance ``S`` are measured at the chain's positions — every draw
at first, then on a geometric schedule (ratio :data:`MEASURE_GROWTH`) so that the dense
Hessians (``D`` Hessian-vector products each) stay a small part of tuning — and averaged over
doubling windows of measurements (:class:`~pymc_sgmcmc.tuning.averaging.WindowedMean`): the
average over the chain's positions is the posterior-averaged curvature, not the curvature at
one point. After each measurement the whitening and the rates are recomputed; ``final`` freezes
them.

Stability. A step ``h`` along the whitened curvature measured at a position,
:math:`\lambda_{max}(L^\top H L)`, must keep :math:`h\lambda_{max} \le 1` (SGD's limit is 2):
the step is capped accordingly — the injected noise then grows to fill the budget, so the cap
changes the mixing time, not the stationary covariance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pymc_sgmcmc.tuning.averaging import WindowedMean
from pymc_sgmcmc.tuning.rates import Rates, largest_eigenvalue
from pymc_sgmcmc.tuning.structure import StructuredCurvature, StructuredWhitening
from pymc_sgmcmc.tuning.whitening import Whitening

__all__ = ["MEASURE_GROWTH", "Measurement", "Tuned", "Tuner"]

MEASURE_EVERY_FIRST = 8
"""The first tuning draws after the search that are all measured."""
MEASURE_GROWTH = 1.25
"""Then a draw is measured when its index has grown by this factor since the last one."""
SEARCH_STEP = 0.5
FIXED_POINT_ITERATIONS = 40
"""Damped iterations of the rule on a noise that grows with the step (``Tuner._retuned``):
each at most halves the distance to the fixed point in log-step."""
EXACT_INJECTION_ATTEMPTS = 4
"""How many times the rule is asked again with its noise inflated until the gradient noise
fits the budgets along every direction (structured whitening; ``Tuner._retuned``)."""


@dataclass(frozen=True)
class Measurement:
    """What a tuning draw measures at the chain's position (θ units)."""

    curvature: np.ndarray | StructuredCurvature
    """Hessian of the potential: ``(D, D)``, its diagonal ``(D,)``, or with the model's nested
    structure (:mod:`~pymc_sgmcmc.tuning.structure`)."""
    noise: np.ndarray
    """Covariance of the sampler's gradient estimate (``(N²/B)·f·C`` for a minibatch):
    ``(D, D)`` or ``(D,)``."""
    fisher: np.ndarray | None = None
    """``N·C`` (``(D, D)`` or ``(D,)``), for the report of how far the Fisher identity
    ``A = N C`` holds; None where not measured."""
    stability: float | None = None
    """``λmax(A⁻¹ H)`` for the measured diagonal ``A`` (the diagonal fallback, measured on the
    device by power iteration); None to compute it on the host from a dense ``curvature``."""
    row_stiffness: float | None = None
    """``(N/B)·max_i λmax(A⁻¹ H_i)``: the curvature one row adds to a minibatch that holds it,
    in units of the posterior's (measured on every row where tuning reads every row); the
    step is capped at its inverse. None: not measured."""


@dataclass(frozen=True)
class Tuned:
    """The frozen or current tuning of a chain, in θ units and in whitened ones."""

    whitening: Whitening
    rates: Rates
    preconditioner: np.ndarray
    """``P = L P_z Lᵀ`` (``h A⁻¹`` with one step ``h``): ``(D, D)`` or ``(D,)``."""
    noise_factor: np.ndarray
    """``R`` with ``R Rᵀ = L Q Lᵀ``: the θ-space factor of the injected noise."""
    searching: bool
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def step_size(self) -> float:
        return self.rates.step_size


def whiten(curvature: Any) -> Whitening | StructuredWhitening:
    """The whitening of a measured curvature: dense, diagonal or structured."""
    if isinstance(curvature, StructuredCurvature):
        return StructuredWhitening.from_curvature(curvature)
    return Whitening.from_curvature(curvature)


class Tuner:
    """Per-chain tuning state.

    Parameters
    ----------
    rule
        ``S_z -> Rates``: the sampler's step and injected noise from the gradient-noise
        covariance in whitened coordinates (:mod:`~pymc_sgmcmc.tuning.rates`).
    search_draws
        Tuning draws spent reaching the mode.
    """

    def __init__(
        self,
        rule: Callable[..., Rates],
        search_draws: int,
        exact: bool = False,
        follow: bool = False,
        noise_grows_with_step: bool = False,
    ) -> None:
        self.rule = rule
        # A variance-reduced estimator's noise is the rows' gradient differences between the
        # chain and the stored points (SVRG's anchor, SAGA's table), which the chain drifts
        # from by about its step times the iterations since: the noise measured at one step
        # is not the noise at the step the rule then chooses (Tuner._retuned).
        self.noise_grows_with_step = noise_grows_with_step
        self.search_draws = int(search_draws)
        self.exact = exact  # a Metropolis-adjusted chain: no stability cap on its step
        # Variational EM moves the prior between draws: the curvature is then the latest
        # measurement's, measured at every tuning draw (an average over past draws lags behind
        # and under-injects noise, which shrinks the draws and pushes a precision up).
        self.follow = follow
        self.init()

    # -- the interface -------------------------------------------------------------------------
    def init(self) -> None:
        """Forget everything: a new chain."""
        self.draws = 0
        self.measurements = 0
        self._last_measured = 0
        self.curvature = WindowedMean()
        self.noise = WindowedMean()
        self.fisher = WindowedMean()
        self.noise_per_step = WindowedMean()
        self.step_cap_factor = 1.0
        self.current: Tuned | None = None
        self.last_measurement: Measurement | None = None
        self._frozen = False

    def wants_measurement(self, tuning: bool) -> bool:
        """Whether the coming draw should be measured first. Every search draw and the first
        draws after it are; then a geometric schedule. Outside tuning only a chain that was
        never measured (no tuning draws) is."""
        if self._frozen:
            return False
        if not tuning:
            return self.current is None
        k = self.draws - self.search_draws
        if k < MEASURE_EVERY_FIRST or self.follow:
            return True
        return k >= MEASURE_GROWTH * self._last_measured

    @property
    def searching(self) -> bool:
        return self.draws < self.search_draws and not self._frozen

    def update(self, measurement: Measurement, tuning: bool = True) -> Tuned:
        """Take a measurement made before the coming draw; returns the tuning to use for it."""
        searching = tuning and self.searching
        self.last_measurement = measurement
        if searching:
            whitening = whiten(measurement.curvature)
            noise = measurement.noise
        else:
            if tuning:
                self._last_measured = self.draws - self.search_draws
            self.measurements += 1
            averaged = self.curvature.update(measurement.curvature)
            whitening = whiten(measurement.curvature if self.follow else averaged)
            if self.noise_grows_with_step:
                self._update_noise_per_step(measurement.noise)
            noise = self.noise.update(measurement.noise)
            if measurement.fisher is not None:
                self.fisher.update(measurement.fisher)
        self.current = self._tuned(whitening, noise, measurement, searching)
        return self.current

    def advance(self, tuning: bool) -> None:
        """Count a finished draw."""
        if tuning:
            self.draws += 1

    def shrink(self, factor: float) -> Tuned | None:
        """A tuning draw diverged: cap the step at ``factor`` times the current one (the
        injected noise grows to keep the stationary covariance)."""
        self.step_cap_factor *= factor
        if self.current is None:
            return None
        self.current = self._retuned(self.current)
        return self.current

    def retune(self) -> Tuned | None:
        """Recompute the rates from the same measurements (the rule's own state changed, e.g.
        MALA's adapted step)."""
        if self.current is not None:
            self.current = self._retuned(self.current)
        return self.current

    def final(self) -> Tuned | None:
        """End of tuning: the rates in force are frozen (also when tuning ended inside the
        search: then from the last measurement's curvature and noise, with the sampler's own
        rule instead of the search step)."""
        if self.current is not None and self.current.searching:
            self.current = self._tuned(
                self.current.whitening, self._last_noise, None, searching=False
            )
        elif self.current is not None:
            self.current = self._retuned(self.current)
        self._frozen = True
        return self.current

    # -- internals -------------------------------------------------------------------------------
    def _update_noise_per_step(self, noise: Any) -> None:
        """Average the measured whitened noise per unit of the step each coordinate took in the
        draws before the measurement (those steps moved the chain away from the stored
        points). Coordinates only: a noise tuned along its eigendirections (a dense
        whitening) keeps the plain rule."""
        current = self.current
        if current is None or current.searching or current.rates.basis is not None:
            return
        s_z = current.whitening.to_whitened(noise)
        steps = np.asarray(current.rates.steps, dtype=np.float64)
        if np.ndim(s_z) != 1 or s_z.shape != steps.shape:
            return
        self.noise_per_step.update(np.asarray(s_z) / np.maximum(steps, 1e-300))

    def _noise_at_own_step(self, cap: float, whitening: Any) -> np.ndarray | None:
        r"""The whitened noise ``s_j = c_j h_j`` at the steps ``h_j`` the rule chooses for it:
        its fixed point, by iterating the rule damped in log-step (:math:`h \leftarrow
        \sqrt{h\,\mathrm{rule}(c h)}`, which converges whatever the noise's growth between
        none and linear: the undamped map's slope at the fixed point is in ``(−1, 0]``).

        Measured on 2 000 exact random intercepts (20 rows per group, B = 256 of 40 000
        rows): SVRG-LD's noise at a group effect grows as the chain drifts from the anchor,
        about ``2h`` per iteration for 157 iterations, while the group's rows are in one
        minibatch of 8. The rule fed the noise measured at the last step chose steps from
        10⁻⁵ to 0.13 for the groups (a low draw of the noise gave a large step, whose noise
        the next measurement found large); at the largest, a visit of the group's rows
        kicked it by tens of sds (one chain of two held two groups 67 and 43 sds away)."""
        per_step = self.noise_per_step.value
        if per_step is None or np.ndim(per_step) != 1:
            return None
        per_step = np.maximum(np.asarray(per_step, dtype=np.float64), 0.0)
        current = self.current
        h = (
            np.asarray(current.rates.steps, dtype=np.float64)
            if current is not None and current.rates is not None and current.rates.basis is None
            else np.full(per_step.shape, cap)
        )
        h = np.maximum(h, 1e-12)
        for _ in range(FIXED_POINT_ITERATIONS):
            chosen = np.asarray(self.rule(per_step * h, cap=cap, whitening=whitening).steps)
            h = np.sqrt(h * np.maximum(chosen, 1e-12))
        return per_step * h

    def _tuned(
        self,
        whitening: Whitening,
        noise: np.ndarray,
        measurement: Measurement | None,
        searching: bool,
    ) -> Tuned:
        self._last_noise = noise
        s_z = whitening.to_whitened(noise)
        report: dict[str, Any] = {"condition_number": whitening.condition_number}
        stiffest = 1.0
        if measurement is not None:
            if measurement.stability is not None:
                stiffest = float(measurement.stability)
            else:
                stiffest = largest_eigenvalue(whitening.to_whitened(measurement.curvature))
            if measurement.row_stiffness is not None:
                report["row_stiffness"] = float(measurement.row_stiffness)
                stiffest = max(stiffest, float(measurement.row_stiffness))
        self._stiffest = max(stiffest, 1e-300)
        if self.fisher.value is not None:
            f_z = whitening.to_whitened(self.fisher.value)
            report["fisher_ratio_max"] = largest_eigenvalue(f_z)
            report["fisher_ratio_min"] = (
                float(np.min(f_z)) if f_z.ndim == 1 else float(np.linalg.eigvalsh(f_z)[0])
            )
        tuned = Tuned(whitening, None, None, None, searching, report)  # type: ignore[arg-type]
        self._noise_z = s_z
        return self._retuned(tuned)

    def _retuned(self, tuned: Tuned) -> Tuned:
        cap = (1.0 if self.exact else min(1.0 / self._stiffest, 1.0)) * self.step_cap_factor
        # The whitened noise the rule sees: as measured, or (a noise that grows with the
        # step) at the rule's fixed point; derived here on every retune, never stored.
        s_z = self._noise_z
        if tuned.searching:
            h = min(SEARCH_STEP, cap)
            dim = s_z.shape[0]
            rates = Rates(h, np.full(dim, h), None, np.zeros_like(s_z), 0.0, 1.0)
        else:
            if self.noise_grows_with_step:
                grown = self._noise_at_own_step(cap, tuned.whitening)
                if grown is not None and grown.shape == np.shape(s_z):
                    s_z = grown
            rates = self.rule(s_z, cap=cap, whitening=tuned.whitening)
        whitening = tuned.whitening
        report = dict(tuned.report)
        factor = None
        if rates.budgets is not None and isinstance(self._last_noise, StructuredCurvature):
            # The minibatch's noise is known beyond its whitened diagonal: the rest of each
            # budget is injected exactly (StructuredWhitening.injection_factor). The rule saw
            # the diagonal only; where the noise exceeds the budgets along a combination of
            # coordinates (by ρ) the rule is asked again as if the noise were ρ times larger.
            inflation = 1.0
            for attempt in range(EXACT_INJECTION_ATTEMPTS):
                exact = whitening.injection_factor(rates.steps, rates.budgets, self._last_noise)
                if exact is None:
                    break
                factor, excess = exact
                report["noise_over_budget"] = excess
                if excess <= 1.0 or attempt == EXACT_INJECTION_ATTEMPTS - 1:
                    break
                inflation *= 1.02 * excess
                rates = self.rule(s_z * inflation, cap=cap, whitening=whitening)
        if factor is None:
            factor = whitening.position_noise_factor(rates.injected)
        precond = whitening.metric_from_whitened(rates.preconditioner())
        report["overdispersion"] = rates.overdispersion
        report["noise_share"] = rates.noise_share
        return Tuned(whitening, rates, precond, factor, tuned.searching, report)
