"""Likelihoods that are not a sum over rows: read whole where every row is read anyway.

A time series' recursion (``pm.AR``, a GARCH(1,1) written with ``scan``), a Gaussian process
(a latent ``f`` over all the points), a ``pm.Potential``: at N ≤ 4 096 rows (every row in
every iteration by default) the samplers run their exact full-batch chain on the whole
likelihood and agree with NUTS; at large N one error names the observed variable and what
to do, before anything compiles.

Tolerance of the comparisons (:func:`posteriors.common.assert_agree`): every scalar's mean
within 0.1 reference sd and its sd within 10%, widened by three Monte Carlo standard errors
from both runs' bulk ESS.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest
from posteriors.common import assert_agree
from posteriors.suite import SUITE, ar_model
from posteriors.suite import reference as suite_reference
from stack import dataset

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.registry import SAMPLERS

QUIET = dict(progressbar=False, compute_convergence_checks=False)


@pytest.mark.parametrize("entry", SAMPLERS, ids=lambda s: s.name)
def test_every_sampler_reads_a_non_separable_likelihood_whole(entry):
    with ar_model(300):
        step = entry.cls()
    assert step.problem.whole_likelihood_rows == 300
    assert step.problem.data_size == 1 and step.batch_size == 1
    assert step.full_batch  # every row in every iteration: the exact (MALA) chain


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, sampler, names, draws",
    [
        ("ar", "IASG", ["rho", "sigma"], 1000),
        ("garch", "SGLD", ["omega", "alpha", "beta"], 1000),
        # The full-batch MALA chain mixes slowly on the GP's hyperparameters (ESS ~ 4% of
        # draws): 1 000 draws leave the sd ratio to Monte Carlo noise the bulk ESS understates.
        ("gp_poisson", "ConstantSGD", ["ell", "eta", "f"], 5000),
    ],
    ids=["ar", "garch", "gp-poisson"],
)
def test_whole_likelihoods_agree_with_nuts(name, sampler, names, draws):
    # Against the committed NUTS reference (posteriors/suite.py: numpyro, 4 x 5 000, checked
    # against nutpie when made).
    with SUITE[name].build():
        ours = pmsg.sample(
            step=getattr(pmsg, sampler)(),
            draws=draws,
            tune=500,
            chains=2,
            random_seed=1,
            progressbar=False,
        )
    assert_agree(ours, suite_reference(name), names)


def test_a_non_separable_likelihood_at_large_n_gets_one_clear_error_before_compiling():
    with ar_model(100_000):
        with pytest.raises(pmsg.DataShapeError) as info:
            pmsg.IASG()
    message = str(info.value)
    assert "'y'" in message and "not" in message and "sum of one term per row" in message
    assert "batch_size=N" in message and "minibatch_data=" in message and "NUTS" in message
    # batch_size=N reads it whole, as asked
    with ar_model(10_000):
        assert pmsg.SGLD(batch_size=10_000).problem.whole_likelihood_rows == 10_000


def test_a_potential_likelihood_runs_at_full_batch():
    rng = np.random.default_rng(4)
    data = rng.normal(2.0, 1.0, 50)
    with pm.Model():
        mu = pm.Normal("mu", 0, 10)
        pm.Potential("likelihood", pm.logp(pm.Normal.dist(mu, 1.0), data).sum())
        idata = pmsg.sample(
            step=pmsg.SGLD(), draws=400, tune=200, chains=2, random_seed=1, progressbar=False
        )
    post = dataset(idata)["mu"].values.ravel()
    exact_mean = data.sum() / (50 + 1 / 100)
    exact_sd = (50 + 1 / 100) ** -0.5
    assert abs(post.mean() - exact_mean) < 0.15 * exact_sd + 4 * exact_sd / np.sqrt(300)
    assert abs(post.std() / exact_sd - 1) < 0.15
