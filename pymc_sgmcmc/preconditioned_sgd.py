"""The base of the samplers whose update is SGD with momentum and injected noise,
``v ← (1−μ)v + P ∇log p̂ + ξ, θ ← θ + v`` (:mod:`pymc_sgmcmc.kernels.sgd`): ConstantSGD, IASG,
SGHMC and SGFS. It turns the tuned rates into the kernel's preconditioner, injected noise and
damping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.adapter.step import SGMCMCStep, _preconditioner_summary
from pymc_sgmcmc.kernels import sgd
from pymc_sgmcmc.kernels.preconditioning import apply_to_rows, as_parameter
from pymc_sgmcmc.schedules import Schedule
from pymc_sgmcmc.tuning import NoiseEstimate
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, resolve_preconditioner

__all__: list[str] = []


class _PreconditionedSGD(SGMCMCStep):
    """Shared parts of the preconditioned constant-rate samplers (ConstantSGD, IASG, SGFS).

    The update is :math:`v \\leftarrow (1-\\mu)v + P\\nabla\\log\\hat p + \\xi,\\ \\theta
    \\leftarrow \\theta + v` (``μ = 1`` without momentum) with :math:`P = hA^{-1}` and injected
    noise :math:`\\xi \\sim \\mathcal N(0, RR^\\top)`, both tuned in whitened coordinates by
    :class:`~pymc_sgmcmc.tuning.tuner.Tuner` (search for the mode, then measurements of the
    curvature ``A`` and of the gradient noise at the chain's positions) with the sampler's
    rule (:meth:`_rates`). With ``batch_size ≥ N`` the chain runs MALA instead
    (:mod:`pymc_sgmcmc.kernels.mala`).
    """

    name = "preconditioned_sgd"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        preconditioner: str = "auto",
        search_draws: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(vars, **kwargs)
        if preconditioner not in ("auto", "scalar", "diagonal", "full"):
            raise ValueError(
                f"preconditioner must be 'auto', 'scalar', 'diagonal' or 'full', got {preconditioner!r}."
            )
        # the default above the dense whitening's dimension looks for nested group structure
        # first (pymc_sgmcmc.tuning.structure), else stays diagonal
        self._structured_auto = preconditioner == "auto" and self.problem.dim > DENSE_MAX_DIM
        preconditioner = resolve_preconditioner(preconditioner, self.problem.dim)
        self.preconditioner: str = preconditioner
        self.whitening_kind = {"full": "dense", "diagonal": "diagonal", "scalar": "scalar"}[
            preconditioner
        ]
        if int(search_draws) != search_draws or search_draws < 0:
            raise ValueError(f"search_draws must be a non-negative integer, got {search_draws!r}.")
        self.search_draws = int(search_draws)
        self._hyper_curvature = NoiseEstimate()
        self.precond_value: np.ndarray = np.asarray(np.nan)
        dim = self.problem.dim
        self.inject_value: np.ndarray = np.zeros(
            (dim, dim) if self.preconditioner == "full" else dim
        )

    def _kernel(self):
        momentum = self._momentum()

        def step(normal, state, grad_fn, params):
            # ``normal`` is already the injected noise R ξ (_mix_normals). The damping is a
            # constant of the sampler, or a draw parameter where tuning chooses it (SGHMC).
            state, info = sgd.step(
                None,
                state,
                grad_fn,
                1.0,
                preconditioner=params["precond"],
                momentum=params.get("momentum", momentum),
                position_noise=normal,
            )
            return state, info._replace(step_size=params["step_size"])

        return sgd.init, step

    def _mix_normals(self, normals, params):
        # The injected noise R ξ of every iteration of the draw at once: with a dense R one
        # (iterations, D) x (D, D) product instead of a matrix-vector product per iteration.
        return apply_to_rows(params["inject"], normals)

    def _momentum(self) -> float | None:
        return None

    def _hyper_schedule(self) -> Schedule | None:
        return None

    def _reset_tuning(self) -> None:
        self._hyper_curvature.reset()

    def _retune(self) -> None:
        pass  # a fixed rate: _params applies the divergence factor

    def _params(self, iteration: int) -> dict[str, Any]:
        if self.exact:
            return self._mala_params()
        dtype = self.problem.dtype
        precond = as_parameter(self.precond_value, dtype)
        if self.tuner is None:
            precond = precond * self._shrink  # a fixed rate, halved by diverged tuning draws
        step = self.tuned.step_size if self.tuned is not None else _scale_of(precond)
        params = {
            "precond": precond,
            "step_size": np.asarray(step, dtype=dtype),
            "inject": as_parameter(self.inject_value, dtype),
        }
        if self._sampled_idx is not None:
            mask = np.ones(self.problem.dim, dtype=dtype)
            mask[self._sampled_idx] = 0.0
            params["hyper_mask"] = mask
            # Off while searching for the mode (the iterates are then optimised, not sampled,
            # and their spread says nothing about the posterior) and after tuning (frozen).
            # Robbins–Monro steps in Newton units: ρ_k g / h with h the potential's curvature
            # along each hyper coordinate (from the tuning measurements), so ρ_k ≤ 1 is a
            # damped EM fixed-point step whatever the hyperparameter's scale; k counts draws.
            # ... and for the first search_draws tuning draws, while the chain spreads out
            # from the mode the search left it at: an EM step from draws without their spread
            # would send a precision up (and the draws would then shrink further).
            burning_in = self.tuner is None or self.tuner.draws < self.search_draws
            on = self.tune and not burning_in
            schedule = self._hyper_schedule()
            rate = float(schedule(iteration // self.thin)) if on and schedule else 0.0
            curvature = self._hyper_curvature.value
            scale = np.ones(self.problem.dim)
            if curvature is not None:
                scale = 1.0 / np.maximum(np.abs(curvature), 1e-8)
            params["hyper_step"] = np.asarray(rate * scale * mask, dtype=dtype)
        return params

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "preconditioner": self.preconditioner,
            "search_draws": self.search_draws,
            **self._tuning_settings(),
            **_preconditioner_summary(self.precond_value),
        }


def _scale_of(precond: np.ndarray) -> np.ndarray:
    """A scalar summary of P for the ``step_size`` stat: its mean diagonal."""
    precond = np.asarray(precond)
    if precond.ndim == 2:
        return np.asarray(np.trace(precond) / precond.shape[0], dtype=precond.dtype)
    return np.asarray(precond.mean(), dtype=precond.dtype)
