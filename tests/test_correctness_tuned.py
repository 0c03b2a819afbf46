"""Automatically tuned samplers against exact and NUTS posteriors (Mandt et al. 2017).

Each test runs through ``pmsg.sample`` (the ``sample_path`` fixture; it draws what
``pm.sample(step=...)`` draws: test_sampling.py) — the hyperparameter tuning through both —
but for the digits example, which runs the example's own code. Tolerances as in
``test_correctness.py``: means within 0.15 posterior sd, marginal sds within
15%, correlations within 0.1, each asserted together with an ESS large enough that the
threshold is at least 3.5 Monte Carlo sds (a correlation ρ has MC sd ≈ (1 − ρ²)/√ESS).
"""

from __future__ import annotations

import arviz as az
import numpy as np
import pymc as pm
import pytest
import xarray as xr
from conftest import SAMPLE_PATHS, make_regression
from posteriors.suite import SUITE
from posteriors.suite import reference as suite_reference

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.tuning import iasg_window

pytestmark = pytest.mark.slow
Z = 3.5
SAMPLE = dict(
    chains=2, cores=1, random_seed=11, progressbar=False, compute_convergence_checks=False
)


def _flat(idata, var):
    """Draws of ``var`` as (chains·draws, size), from a result or a posterior Dataset."""
    post = idata if isinstance(idata, xr.Dataset) else idata.posterior
    values = post[var].values
    return values.reshape(values.shape[0] * values.shape[1], -1)


def _ess(idata, var):
    return float(az.ess(idata, var_names=[var])[var].min())


def _check_gaussian(draws, mean, cov, ess, correlations=True):
    """Means within 0.15 sd, sds within 15% and (optionally) correlations within 0.1, with an
    ESS large enough that each threshold is ≥ Z Monte Carlo sds."""
    sd = np.sqrt(np.diag(cov))
    assert 0.15 >= Z / np.sqrt(ess) and 0.15 >= Z / np.sqrt(2 * ess), f"ESS {ess:.0f} too small"
    z = np.abs(draws.mean(0) - mean) / sd
    ratio = draws.std(0) / sd
    assert np.all(z < 0.15), f"mean errors in sds: {np.round(z, 3)}"
    assert np.all(np.abs(ratio - 1) < 0.15), f"sd ratios: {np.round(ratio, 3)}"
    if correlations:
        assert 0.1 >= Z / np.sqrt(ess), f"ESS {ess:.0f} too small for correlations"
        corr_err = np.abs(np.corrcoef(draws, rowvar=False) - cov / np.outer(sd, sd))
        assert corr_err.max() < 0.1, f"max correlation error {corr_err.max():.3f}"


@pytest.mark.parametrize(
    "make_step",
    [
        pytest.param(
            lambda: pmsg.ConstantSGD(batch_size=100, preconditioner="full"), id="constant_sgd_full"
        ),
        pytest.param(
            # Mandt §4.3: with damping μ the KL-optimal rate is μ P*, same stationary law
            lambda: pmsg.ConstantSGD(batch_size=100, preconditioner="full", momentum=0.5),
            id="constant_sgd_full_momentum",
        ),
        pytest.param(lambda: pmsg.IASG(batch_size=100), id="iasg"),
    ],
)
def test_exact_posterior_of_a_d10_regression(regression_d10, make_step, sample_path):
    reg = regression_d10
    with reg.model():
        step = make_step()
        # IASG's draws are about half a pass each (window 47 of N/B = 100 iterations): 1600 of
        # them per chain for the ESS of 1225 that the correlation check needs.
        draws = 1600 if isinstance(step, pmsg.IASG) else 1200
        idata = sample_path(draws=draws, tune=50, step=step, **SAMPLE)
    ess = _ess(idata, "beta")
    _check_gaussian(_flat(idata, "beta"), reg.mean, reg.cov, ess)
    if isinstance(step, pmsg.IASG):
        # About one independent draw per pass over the data (Mandt §6.2): the window is N/B
        # less the finite-window correction, 47 of 100 iterations with ε = 3B/N here.
        passes = np.diff(idata.sample_stats["data_passes"].values, axis=1)
        np.testing.assert_allclose(passes, step.window * 100 / 10_000)
        assert step.window == iasg_window(100, 0.03) == 47
        per_pass = ess / (passes.shape[0] * draws * passes.mean())
        assert per_pass >= 0.5, f"IASG ESS per pass {per_pass:.2f}"


def test_full_constant_sgd_is_exact_at_a_large_batch_fraction(sample_path):
    """B/N = 1/2: the minibatch noise is ~N/B = 2 posterior units per step, far less than a
    step at the discretisation cap needs; the rest is injected and the discrete-time budget
    h(2 − h) keeps the iterates' AR(1) at exactly the posterior variance (Theorem 2's
    continuous-time rate gave sds 1.26–1.36× exact here)."""
    reg = make_regression(400, 3, seed=7)
    with reg.model():
        step = pmsg.ConstantSGD(batch_size=200, preconditioner="full")
        idata = sample_path(draws=3000, tune=50, step=step, **SAMPLE)
    ess = _ess(idata, "beta")
    # 15% on an sd is ≥ 3.5 Monte Carlo sds, and 0.1 on a correlation too, at ESS ≥ 1225
    # (checked inside).
    _check_gaussian(_flat(idata, "beta"), reg.mean, reg.cov, ess)


