"""The steps' side of the self-check (:mod:`pymc_sgmcmc.diagnostics`): which coordinates are
checked, their names, the parameters the compiled draw computes the check's terms with, and
the predicted covariance it is compared with.

A mixin of :class:`pymc_sgmcmc.adapter.step.SGMCMCStep` (it reads the step's problem, tuned
preconditioner and local variables), kept apart so that the step's module holds the draw loop.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pymc_sgmcmc.diagnostics import MAX_CHECKED, check_indices, predicted_sd_ratio
from pymc_sgmcmc.draws import full_data_logdensity
from pymc_sgmcmc.kernels.preconditioning import (
    ArrowheadCholesky,
    ArrowheadMetric,
    as_parameter,
    is_operator,
)
from pymc_sgmcmc.tuning.marginal import solve_columns
from pymc_sgmcmc.tuning.whitening import Whitening

# The globals whose marginal the self-check tests with the joint curvature: with local
# variables every sampled coordinate (up to MAX_GLOBALS); without, the coordinates of the
# small variables (at most GLOBAL_VARIABLE_MAX coordinates each:
# intercepts, slopes, scales) when larger ones (group effects) are sampled beside them.
GLOBAL_VARIABLE_MAX = 16
MAX_GLOBALS = 64

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
        """The locals' coordinate labels (``u[county]``: the model's names and coords)."""
        if self.hybrid is None:
            return []
        return self.problem.labels(self.hybrid.layout.names)

    def _coordinate_names(self) -> list[str]:
        """The sampled coordinates' labels as ArviZ shows them (``beta[age]``;
        ``log(sigma)`` for a transformed variable)."""
        return self.problem.labels()

    def _global_indices(self) -> np.ndarray:
        """The raveled coordinates whose *marginal* the self-check tests with the joint
        curvature (:mod:`pymc_sgmcmc.tuning.marginal`): where the check's own metric sees
        only their conditional — with local variables (q fitted at given globals), and with
        group effects beside them, whatever the whitening (a dense one is measured on a block
        of rows and tuned for the joint; the globals' marginal is what users read). Empty
        where the data are streamed or sharded (no full-data pass to measure it) or locals
        follow the rows."""
        problem = self.problem
        sharded = self.devices not in (None, 1, "chains")
        if self.streaming or sharded or problem.row_local_names:
            return np.zeros(0, dtype=int)
        sizes = [info.size for info in problem.var_infos]
        if self.hybrid is not None and problem.dim <= MAX_GLOBALS:
            return np.arange(problem.dim)
        if self.hybrid is None and max(sizes, default=0) <= GLOBAL_VARIABLE_MAX:
            return np.zeros(0, dtype=int)
        out, start = [], 0
        for size in sizes:
            if size <= GLOBAL_VARIABLE_MAX:
                out.extend(range(start, start + size))
            start += size
        return np.asarray(out[:MAX_GLOBALS], dtype=int)

    def _joint_dim(self) -> int:
        """Coordinates of the joint the marginal check's curvature is taken in: the sampled
        ones, then the local variables' (raveled as ``hybrid.layout``)."""
        local = self.hybrid.layout.size if self.hybrid is not None else 0
        return self.problem.dim + local

    def _marginal_columns_function(self, fns: dict, data: Any, n: int, b: int) -> Any:
        """Jitted ``(point, fixed, data, diagonal) -> ColumnSolve``: the globals' columns of
        the inverse curvature of the full-data joint density at ``point`` (the sampled
        coordinates, then the locals'), or None without globals to check."""
        idx = self._global_indices()
        if idx.size == 0:
            return None
        logdensity = full_data_logdensity(fns, n, b)
        dim, hybrid = self.problem.dim, self.hybrid

        def negative(point, fixed, data):
            if hybrid is None:
                return -logdensity(point, fixed, data)
            return -logdensity(point[:dim], hybrid.layout.insert(fixed, point[dim:]), data)

        def columns(point, fixed, data, diagonal):
            grad = jax.grad(negative)

            def hvp(v):
                return jax.jvp(lambda x: grad(x, fixed, data), (point,), (v,))[1]

            return solve_columns(hvp, diagonal, jax.numpy.asarray(idx))

        return jax.jit(columns)

    def _check_params(self) -> dict[str, np.ndarray]:
        dtype, dim = self.problem.dtype, self.problem.dim
        check = self._check
        if check is None:
            dense = self.whitening_kind == "dense"
            zeros = np.zeros(dim, dtype=dtype)
            return {
                "check_centre": zeros,
                "check_grad": zeros,
                "check_exact": np.zeros((), dtype=dtype),
                "check_cov": self._structured_placeholder(dtype)
                if self.whitening_kind == "structured"
                else np.zeros((dim, dim) if dense else dim, dtype=dtype),
                "check_rows": np.zeros(
                    (self._joint_dim(), self._global_indices().size), dtype=dtype
                ),
            }
        return {k: as_parameter(v, dtype) for k, v in check.items()}

    def _structured_placeholder(self, dtype: Any) -> Any:
        """A zero operator shaped as the structured ``A⁻¹`` the check will hold (the draw's
        parameters keep one structure, so that it compiles once)."""
        structure = self._compile()["group_structure"]
        j, k, g = structure.n_groups, structure.k, structure.global_idx.size
        r = 2 * len(structure.pairs())  # crossed factors' couplings (StructuredCurvature)
        chol = ArrowheadCholesky(
            structure.global_idx,
            structure.local_idx,
            np.broadcast_to(np.eye(k), (j, k, k)).copy(),
            np.zeros((j, g, k)),
            np.eye(g),
            np.zeros((structure.dim, r)),
            np.zeros((r, r)),
            np.zeros((r, r)),
        )
        return ArrowheadMetric(chol, np.zeros(structure.dim)).astype(dtype)

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
        cov_diag = None
        if tuned is not None:
            cov = tuned.whitening.covariance()
            if is_operator(cov):
                cov_diag = tuned.whitening.covariance_diagonal()
        else:
            dense = self.whitening_kind == "dense"
            _, h = self._estimate_noise(
                state.position, fixed, key, full=dense, full_curvature=dense
            )
            cov = Whitening.from_curvature(h).covariance()
        sharded = self.devices not in (None, 1, "chains")
        if cov_diag is None:
            cov_diag = np.diag(cov) if np.ndim(cov) == 2 else np.asarray(cov)
        if self._sampled_idx is not None or self.streaming or sharded:
            # Variational EM: the hyperparameters are point estimates, not draws; streamed or
            # sharded data: the draw has no minibatch of its own to spare. No Stein check.
            dense = np.ndim(cov) == 2
            self._check = {
                "check_centre": centre,
                "check_grad": np.zeros(dim),
                "check_exact": np.zeros(()),
                "check_cov": np.zeros((dim, dim) if dense else dim),
                "check_rows": np.zeros((self._joint_dim(), self._global_indices().size)),
            }
            self._check_report = {}
            return
        grad = np.zeros(dim)
        if compiled.get("full_grad") is not None and not self.exact and self.hybrid is None:
            grad = np.asarray(compiled["full_grad"](centre, fixed, compiled["data"]))
        rows, marginal = self._marginal_check(compiled, state, fixed, cov_diag)
        # With the model's group structure the checked group effects are informed by few
        # rows of any minibatch: the check takes the exact gradient (draws.py).
        exact = compiled.get("full_grad") is not None and self.whitening_kind == "structured"
        self._check = {
            "check_centre": centre,
            "check_grad": grad,
            "check_exact": np.asarray(1.0 if exact and not self.exact else 0.0),
            "check_cov": cov,
            "check_rows": rows,
        }
        idx = self._check_indices()
        names = self._coordinate_names()
        diag = cov_diag
        local_idx = self._check_local_indices()
        local_names = self._local_names()
        report: dict[str, Any] = {
            "check": {
                "names": [names[i] for i in idx] + [local_names[i] for i in local_idx],
                # A⁻¹'s diagonal; NaN for the locals (M = I there: their scale is the draws')
                "cov_diag": diag[idx].tolist() + [float("nan")] * len(local_idx),
                "metric": "structured"
                if is_operator(cov)
                else ("dense" if np.ndim(cov) == 2 else "diagonal"),
            }
        }
        if marginal is not None:
            report["check"]["marginal"] = marginal
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

    def _marginal_check(
        self, compiled: dict, state: Any, fixed: tuple, variances: np.ndarray
    ) -> tuple[np.ndarray, dict[str, Any] | None]:
        """The globals' columns ``R`` of the joint curvature's inverse at the chain's position
        (and q's mean for the locals), and what the check needs to read their terms: names,
        ``[H⁻¹]_gg`` (their marginal variances under that curvature) and the direction of
        largest marginal variance. Zeros and None without globals to check."""
        g_idx = self._global_indices()
        rows = np.zeros((self._joint_dim(), g_idx.size))
        solve = compiled.get("marginal_columns")
        if g_idx.size == 0 or solve is None:
            return rows, None
        dim = self.problem.dim
        point = np.asarray(state.position, dtype=np.float64)[:dim]
        diagonal = 1.0 / np.maximum(variances, 1e-300)
        if self.hybrid is not None:
            # compiled: run op by op, q's moments (a prior's Hessian-vector products through
            # the model's graph) took 5 s a chain on radon's 386 counties
            moments = compiled.get("local_moments")
            if moments is None:
                moments = compiled["local_moments"] = compiled["jax"].jit(self.hybrid.moments)
            mean, sd = moments(state.position, state.local["params"], fixed)
            point = np.concatenate([point, np.asarray(mean, dtype=np.float64)])
            sd = np.asarray(sd, dtype=np.float64)
            diagonal = np.concatenate([diagonal, 1.0 / np.maximum(sd * sd, 1e-300)])
        solved = solve(point, fixed, compiled["data"], diagonal)
        rows = np.asarray(solved.columns, dtype=np.float64)
        covariance = 0.5 * (rows[g_idx] + rows[g_idx].T)  # [H⁻¹]_gg, the globals' marginal
        values, vectors = np.linalg.eigh(covariance)
        names = self._coordinate_names()
        return rows, {
            "names": [names[i] for i in g_idx],
            "cov_diag": np.diag(covariance).tolist(),
            "direction": vectors[:, -1].tolist(),
            "direction_variance": float(values[-1]),
            "conditional_cov_diag": variances[g_idx].tolist(),
            "cg_iterations": int(solved.iterations),
            "cg_residual": float(solved.residual),
        }

    def _check_momentum(self) -> float | None:
        """The damping μ the self-check's predicted covariance models (None: no momentum)."""
        return getattr(self, "momentum", None)

    def _check_window(self) -> int | None:
        """The averaging window of the saved draws the self-check's prediction models (IASG's:
        each draw is the mean of a window of iterates); None for draws that are iterates."""
        return None
