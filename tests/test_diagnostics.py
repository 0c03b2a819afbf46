"""The self-check (pymc_sgmcmc.diagnostics): it fires on deliberately mis-tuned runs, names the
parameters, records its report in the attrs, and stays quiet on correct runs.

The mis-tuned runs are classic samplers with a user's step, whose variance errors are
predictable: SGLD's uncorrected minibatch noise inflates the variances by about
``1 + ε N² C / (4B)`` (Mandt et al. 2017, §5.1), and a step of 10⁻¹² does not move.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pymc as pm
import pytest
from conftest import make_regression

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.adapter.stats import ess_mean
from pymc_sgmcmc.diagnostics import SGMCMCCheckWarning, check_draws

SAMPLE = dict(chains=2, cores=1, random_seed=5, progressbar=False, compute_convergence_checks=False)


@pytest.fixture(scope="module")
def regression():
    return make_regression(8000, 3, seed=4)


def _report(idata):
    return json.loads(idata.sample_stats.attrs["sgmcmc_diagnostics"])


def test_a_chain_that_does_not_move_is_named(regression):
    with regression.model():
        with pytest.warns(
            SGMCMCCheckWarning, match=r"barely move along beta\[x0\].*step_size=.*1e-12"
        ):
            idata = pm.sample(
                step=pmsg.SGLD(step_size=1e-12, preconditioner=None), draws=100, tune=20, **SAMPLE
            )
    report = _report(idata)
    assert not report["ok"]
    # named as ArviZ labels them (the model's coords)
    assert set(report["stuck"]) == {"beta[x0]", "beta[x1]", "beta[x2]"}
    assert report["relaxation_passes_max"] > 1e6
    assert "sgmcmc_check" not in idata.sample_stats  # moved into the attrs


def test_draws_too_wide_fail_steins_identity(regression):
    """ε = 4·10⁻⁵ with B = 256 of N = 8000 rows: the minibatch noise N²C/B ≈ 2.5·10⁵ inflates
    the variances by ≈ 1 + ε·2.5·10⁵/4 ≈ 3.5 (measured below); the check reads the ratio
    off Stein's identity without knowing the posterior."""
    with regression.model():
        with pytest.warns(SGMCMCCheckWarning, match=r"Stein's identity fails for beta\["):
            idata = pm.sample(
                step=pmsg.SGLD(step_size=4e-5, preconditioner=None), draws=600, tune=100, **SAMPLE
            )
    beta = idata.posterior["beta"].values.reshape(-1, 3)
    measured = beta.var(0) / np.diag(regression.cov)
    report = _report(idata)
    estimated = np.array([report["stein_ratio"][f"beta[x{k}]"] for k in range(3)])
    assert np.all(measured > 2.0), measured
    # the estimate follows the measured ratio (within its Monte Carlo error and the
    # non-Gaussian shape of an inflated chain's law)
    np.testing.assert_allclose(estimated, measured, rtol=0.35)


def test_correct_runs_pass_quietly(regression):
    with regression.model(), warnings.catch_warnings():
        warnings.simplefilter("error", SGMCMCCheckWarning)
        for step in (pmsg.IASG(), pmsg.SGLD(batch_size=8000)):
            idata = pm.sample(step=step, draws=400, tune=200, **SAMPLE)
            report = _report(idata)
            assert report["ok"]
            # every coordinate of the posterior (beta's 3 and sigma) had its chains compared
            assert report["rhat_checked"] >= 4 and not report["rhat_flagged"]
            ratios = np.array(list(report["stein_ratio"].values()))
            ses = np.array(list(report["stein_se"].values()))
            assert np.all(np.abs(ratios - 1) < 0.2 + 4 * ses), (ratios, ses)


