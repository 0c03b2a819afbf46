"""The steps' side of the self-check (:mod:`pymc_sgmcmc.diagnostics`): which coordinates are
checked, their names, the parameters the compiled draw computes the check's terms with, and
the predicted covariance it is compared with.

A mixin of :class:`pymc_sgmcmc.adapter.step.SGMCMCStep` (it reads the step's problem, tuned
preconditioner and local variables), kept apart so that the step's module holds the draw loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pymc_sgmcmc.diagnostics import MAX_CHECKED, check_indices, predicted_sd_ratio
from pymc_sgmcmc.tuning.whitening import Whitening

__all__ = ["SelfCheckGlue"]


class SelfCheckGlue:
    # -- the self-check (pymc_sgmcmc.diagnostics) --------------------------------------------------

    def _check_indices(self) -> np.ndarray:
        return check_indices([info.size for info in self.problem.var_infos])

    def _check_local_indices(self) -> np.ndarray:
        """With local variables: the raveled locals the self-check follows too."""
        if self.hybrid is None:
            return np.zeros(0, dtype=int)
        room = max(MAX_CHECKED - len(self._check_indices()), 0)
        return check_indices(list(self.hybrid.layout.sizes), limit=room)

    def _local_names(self) -> list[str]:
        if self.hybrid is None:
            return []
        layout = self.hybrid.layout
        names = []
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            if not shape:
                names.append(name)
            else:
                names.extend(f"{name}[{','.join(map(str, i))}]" for i in np.ndindex(*shape))
        return names

    def _coordinate_names(self) -> list[str]:
        names = []
        for info in self.problem.var_infos:
            if info.size == 1 and not info.shape:
                names.append(info.name)
            else:
                names.extend(
                    f"{info.name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*info.shape)
                )
        return names

    def _check_params(self) -> dict[str, np.ndarray]:
        dtype, dim = self.problem.dtype, self.problem.dim
        check = self._check
        if check is None:
            dense = self.whitening_kind == "dense"
            zeros = np.zeros(dim, dtype=dtype)
            return {
                "check_centre": zeros,
                "check_grad": zeros,
                "check_cov": np.zeros((dim, dim) if dense else dim, dtype=dtype),
            }
        return {k: np.asarray(v, dtype=dtype) for k, v in check.items()}

    def _setup_check(self) -> None:
        """After tuning: the centre of the SVRG control variate (the chain's position) with its
        full-data gradient, ``A⁻¹`` (from the tuning, else measured once here), and the
        predicted sd ratios of the frozen tuning (:func:`pymc_sgmcmc.diagnostics.predicted_sd_ratio`)."""
        compiled = self._compile()
        key, state = self.chain_state
        fixed = self._last_fixed
        dim = self.problem.dim
        centre = np.asarray(state.position, dtype=np.float64)[:dim]
        tuned = self.tuned
        if tuned is not None:
            cov = tuned.whitening.covariance()
        else:
            dense = self.whitening_kind == "dense"
            _, h = self._estimate_noise(
                state.position, fixed, key, full=dense, full_curvature=dense
            )
            cov = Whitening.from_curvature(h).covariance()
        sharded = self.devices not in (None, 1, "chains")
        if self._sampled_idx is not None or self.streaming or sharded:
            # Variational EM: the hyperparameters are point estimates, not draws; streamed or
            # sharded data: the draw has no minibatch of its own to spare. No Stein check.
            dense = np.ndim(cov) == 2
            self._check = {
                "check_centre": centre,
                "check_grad": np.zeros(dim),
                "check_cov": np.zeros((dim, dim) if dense else dim),
            }
            self._check_report = {}
            return
        grad = np.zeros(dim)
        if compiled.get("full_grad") is not None and not self.exact and self.hybrid is None:
            grad = np.asarray(compiled["full_grad"](centre, fixed, compiled["data"]))
        self._check = {"check_centre": centre, "check_grad": grad, "check_cov": cov}
        idx = self._check_indices()
        names = self._coordinate_names()
        diag = np.diag(cov) if np.ndim(cov) == 2 else np.asarray(cov)
        local_idx = self._check_local_indices()
        local_names = self._local_names()
        report: dict[str, Any] = {
            "check": {
                "names": [names[i] for i in idx] + [local_names[i] for i in local_idx],
                # A⁻¹'s diagonal; NaN for the locals (M = I there: their scale is the draws')
                "cov_diag": diag[idx].tolist() + [float("nan")] * len(local_idx),
                "metric": "dense" if np.ndim(cov) == 2 else "diagonal",
            }
        }
        tuner = self.tuner
        averaged = tuner is not None and tuner.curvature.value is not None
        if (
            tuned is not None
            and averaged
            and tuned.whitening.dense
            and not self.exact
            and self._sampled_idx is None
            and (self.auto_step_size if hasattr(self, "auto_step_size") else True)
        ):
            window = self._check_window()
            try:
                ratio = predicted_sd_ratio(
                    tuned.rates.preconditioner(),
                    tuned.rates.injected,
                    tuned.whitening,
                    tuner.curvature.value,
                    tuner.noise.value,
                    window=window,
                    momentum=self._check_momentum(),
                )
            except (np.linalg.LinAlgError, ValueError):
                ratio = None
            if ratio is not None and np.all(np.isfinite(ratio)):
                # against the tempered target's sds (√T times the posterior's)
                ratio = ratio / np.sqrt(self.temperature)
                report["predicted_sd_ratio"] = ratio[idx].tolist()
        self._check_report = report

    def _check_momentum(self) -> float | None:
        """The damping μ the self-check's predicted covariance models (None: no momentum)."""
        return getattr(self, "momentum", None)

    def _check_window(self) -> int | None:
        """The averaging window of the saved draws the self-check's prediction models (IASG's:
        each draw is the mean of a window of iterates); None for draws that are iterates."""
        return None
