"""Statistical checks against closed-form posteriors and NUTS.

Each test runs through the vectorised ``pmsg.sample`` (the ``sample_path`` fixture), which
draws what ``pm.sample(step=...)`` draws for the same seed (test_sampling.py checks it for
every sampler).

Tolerances: a posterior mean estimated from draws with effective sample size ESS has Monte
Carlo sd ``sd/√ESS``; a marginal sd has relative Monte Carlo sd ``≈ 1/√(2 ESS)``. Each test
asserts the issue's thresholds (0.15 posterior sd on means, 15% on sds) *and* that the run's
ESS makes those thresholds at least 3.5 Monte Carlo sds wide, so a pass is not luck and a
bias of the sampler larger than about half the threshold would fail.
"""

from __future__ import annotations

import arviz as az
import numpy as np
import pytest
import xarray as xr
from posteriors.suite import multi_output_model
from posteriors.suite import reference as suite_reference

import pymc_sgmcmc as pmsg

pytestmark = pytest.mark.slow

MEAN_TOL = 0.15  # posterior sds
SD_TOL = 0.15  # relative
Z = 3.5


def _min_ess(idata, var="beta") -> float:
    if isinstance(idata, xr.Dataset):  # a committed reference
        # (selected first: ArviZ 1.3's ess of one Dataset with var_names raised KeyError for a
        # second variable after a first call)
        return float(az.ess(idata[[var]])[var].min())
    return float(az.ess(idata, var_names=[var])[var].min())


def _assert_matches(draws_mean, draws_sd, ref_mean, ref_sd, ess):
    assert MEAN_TOL >= Z / np.sqrt(ess), f"ESS {ess:.0f} too small for a {MEAN_TOL} sd test"
    assert SD_TOL >= Z / np.sqrt(2 * ess), f"ESS {ess:.0f} too small for a {SD_TOL:.0%} sd test"
    z_mean = np.abs(draws_mean - ref_mean) / ref_sd
    sd_ratio = draws_sd / ref_sd
    assert np.all(z_mean < MEAN_TOL), f"mean errors (in sds): {z_mean}"
    assert np.all(np.abs(sd_ratio - 1) < SD_TOL), f"sd ratios: {sd_ratio}"


def test_sgld_recovers_the_conjugate_posterior(regression_10k, sample_path):
    reg = regression_10k
    with reg.model():
        idata = sample_path(
            # Plain SGLD at a 5% variance bias mixes slowly (ESS ≈ 0.03 per pass here), so
            # this needs ~20 000 passes for ESS ≳ 550.
            draws=10_000,
            tune=300,
            chains=2,
            cores=2,
            step=pmsg.SGLD(batch_size=100),
            random_seed=2024,
            progressbar=False,
            compute_convergence_checks=False,
        )
    beta = idata.posterior["beta"].values.reshape(-1, reg.X.shape[1])
    _assert_matches(beta.mean(0), beta.std(0), reg.mean, reg.sd, _min_ess(idata))


@pytest.fixture(scope="module")
def multi_output():
    """Two observed variables sharing X, plus one full-batch observed variable; the committed
    NUTS reference (posteriors/suite.py: numpyro, checked against nutpie when made)."""
    return multi_output_model, suite_reference("multi_output")


MULTI_OUTPUT_SAMPLE = dict(chains=2, cores=1, progressbar=False, compute_convergence_checks=False)


def test_multi_output_model_against_nuts(multi_output, sample_path):
    """Two observed variables sharing X, plus one full-batch observed variable."""
    build, nuts = multi_output
    with build():
        ours = sample_path(
            draws=10_000,
            tune=300,
            step=pmsg.SGLD(batch_size=100),
            random_seed=2,
            **{**MULTI_OUTPUT_SAMPLE, "cores": 2},
        )
    for var in ("beta", "a", "s"):
        ref = nuts[var].values.reshape(-1, nuts[var].values[0, 0].size)
        got = ours.posterior[var].values.reshape(20_000, -1)
        ess = min(_min_ess(ours, var), _min_ess(nuts, var))
        _assert_matches(got.mean(0), got.std(0), ref.mean(0), ref.std(0), ess)