def test_check_draws_statistics_on_known_draws():
    """Exact Gaussian draws with A⁻¹ = I: Stein ratio ≈ 1; the same draws scaled by 1.5 (variance
    2.25×) flagged, a mean shift of 0.5 sd flagged, independent draws move."""
    rng = np.random.default_rng(0)
    theta = rng.normal(size=(2, 2000, 3))
    grad = -theta  # ∇log p of N(0, I), M = I
    names = ["x[0]", "x[1]", "x[2]"]
    ok = check_draws(theta, grad, np.ones(3), names, passes_per_draw=1.0, ess=ess_mean)
    assert not ok["stein_flagged"] and not ok["stuck"]
    assert all(abs(v - 1) < 0.1 for v in ok["stein_ratio"].values())
    wide = check_draws(1.5 * theta, -1.5 * theta, np.ones(3), names, 1.0, ess=ess_mean)
    assert wide["stein_flagged"] == names
    assert all(abs(v - 2.25) < 0.25 for v in wide["stein_ratio"].values())
    shifted = check_draws(theta + 0.5, -(theta + 0.5), np.ones(3), names, 1.0, ess=ess_mean)
    assert shifted["stein_flagged"] == names
    assert all(abs(v - 0.5) < 0.1 for v in shifted["mean_shift_sd"].values())
    still = np.repeat(theta[:, :1], 2000, axis=1) + 1e-9 * theta
    assert check_draws(still, -still, np.ones(3), names, 1.0, ess=ess_mean)["stuck"] == names


def test_a_chain_away_from_the_others_is_named_on_any_coordinate():
    """The chains-agree check reads every coordinate, not the Stein check's subset: exact
    N(0, 1) draws of 3 000 group effects in 2 chains × 200 draws, where chain 1 holds one
    effect 10 sds away, and a drifting chain of a 2-d variable: both named (with their
    integer positions), nothing else; chains shorter than 50 draws are not compared. Here
    each coordinate has 400 effective draws: R̂ exceeds 1.2 by chance with probability
    about 10⁻²⁰."""
    from pymc_sgmcmc.diagnostics import RHAT_TOLERANCE, check_chains_agree

    rng = np.random.default_rng(3)
    u = rng.normal(size=(2, 200, 3000))
    quiet = check_chains_agree({"u": u})
    assert quiet["rhat_checked"] == 3000 and not quiet["rhat_flagged"], quiet["rhat_max"]
    assert quiet["rhat_max"] < 1.05
    u[1, :, 1900] += 10.0
    slopes = rng.normal(size=(2, 200, 4, 2))
    slopes[0, :, 3, 1] += np.linspace(0.0, 6.0, 200)  # chain 0 still drifting
    # a coordinate constant up to rounding (a correlation matrix's unit diagonal) is skipped
    unit = 1.0 + np.where(np.arange(200) < 100, 0.0, 2.2e-16)[None, :] * np.array([[1], [0]])
    found = check_chains_agree(
        {"u": u, "slopes": slopes, "theta": rng.normal(size=(2, 200)), "corr_diag": unit}
    )
    assert set(found["rhat_flagged"]) == {"u[1900]", "slopes[3,1]"}, found
    assert all(r > RHAT_TOLERANCE for r in found["rhat_flagged"].values())
    assert found["rhat_checked"] == 3000 + 8 + 1
    assert check_chains_agree({"u": u[:, :40]})["rhat_checked"] == 0


def test_the_chains_agree_check_computes_arviz_rank_rhat():
    """``split_rhat`` is ArviZ's rank-normalised split R̂ (bulk and folded), vectorised: it
    equals the host ArviZ's value per coordinate — chains that agree, one shifted, one with a
    wider spread (the folded R̂) and one still drifting; continuous draws and tied ones."""
    import arviz as az

    from pymc_sgmcmc.diagnostics import split_rhat

    rng = np.random.default_rng(11)
    x = rng.normal(size=(3, 120, 4))
    x[1, :, 1] += 0.8
    x[2, :, 2] *= 3.0
    x[0, :, 3] += np.linspace(0.0, 2.0, 120)
    ours = split_rhat(x)
    theirs = [float(az.rhat(x[:, :, j], method="rank")) for j in range(4)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)
    assert ours[0] < 1.05 < min(ours[1:])
    # ties (counts, rounded values: the folded draws tie too) take their average rank
    tied = np.round(x * 2.0)
    theirs = [float(az.rhat(tied[:, :, j], method="rank")) for j in range(4)]
    np.testing.assert_allclose(split_rhat(tied), theirs, rtol=1e-10)


