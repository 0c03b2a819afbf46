"""The smoke test: the package imports, and one sampler runs through each driver.

CI runs it on every Python it supports (``./run smoke``: this file and the README example);
the full suite runs it too. It checks what a user meets first, not correctness.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pymc as pm
import pytest
from stack import groups, result_type

import pymc_sgmcmc as pmsg

pytestmark = pytest.mark.smoke

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(6_000, 2))
    y = 0.5 + X @ [1.0, -1.0] + rng.normal(size=6_000)
    with pm.Model() as m:
        alpha = pm.Normal("alpha", 0, 10)
        beta = pm.Normal("beta", 0, 10, shape=2)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", alpha + pm.Data("X", X) @ beta, sigma, observed=y)
    return m


def test_the_package_imports_with_its_version():
    """One version source: the installed package's metadata (pyproject.toml), which the
    CHANGELOG's newest section names."""
    assert pmsg.__version__ == version("pymc-sgmcmc")
    newest = re.search(r"^## (\S+)", CHANGELOG.read_text(), re.M).group(1)
    assert newest == pmsg.__version__, (newest, pmsg.__version__)
    package = Path(pmsg.__file__).parent
    written = [
        p for p in package.rglob("*.py") if re.search(r"__version__\s*=\s*['\"]", p.read_text())
    ]
    assert not written, f"a version written in the code: {written}"
    assert {"IASG", "SGLD", "sample", "compare"} <= set(pmsg.__all__)


@pytest.mark.parametrize("driver", ["pm.sample", "pmsg.sample"])
def test_one_sampler_per_driver(model, driver):
    kwargs = dict(draws=40, tune=40, chains=2, random_seed=1, progressbar=False)
    with model:
        if driver == "pm.sample":
            idata = pm.sample(step=pmsg.IASG(), cores=1, compute_convergence_checks=False, **kwargs)
        else:
            idata = pmsg.sample(step=pmsg.SGLD(), **kwargs)
    assert isinstance(idata, result_type())
    assert {"posterior", "sample_stats"} <= set(groups(idata))
    beta = idata["posterior"]["beta"].values
    assert beta.shape == (2, 40, 2) and np.all(np.isfinite(beta))
    assert idata["posterior"].attrs["sgmcmc_samplers"] in ("IASG", "SGLD")
