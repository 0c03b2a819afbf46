r"""Step sizes and injected noise, computed in the whitened coordinates of
:class:`~pymc_sgmcmc.tuning.whitening.Whitening`.

Notation. In ``z`` (:math:`\theta = c + L z`, :math:`LL^\top = A^{-1}`) the potential has unit
curvature, :math:`\nabla_z U \approx z`. Every sampler of this package moves as

.. math::

    z \leftarrow z - h\,\hat g_z(z) + \xi,\qquad \xi \sim \mathcal N(0, Q),

(with momentum: :math:`v \leftarrow (1-\mu)v - h\hat g_z + \xi,\ z \leftarrow z + v`), where
:math:`\hat g_z` is the sampler's gradient estimate, whose noise covariance is ``S`` (for a
minibatch of ``B`` of ``N`` rows, :math:`S = (N^2/B)\,f\,L^\top C L` with ``C`` the per-datum
gradient covariance and ``f`` the minibatch scheme's factor). In θ this is
:math:`\theta \leftarrow \theta - hA^{-1}\hat g + L\xi`: the preconditioner is :math:`P = hA^{-1}`.

The noise the target needs. On a Gaussian target with unit curvature, ``z`` is an AR(1) process
per coordinate, :math:`z' = (1-h)z + \epsilon`, whose stationary variance is
:math:`\operatorname{Var}\epsilon/(h(2-h))`. For the tempered posterior
:math:`p^{1/T}` (variance ``T``) the step needs noise :math:`T h (2-h)` per coordinate — the
*budget*. The minibatch supplies :math:`h^2 S`; the rest is injected:

.. math::

    Q = T\,h(2-h)\,I - h^2 S \quad(\succeq 0).

This is what makes the stationary covariance :math:`A^{-1}` wherever the Fisher identity
:math:`A = NC` fails — a direction only the prior informs (``S = 0`` there: all of its noise is
injected), a hierarchical prior, a full batch (``S = 0``), over- or under-dispersed data — and
it is exact in discrete time (no :math:`O(h)` inflation on a Gaussian target). With momentum
the budget is the exact stationary variance of the damped AR(2) (:func:`noise_budget`).

How large a step. ``Q ⪰ 0`` needs :math:`h^2\lambda_{max}(S) \le T h(2-h)`. A sampler takes the
largest ``h ≤ step_cap`` whose minibatch noise is at most a share ``s`` of the budget:
``s = 1`` is constant SGD's regime (the step the theorems of Mandt et al. 2017 call
KL-optimal: all the noise the data can give, :math:`h \approx 2B/N` in the Fisher regime);
a smaller share (the Langevin family) costs mixing time and buys robustness — an error ``δ`` in
the estimate of ``S`` moves the stationary variances by at most ``s·δ``. ``step_cap`` bounds the
discretisation error on non-Gaussian posteriors.

IASG (Mandt et al. §6) takes large steps and averages a window of ``W`` iterates: the mean of
``W`` consecutive AR(1) iterates has variance :math:`\operatorname{Var}\epsilon/(h^2 W_{eff})`
(:func:`effective_window`), so the budget is :math:`T h^2 W_{eff}` and
:math:`Q = T h^2 W_{eff} I - h^2 S`; where ``S`` exceeds it (over-dispersed data) the draws are
too wide by that factor and it is reported as ``overdispersion``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.linalg import solve_discrete_lyapunov

__all__ = [
    "Rates",
    "effective_window",
    "iasg_rule",
    "iasg_window",
    "langevin_rule",
    "largest_eigenvalue",
    "noise_budget",
    "sgld_step_size",
]


class Rates(NamedTuple):
    """A tuned step in whitened coordinates: a step ``h_j`` along each eigendirection of the
    gradient-noise covariance ``S`` (its eigenvectors ``basis``; None when ``S`` is a
    diagonal: the coordinates), and the injected noise."""

    step_size: float
    """The largest ``h_j`` (the step along directions with little gradient noise)."""
    steps: np.ndarray
    """``(D,)`` the step along each direction of ``basis``."""
    basis: np.ndarray | None
    injected: np.ndarray
    """``Q``: covariance (in ``z``) of the Gaussian noise added to every iteration."""
    noise_share: float
    """Largest share of a direction's noise budget that the gradient noise supplies."""
    overdispersion: float
    """``max(1, h² s / budget)`` over the directions: above 1, the gradient noise alone
    exceeds what the target allows and the draws are too wide along it by about this factor
    (only where a step cannot shrink, e.g. a fixed user step)."""
    budgets: np.ndarray | None = None
    """``(D,)`` each direction's whole noise budget (gradient noise plus injected), or None
    (a user's step, the search). With it the injected noise can be the exact
    ``Q = diag(budgets) − P S P`` where ``S`` is known beyond its diagonal
    (:meth:`pymc_sgmcmc.tuning.structure.StructuredWhitening.injection_factor`)."""

    def preconditioner(self) -> np.ndarray:
        """``P_z``: ``(D, D)``, or ``(D,)`` along the coordinates."""
        if self.basis is None:
            return self.steps.copy()
        return (self.basis * self.steps) @ self.basis.T


