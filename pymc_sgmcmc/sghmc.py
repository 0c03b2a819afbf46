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
curvatures 0.5–2 in the whitened coordinates (the measured curvature is never exact) and over
the directions, each with its own step. At the step cap ``h = 0.25`` with little gradient
noise it picks :math:`\mu = 0.3`: worst-case autocorrelation time 5.1 iterations against 15
for plain Langevin at the same step; where the gradient noise fills the budget it returns to
:math:`\mu = 1`, ConstantSGD's rule.

References
----------
.. [1] Chen, T., Fox, E., Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte Carlo.
   ICML.
.. [2] Ma, Y.-A., Chen, T., Fox, E. (2015). A complete recipe for stochastic gradient MCMC.
   NeurIPS.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.adapter.step import LANGEVIN_NOISE_SHARE
from pymc_sgmcmc.constant_sgd import CONSTANT_SGD_STEP_CAP
from pymc_sgmcmc.preconditioned_sgd import _PreconditionedSGD
from pymc_sgmcmc.tuning.rates import Rates, _rates, _spectrum, langevin_rule

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
    return float(_ar2(np.asarray([float(step_size) * float(curvature)]), float(friction))[1][0])


def _ar2(steps: np.ndarray, friction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(variance, time)`` for each step ``h`` (curvature folded in) at ``friction``: the
    stationary variance of ``z`` per unit of noise and the larger autocorrelation time of
    ``z`` and ``z²`` (:func:`autocorrelation_time`); ``inf`` and ``inf`` where unstable.
    Batched 2 × 2 Lyapunov equations (as 4 × 4 linear systems)."""
    h = np.asarray(steps, dtype=np.float64)
    b = 1.0 - float(friction)
    n = h.size
    trans = np.zeros((n, 2, 2))
    trans[:, 0, 0], trans[:, 0, 1], trans[:, 1, 0], trans[:, 1, 1] = 1.0 - h, b, -h, b
    det, trace = (1.0 - h) * b + h * b, 1.0 - h + b
    stable = (np.abs(det) < 1.0) & (np.abs(trace) < 1.0 + det)
    eye4 = np.eye(4)[None]
    kron = np.einsum("nij,nkl->nikjl", trans, trans).reshape(n, 4, 4)
    system = eye4 - kron
    system[~stable] = np.eye(4)  # placeholders, masked below
    cov = np.linalg.solve(system, np.ones((n, 4, 1)))[..., 0].reshape(n, 2, 2)
    var = cov[:, 0, 0]
    column = cov[:, :, 0]
    ident = np.eye(2)[None] - trans
    ident[~stable] = np.eye(2)
    summed = np.linalg.solve(ident, column[..., None])[:, 0, 0] - var
    outer = np.einsum("ni,nj->nij", column, column).reshape(n, 4, 1)
    squares = np.linalg.solve(system, outer)[:, 0, 0] - var**2
    with np.errstate(divide="ignore", invalid="ignore"):
        time = np.maximum(1.0 + 2.0 * summed / var, 1.0 + 2.0 * squares / var**2)
    return np.where(stable, var, np.inf), np.where(stable, time, np.inf)


def _worst_times(steps: np.ndarray, friction: float) -> np.ndarray:
    """:func:`autocorrelation_time` at its worst over :data:`CURVATURES`, per step."""
    steps = np.asarray(steps, dtype=np.float64)
    return np.max([_ar2(steps * c, friction)[1] for c in CURVATURES], axis=0)


def sghmc_rule(
    noise: np.ndarray,
    *,
    step_cap: float,
    noise_share: float = 1.0,
    temperature: float = 1.0,
    friction: float | None = None,
) -> tuple[Rates, float]:
    """``(rates, friction)`` in whitened coordinates (unit curvature).

    At a friction μ each eigendirection ``j`` of the gradient noise (eigenvalue ``s_j``) takes
    the largest step ``h_j ≤ step_cap`` whose noise ``h_j² s_j`` fits ``noise_share`` of the
    exact budget :func:`~pymc_sgmcmc.tuning.rates.noise_budget` ``(h_j, μ)`` — with unit
    curvature the directions decouple, so each has its own step, as in
    :func:`~pymc_sgmcmc.tuning.rates.langevin_rule` — and the rest of its budget is injected.
    ``friction=None`` picks μ from :data:`FRICTION_GRID`: the smallest worst-case
    :func:`autocorrelation_time` over the directions (less friction must gain 2% there),
    starting from μ = 1 — ConstantSGD's rule, which the choice then never makes slower in its slowest
    direction. Steps below the cap come from a table of each friction's budget over a
    geometric grid of steps (ratio 1.03; the grid point at or below the largest admissible
    step, so the noise always fits)."""
    values, basis = _spectrum(noise)
    share, temp = float(noise_share), float(temperature)
    plain = langevin_rule(noise, noise_share=share, step_cap=step_cap, temperature=temp)
    if friction is not None and float(friction) == 1.0:
        return plain, 1.0
    candidates = [float(friction)] if friction is not None else list(FRICTION_GRID)
    best: tuple[float, float, np.ndarray] | None = None
    for mu in sorted(candidates, reverse=True):  # from plain Langevin down
        if mu == 1.0:
            steps = plain.steps
            times = _worst_times(steps, 1.0)
        else:
            steps, times = _steps_and_times(values, mu, step_cap, share, temp)
        worst = float(times.max(initial=0.0))
        # Less friction must be clearly better in the slowest direction (2%); near-ties keep
        # more friction. Winning on the average alone is not enough: on radon (rare groups,
        # a funnel in the group scale) light friction chosen that way let a tuning draw
        # diverge, while the slowest direction gained nothing.
        if best is None or worst < 0.98 * best[0]:
            best = (worst, mu, steps)
    assert best is not None
    _, mu, steps = best
    if mu == 1.0:
        return plain, 1.0
    unique, inverse = np.unique(steps, return_inverse=True)
    budgets = temp / _ar2(unique, mu)[0][inverse]
    return _rates(steps, values, basis, budgets), mu


_STEP_GRID = np.geomspace(1e-8, 1.0, 631)  # ratio 1.03


@functools.cache
def _tables(friction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(tolerated, times)`` over :data:`_STEP_GRID` at ``friction``: the largest gradient
    noise a step tolerates per unit of the budget's temperature and share,
    ``noise_budget(h, μ) / h²`` (``-inf`` where unstable; decreasing in ``h``), and the
    worst-case autocorrelation time there. Once per friction and process."""
    var, _ = _ar2(_STEP_GRID, friction)
    tolerated = np.where(np.isfinite(var), 1.0 / (var * _STEP_GRID**2), -np.inf)
    return tolerated, _worst_times(_STEP_GRID, friction)


def _steps_and_times(
    values: np.ndarray, friction: float, step_cap: float, share: float, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per direction, the largest admissible step at ``friction`` and its autocorrelation
    time (the cap exactly where its noise fits there, else the grid point below)."""
    tolerated, times = _tables(friction)
    need = values / (share * temperature)
    var_cap = _ar2(np.asarray([step_cap]), friction)[0][0]
    at_cap = 1.0 / (var_cap * step_cap**2) if np.isfinite(var_cap) else -np.inf
    # the largest grid step under the cap that tolerates the noise (tolerated decreases in h)
    usable = np.where(_STEP_GRID <= step_cap, tolerated, -np.inf)
    index = np.searchsorted(-usable, -need, side="right") - 1
    index = np.clip(index, 0, _STEP_GRID.size - 1)
    steps = np.where(need <= at_cap, step_cap, _STEP_GRID[index])
    cap_time = float(_worst_times(np.asarray([step_cap]), friction)[0])
    return steps, np.where(need <= at_cap, cap_time, times[index])


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
        # As ConstantSGD: all the noise the minibatch gives when the injection corrects it
        # whole (dense, or nested groups), a quarter of it when only its diagonal is.
        share = (
            1.0
            if noise_z.ndim == 2 or getattr(whitening, "injects_exactly", False)
            else LANGEVIN_NOISE_SHARE
        )
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
