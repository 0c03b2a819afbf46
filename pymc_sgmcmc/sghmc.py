r"""Stochastic-gradient Hamiltonian Monte Carlo (Chen, Fox & Guestrin 2014), tuned.

SGHMC's update (Chen et al., eq. 15) is SGD with momentum and injected noise,

.. math::

    v \leftarrow (1-\mu)\,v + P\,\nabla\log\hat p(\theta) + \xi, \qquad
    \theta \leftarrow \theta + v, \qquad \xi \sim \mathcal N(0, RR^\top),

with friction :math:`\mu` per iteration (their :math:`\alpha`), learning rate ``P`` (their
:math:`\eta M^{-1}`) and the injected noise :math:`2\alpha\eta - \eta^2\hat B` that leaves, with
the minibatch's own gradient noise, exactly what a Gaussian target of that curvature needs.
Here it is tuned as the other samplers are (:class:`~pymc_sgmcmc.tuning.tuner.Tuner`): in the
coordinates ``z`` where the measured curvature is the identity, ``P = h A^{-1}`` and the noise
budget of a unit-curvature Gaussian is solved exactly for the damped two-step recursion
(:func:`~pymc_sgmcmc.tuning.rates.noise_budget`), so the minibatch's measured noise and the
injected noise add up to the posterior's spread whatever ``B/N`` (no small-step limit).

**The friction.** With unit curvature the position is an AR(2) process. Plain Langevin
(:math:`\mu = 1`) at step ``h`` has an integrated autocorrelation time of about :math:`2/h`;
light friction lets the chain travel (momentum) and decorrelate faster — but too little leaves
the energy slow to mix (the squared position decorrelates slowly), and every unit of gradient
noise must be dissipated by the friction (Chen et al.'s :math:`\alpha \ge \eta\hat B/2`), so
where the minibatch is noisy, friction must be large. ``friction="auto"`` picks, at each
retune, the friction on a grid whose largest admissible step (stability, the noise budget)
gives the smallest autocorrelation time of the position and of its square, worst over
curvatures 0.5–2 in the whitened coordinates (the measured curvature is never exact). At the
step cap ``h = 0.25`` with little gradient noise it picks :math:`\mu \approx 0.2`: worst-case
autocorrelation time ~7 iterations against ~14 for plain Langevin at the same step; where the
gradient noise fills the budget it returns to :math:`\mu = 1`.

References
----------
.. [1] Chen, T., Fox, E., Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte Carlo.
   ICML.
.. [2] Ma, Y.-A., Chen, T., Fox, E. (2015). A complete recipe for stochastic gradient MCMC.
   NeurIPS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.linalg import solve_discrete_lyapunov

from pymc_sgmcmc.step_methods import (
    CONSTANT_SGD_STEP_CAP,
    LANGEVIN_NOISE_SHARE,
    _PreconditionedSGD,
)
from pymc_sgmcmc.tuning.rates import Rates, langevin_rule, largest_eigenvalue, noise_budget

__all__ = ["FRICTION_GRID", "SGHMC", "autocorrelation_time", "sghmc_rule"]

FRICTION_GRID = (0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.65, 1.0)
"""Frictions ``friction="auto"`` chooses among (1 is plain Langevin)."""
CURVATURES = (0.5, 1.0, 2.0)
"""Whitened curvatures over which the autocorrelation time is taken at its worst."""


def autocorrelation_time(step_size: float, friction: float, curvature: float = 1.0) -> float:
    r"""The larger of the integrated autocorrelation times of ``z`` and of ``z²`` for the
    damped recursion :math:`v' = (1-\mu)v - h\lambda z + \epsilon,\ z' = z + v'` (a Gaussian
    target of curvature λ), in iterations; ``inf`` if it is unstable. Closed form: with
    transition ``T`` and stationary covariance ``S``, the autocovariances are
    :math:`e_1^\top T^k S e_1`, summed by :math:`(I-T)^{-1}`, and their squares by a second
    Lyapunov equation."""
    h, mu = float(step_size) * float(curvature), float(friction)
    transition = np.array([[1.0 - h, 1.0 - mu], [-h, 1.0 - mu]])
    if np.max(np.abs(np.linalg.eigvals(transition))) >= 1.0:
        return float("inf")
    cov = solve_discrete_lyapunov(transition, np.ones((2, 2)))
    var = cov[0, 0]
    column = cov[:, 0]
    summed = np.linalg.solve(np.eye(2) - transition, column)[0] - var  # Σ_{k≥1} acov(k)
    squares = solve_discrete_lyapunov(transition, np.outer(column, column))[0, 0] - var**2
    return float(max(1.0 + 2.0 * summed / var, 1.0 + 2.0 * squares / var**2))


def sghmc_rule(
    noise: np.ndarray,
    *,
    step_cap: float,
    noise_share: float = 1.0,
    temperature: float = 1.0,
    friction: float | None = None,
) -> tuple[Rates, float]:
    """``(rates, friction)``: :func:`~pymc_sgmcmc.tuning.rates.langevin_rule` with momentum
    at the given ``friction``, or (``None``) at the friction of :data:`FRICTION_GRID` whose
    largest admissible step has the smallest worst-case :func:`autocorrelation_time`."""
    if friction is not None:
        rates = langevin_rule(
            noise,
            noise_share=noise_share,
            step_cap=step_cap,
            temperature=temperature,
            momentum=float(friction),
        )
        return rates, float(friction)
    # The step at each friction depends on the noise only through its largest eigenvalue
    # (one step for every direction, as langevin_rule with momentum): found here by bisection,
    # the full rule then run once at the chosen friction.
    largest = largest_eigenvalue(noise)
    best: tuple[float, float] | None = None
    for mu in reversed(FRICTION_GRID):  # from plain Langevin down: ties keep more friction
        step = _largest_step(largest, mu, step_cap, noise_share, temperature)
        if not step > 0:
            continue
        time = max(autocorrelation_time(step, mu, c) for c in CURVATURES)
        if best is None or time < 0.98 * best[0]:
            best = (time, mu)
    mu = 1.0 if best is None else best[1]
    rates = langevin_rule(
        noise,
        noise_share=noise_share,
        step_cap=step_cap,
        temperature=temperature,
        momentum=None if mu == 1.0 else mu,
    )
    return rates, mu


def _largest_step(
    largest: float, friction: float, step_cap: float, share: float, temperature: float
) -> float:
    """The largest step ``h ≤ step_cap`` whose gradient noise ``h² s_max`` fits ``share`` of
    the noise budget at ``friction`` (and is stable)."""

    def fits(h: float) -> bool:
        try:
            budget = noise_budget(h, None if friction == 1.0 else friction, temperature)
        except ValueError:
            return False
        return h * h * largest <= share * budget

    if fits(step_cap):
        return float(step_cap)
    lo, hi = 0.0, float(step_cap)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class SGHMC(_PreconditionedSGD):
    r"""Stochastic-gradient Hamiltonian Monte Carlo (Chen, Fox & Guestrin 2014), tuned.

    .. math::

        v \leftarrow (1-\mu)\,v + P\,\nabla\log\hat p(\theta) + \xi, \qquad
        \theta \leftarrow \theta + v

    (:func:`pymc_sgmcmc.kernels.sgd.step` with momentum) with friction μ, learning rate
    :math:`P = hA^{-1}` (``A`` the measured curvature) and
    injected noise ξ that, added to the minibatch's measured gradient noise, gives the
    posterior's spread exactly for a Gaussian target (:mod:`pymc_sgmcmc.sghmc`). Tuning is
    automatic (search for the mode, then measurements of the curvature and of the gradient
    noise, as :class:`~pymc_sgmcmc.ConstantSGD`); with ``batch_size ≥ N`` the chain runs MALA.

    Parameters
    ----------
    friction
        ``"auto"`` (default: re-chosen at every retune for the shortest autocorrelation time
        the step allows, see the module docstring) or a fixed μ in (0, 1] (1: no momentum,
        i.e. preconditioned Langevin).
    preconditioner
        ``"auto"`` (``"full"`` up to 500 dimensions, else ``"diagonal"``), ``"scalar"``,
        ``"diagonal"`` or ``"full"``: how the curvature whitens the coordinates.
    search_draws
        Tuning draws spent reaching the mode with local variables (default 5).
    **kwargs
        See :class:`~pymc_sgmcmc.SGMCMCStep` (``vars``, ``batch_size``, ``temperature``,
        ``thin``, ``minibatch``, ``data``, ``devices``, ``local_vars``, ...).

    References
    ----------
    .. [1] Chen, T., Fox, E., Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte
       Carlo. ICML.
    """

    name = "sghmc"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        friction: float | str = "auto",
        **kwargs: Any,
    ) -> None:
        if friction != "auto":
            if isinstance(friction, bool) or not isinstance(friction, int | float | np.number):
                raise ValueError(
                    f"friction must be 'auto' or a number in (0, 1], got {friction!r}."
                )
            if not 0.0 < float(friction) <= 1.0:
                raise ValueError(f"friction must be 'auto' or in (0, 1], got {friction!r}.")
        self.friction: float | None = None if friction == "auto" else float(friction)
        self.friction_value = 1.0 if self.friction is None else self.friction
        super().__init__(vars, **kwargs)
        self._make_tuner(self.search_draws)

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        # As ConstantSGD: all the noise the minibatch gives when it is measured whole (dense),
        # a quarter of it when only its diagonal is (its correlations then go uncorrected).
        share = 1.0 if noise_z.ndim == 2 else LANGEVIN_NOISE_SHARE
        rates, friction = sghmc_rule(
            noise_z,
            step_cap=min(cap, CONSTANT_SGD_STEP_CAP),
            noise_share=share,
            temperature=self.temperature,
            friction=self.friction,
        )
        self.friction_value = friction
        return rates

    def _reset_tuning(self) -> None:
        super()._reset_tuning()
        self.friction_value = 1.0 if self.friction is None else self.friction

    def _params(self, iteration: int) -> dict[str, Any]:
        params = super()._params(iteration)
        if not self.exact:
            searching = self.tuned is not None and self.tuned.searching
            friction = 1.0 if searching else self.friction_value
            params["momentum"] = np.asarray(friction, dtype=self.problem.dtype)
        return params

    def _check_momentum(self) -> float | None:
        return self.friction_value

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size_rule": "sghmc",
            "friction": "auto" if self.friction is None else self.friction,
            "friction_value": None if self.exact else self.friction_value,
        }
