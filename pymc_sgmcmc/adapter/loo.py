r"""Subsampled PSIS-LOO (:func:`loo_subsample`): the elpd of all N rows estimated from m of them
with the difference estimator of Magnusson et al. (2020) — the log density at the posterior
mean for every row (one pass over the data) plus exact PSIS-LOO on the m sampled rows, with
the subsampling standard error. Memory: N + m × draws numbers. The pointwise terms come from
:mod:`pymc_sgmcmc.adapter.model_checking`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pymc as pm
import xarray as xr
from scipy.special import logsumexp

from pymc_sgmcmc.adapter.model_checking import (
    MEMORY_BUDGET,
    _auto_chunk,
    _check_budget,
    _chunks,
    _draw_chunks,
    _padded,
    _posterior,
    _row_likelihood,
    _select_rows,
    _stacked_draws,
)
from pymc_sgmcmc.adapter.precision import in_float64
from pymc_sgmcmc.adapter.stats import LOO_SE_DDOF, ess_of_means, psis_loo

__all__ = ["ElpdDifference", "LooSubsample", "loo_subsample"]

# ---------------------------------------------------------------------------------------
# loo_subsample
# ---------------------------------------------------------------------------------------


def _difference_estimate(
    approx: np.ndarray, exact: np.ndarray, index: np.ndarray
) -> tuple[float, float, float]:
    r"""The difference estimator of a population total under simple random sampling.

    ``approx`` (N,) approximates every term, ``exact`` (m,) are the exact terms at the rows
    ``index``. Returns the estimate of :math:`t = \sum_i \pi_i`, the estimated variance of
    that estimate from the subsampling, and the estimated :math:`\sum_i (\pi_i - \bar\pi)^2`
    (N times the population variance, or N²/(N − 1) times it: its square root is the usual
    PSIS-LOO SE, with the host ArviZ's ``ddof``).
    Magnusson et al. (2020), eqs. (7)-(9), with the sign in (9) as in their supplement.
    """
    n, m = approx.size, exact.size
    approx_m = approx[index]
    e = exact - approx_m
    t_approx = float(np.sum(approx))
    estimate = t_approx + n * float(np.mean(e))
    var_e = float(np.var(e, ddof=1)) if m > 1 else math.inf
    subsampling_var = n**2 * (1 - m / n) * var_e / m if m < n else 0.0
    sum_sq = float(np.sum(approx**2)) + n * float(np.mean(exact**2 - approx_m**2))
    spread = sum_sq - (estimate**2 - subsampling_var) / n
    # The usual SE as the host ArviZ computes it: sqrt(N·Var(π)) with Var's ddof 0 in ArviZ
    # 0.x, sqrt(N)·sd(π) (ddof 1, as R's loo) in ArviZ 1.
    spread *= n / (n - LOO_SE_DDOF) if n > LOO_SE_DDOF else 1.0
    return estimate, subsampling_var, max(spread, 0.0)


@dataclass(frozen=True)
class ElpdDifference:
    """Difference of two subsampled PSIS-LOO elpds on the same rows (``a − b``)."""

    elpd_diff: float
    se: float
    subsampling_se: float
    n_subsample: int
    n_data_points: int

    def __repr__(self) -> str:
        return (
            f"elpd_diff {self.elpd_diff:.2f} (SE {self.se:.2f}, subsampling SE "
            f"{self.subsampling_se:.2f}; {self.n_subsample} of {self.n_data_points} rows)"
        )


@dataclass(frozen=True, repr=False)
class LooSubsample:
    """PSIS-LOO elpd of all N rows estimated from a subsample (:func:`loo_subsample`).

    Attributes
    ----------
    elpd_loo
        Estimate of the sum over all N rows of the PSIS-LOO log predictive densities.
    se
        Its usual standard error, ``sqrt(N · variance of the rows' elpd_loo_i)``, estimated
        from the subsample (``az.loo``'s ``se`` when every row is used).
    subsampling_se
        Standard error of ``elpd_loo`` as an estimate of the full-data PSIS-LOO elpd (the
        error from using m rows, 0 when m = N). Add its square to ``se``'s square for the
        total uncertainty.
    p_loo, p_loo_subsampling_se
        Effective number of parameters (N × the subsample's mean ``p_loo_i``) and its
        subsampling SE.
    n_samples, n_data_points, n_subsample
        Draws, rows N, rows m in the subsample.
    rows, loo_i, p_loo_i, pareto_k
        The subsample's original row numbers and, for each, its PSIS-LOO elpd, its
        ``lpd_i − elpd_loo_i``, and its Pareto k.
    elpd_loo_approx
        The approximation for every row (N): its log density at the posterior mean.
    good_k
        ``az.loo``'s threshold for a good Pareto k.
    warning
        Some Pareto k in the subsample above ``good_k``.
    lowest_rows, lowest_pareto_k
        The ``check_lowest`` rows with the lowest ``elpd_loo_approx`` and their Pareto k (a
        check, not part of the estimate).
    """

    elpd_loo: float
    se: float
    subsampling_se: float
    p_loo: float
    p_loo_subsampling_se: float
    n_samples: int
    n_data_points: int
    n_subsample: int
    rows: np.ndarray
    loo_i: np.ndarray
    p_loo_i: np.ndarray
    pareto_k: np.ndarray
    elpd_loo_approx: np.ndarray
    good_k: float
    warning: bool
    lowest_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    lowest_pareto_k: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __repr__(self) -> str:
        counts = [
            int(np.sum(self.pareto_k <= self.good_k)),
            int(np.sum((self.pareto_k > self.good_k) & (self.pareto_k <= 1))),
            int(np.sum(self.pareto_k > 1)),
        ]
        width = max(5, len(str(max(counts))))
        pct = [100 * c / max(self.n_subsample, 1) for c in counts]
        k = f"{self.good_k:.2f}"
        lines = [
            f"Computed from {self.n_samples} posterior samples and {self.n_subsample} of "
            f"{self.n_data_points} rows (a simple random",
            "subsample), with the log density at the posterior mean on every row",
            "(difference estimator).",
            "",
            "          Estimate       SE  subsampling SE",
            f"elpd_loo {self.elpd_loo:9.2f}  {self.se:7.2f}  {self.subsampling_se:14.2f}",
            f"p_loo    {self.p_loo:9.2f}        -  {self.p_loo_subsampling_se:14.2f}",
        ]
        if self.warning:
            lines += [
                "",
                "There has been a warning during the calculation. Please check the results.",
            ]
        lines += [
            "------",
            "",
            f"Pareto k diagnostic values (on the {self.n_subsample} subsampled rows):",
            f"{'':26}{'Count':>{width}}   Pct.",
            f"(-Inf, {k}]   (good)     {counts[0]:{width}d} {pct[0]:6.1f}%",
            f"   ({k}, 1]   (bad)      {counts[1]:{width}d} {pct[1]:6.1f}%",
            f"   (1, Inf)   (very bad) {counts[2]:{width}d} {pct[2]:6.1f}%",
        ]
        if self.lowest_rows.size:
            worst = int(np.argmax(self.lowest_pareto_k))
            lines += [
                "",
                f"Pareto k of the {self.lowest_rows.size} rows with the lowest log density at "
                "the posterior mean",
                f"(a check, not in the estimate): largest {self.lowest_pareto_k[worst]:.2f}, row "
                f"{int(self.lowest_rows[worst])}.",
            ]
            if self.lowest_pareto_k[worst] > self.good_k:
                lines.append(
                    "An influential row: the subsampling SE may be too small (see the docs)."
                )
        return "\n".join(lines)

    __str__ = __repr__

    def elpd_diff(self, other: LooSubsample) -> ElpdDifference:
        """``self − other``: the difference of the two models' elpd over all N rows.

        Both must come from the same N rows and the same subsample (the same ``rows=`` and
        ``random_seed=``, the default). The difference estimator is applied to the pointwise
        differences, so the rows' common variation cancels and ``se`` is the paired SE.
        """
        if self.n_data_points != other.n_data_points or not np.array_equal(self.rows, other.rows):
            raise ValueError(
                "The two subsampled LOOs were computed on different rows "
                f"({self.n_subsample} of {self.n_data_points} and {other.n_subsample} of "
                f"{other.n_data_points}): compare models on the same subsample, i.e. call "
                "pmsg.loo_subsample with the same rows= and random_seed= on the same data."
            )
        estimate, subsampling_var, spread = _difference_estimate(
            self.elpd_loo_approx - other.elpd_loo_approx,
            self.loo_i - other.loo_i,
            self.rows,
        )
        return ElpdDifference(
            elpd_diff=estimate,
            se=math.sqrt(spread),
            subsampling_se=math.sqrt(subsampling_var),
            n_subsample=self.n_subsample,
            n_data_points=self.n_data_points,
        )


def _reff(model: pm.Model, posterior: xr.Dataset, n_draws: int) -> float:
    """``az.loo``'s relative effective sample size, from the free variables' draws only (not
    from deterministics, which may hold a value per row)."""
    if posterior.sizes["chain"] == 1:
        return 1.0
    free = [rv.name for rv in model.free_RVs if rv.name in posterior] or list(posterior)
    return float(ess_of_means(posterior[free]).mean() / n_draws)


def _psis_loo(lik, posterior, values, n_draws, rows, reff, chunk_draws):
    """``az.loo(pointwise=True)`` on the per-row log-likelihood totals of ``rows``, and the
    rows' log pointwise predictive densities."""
    itemsize = np.dtype(lik.dtype).itemsize
    m = rows.size
    data = [d[rows] for d in lik.data]
    sub = np.empty((n_draws, m), dtype=lik.dtype)
    for start, stop, chunk in _draw_chunks(
        lik, values, n_draws, data, "draws_totals", chunk_draws, m * itemsize
    ):
        chunk = np.asarray(chunk)
        if start == 0 and chunk.shape[1:] != (m,):
            lik.check_rows([chunk], m, leading=1)
        sub[start:stop] = chunk[: stop - start]
    n_chains = posterior.sizes["chain"]
    ll = xr.Dataset(
        {"rows": (("chain", "draw", "row"), sub.reshape(n_chains, n_draws // n_chains, m))},
        coords={"chain": posterior["chain"].values, "draw": posterior["draw"].values},
    )
    return psis_loo(ll, "rows", reff), logsumexp(sub, axis=0) - math.log(n_draws)


@in_float64
def loo_subsample(
    idata: Any,
    model: pm.Model | None = None,
    *,
    rows: int | Sequence[int] | np.ndarray = 1000,
    var_names: Sequence[str] | None = None,
    random_seed: int | None = 0,
    reff: float | None = None,
    chunk_draws: int | None = None,
    chunk_rows: int | None = None,
    memory_budget: float = MEMORY_BUDGET,
    check_lowest: int = 20,
) -> LooSubsample:
    r"""PSIS-LOO elpd of all N rows from a subsample of them (difference estimator).

    For every row :math:`i`, a cheap approximation :math:`\tilde\pi_i` of its LOO log
    predictive density: the log density at the posterior mean :math:`\log p(y_i \mid
    \bar\theta)` ("plpd"; one pass over the N rows, ``chunk_rows`` at a time). On a simple
    random sample :math:`S` of :math:`m` rows without replacement, the PSIS-LOO
    :math:`\pi_j` (``az.loo(pointwise=True)`` on those rows' log-likelihood). Then

    .. math::

        \widehat{\mathrm{elpd}}_{loo} = \sum_{i=1}^N \tilde\pi_i
            + \frac{N}{m}\sum_{j\in S} (\pi_j - \tilde\pi_j), \qquad
        \widehat{\mathrm{Var}}_{sub} = N^2 \Bigl(1 - \frac{m}{N}\Bigr) \frac{s_e^2}{m},

    with :math:`s_e^2` the sample variance of the differences :math:`\pi_j - \tilde\pi_j`.
    The estimate is unbiased for the full-data PSIS-LOO elpd whatever the approximation; a
    good approximation makes the subsampling SE small. The usual SE,
    :math:`\sqrt{N\,\mathrm{Var}(\pi_i)}`, is estimated with the same estimator applied to
    :math:`\pi_i^2`, and ``p_loo`` as N times the subsample's mean ``p_loo_i``. This is the
    ``diff_srs`` estimator with the ``plpd`` approximation of the R package loo's
    ``loo_subsample``.

    Parameters
    ----------
    idata
        InferenceData with a ``posterior`` group.
    model
        The PyMC model (default: the model on the context stack).
    rows
        Subsample size ``m`` (default 1000; ``m ≥ N`` uses every row, i.e. plain PSIS-LOO),
        or the row indices of a simple random sample drawn by you.
    var_names
        Observed variables on the data axis whose log-likelihoods are summed per row (default:
        all of them: a "row" left out is all of its observations).
    random_seed
        Seed of the row sample: keep the default (or any fixed seed) to compare models on the
        same rows, see :meth:`LooSubsample.elpd_diff`.
    reff
        Relative effective sample size for PSIS (default: as ``az.loo`` computes it, the mean
        relative ESS (``method="mean"``) of the posterior's free variables; 1 for one chain).
    chunk_draws, chunk_rows
        Draws per call on the subsample, rows per call for the approximation (default: about
        64 MB per chunk).
    memory_budget
        Largest subsample log-likelihood (``m × draws × 8`` bytes) allowed (default 2 GB).
    check_lowest
        Also compute the Pareto k of this many rows with the lowest log density at the
        posterior mean (default 20; 0: off). They are not part of the estimate: a check for
        outliers that the subsample may miss, whose LOO terms differ most from their
        approximation; a k above ``good_k`` among them warns that the subsampling SE may be
        too small.

    Returns
    -------
    LooSubsample
        Prints like ``az.loo``'s result, with a subsampling SE column.

    Warns
    -----
    UserWarning
        From ``az.loo``: a Pareto k in the subsample above ``good_k``. From the check: one of
        the ``check_lowest`` rows has a Pareto k above ``good_k`` (named, with whether it is in
        the subsample).

    References
    ----------
    Magnusson, M., Riis Andersen, M., Jonasson, J. and Vehtari, A. (2019). Bayesian
    leave-one-out cross-validation for large data. *ICML*, PMLR 97:4244–4253 (subsampled LOO
    with cheap approximations for every row).

    Magnusson, M., Riis Andersen, M., Jonasson, J. and Vehtari, A. (2020). Leave-one-out
    cross-validation for model comparison in large data. *AISTATS*, PMLR 108:341–351 (the
    difference estimator under simple random sampling and its variance, eqs. 7–9; the sign
    of the second ``+`` in eq. 9 is a ``−``, as in their supplement and in loo's code).
    """
    model = pm.modelcontext(model)
    posterior = _posterior(idata)
    lik = _row_likelihood(model, var_names)
    n = lik.data_size
    row_index = _select_rows(rows, n, random_seed)
    m = row_index.size
    values, n_draws = _stacked_draws(posterior, lik)
    itemsize = np.dtype(lik.dtype).itemsize
    _check_budget(m, n_draws, 1, itemsize, memory_budget, "subsample's log-likelihood")

    # PSIS-LOO on the subsample: per-row totals over the observed variables.
    reff = _reff(model, posterior, n_draws) if reff is None else float(reff)
    loo, lpd_i = _psis_loo(lik, posterior, values, n_draws, row_index, reff, chunk_draws)
    loo_i, pareto_k = loo.elpd_i, loo.pareto_k
    p_loo_i = lpd_i - loo_i

    # The approximation on every row: log density at the posterior mean.
    point = []
    for v, dtype in zip(values, lik.input_dtypes, strict=True):
        mean = v.mean(axis=0)
        point.append(
            mean.astype(dtype) if np.dtype(dtype).kind == "f" else np.rint(mean).astype(dtype)
        )
    size = _auto_chunk(n, lik.row_width * itemsize, chunk_rows, "chunk_rows")
    approx = np.empty(n, dtype=float)
    for start, stop in _chunks(n, size):
        rows_data = [_padded(d[start:stop], size) for d in lik.data]
        out = np.asarray(lik.evaluate("point_totals", point, rows_data))
        if start == 0 and out.shape != (size,):
            raise ValueError(
                f"The log-likelihood at the posterior mean on {size} rows has shape "
                f"{out.shape}: the likelihood of {list(lik.names)} does not follow the rows."
            )
        approx[start:stop] = out[: stop - start]

    # Outside the estimate: the Pareto k of the rows the posterior mean finds least likely,
    # the outliers whose LOO terms differ most from their approximation.
    lowest = np.sort(np.argsort(approx, kind="stable")[: max(0, min(int(check_lowest), n))])
    lowest_k = np.zeros(0)
    if lowest.size:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            lowest_loo, _ = _psis_loo(lik, posterior, values, n_draws, lowest, reff, chunk_draws)
        lowest_k = lowest_loo.pareto_k
        if np.any(lowest_k > loo.good_k):
            worst = int(lowest[np.argmax(lowest_k)])
            where = "in" if worst in set(row_index.tolist()) else "not in"
            warnings.warn(
                f"Row {worst}, one of the {lowest.size} rows with the lowest log density at the "
                f"posterior mean, has Pareto k {lowest_k.max():.2f} > {loo.good_k:.2f} and is "
                f"{where} the subsample: an influential row (an outlier under this model?). A "
                "few such rows can carry much of the difference between the PSIS-LOO and its "
                "approximation, and the subsampling SE is then unreliable (too small when the "
                "subsample misses them). Look at it with pmsg.log_likelihood(idata, model, "
                f"rows=[{worst}]) and check with a larger rows= or another random_seed=.",
                UserWarning,
                stacklevel=2,
            )

    estimate, subsampling_var, spread = _difference_estimate(approx, loo_i, row_index)
    p_mean = float(np.mean(p_loo_i))
    p_var = float(np.var(p_loo_i, ddof=1)) if m > 1 else math.inf
    p_subsampling_var = n**2 * (1 - m / n) * p_var / m if m < n else 0.0
    return LooSubsample(
        elpd_loo=estimate,
        se=math.sqrt(spread),
        subsampling_se=math.sqrt(subsampling_var),
        p_loo=n * p_mean,
        p_loo_subsampling_se=math.sqrt(p_subsampling_var),
        n_samples=int(n_draws),
        n_data_points=int(n),
        n_subsample=int(m),
        rows=row_index,
        loo_i=loo_i,
        p_loo_i=p_loo_i,
        pareto_k=pareto_k,
        elpd_loo_approx=approx,
        good_k=float(loo.good_k),
        warning=bool(loo.warning),
        lowest_rows=lowest,
        lowest_pareto_k=lowest_k,
    )
