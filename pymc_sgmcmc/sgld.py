"""SGLD (Welling & Teh 2011), preconditioned and automatically tuned: Langevin dynamics with
minibatch gradients and a decreasing or tuned step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from pymc_sgmcmc.adapter.step import LANGEVIN_STEP_CAP, SGMCMCStep, _preconditioner_summary
from pymc_sgmcmc.kernels import sgld
from pymc_sgmcmc.kernels.preconditioning import as_parameter
from pymc_sgmcmc.schedules import Schedule, as_schedule
from pymc_sgmcmc.tuning import NoiseEstimate, sgld_step_size
from pymc_sgmcmc.tuning.rates import Rates, langevin_rule
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, resolve_preconditioner

__all__ = ["SGLD"]


class SGLD(SGMCMCStep):
    r"""Stochastic-gradient Langevin dynamics (Welling & Teh 2011), preconditioned by the
    measured curvature; optionally pSGLD.

    .. math::

        \theta \leftarrow \theta + \frac{\epsilon_t}{2} G\, \nabla\log\hat p(\theta) + \xi,
        \qquad \xi \sim \mathcal N(0, \epsilon_t T G - \tfrac{\epsilon_t^2}{4} G S G)

    with :math:`G = A^{-1}` the inverse of the potential's curvature measured while tuning
    (the whitening of :mod:`pymc_sgmcmc.tuning.whitening`: every direction then has curvature
    about 1 whatever the units) and ``S`` the measured covariance of the minibatch gradient:
    the injected noise is what the target needs less what the minibatch already gives
    (:mod:`pymc_sgmcmc.tuning.rates`), so the stationary covariance is the posterior's also
    where the data do not inform a direction or the batch is the whole data set. With
    ``batch_size ≥ N`` (the default up to 4096 rows) the chain is Metropolis-adjusted (MALA,
    :mod:`pymc_sgmcmc.kernels.mala`) and exact.

    Automatic step. The largest :math:`\epsilon = 2h` (whitened units) whose minibatch noise is
    at most a share ``5·target_bias`` (default a quarter) of the noise the step needs, and
    ``h ≤ 0.25``: a misestimated gradient noise then moves the variances by at most
    ``target_bias`` per 20% of error. It relaxes in about ``2N/B`` iterations (two passes);
    ConstantSGD uses all the noise the minibatch can give and mixes four times faster, at the
    price of trusting the noise estimate.

    Parameters
    ----------
    step_size
        ``"auto"`` (default), a float ε, or a schedule such as
        ``pmsg.schedules.polynomial_decay(a, b, gamma)`` (:math:`a (b+t)^{-\gamma}`). A
        user's step is classic SGLD: noise ``N(0, ε T G)``, nothing subtracted.
    preconditioner
        ``"auto"`` (default: the dense whitening up to 500 dimensions, diagonal above),
        ``"full"``, ``"diagonal"``, ``None`` (``G = I``: not invariant to the units of the
        parameters) or ``"rmsprop"`` (pSGLD, Li et al. 2016).
    target_bias
        See "Automatic step" (default 0.05).
    search_draws
        Tuning draws spent reaching the mode (default 5).
    **kwargs
        See :class:`SGMCMCStep`.

    References
    ----------
    .. [1] Welling, M., Teh, Y. W. (2011). Bayesian learning via stochastic gradient Langevin
       dynamics. ICML.
    .. [2] Li, C., Chen, C., Carlson, D., Carin, L. (2016). Preconditioned stochastic gradient
       Langevin dynamics for deep neural networks. AAAI.
    .. [3] Mandt, S., Hoffman, M. D., Blei, D. M. (2017), §5.1.
    """

    name = "sgld"
    _share_per_bias: ClassVar[float] = 5.0  # the noise share is 5·target_bias (a quarter)

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        step_size: float | Schedule | str = "auto",
        preconditioner: str | None = "auto",
        target_bias: float = 0.05,
        search_draws: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(vars, **kwargs)
        if preconditioner not in (None, "auto", "rmsprop", "diagonal", "full"):
            raise ValueError(
                "SGLD preconditioner must be 'auto', 'full', 'diagonal', None or 'rmsprop', got "
                f"{preconditioner!r}."
            )
        # the default above the dense whitening's dimension looks for nested group structure
        # first (pymc_sgmcmc.tuning.structure), else stays diagonal
        self._structured_auto = preconditioner == "auto" and self.problem.dim > DENSE_MAX_DIM
        preconditioner = resolve_preconditioner(preconditioner, self.problem.dim)
        self.preconditioner = preconditioner
        self.precond_value: np.ndarray | None = None
        self.inject_value: np.ndarray | None = None
        if not (0 < target_bias < 1):
            raise ValueError(f"target_bias must be in (0, 1), got {target_bias!r}.")
        self.target_bias = float(target_bias)
        self.auto_step_size = step_size == "auto"
        self.schedule: Schedule | None = None if self.auto_step_size else as_schedule(step_size)
        self.step_size_value = float("nan")
        if int(search_draws) != search_draws or search_draws < 0:
            raise ValueError(f"search_draws must be a non-negative integer, got {search_draws!r}.")
        self.search_draws = int(search_draws)
        self.whitening_kind = {
            "full": "dense",
            "diagonal": "diagonal",
            None: "scalar",
            "rmsprop": "diagonal",
        }[preconditioner]
        self._noise = NoiseEstimate()  # pSGLD's automatic step only
        self._curvature = NoiseEstimate()
        self._tune_calls = 0
        if self.preconditioner == "rmsprop" or not self._whitened:
            return  # pSGLD, or a user's step without a preconditioner: classic, untuned
        if not self.auto_step_size:
            self.full_batch = False  # a user's step is unadjusted Langevin
        self._make_tuner(self.search_draws if self.auto_step_size else 0)

    @property
    def _whitened(self) -> bool:
        """Whether the chain moves in the measured whitening (``G = A⁻¹``)."""
        return self.preconditioner in ("full", "diagonal") or (
            self.preconditioner is None and self.auto_step_size
        )

    def _kernel(self):
        rmsprop = self.preconditioner == "rmsprop"
        temperature = self.temperature
        schedule = self.schedule
        preconditioned = self.tuner is not None

        def step(normal, state, grad_fn, params):
            eps = params["step_size"]
            if schedule is not None:
                eps = params["shrink"] * schedule(state.iteration)
            return sgld.step(
                None,
                state,
                grad_fn,
                eps,
                temperature=temperature,
                rmsprop=rmsprop,
                normal=normal,
                preconditioner=params["precond"] if preconditioned else None,
                preconditioner_sqrt=params["precond_sqrt"] if preconditioned else None,
            )

        return sgld.init, step

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        if not self.auto_step_size:
            # A user's ε: classic SGLD in the whitened coordinates (P = ε/2 A⁻¹, noise ε T A⁻¹;
            # a schedule scales both in the kernel).
            eps = float(self.schedule(0)) if self.schedule is not None else 1.0
            h = 0.5 * eps
            dim = noise_z.shape[0]
            injected = self.temperature * eps * np.ones(dim)
            if noise_z.ndim == 2:
                injected = self.temperature * eps * np.eye(dim)
            return Rates(h, np.full(dim, h), None, injected, 0.0, 1.0)
        return langevin_rule(
            noise_z,
            noise_share=min(1.0, self._share_per_bias * self.target_bias),
            step_cap=min(cap, LANGEVIN_STEP_CAP),
            temperature=self.temperature,
        )

    def _reset_tuning(self) -> None:
        self._noise.reset()
        self._curvature.reset()
        self._tune_calls = 0
        if self.auto_step_size:
            self.step_size_value = float("nan")
        if self.tuner is not None:
            self.precond_value = None

    def _tune_draw(self, state, fixed, key) -> None:
        if self.tuner is not None:
            super()._tune_draw(state, fixed, key)
            if self.tuned is not None:
                self.step_size_value = 2.0 * self.tuned.step_size
            return
        if self.preconditioner != "rmsprop" or not self.auto_step_size:
            return
        # pSGLD's automatic step (not whitened): the largest constant step whose stationary
        # variance inflation under the RMSprop preconditioner is target_bias.
        noise, curvature = self._estimate_noise(state.position, fixed, key)
        self._tune_calls += 1
        c = self._noise.update(noise)
        h = self._curvature.update(curvature)
        self.step_size_value = sgld_step_size(
            c,
            self.problem.data_size,
            self.batch_size,
            rmsprop=True,
            target_bias=self.target_bias,
            curvature=h,
        )

    def stop_tuning(self) -> None:
        super().stop_tuning()
        if self.tuner is not None and self.chain_state is not None and self.tuned is not None:
            self.step_size_value = 2.0 * self.tuned.step_size

    def _params(self, iteration: int) -> dict[str, Any]:
        if self.exact:
            return self._mala_params()
        dtype = self.problem.dtype
        if self.tuner is None:
            step = self.step_size_value if self.auto_step_size else float("nan")
            if self.schedule is not None and not self.auto_step_size:
                step = float(self.schedule(iteration)) if self.schedule is not None else step
            return {
                "step_size": np.asarray(
                    (self.step_size_value if self.auto_step_size else step) * self._shrink,
                    dtype=dtype,
                ),
                "shrink": np.asarray(self._shrink, dtype=dtype),
            }
        tuned = self.tuned
        assert tuned is not None
        whitening = tuned.whitening
        if self.auto_step_size:
            # ε = 2 h_max, G = P / h_max and √(εT)·S = R: the kernel's drift is P ∇log p̂
            # and its noise the tuned injection.
            eps = 2.0 * tuned.step_size
            precond = tuned.preconditioner * (1.0 / tuned.step_size)
            root = tuned.noise_factor * (1.0 / np.sqrt(eps * self.temperature))
        else:
            eps = float(self.schedule(0)) * self._shrink if self.schedule is not None else 1.0
            precond = whitening.covariance()
            root = whitening.factor()
        return {
            "step_size": np.asarray(eps, dtype=dtype),
            "shrink": np.asarray(self._shrink, dtype=dtype),
            "precond": as_parameter(precond, dtype),
            "precond_sqrt": as_parameter(root, dtype),
        }

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size": self.step_size_value if self.schedule is None else repr(self.schedule),
            "step_size_rule": "auto_noise_share" if self.auto_step_size else "user",
            "target_bias": self.target_bias,
            "preconditioner": self.preconditioner,
            **self._tuning_settings(),
            **(
                _preconditioner_summary(self.precond_value)
                if self.precond_value is not None
                else {}
            ),
        }
