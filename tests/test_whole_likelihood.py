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
import pytensor
import pytensor.tensor as pt
import pytest
from posteriors.common import assert_agree
from stack import dataset

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.registry import SAMPLERS

QUIET = dict(progressbar=False, compute_convergence_checks=False)


def _ar_model(n: int, seed: int = 0) -> pm.Model:
    rng = np.random.default_rng(seed)
    y = np.zeros(n)
    for t in range(1, n):
        y[t] = 0.6 * y[t - 1] + rng.normal()
    with pm.Model() as model:
        rho = pm.Normal("rho", 0, 1, shape=1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.AR("y", rho=rho, sigma=sigma, init_dist=pm.Normal.dist(0, 1), observed=y)
    return model


def _garch_model(n: int = 200, seed: int = 1) -> pm.Model:
    """GARCH(1,1) written with its recursion: s²_t = ω + α r²_{t−1} + β s²_{t−1}."""
    rng = np.random.default_rng(seed)
    r = np.zeros(n)
    s2 = 0.1
    for t in range(n):
        r[t] = np.sqrt(s2) * rng.normal()
        s2 = 0.05 + 0.1 * r[t] ** 2 + 0.8 * s2
    start = pt.as_tensor(np.var(r))
    with pm.Model() as model:
        omega = pm.HalfNormal("omega", 0.5)
        alpha = pm.Uniform("alpha", 0, 0.5)
        beta = pm.Uniform("beta", 0, 0.95)

        def step(r_prev, s2_prev, omega, alpha, beta):
            return omega + alpha * r_prev**2 + beta * s2_prev

        path = pytensor.scan(
            step,
            sequences=[pt.as_tensor(r)[:-1]],
            outputs_info=[start],
            non_sequences=[omega, alpha, beta],
            return_updates=False,
        )
        pm.Normal("r", 0, pt.sqrt(pt.concatenate([start[None], path])), observed=r)
    return model


def _gp_poisson_model() -> pm.Model:
    """Counts at 11 points with a latent GP log-rate f over all of them."""
    rng = np.random.default_rng(2)
    x = np.linspace(0, 1, 11)[:, None]
    counts = rng.poisson(np.exp(np.sin(6 * x[:, 0])))
    with pm.Model() as model:
        ell = pm.Gamma("ell", 2, 4)
        eta = pm.HalfNormal("eta", 1)
        gp = pm.gp.Latent(cov_func=eta**2 * pm.gp.cov.ExpQuad(1, ell))
        f = gp.prior("f", X=x)
        pm.Poisson("counts", mu=pm.math.exp(f), observed=counts)
    return model


@pytest.mark.parametrize("entry", SAMPLERS, ids=lambda s: s.name)
def test_every_sampler_reads_a_non_separable_likelihood_whole(entry):
    with _ar_model(300):
        step = entry.cls()
    assert step.problem.whole_likelihood_rows == 300
    assert step.problem.data_size == 1 and step.batch_size == 1
    assert step.full_batch  # every row in every iteration: the exact (MALA) chain


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, sampler, names, draws",
    [
        (lambda: _ar_model(300), "IASG", ["rho", "sigma"], 1000),
        (_garch_model, "SGLD", ["omega", "alpha", "beta"], 1000),
        # The full-batch MALA chain mixes slowly on the GP's hyperparameters (ESS ~ 4% of
        # draws): 1 000 draws leave the sd ratio to Monte Carlo noise the bulk ESS understates.
        (_gp_poisson_model, "ConstantSGD", ["ell", "eta", "f"], 5000),
    ],
    ids=["ar", "garch", "gp-poisson"],
)
def test_whole_likelihoods_agree_with_nuts(build, sampler, names, draws):
    model = build()
    with model:
        ours = pmsg.sample(
            step=getattr(pmsg, sampler)(),
            draws=draws,
            tune=500,
            chains=2,
            random_seed=1,
            progressbar=False,
        )
        reference = pm.sample(
            draws=1000,
            tune=1000,
            chains=2,
            random_seed=2,
            nuts_sampler="pymc",
            target_accept=0.9,
            **QUIET,
        )
    assert_agree(ours, reference, names)


def test_a_non_separable_likelihood_at_large_n_gets_one_clear_error_before_compiling():
    with _ar_model(100_000):
        with pytest.raises(pmsg.DataShapeError) as info:
            pmsg.IASG()
    message = str(info.value)
    assert "'y'" in message and "not" in message and "sum of one term per row" in message
    assert "batch_size=N" in message and "minibatch_data=" in message and "NUTS" in message
    # batch_size=N reads it whole, as asked
    with _ar_model(10_000):
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
