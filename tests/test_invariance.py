"""Invariance to the units of a predictor: the same regression with a predictor in metres and
in kilometres gives the same posterior after back-transforming, for every sampler.

The tuning is done in the whitened coordinates of the measured curvature
(:mod:`pymc_sgmcmc.tuning.whitening`), which an affine change of a coordinate leaves unchanged;
before it, the rates came from the gradient noise in the parameters' own units and a predictor
in metres next to an intercept gave sds 5–15× too small. Flat priors make the posterior exactly
equivariant (``b_km = 1000 b_m``). N = 8000 rows: the stochastic-gradient regime (B = 256).

Tolerance (derived from the ESS): each run's mean is compared with the exact posterior's
within ``0.1 sd + 4 sd/√ESS`` (the Langevin family ``0.15 sd + ...``) and its sd within
``10% + 4·√(1/(2 ESS))`` (15% for the Langevin family), the intercept, slope (back-transformed)
and σ alike — so both units pass the same test and hence agree with each other.
"""

from __future__ import annotations

import arviz as az
import numpy as np
import pymc as pm
import pytest

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.registry import SAMPLERS

N = 8000
SAMPLE = dict(chains=2, cores=1, random_seed=3, progressbar=False, compute_convergence_checks=False)


def _data():
    rng = np.random.default_rng(12)
    metres = rng.normal(2500.0, 800.0, N)  # uncentred, in metres
    y = 3.0 + 0.002 * metres + rng.normal(0, 1.5, N)
    return metres, y


def _model(x, y):
    with pm.Model() as model:
        a = pm.Flat("a")
        b = pm.Flat("b")
        sigma = pm.HalfFlat("sigma")
        pm.Normal("y", a + b * pm.Data("x", x), sigma, observed=y)
    return model


def _exact(x, y):
    """Flat priors on (a, b) and on σ: (a, b) | σ ~ N(OLS, σ²(XᵀX)⁻¹) and
    σ² ~ SSE/χ²(N − 3) (the flat prior on σ, not on log σ)."""
    X = np.column_stack([np.ones_like(x), x])
    xtx = X.T @ X
    coef = np.linalg.solve(xtx, X.T @ y)
    sse = float(np.sum((y - X @ coef) ** 2))
    rng = np.random.default_rng(0)
    s2 = sse / rng.chisquare(N - 3, 40_000)
    draws = coef + np.sqrt(s2)[:, None] * (
        rng.standard_normal((40_000, 2)) @ np.linalg.cholesky(np.linalg.inv(xtx)).T
    )
    return {"a": draws[:, 0], "b": draws[:, 1], "sigma": np.sqrt(s2)}


LANGEVIN = {s.name for s in SAMPLERS if s.tolerance == "langevin"}


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [s.name for s in SAMPLERS])
def test_a_predictor_in_metres_or_kilometres_gives_the_same_posterior(sampler):
    metres, y = _data()
    tol_mean, tol_sd = (0.15, 0.15) if sampler in LANGEVIN else (0.10, 0.10)
    draws = 1500 if sampler in LANGEVIN else 800
    runs = {}
    for scale in (1.0, 1000.0):  # metres, kilometres
        x = metres / scale
        exact = _exact(x, y)
        with _model(x, y):
            idata = pm.sample(step=getattr(pmsg, sampler)(), draws=draws, tune=300, **SAMPLE)
        post = idata.posterior
        runs[scale] = post["b"].values / scale  # the slope per metre
        for name in ("a", "b", "sigma"):
            ours = post[name].values
            ess = float(az.ess(ours))
            # back in metres: b_km / 1000 — the comparison is with the same units' exact
            # posterior, so both runs are held to the same target
            ref = exact[name]
            z_mean = abs(ours.mean() - ref.mean()) / ref.std()
            ratio = ours.std() / ref.std()
            assert z_mean < tol_mean + 4 / np.sqrt(ess), (sampler, scale, name, z_mean, ess)
            assert abs(ratio - 1) < tol_sd + 4 * np.sqrt(1 / (2 * ess)), (
                sampler,
                scale,
                name,
                ratio,
                ess,
            )
    # and directly: the slope per metre from both runs
    per_m, per_km = runs[1.0], runs[1000.0]
    ess = min(float(az.ess(per_m)), float(az.ess(per_km)))
    sd = per_m.std()
    assert abs(per_m.mean() - per_km.mean()) / sd < 2 * tol_mean + 4 * np.sqrt(2 / ess)
    assert abs(per_km.std() / sd - 1) < 2 * tol_sd + 4 * np.sqrt(1 / ess)
