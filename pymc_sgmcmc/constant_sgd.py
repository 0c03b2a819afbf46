"""ConstantSGD (Mandt, Hoffman & Blei 2017): SGD at a constant learning rate whose stationary
distribution, with a tuned preconditioner and injected noise, matches the posterior.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.adapter.step import LANGEVIN_NOISE_SHARE
from pymc_sgmcmc.preconditioned_sgd import _PreconditionedSGD
from pymc_sgmcmc.schedules import Schedule, as_schedule, polynomial_decay
from pymc_sgmcmc.tuning.rates import Rates, langevin_rule

__all__ = ["ConstantSGD"]

CONSTANT_SGD_STEP_CAP = 0.25  # whitened units: the discretisation limit on skewed posteriors


class ConstantSGD(_PreconditionedSGD):
    r"""Constant-rate SGD as an approximate posterior sampler (Mandt, Hoffman & Blei 2017).

    .. math::

        v \leftarrow (1-\mu) v - P \hat g(\theta), \qquad \theta \leftarrow \theta + v

    (``momentum=None`` is plain SGD, :math:`\mu = 1`). Near the mode the iterates are an
    Ornstein–Uhlenbeck process with stationary covariance Σ solving
    :math:`P A_U \Sigma + \Sigma A_U P = P (N^2 C / B) P` (§4.1).

    Tuning (``step_size="auto"``, the default) estimates the per-datum gradient covariance
    ``C`` online and sets the KL-optimal preconditioner
    (:func:`~pymc_sgmcmc.tuning.kl_optimal_preconditioner`): ``"scalar"`` :math:`2BD/(N^2 \operatorname{Tr} C)`
    (Theorem 1), ``"diagonal"`` :math:`2B/(N^2 C_{kk})` (Corollary 3), ``"full"``
    :math:`(2B/N^2) C^{-1}` (Theorem 2; its stationary covariance is the Laplace posterior
    :math:`A_U^{-1}` when :math:`A = C`). It is multiplied by ``temperature`` (Σ scales with P)
    and, with momentum, by μ (the stationary covariance of damped SGD at ``P`` is that of
    plain SGD at :math:`P/\mu`, §4.3). Without momentum, ``"full"`` is also multiplied by
    :math:`N/(N + TB)`: the theorems are for the continuous-time limit, while the iterates
    are an AR(1) that contracts by :math:`a = 2TB/N` per step in every direction, with
    stationary variance :math:`a/(2-a)` rather than :math:`a/2` in posterior units; the
    factor makes it exact (it matters when B/N is not small: at B/N = 1/2 the sds were
    1.26–1.36× exact without it). The first ``search_draws`` tuning draws reach the
    mode first, with IASG's large preconditioned rate :math:`P = (0.5/N)\hat C^{-1}`
    re-estimated at each draw.

    Parameters
    ----------
    step_size
        ``"auto"`` or a float: a fixed scalar ``P`` (no tuning; ``preconditioner`` must then
        be ``"scalar"`` or ``"auto"``).
    preconditioner
        ``"auto"`` (``"full"`` up to 500 dimensions, else ``"diagonal"``), ``"scalar"``,
        ``"diagonal"`` or ``"full"``.
    momentum
        Damping μ in (0, 1], or None.
    search_draws
        Tuning draws spent reaching the mode before ``C`` is averaged (default 5).
    hyper_vars
        Variational EM (§4.2): free variables (e.g. a prior precision) that are
        point-estimated instead of sampled. During tuning, each draw is an E-step and a
        Robbins–Monro M-step: the other variables are sampled for one draw at ``P*``
        (computed from their block of ``C``) with the hyperparameters held fixed, then the
        hyperparameters take one step up the draw's mean minibatch gradient of the log-joint —
        of λ itself, without the log-Jacobian of its transform, as befits a point estimate —
        in Newton units, ``λ ← λ + ρ_k ḡ_λ / h_λ`` with ``h_λ`` the potential's curvature
        along λ (so ``ρ_k ≤ 1`` is a damped, stochastic EM fixed-point step whatever λ's
        scale). Holding λ fixed within a draw matters: moved at every iteration, λ ran ahead
        of the sampled spread, and on a 10-weight regression settled at 5× the
        empirical-Bayes value. At ``stop_tuning`` they are frozen: every saved draw holds the
        final value, and the trajectory (unconstrained values) is the
        ``hyper_<value var>[_<k>]`` stats, e.g. ``hyper_lam_log__`` — over the tuning draws in
        ``warmup_sample_stats`` with ``discard_tuned_samples=False`` — and
        ``step.hyper_trajectory``. Give enough tuning draws for them to converge (the
        digits example in the docs uses 1500).
    hyper_rate
        ``ρ_k``: a float or a schedule of the draw index ``k`` (default
        ``polynomial_decay(a=1, b=1, gamma=0.6)``: a full EM step at the first draw, then
        ``(1 + k)^-0.6``).
    **kwargs
        See :class:`SGMCMCStep` (``vars``, ``batch_size``, ``temperature``, ``thin``,
        ``minibatch``, ``minibatch_data``).

    References
    ----------
    .. [1] Mandt, S., Hoffman, M. D., Blei, D. M. (2017). Stochastic Gradient Descent as
       Approximate Bayesian Inference. JMLR 18(134), §4.
    """

    name = "constant_sgd"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        step_size: float | str = "auto",
        momentum: float | None = None,
        preconditioner: str = "auto",
        hyper_vars: Sequence[Any] | None = None,
        hyper_rate: float | Schedule | None = None,
        **kwargs: Any,
    ) -> None:
        self.auto_step_size = step_size == "auto"
        if not self.auto_step_size:
            fixed_rate = float(as_schedule(step_size).value)  # type: ignore[attr-defined]
            if preconditioner not in ("auto", "scalar"):
                raise ValueError(
                    f"A fixed step_size={step_size!r} is a scalar rate; preconditioner="
                    f"{preconditioner!r} needs step_size='auto' (it is tuned from the gradient noise)."
                )
            preconditioner = "scalar"
        super().__init__(vars, preconditioner=preconditioner, **kwargs)
        if momentum is not None and not (0.0 < float(momentum) <= 1.0):
            raise ValueError(f"momentum (damping μ) must be in (0, 1], got {momentum!r}.")
        self.momentum = None if momentum is None else float(momentum)
        if not self.auto_step_size:
            self.search_draws = 0
            self.precond_value = np.asarray(fixed_rate)
        self.hyper_names: list[str] = []
        self.hyper_trajectory: list[np.ndarray] = []
        self.hyper_schedule: Schedule | None = None
        if hyper_vars:
            if not self.auto_step_size:
                raise ValueError("hyper_vars (variational EM) needs step_size='auto'.")
            self._setup_hyper(hyper_vars, hyper_rate)
        if self.auto_step_size:
            if self._sampled_idx is not None:
                # Variational EM moves the hyperparameters between draws: no MALA.
                self.full_batch = False
            self._make_tuner(self.search_draws)

    def _setup_hyper(self, hyper_vars: Sequence[Any], hyper_rate: Any) -> None:
        model = self.problem.model
        names = []
        for v in hyper_vars:
            name = v if isinstance(v, str) else v.name
            rv = model.named_vars.get(name)
            value = model.rvs_to_values.get(rv) if rv is not None else None
            if value is None and rv in model.value_vars:
                value = rv
            if value is None or value.name not in [i.name for i in self.problem.var_infos]:
                raise ValueError(
                    f"hyper_vars contains {name!r}, which is not one of this step's free "
                    f"variables {[i.name for i in self.problem.var_infos]}."
                )
            names.append(value.name)
        hyper_idx, start = [], 0
        for info in self.problem.var_infos:
            if info.name in names:
                hyper_idx.extend(range(start, start + info.size))
            start += info.size
        if len(hyper_idx) == self.problem.dim:
            raise ValueError("hyper_vars covers every variable: nothing would be sampled.")
        self.hyper_names = names
        self._hyper_idx = np.asarray(hyper_idx)
        self._sampled_idx = np.setdiff1d(np.arange(self.problem.dim), self._hyper_idx)
        self.hyper_schedule = as_schedule(
            hyper_rate if hyper_rate is not None else polynomial_decay(a=1.0, b=1.0, gamma=0.6),
            "hyper_rate",
        )
        # PyMC's NDArray trace stores scalar stats only: one stat per hyper coordinate.
        self._hyper_stat_names = []
        for info in self.problem.var_infos:
            if info.name in names:
                for k in range(info.size):
                    suffix = f"_{k}" if info.size > 1 else ""
                    self._hyper_stat_names.append(f"hyper_{info.name}{suffix}")
        shapes = dict(self.stats_dtypes_shapes)
        for stat in self._hyper_stat_names:
            shapes[stat] = (np.float64, [])
        self.stats_dtypes_shapes = shapes
        self.stats_dtypes = [{k: dtype for k, (dtype, _) in shapes.items()}]

    def _hyper_schedule(self) -> Schedule | None:
        return self.hyper_schedule

    def _extra_stats(self, state: Any) -> dict[str, Any]:
        if not self.hyper_names:
            return {}
        values = np.asarray(state.position)[self._hyper_idx]
        if self.tune:
            self.hyper_trajectory.append(values)
        return {name: float(v) for name, v in zip(self._hyper_stat_names, values, strict=True)}

    def _reset_tuning(self) -> None:
        super()._reset_tuning()
        self.hyper_trajectory = []

    def _momentum(self) -> float | None:
        return self.momentum

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        # All the noise the minibatch can give (share 1): the largest step whose gradient
        # noise fits the budget, the rest injected (pymc_sgmcmc.tuning.rates) — with a dense
        # whitening, or a structured one whose injection is exact (nested groups:
        # StructuredWhitening.injection_factor). Under a diagonal whitening (or crossed
        # factors) only the noise's diagonal is corrected: its correlations (strong in a
        # softmax's classes) then stay, so the minibatch may give only a quarter of the
        # noise (the draws' variances then err by at most a quarter of that mismatch): on
        # 600 group effects coupled to a global by an uncentred predictor (noise correlation
        # 0.93 per row), share 1 gave the global 0.39x its sd, a quarter 0.88x
        # (tests/test_large_dim.py).
        share = (
            1.0
            if noise_z.ndim == 2 or getattr(whitening, "injects_exactly", False)
            else LANGEVIN_NOISE_SHARE
        )
        return langevin_rule(
            noise_z,
            noise_share=share,
            step_cap=min(cap, CONSTANT_SGD_STEP_CAP),
            temperature=self.temperature,
            momentum=self.momentum,
        )

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size_rule": "kl_optimal" if self.auto_step_size else "fixed",
            "momentum": self.momentum,
        }