def largest_eigenvalue(matrix: np.ndarray) -> float:
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.size == 0:
        return 0.0
    if matrix.ndim == 1:
        return float(matrix.max())
    return float(np.linalg.eigvalsh(0.5 * (matrix + matrix.T))[-1])


def _spectrum(noise: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    noise = np.asarray(noise, dtype=np.float64)
    if noise.ndim == 1:
        return np.maximum(noise, 0.0), None
    w, v = np.linalg.eigh(0.5 * (noise + noise.T))
    return np.maximum(w, 0.0), v


def noise_budget(
    step_size: float, momentum: float | None = None, temperature: float = 1.0
) -> float:
    r"""Noise variance per iteration that gives a unit-curvature Gaussian target the stationary
    variance ``temperature``.

    Plain (``momentum=None``): :math:`T h (2-h)`. With damping μ the position follows
    :math:`v' = (1-\mu)v - h z + \epsilon,\ z' = z + v'`; its stationary variance per unit of
    noise is read off the discrete Lyapunov equation of that AR(2) (exact, no small-step
    limit)."""
    h = float(step_size)
    if momentum is None or momentum == 1.0:
        return temperature * h * (2.0 - h)
    mu = float(momentum)
    transition = np.array([[1.0 - h, 1.0 - mu], [-h, 1.0 - mu]])
    if np.max(np.abs(np.linalg.eigvals(transition))) >= 1.0:
        raise ValueError(f"step size {h} with momentum {mu} is unstable")
    g = np.ones((2, 1))
    var_x = solve_discrete_lyapunov(transition, g @ g.T)[0, 0]
    return temperature / float(var_x)


def langevin_rule(
    noise: np.ndarray,
    *,
    noise_share: float,
    step_cap: float,
    temperature: float = 1.0,
    momentum: float | None = None,
) -> Rates:
    r"""Along each eigendirection ``j`` of ``S`` (eigenvalue ``s_j``), the largest
    ``h_j ≤ step_cap`` whose gradient noise ``h_j² s_j`` is at most ``noise_share`` of the
    budget, and the noise ``Q`` to inject (module docstring).

    With unit curvature the directions decouple, so each can take its own step: Mandt et al.'s
    full KL-optimal preconditioner (Theorem 2) is this with ``P_z ∝ S⁻¹``. A direction the
    data over-disperse gets a smaller step, one only the prior informs (``s_j = 0``) the cap.
    Without momentum the step is in closed form, :math:`h_j = 2sT/(s_j + sT)` (from
    :math:`h^2 s_j = sTh(2-h)`); with momentum one step for all directions is found by
    bisection on :func:`noise_budget`."""
    if not 0.0 < noise_share <= 1.0:
        raise ValueError(f"noise_share must be in (0, 1], got {noise_share!r}")
    values, basis = _spectrum(noise)
    s, t = float(noise_share), float(temperature)
    if momentum is None:
        steps = np.minimum(step_cap, 2.0 * s * t / (values + s * t))
        budgets = t * steps * (2.0 - steps)
    else:
        lam = float(values.max(initial=0.0))

        def fits(h: float) -> bool:
            try:
                return h * h * lam <= s * noise_budget(h, momentum, t)
            except ValueError:
                return False

        lo, hi = 0.0, float(step_cap)
        if fits(hi):
            lo = hi
        else:
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        steps = np.full_like(values, lo)
        budgets = np.full_like(values, noise_budget(lo, momentum, t))
    return _rates(steps, values, basis, budgets)


def effective_window(window: int, step_size: float | np.ndarray) -> float | np.ndarray:
    r"""``W_eff``: the mean of ``W`` consecutive stationary AR(1) iterates with coefficient
    :math:`\rho = 1-h` has the variance of :math:`W_{eff}` independent draws of the long-run
    variance :math:`\operatorname{Var}\epsilon/h^2`:

    .. math::

        W_{eff} = W \Big/ \Big[1 - \frac{2\rho(1-\rho^W)}{W(1-\rho)(1+\rho)}\Big]
        \approx W + 1/h,

    larger than ``W`` because a finite window does not see the correlations reaching outside
    it."""
    rho = 1.0 - np.asarray(step_size, dtype=np.float64)
    w = float(window)
    deficit = 2.0 * rho * (1.0 - rho**w) / (w * (1.0 - rho) * (1.0 + rho))
    out = w / np.maximum(1.0 - deficit, 1e-12)
    return float(out) if np.ndim(out) == 0 else out


def iasg_window(target: float, step_size: float) -> int:
    """The smallest window ``W`` with ``W_eff ≥ target`` (about ``target − 1/h``): the window
    whose mean has the variance of ``target`` independent iterates."""
    for w in range(1, int(np.ceil(target)) + 1):
        if effective_window(w, step_size) >= target:
            return w
    return max(1, int(np.ceil(target)))


def iasg_rule(
    noise: np.ndarray, *, step_size: float, window: int, temperature: float = 1.0
) -> Rates:
    """IASG: the step ``h`` along every direction whose gradient noise fits the window's
    budget ``T h² W_eff``; along a direction the data over-disperse (``s_j > T·W_eff``) a
    smaller step, whose longer relaxation raises ``W_eff`` to ``s_j/T`` (module docstring)."""
    values, basis = _spectrum(noise)
    t = float(temperature)
    steps = np.full_like(values, float(step_size))
    over = np.nonzero(t * effective_window(window, step_size) < values)[0]
    if over.size:
        # bisection for every over-dispersed direction at once (W_eff grows as h shrinks,
        # ≈ W + 1/h): thousands of group effects each ask for one
        target = values[over]
        lo, hi = np.zeros(over.size), np.full(over.size, float(step_size))
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            fits = (mid > 0) & (t * effective_window(window, mid) >= target)
            lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
        steps[over] = np.maximum(lo, 1e-12)
    budgets = t * steps**2 * effective_window(window, steps)
    return _rates(steps, values, basis, budgets)


def _rates(
    steps: np.ndarray, values: np.ndarray, basis: np.ndarray | None, budgets: np.ndarray
) -> Rates:
    gradient = steps**2 * values
    injected_diag = np.maximum(budgets - gradient, 0.0)
    injected = injected_diag if basis is None else (basis * injected_diag) @ basis.T
    share = gradient / np.maximum(budgets, 1e-300)
    return Rates(
        float(steps.max(initial=0.0)),
        steps,
        basis,
        injected,
        float(share.max(initial=0.0)),
        float(max(1.0, share.max(initial=0.0))),
        budgets,
    )


def sgld_step_size(
    noise_diag: np.ndarray,
    data_size: int,
    batch_size: int,
    rmsprop: bool,
    target_bias: float,
    curvature: np.ndarray | None = None,
) -> float:
    r"""The largest constant SGLD step whose stationary variance inflation is ``target_bias``.

    For a Gaussian target with per-coordinate curvature :math:`a_k = N C_{kk}` (the Fisher
    identity, exact for well-specified models near the mode) and minibatch-gradient noise
    variance :math:`s_k^2 = N^2 C_{kk} / B`, one SGLD step
    :math:`\theta' = \theta - \tfrac{\epsilon}{2}(a\theta + s\xi_1) + \sqrt{\epsilon}\,\xi_2`
    has stationary variance :math:`(1 + \epsilon s^2/4) / (a (1 - \epsilon a / 4))`, i.e. a
    relative inflation of about :math:`\epsilon (s^2 + a)/4` (Mandt et al. 2017, §5.1).
    Setting that to ``target_bias`` in the worst coordinate gives
    :math:`\epsilon = 4\delta / \max_k (N^2 C_{kk}/B + N C_{kk})`. With the RMSprop
    preconditioner :math:`G_k \approx 1/s_k` the inflation is :math:`\epsilon s_k / 4`, so
    :math:`\epsilon = 4\delta / \max_k s_k`. When the diagonal Hessian of the potential
    ``curvature`` is given it replaces the Fisher proxy :math:`N C_{kk}` for :math:`a_k`
    (it also covers directions that only the prior informs).
    """
    noise_diag = np.maximum(np.asarray(noise_diag, dtype=np.float64), 1e-300)
    a = data_size * noise_diag if curvature is None else np.abs(np.asarray(curvature))
    s2 = data_size**2 * noise_diag / batch_size + a
    if rmsprop:
        return float(4.0 * target_bias / np.sqrt(s2).max())
    return float(4.0 * target_bias / s2.max())
