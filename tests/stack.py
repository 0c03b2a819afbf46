"""What differs between the two stacks the tests run on, for the tests' own plumbing.

Today's stack (Python >= 3.12): PyMC 6, ArviZ 1 — ``pm.sample`` returns an ``xarray.DataTree``.
The previous one (Python 3.11): PyMC 5.28, ArviZ 0.23 — an ``arviz.InferenceData``. The
tests build and read results through these helpers, written on ArviZ's and xarray's own API
(not the package's), so that one test runs on both.
"""

from __future__ import annotations

from typing import Any

import arviz as az
import numpy as np
import xarray as xr

ARVIZ_1 = int(az.__version__.split(".")[0]) >= 1
PYMC_6 = ARVIZ_1  # PyMC 6 requires ArviZ >= 1.1; PyMC 5 ArviZ < 1

if PYMC_6:
    from pymc.step_methods import STEP_METHODS
else:
    from pymc import STEP_METHODS

__all__ = [
    "ARVIZ_1",
    "PYMC_6",
    "STEP_METHODS",
    "dataset",
    "drop_groups",
    "from_dict",
    "groups",
    "loo",
    "loo_elpd",
    "loo_pointwise",
    "loo_p",
    "result",
    "result_type",
    "summary_with_hdi",
]


def groups(idata: Any) -> list[str]:
    """The groups of a result, in order."""
    if isinstance(idata, xr.DataTree):
        return list(idata.children)
    return list(idata.groups())


def dataset(idata: Any, name: str = "posterior") -> xr.Dataset:
    """Group ``name`` of a result as an ``xarray.Dataset``."""
    group = idata[name]
    return group.to_dataset() if isinstance(group, xr.DataTree) else group


def drop_groups(idata: Any, *names: str) -> None:
    """Remove groups from a result, in place."""
    for name in names:
        if isinstance(idata, xr.DataTree):
            del idata[name]
        else:
            delattr(idata, name)


def result_type() -> type:
    """The type ``pm.sample`` returns on this stack."""
    return xr.DataTree if ARVIZ_1 else az.InferenceData


def from_dict(groups_: dict[str, dict[str, np.ndarray]], **kwargs: Any) -> Any:
    """``az.from_dict`` with the groups as one mapping (ArviZ 1's form) on either stack;
    arrays are ``(chain, draw, ...)``."""
    if ARVIZ_1:
        if any(k.startswith("warmup_") for k in groups_):
            kwargs.setdefault("save_warmup", True)
        return az.from_dict(groups_, **kwargs)
    return az.from_dict(**groups_, **kwargs)


def result(**datasets: xr.Dataset) -> Any:
    """A result of this stack's type made of Datasets."""
    if ARVIZ_1:
        return xr.DataTree.from_dict(datasets)
    return az.InferenceData(**datasets)


def loo(idata: Any, **kwargs: Any) -> Any:
    """``az.loo`` on the log scale, pointwise."""
    if not ARVIZ_1:
        kwargs.setdefault("scale", "log")
    return az.loo(idata, pointwise=True, **kwargs)


def loo_elpd(result_: Any) -> float:
    return float(result_.elpd if ARVIZ_1 else result_.elpd_loo)


def loo_p(result_: Any) -> float:
    return float(result_.p if ARVIZ_1 else result_.p_loo)


def loo_pointwise(result_: Any) -> np.ndarray:
    return np.asarray((result_.elpd_i if ARVIZ_1 else result_.loo_i).values)


def summary_with_hdi(idata: Any, **kwargs: Any) -> Any:
    """``az.summary`` with the 94% HDI, its columns named ``hdi_3%`` / ``hdi_97%`` on both."""
    if ARVIZ_1:
        table = az.summary(idata, ci_kind="hdi", ci_prob=0.94, **kwargs)
        return table.rename(columns={"hdi94_lb": "hdi_3%", "hdi94_ub": "hdi_97%"})
    return az.summary(idata, hdi_prob=0.94, **kwargs)