def test_scalar_constant_sgd_gives_the_posterior(regression_d10, sample_path):
    """A scalar whitening (``A ≈ mean(diag A)·I``) leaves the curvature's spread to the
    stability cap and the mixing time, not to the stationary covariance: the injected noise
    fills the budget in every direction (the continuous-time stationary law of preconditioned
    Langevin dynamics is the posterior for any fixed preconditioner)."""
    reg = regression_d10
    with reg.model():
        step = pmsg.ConstantSGD(batch_size=100, preconditioner="scalar")
        idata = sample_path(draws=2500, tune=50, step=step, **SAMPLE)
    ess = _ess(idata, "beta")
    _check_gaussian(_flat(idata, "beta"), reg.mean, reg.cov, ess, correlations=False)
    assert step.tuned.whitening.condition_number == pytest.approx(1.0)


def test_temperature_scales_the_posterior_covariance(regression_d10, sample_path):
    reg = regression_d10
    with reg.model():
        idata = sample_path(
            draws=1600, tune=50, step=pmsg.IASG(batch_size=100, temperature=2.0), **SAMPLE
        )
    ess = _ess(idata, "beta")
    _check_gaussian(_flat(idata, "beta"), reg.mean, 2.0 * reg.cov, ess)


def test_iasg_logistic_regression_against_nuts(sample_path):
    # The committed NUTS reference (posteriors/suite.py, checked against nutpie when made).
    build, nuts = SUITE["logistic_50k"].build, suite_reference("logistic_50k")
    with build():
        ours = sample_path(draws=1600, tune=30, step=pmsg.IASG(batch_size=500), **SAMPLE)
    ref = _flat(nuts, "beta")
    ess = min(_ess(ours, "beta"), _ess(nuts, "beta"))
    _check_gaussian(_flat(ours, "beta"), ref.mean(0), np.cov(ref, rowvar=False), ess)
    passes = np.diff(ours.sample_stats["data_passes"].values, axis=1).mean()
    assert _ess(ours, "beta") / (3200 * passes) >= 0.5, "IASG: under 0.5 ESS per data pass"


# Both drivers: the hyperparameters' tuning is not in test_sampling's draw-for-draw check.
@pytest.mark.parametrize("sample_path", SAMPLE_PATHS, indirect=True)
def test_variational_em_finds_the_empirical_bayes_prior_precision(sample_path):
    """Mandt §4.2 on a model where the answer is closed-form.

    Linear regression with a prior precision λ on the weights: the empirical-Bayes λ maximises
    the marginal likelihood N(y | 0, I + X Xᵀ/λ), computed exactly here. Weak features make the
    prior matter, so a sampler that misjudged the posterior spread would move λ far away
    (before the curvature lift, λ ran to the hyperprior's scale, ~10³).
    """
    import scipy.optimize

    rng = np.random.default_rng(4)
    n, d = 5000, 10
    X = rng.normal(size=(n, d)) * 0.02
    y = X @ (rng.normal(size=d) / 2.0) + rng.normal(size=n)

    def neg_log_evidence(log_lam):
        lam = np.exp(log_lam)
        precision = X.T @ X + lam * np.eye(d)
        mean = np.linalg.solve(precision, X.T @ y)
        return 0.5 * (y @ y - y @ X @ mean + np.linalg.slogdet(precision)[1] - d * np.log(lam))

    eb = float(
        np.exp(scipy.optimize.minimize_scalar(neg_log_evidence, bounds=(-8, 8), method="bounded").x)
    )
    with pm.Model():
        lam = pm.Gamma("lam", alpha=1.0, beta=1e-3, initval=1.0)
        b = pm.Normal("b", 0, sigma=1 / pm.math.sqrt(lam), shape=d)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
        step = pmsg.ConstantSGD(batch_size=100, hyper_vars=[lam])
        idata = sample_path(draws=100, tune=1000, step=step, **{**SAMPLE, "chains": 1})
    found = idata.posterior["lam"].values
    assert np.all(found == found[0, 0]), "the hyperparameter is frozen after tuning"
    # The hyperprior Gamma(1, 1e-3) shifts the optimum by a factor (d - 2e-3 λ)/d ≈ 1.
    np.testing.assert_allclose(found[0, 0], eb, rtol=0.2)
    assert "hyper_lam_log__" in idata.sample_stats
    assert len(step.hyper_trajectory) == 1000  # one entry per tuning draw


def test_variational_em_selects_the_validation_optimal_prior_precision_on_digits():
    """Mandt et al. §7.3: multinomial logistic regression on scikit-learn's digits (1797 × 64,
    shipped with the package), prior precision λ on the weights. Variational EM's λ must be
    within a factor 5 of the λ minimising validation log-loss on a grid (MAP fits by
    scikit-learn). The validation optimum is a proxy for variational EM's fixed point, not
    the fixed point itself, and D = 650 puts the tuning on its diagonal fallback, whose
    curvature diagonal is a 16-probe Hutchinson estimate: with plain probes λ came out 0.09
    to 0.24 depending on the probes' seed alone (validation optimum 0.032), with the scaled
    probes (docs/tuning.md) 0.13–0.15 whatever the minibatch's share of the noise. Uses ``examples/vem_digits.py`` itself, which also draws the docs figure
    (through pm.sample only: it tests the example; variational EM through pmsg.sample is the
    test above).
    """
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "vem_digits.py"
    spec = importlib.util.spec_from_file_location("vem_digits", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    Xt, yt, Xv, yv = example.load()
    grid = np.logspace(-3, 2, 11)
    best = float(grid[np.argmin(example.validation_grid(Xt, yt, Xv, yv, grid))])
    lam, trajectory = example.fit_vem(Xt, yt, tune=1500, draws=20, seed=1)
    assert len(trajectory) == 1500
    assert best / 5 <= lam <= best * 5, (lam, best)
