"""ArviZ's estimators as the package calls them: the ESS of a mean and PSIS-LOO.

The rest of the package passes :func:`ess_mean` down (the self-check takes it as an argument)
and reads LOO's results through :func:`loo_pointwise`, so that it sees plain NumPy values
whichever ArviZ the host has.
"""

from __future__ import annotations

from typing import NamedTuple

import arviz as az
import numpy as np
import xarray as xr

from pymc_sgmcmc.adapter.results import ARVIZ_1, from_groups

__all__ = ["LOO_SE_DDOF", "PsisLoo", "ess_mean", "ess_of_means", "psis_loo"]

# The ddof of the spread of the rows' elpd in ArviZ's LOO standard error (ArviZ 1 follows R's
# loo: sqrt(N)·sd with ddof 1; ArviZ 0.x: sqrt(N·Var) with ddof 0).
LOO_SE_DDOF = 1 if ARVIZ_1 else 0


def ess_mean(values: np.ndarray) -> float:
    """ArviZ's effective sample size of the mean of a ``(chains, draws)`` array."""
    return float(az.ess(np.asarray(values, dtype=np.float64), method="mean"))


class PsisLoo(NamedTuple):
    """ArviZ's pointwise PSIS-LOO, as NumPy values: the rows' ``elpd_loo_i``, their Pareto k,
    ArviZ's threshold for a good k and whether ArviZ warned (a k above it)."""

    elpd_i: np.ndarray
    pareto_k: np.ndarray
    good_k: float
    warning: bool


def psis_loo(log_likelihood: xr.Dataset, var_name: str, reff: float) -> PsisLoo:
    """``az.loo(pointwise=True)`` on the variable ``var_name`` of a ``log_likelihood``
    Dataset (``chain``, ``draw``, rows), on the log scale."""
    data = from_groups({"log_likelihood": log_likelihood})
    if ARVIZ_1:
        loo = az.loo(data, pointwise=True, var_name=var_name, reff=reff)
        elpd_i = loo.elpd_i
    else:
        loo = az.loo(data, pointwise=True, var_name=var_name, reff=reff, scale="log")
        elpd_i = loo.loo_i
    return PsisLoo(
        np.asarray(elpd_i.values, dtype=float),
        np.asarray(loo.pareto_k.values, dtype=float),
        float(loo.good_k),
        bool(loo.warning),
    )


def ess_of_means(dataset: xr.Dataset) -> np.ndarray:
    """ArviZ's ESS of the mean of every scalar of ``dataset`` (chain, draw, ...), raveled."""
    ess = az.ess(dataset, method="mean")
    if isinstance(ess, xr.DataTree):
        ess = ess.to_dataset()
    return np.hstack([np.asarray(ess[v].values).ravel() for v in ess.data_vars])