def test_a_global_with_few_effective_draws_is_named():
    """The globals' marginal check reports a global whose draws are too correlated to tell
    its accuracy (bulk ESS below 100: issue 37's rule), with exact but slowly mixing draws
    — an AR(1) chain of N(0, 1) with ρ = 0.99 (ESS ≈ 800 · 0.005 ≈ 4) beside independent
    ones."""
    from pymc_sgmcmc.diagnostics import _marginal_messages, check_marginal

    rng = np.random.default_rng(0)
    chains, draws = 2, 400
    slow = np.zeros((chains, draws))
    slow[:, 0] = rng.normal(size=chains)
    for t in range(1, draws):
        slow[:, t] = 0.99 * slow[:, t - 1] + np.sqrt(1 - 0.99**2) * rng.normal(size=chains)
    positions = np.stack([rng.normal(size=(chains, draws)), slow], axis=-1)
    info = {
        "names": ["theta", "tau"],
        "cov_diag": [1.0, 1.0],
        "direction": [1.0, 0.0],
        "direction_variance": 1.0,
    }
    entries = [{"check": {"marginal": info}}] * chains
    out = check_marginal(positions, -positions, entries, 1.0, ess=_bulk_ess)
    assert out["few_effective_draws"] == ["tau"], out["global_ess"]
    assert out["global_ess"]["theta"] > 400
    (message,) = [m for m in _marginal_messages(out, {}) if "effective draws" in m]
    assert "tau (ESS" in message and "theta" not in message


def _bulk_ess(x):
    import arviz as az

    return float(az.ess(np.asarray(x), method="bulk"))


def test_a_negative_stein_statistic_is_not_called_a_variance_ratio():
    # Stein's mean of products estimates the variance ratio near the posterior; far off it
    # goes below 0 (InstEval's scales under IASG: -0.71), which is no variance
    from pymc_sgmcmc.diagnostics import _ratio_text

    assert _ratio_text(0.5) == "variance ratio 0.50"
    assert "below 0" in _ratio_text(-0.71) and "-0.71" in _ratio_text(-0.71)


def test_a_global_whose_measured_curvature_is_indefinite_is_not_checked_on_it():
    """A non-centred scale's joint curvature, measured at one point of its funnel, can be
    indefinite there: [H⁻¹]_gg ≤ 0 is no variance. That global's marginal is left out (named
    in the attrs) instead of read as NaN (numpy's "invalid value in sqrt" in the grid's
    non-centred runs); the others are checked as before."""
    import warnings as _warnings

    from pymc_sgmcmc.diagnostics import check_marginal

    rng = np.random.default_rng(1)
    positions = rng.normal(size=(2, 400, 2))
    info = {
        "names": ["theta", "tau"],
        "cov_diag": [1.0, -0.3],
        "direction": [1.0, 0.0],
        "direction_variance": 1.0,
    }
    with _warnings.catch_warnings():
        _warnings.simplefilter("error", RuntimeWarning)
        out = check_marginal(
            positions, -positions, [{"check": {"marginal": info}}] * 2, 1.0, ess=_bulk_ess
        )
    assert out["not_positive"] == ["tau"]
    assert list(out["stein_ratio"]) == ["theta"] and abs(out["stein_ratio"]["theta"] - 1) < 0.2
    assert list(out["laplace_variance_ratio"]) == ["theta"]
    assert set(out["global_ess"]) == {"theta", "tau"}
