"""IASG: iterate-averaged SGD (Mandt, Hoffman & Blei 2017, section 5): each saved draw is the
mean of a window of SGD iterates, whose width the tuning sets.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.kernels.preconditioning import is_operator
from pymc_sgmcmc.preconditioned_sgd import _PreconditionedSGD
from pymc_sgmcmc.tuning import lanczos_extremes
from pymc_sgmcmc.tuning.rates import Rates, iasg_rule, iasg_window
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, psd_sqrt

__all__ = ["IASG"]

MAX_RELAXATION_CHECK_DIM = 400  # IASG's end-of-tuning check of its slowest direction


class IASG(_PreconditionedSGD):
    r"""Iterate-averaged stochastic gradients (Mandt, Hoffman & Blei 2017, §6, Algorithm 1).

    Constant SGD :math:`\theta \leftarrow \theta - P \hat g` with the large preconditioned
    rate :math:`P = (\epsilon/N)\,\hat C^{-1}`; one saved draw is the mean of a window of
    ``T = N/B`` consecutive iterates — about one independent posterior draw per pass over the
    data, the best any SG-MCMC method can do (§6.2).

    Why the average has the posterior's covariance: in one direction with per-datum curvature
    and noise :math:`c` (A = C), the iterates are AR(1) with coefficient :math:`1-\epsilon`
    and innovation variance :math:`\epsilon^2/(Bc)`, so their stationary variance is
    :math:`\epsilon / (Bc(2-\epsilon))` and the mean of ``T`` of them has variance
    :math:`\frac{\epsilon}{Bc(2-\epsilon)} \cdot \frac{2-\epsilon}{\epsilon T} = 1/(BcT)`,
    which is the posterior variance :math:`1/(Nc)` for ``T = N/B`` — whatever ε. A
    ``temperature`` T multiplies it by shortening the window to ``N/(B T)``.

    Preconditioning with :math:`\hat C^{-1}` (full up to 500 dimensions, diagonal above) makes
    the preconditioned Hessian ≈ I, so the step-size conditions
    :math:`B/(N\lambda_{min}) \ll \epsilon < 2/\lambda_{max}` hold without hand tuning. With
    a diagonal or scalar preconditioner the correlations remain: a direction relaxes in
    :math:`1/\lambda` iterations, λ the eigenvalue of :math:`P H` along it — about
    :math:`1/(\epsilon\, \lambda_{min}(R))` for the slowest, R the correlation matrix. At the
    end of tuning :math:`\lambda_{min}(P H)` is found by Lanczos (up to 400 dimensions) and a
    warning is given when the window is shorter than 5 such times: the window then misses
    about relaxation/window of that direction's variance.

    Choosing ε. The window must span a few relaxation times (:math:`\epsilon T > 1`) for
    consecutive draws to be nearly independent, but the iterates spread over
    :math:`s = \epsilon N/(B(2-\epsilon))` posterior variances, and on a skewed posterior
    their mean sits :math:`s` times as far from the mode as the posterior mean does (the
    stationary iterates satisfy :math:`E[\nabla U] = 0` as the posterior does, and the
    third-derivative term scales with their covariance), so the draws' means are off by
    :math:`(s-1)` times that mode-to-mean gap. ``learning_rate="auto"`` sets
    :math:`\epsilon = \min(0.5, 3/T)` with the full preconditioner: three relaxation times per
    window and a spread of 1.5 posterior variances (measured on logistic regression, D = 20,
    B = 256: the means 0.03–0.04 sd off in root mean square at N = 10⁴ and 10⁵, against
    0.28 and 0.06 sd with the former :math:`10/T`, at the same ESS per pass within the
    scatter). With a diagonal or scalar preconditioner the slower directions need more
    relaxation times, so it stays :math:`\min(0.5, 10/T)` there. The window is then shortened
    from ``N/B`` by about ``1/ε`` iterations, which makes up for the variance a finite window
    misses (:func:`pymc_sgmcmc.tuning.iasg_window`).

    Parameters
    ----------
    learning_rate
        ε in :math:`P = (\epsilon/N) \hat C^{-1}`; ``"auto"`` (default) is
        :math:`\min(0.5, 3/T)` with the full preconditioner and :math:`\min(0.5, 10/T)` with
        a diagonal or scalar one, at least :math:`2/(T+1)` (which binds for ``T < 3`` only:
        below it even one iterate is narrower than the posterior; a smaller explicit value
        warns).
    window
        Iterates averaged per draw (default: ``N/(B·temperature)`` less the finite-window
        correction, :func:`pymc_sgmcmc.tuning.iasg_window`); the same as ``thin``.
    preconditioner
        ``"auto"``, ``"scalar"``, ``"diagonal"`` or ``"full"``.
    **kwargs
        See :class:`SGMCMCStep`.

    References
    ----------
    .. [1] Mandt, S., Hoffman, M. D., Blei, D. M. (2017). Stochastic Gradient Descent as
       Approximate Bayesian Inference. JMLR 18(134), §6.
    """

    name = "iasg"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        learning_rate: float | str = "auto",
        window: int | None = None,
        **kwargs: Any,
    ) -> None:
        if window is not None and kwargs.get("thin") is not None and kwargs["thin"] != window:
            raise ValueError("IASG's window is its thin: give one of them.")
        if window is not None:
            kwargs["thin"] = window
        super().__init__(vars, **kwargs)
        target = self.problem.data_size / (self.batch_size * self.temperature)
        if learning_rate == "auto":
            # Relaxation times per window: every direction relaxes at rate ε in whitened
            # coordinates; under a diagonal or scalar whitening the correlated directions are
            # slower.
            relaxations = 3.0 if self.preconditioner == "full" else 10.0
            learning_rate = min(0.5, relaxations / max(target, 1.0))
        if not (0.0 < float(learning_rate) < 2.0):
            raise ValueError(f"learning_rate must be 'auto' or in (0, 2), got {learning_rate!r}.")
        self.learning_rate = float(learning_rate)
        if window is None and kwargs.get("thin") is None and not self.full_batch:
            self.thin = max(1, iasg_window(target, self.learning_rate))
        self.window = self.thin
        self._warned = False
        self._make_tuner(self.search_draws)

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        # The window's mean has the posterior's variance when each iterate gets T h² W_eff of
        # noise; the minibatch gives h² S of it, the rest is injected (tuning.rates).
        return iasg_rule(
            noise_z,
            step_size=min(self.learning_rate, cap),
            window=self.window,
            temperature=self.temperature,
        )

    def stop_tuning(self) -> None:
        super().stop_tuning()
        if self._warned or self.preconditioner == "full":
            return
        rate = self._slowest_rate()
        if rate is None:
            return
        relaxation = 1.0 / rate
        if self.window < 5 * relaxation:
            self._warned = True
            fix = (
                "Use preconditioner='full' (its cost per iteration grows as the square of the "
                "dimension)."
                if self.problem.dim <= DENSE_MAX_DIM
                else "Use ConstantSGD() or SGLD(), which average no window."
            )
            warnings.warn(
                f"IASG: the slowest direction relaxes in about {relaxation:.0f} iterations but the "
                f"window is {self.window}: along it the draws will be too narrow (the window "
                "misses part of its variance, about relaxation/window of it) and correlated. "
                + fix,
                UserWarning,
                stacklevel=2,
            )

    def _slowest_rate(self) -> float | None:
        """The smallest eigenvalue of ``P·H`` at the chain's position (``P`` the tuned
        scalar or diagonal preconditioner, ``H`` the potential's Hessian on a block of rows):
        the fraction by which the slowest direction contracts per iteration, the inverse of
        its relaxation time. By Lanczos on the symmetric ``√P·H·√P`` (the same eigenvalues),
        so the correlations that a diagonal or scalar ``P`` leaves in place are seen; an
        estimate from above of the block's (exact up to rounding in up to 80 dimensions).

        The block has ``R = max(1024, 50·D)`` rows (at most ``N``): a Hessian from ``R`` rows
        has its smallest eigenvalue pulled down by up to ``(1 − √(D/R))²``
        (Marchenko–Pastur), which overstates the relaxation time — up to 1.35× at
        ``R = 50·D`` (measured at D = 60: 1.05–1.15×), so independent features never warn;
        with the 1024 rows of the noise estimate it would be 10× at ``D = 500``. Above
        ``MAX_RELAXATION_CHECK_DIM`` dimensions such a block makes the check slow (at
        ``D = 1000`` and 20 000 rows, 3.3 s per chain and still 1.4× too long, enough to warn
        on independent features), so there it returns None unless the block is every row
        (``N ≤ 50·D``: the Hessian is then exact) — as it does before a tuned,
        positive ``P`` or where ``P·H`` is not positive definite (no relaxation time)."""
        dim = self.problem.dim
        every_row = self.problem.data_size <= 50 * dim  # the block is the data: exact
        if self.chain_state is None or (dim > MAX_RELAXATION_CHECK_DIM and not every_row):
            return None
        if is_operator(self.precond_value):
            # structured: P = F Fᵀ, and P·H has the eigenvalues of Fᵀ H F
            root = self.precond_value.root()
            return self._lanczos_rate(
                lambda v: np.asarray(root.apply(v)), lambda v: np.asarray(root.apply_transpose(v))
            )
        precond = np.asarray(self.precond_value, dtype=np.float64)
        if not np.all(np.isfinite(precond)):
            return None
        if precond.ndim == 2:
            # a diagonal or scalar whitening whose per-direction steps follow the (dense)
            # measured noise: P is dense but not A⁻¹
            w = np.linalg.eigvalsh(0.5 * (precond + precond.T))
            if w.min() <= 0:
                return None
            root_matrix = psd_sqrt(precond)

            def scale(v: np.ndarray) -> np.ndarray:
                return root_matrix @ v

        elif np.any(precond <= 0):
            return None
        else:
            root = np.broadcast_to(np.sqrt(precond), (dim,))

            def scale(v: np.ndarray) -> np.ndarray:
                return root * v

        return self._lanczos_rate(scale, scale)

    def _lanczos_rate(self, scale: Callable, scale_transpose: Callable) -> float | None:
        """The smallest eigenvalue of ``Sᵀ H S`` (``S v`` by ``scale``, ``Sᵀ w`` by
        ``scale_transpose``), ``H`` the potential's Hessian on ``max(1024, 50·D)`` rows; None
        where it is not positive."""
        dim, dtype = self.problem.dim, self.problem.dtype
        compiled = self._compile()
        key, state = self.chain_state
        key = compiled["fold_in"](key, 4)
        rows = min(self.problem.data_size, max(self._noise_rows, 50 * dim))
        args = (key, state.position, self._last_fixed, self._tuning_data(key, rows))
        local = self._tuning_local()

        def product(v: np.ndarray) -> np.ndarray:
            hv = compiled["hessian_product"](
                *args, local, np.asarray(scale(v), dtype=dtype), rows=rows
            )
            return scale_transpose(np.asarray(hv, dtype=np.float64))

        smallest, largest = lanczos_extremes(product, dim)
        if not (np.isfinite(smallest) and np.isfinite(largest)) or smallest <= 1e-9 * largest:
            return None
        return smallest

    def _emit(self, state: Any, mean_position: Any, key: Any, fixed: tuple) -> Any:
        # Full batch: a MALA chain's position (its iterates are draws; their mean is not).
        return state.position if self.exact else mean_position

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "learning_rate": self.learning_rate, "window": self.window}

    def _check_window(self) -> int | None:
        return self.window
