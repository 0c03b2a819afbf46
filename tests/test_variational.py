"""Local variables (``local_vars=``): exact algebra, structure checks, and closed-form posteriors.

The statistical tests use Gaussian random-effects models whose joint posterior over the global
mean and the local effects is Gaussian and known in closed form. Tolerances are stated at each
assertion: the issue's acceptance bound (means within 0.2 posterior sds) and, for sds, the
Monte Carlo error of an sd estimated from ``ESS`` draws (relative sd ≈ 1/√(2 ESS)) plus the
bias the sampler's tuning allows (SGLD's ``target_bias`` 5% of variance ≈ 2.5% of sd).
"""

from __future__ import annotations

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import pymc as pm
import pytest
from posteriors.common import score, verdict
from posteriors.posteriordb import build, reference
from stack import groups

import pymc_sgmcmc as pmsg
from pymc_sgmcmc import _tridiagonal as T
from pymc_sgmcmc import variational as V
from pymc_sgmcmc.errors import ModelNotSupportedError

jax.config.update("jax_enable_x64", True)


# ---------------------------------------------------------------------------------------
# Exact algebra
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 17])
def test_tridiagonal_factor_solves_and_inverse_diagonal_match_dense_algebra(n):
    rng = np.random.default_rng(n)
    sub = rng.normal(size=n - 1)
    diag = (
        np.abs(rng.normal(size=n)) + 2.5 * np.r_[np.abs(sub), 0] + 2.5 * np.r_[0, np.abs(sub)] + 0.1
    )
    dense = np.diag(diag) + np.diag(sub, -1) + np.diag(sub, 1)
    chol = np.linalg.cholesky(dense)
    l_diag, c = V.tridiagonal_cholesky(jnp.asarray(diag), jnp.asarray(sub))
    np.testing.assert_allclose(
        np.diag(np.asarray(l_diag)) + np.diag(np.asarray(c), -1), chol, atol=1e-12
    )
    rhs = rng.normal(size=(n, 3))
    np.testing.assert_allclose(
        V.tridiagonal_solve_lower(l_diag, c, jnp.asarray(rhs)),
        np.linalg.solve(chol, rhs),
        atol=1e-12,
    )
    np.testing.assert_allclose(
        V.tridiagonal_solve_upper(l_diag, c, jnp.asarray(rhs)),
        np.linalg.solve(chol.T, rhs),
        atol=1e-12,
    )
    np.testing.assert_allclose(
        T._tridiagonal_inverse_diagonal(l_diag, c), np.diag(np.linalg.inv(dense)), atol=1e-12
    )


def test_colour_probes_read_a_tridiagonal_matrix_off_three_products():
    rng = np.random.default_rng(0)
    n = 11
    diag, sub = rng.normal(size=n), rng.normal(size=n - 1)
    dense = np.diag(diag) + np.diag(sub, -1) + np.diag(sub, 1)
    products = np.asarray(T._colour_probes(n, jnp.float64)) @ dense  # rows: (M v_c)^T
    got_diag, got_sub = T._tridiagonal_from_products(jnp.asarray(products))
    np.testing.assert_allclose(got_diag, diag, atol=1e-14)
    np.testing.assert_allclose(got_sub, sub, atol=1e-14)


def test_antithetic_draws_come_in_pairs():
    layout = V.LocalLayout(names=("z",), shapes=((5,),), dtypes=("float64",), slots=(0,))
    hybrid = V.Hybrid(layout, "meanfield", 4, 0.1)
    eps = np.asarray(hybrid.draw_eps(jax.random.PRNGKey(0), jnp.float64))
    assert eps.shape == (4, 5)
    np.testing.assert_array_equal(eps[2:], -eps[:2])


# ---------------------------------------------------------------------------------------
# Closed-form random effects
# ---------------------------------------------------------------------------------------

SIGMA, TAU, PRIOR_SD = 1.0, 0.5, 10.0


def grouped_effects(groups: int = 24, seed: int = 0):
    """``y_ij ~ N(u_j, σ)``, ``u_j ~ N(μ, τ)``, ``μ ~ N(0, 10)`` with σ, τ known (centred).

    Returns the model and the exact posterior mean and sd of (μ, u) (a Gaussian: its
    precision has the prior's and the data's terms and the μ–u coupling ``−1/τ²``)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(2, 40, size=groups)
    g = np.repeat(np.arange(groups), counts)
    y = (1.0 + TAU * rng.normal(size=groups))[g] + SIGMA * rng.normal(size=g.size)
    precision = np.zeros((groups + 1, groups + 1))
    shift = np.zeros(groups + 1)
    precision[0, 0] = groups / TAU**2 + 1 / PRIOR_SD**2
    for j in range(groups):
        precision[j + 1, j + 1] = counts[j] / SIGMA**2 + 1 / TAU**2
        precision[0, j + 1] = precision[j + 1, 0] = -1 / TAU**2
        shift[j + 1] = y[g == j].sum() / SIGMA**2
    cov = np.linalg.inv(precision)
    with pm.Model(coords={"group": np.arange(groups)}) as model:
        index = pm.Data("g", g)
        mu = pm.Normal("mu", 0, PRIOR_SD)
        u = pm.Normal("u", mu, TAU, dims="group")
        pm.Normal("y", u[index], SIGMA, observed=y)
    return model, cov @ shift, np.sqrt(np.diag(cov))


def row_effects(rows: int = 1500, seed: int = 1):
    """One effect per row, ``y_n ~ N(z_n, σ)``, ``z_n ~ N(μ, τ)``: the locals lie on the data
    axis and are minibatched with it (gathered at the minibatch's original rows)."""
    rng = np.random.default_rng(seed)
    y = 0.7 + TAU * rng.normal(size=rows) + SIGMA * rng.normal(size=rows)
    total = TAU**2 + SIGMA**2
    mu_var = 1 / (rows / total + 1 / PRIOR_SD**2)
    mu_mean = mu_var * y.sum() / total
    shrink = TAU**2 / total  # E[z | μ, y] = μ + shrink (y − μ)
    z_mean = mu_mean + shrink * (y - mu_mean)
    z_var = TAU**2 * SIGMA**2 / total + (1 - shrink) ** 2 * mu_var
    with pm.Model(coords={"obs": np.arange(rows)}) as model:
        mu = pm.Normal("mu", 0, PRIOR_SD)
        z = pm.Normal("z", mu, TAU, dims="obs")
        pm.Normal("y", z, SIGMA, observed=y, dims="obs")
    mean = np.r_[mu_mean, z_mean]
    sd = np.sqrt(np.r_[mu_var, np.full(rows, z_var)])
    return model, mean, sd


def errors(idata, mean, sd, local: str):
    post = idata.posterior
    ess = az.ess(idata, var_names=["mu", local])
    out = {
        "mu_err": (float(post["mu"].mean()) - mean[0]) / sd[0],
        "mu_sd": float(post["mu"].std()) / sd[0],
        "mu_ess": float(ess["mu"]),
        "local_err": (post[local].mean(("chain", "draw")).values - mean[1:]) / sd[1:],
        "local_sd": post[local].std(("chain", "draw")).values / sd[1:],
        "local_ess": ess[local].values,
    }
    return out


def sd_tolerance(ess, bias: float) -> float:
    """Relative error allowed for an sd: 4 Monte Carlo sds of an sd from ``ess`` draws plus
    the sampler's bias allowance."""
    return 4.0 / np.sqrt(2.0 * np.min(ess)) + bias


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sampler", "mu_bias"),
    [
        # SGLD: target_bias 5% of variance (≈ 2.5% of sd), on the ELBO's noise and curvature.
        (pmsg.SGLD, 0.05),
        # IASG: N/B = 2 here, so "auto" takes ε = 2/3 and a window of one iterate (below that
        # ε even one iterate is narrower than the posterior: μ sd was 0.80–0.84× at ε = 0.5).
        # Measured μ sd 0.98–1.02×, seeds 3 and 4.
        (pmsg.IASG, 0.05),
        # ConstantSGD: the full KL-optimal rate, exact in discrete time (N/B = 2 here):
        # measured μ sd 0.97–0.99× exact, seeds 3 and 4.
        (pmsg.ConstantSGD, 0.05),
    ],
)
def test_markov_locals_recover_the_exact_random_effects_posterior(sampler, mu_bias):
    """Acceptance (issue 5): global and local means within 0.2 sd. "markov" contains the exact
    conditional posterior of the effects for every μ, so sds must match too."""
    model, mean, sd = grouped_effects()
    with model:
        step = sampler(local_vars=["u"], local_family="markov")
        idata = pm.sample(
            draws=600,
            tune=200,
            chains=2,
            cores=1,
            step=step,
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
        )
    e = errors(idata, mean, sd, "u")
    assert abs(e["mu_err"]) < 0.2, e["mu_err"]
    assert np.max(np.abs(e["local_err"])) < 0.2, e["local_err"]
    assert abs(e["mu_sd"] - 1) < sd_tolerance(e["mu_ess"], mu_bias), (e["mu_sd"], e["mu_ess"])
    assert np.all(np.abs(e["local_sd"] - 1) < sd_tolerance(e["local_ess"], 0.03)), e["local_sd"]


@pytest.mark.slow
def test_meanfield_locals_get_the_means_right():
    """``"meanfield"`` (the default before "auto"): q does not follow μ by construction (it
    adapts while sampling, and the minibatch noise of its updates widens the effects' draws),
    so only the means are asserted (acceptance)."""
    model, mean, sd = grouped_effects(seed=4)
    with model:
        idata = pm.sample(
            draws=600,
            tune=200,
            chains=2,
            cores=1,
            random_seed=5,
            step=pmsg.SGLD(local_vars=["u"], local_family="meanfield"),
            progressbar=False,
            compute_convergence_checks=False,
        )
    e = errors(idata, mean, sd, "u")
    assert abs(e["mu_err"]) < 0.2, e["mu_err"]
    assert np.max(np.abs(e["local_err"])) < 0.2, e["local_err"]


@pytest.mark.slow
def test_row_aligned_locals_are_minibatched_with_their_rows():
    """Per-row effects with B = 250 of N = 1500 rows: each iteration gathers the locals at the
    minibatch's original row indices (the data are shuffled once for the blocks scheme)."""
    model, mean, sd = row_effects()
    with model:
        step = pmsg.SGLD(local_vars=["z"], local_family="markov", batch_size=250)
        idata = pm.sample(
            draws=500,
            tune=200,
            chains=2,
            cores=1,
            step=step,
            random_seed=7,
            progressbar=False,
            compute_convergence_checks=False,
        )
    assert step.problem.row_local_names == ("z",)
    e = errors(idata, mean, sd, "z")
    assert abs(e["mu_err"]) < 0.2, e["mu_err"]
    assert np.max(np.abs(e["local_err"])) < 0.2, np.max(np.abs(e["local_err"]))
    # The locals' sds: exact family, frozen after full-data refinement (the default with
    # minibatches); 1 500 sds, so the median is tight.
    assert abs(np.median(e["local_sd"]) - 1) < 0.05, np.median(e["local_sd"])
    assert abs(e["mu_sd"] - 1) < sd_tolerance(e["mu_ess"], 0.05), (e["mu_sd"], e["mu_ess"])


def test_inference_data_holds_locals_elbo_and_q():
    model, _, _ = grouped_effects(groups=6)
    with model:
        idata = pm.sample(
            draws=5,
            tune=5,
            chains=2,
            cores=1,
            random_seed=1,
            progressbar=False,
            step=pmsg.SGLD(local_vars=["u"], local_family="markov"),
            compute_convergence_checks=False,
        )
    assert idata.posterior["u"].dims == ("chain", "draw", "group")
    assert np.all(np.isfinite(idata.posterior["u"].values))
    assert "elbo" in idata.sample_stats and np.all(np.isfinite(idata.sample_stats["elbo"]))
    group = idata.variational
    assert set(group.data_vars) == {"u_site_shift", "u_log_site_precision", "u_gain"}
    assert group["u_site_shift"].dims == ("chain", "group")
    # q's mean's linear response to the sampled globals: one column per sampled coordinate
    assert group["u_gain"].shape[:2] == (2, 6) and group["u_gain"].ndim == 3
    assert groups(idata).count("sample_stats") == 1
    settings = idata.posterior.attrs["sgmcmc_settings"]
    assert '"local_family": "markov"' in settings and "site_shift" not in settings
    # The draws of the locals differ from draw to draw (fresh draws from q).
    assert np.all(np.std(idata.posterior["u"].values, axis=1) > 0)


# ---------------------------------------------------------------------------------------
# Structure checks and bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.slow  # 20-60 s, compiling (tests/README.md: the loop's budget)
def test_markov_needs_a_gaussian_tridiagonal_prior_and_is_the_default_where_it_has_one():
    # local_family="markov" by name is refused where the prior does not allow it; the
    # default ("auto") takes "markov" where it does and "meanfield" elsewhere.
    rng = np.random.default_rng(0)
    y = rng.normal(size=30)
    with pm.Model():
        s = pm.HalfNormal("s", 1)
        z = pm.GaussianRandomWalk("z", sigma=s, init_dist=pm.Normal.dist(0, 10), shape=30)
        pm.Normal("y", z, 1.0, observed=y)
        pmsg.SGLD(local_vars=["z"], local_family="markov")._compile()  # a random walk: fine
        default = pmsg.SGLD(local_vars=["z"], batch_size=10)
        default._compile()
        assert default.hybrid.family_name == "markov" and default.freeze_locals
    cov = 0.5 * np.ones((30, 30)) + 0.5 * np.eye(30)
    with pm.Model():
        z = pm.MvNormal("z", np.zeros(30), cov)
        m = pm.Normal("m", 0, 1)
        pm.Normal("y", z + m, 1.0, observed=y)
        with pytest.raises(ModelNotSupportedError, match="not neighbours"):
            pmsg.SGLD(local_vars=["z"], local_family="markov")._compile()
        default = pmsg.SGLD(local_vars=["z"], batch_size=10)
        default._compile()
        assert default.hybrid.family_name == "meanfield" and not default.freeze_locals
    with pm.Model():
        z = pm.HalfNormal("z", 1, shape=30)
        m = pm.Normal("m", 0, 1)
        pm.Normal("y", z + m, 1.0, observed=y)
        with pytest.raises(ModelNotSupportedError, match="not Gaussian"):
            pmsg.SGLD(local_vars=["z"], local_family="markov")._compile()
        default = pmsg.SGLD(local_vars=["z"])
        default._compile()
        assert default.hybrid.family_name == "meanfield"


def test_local_options_are_validated():
    model, _, _ = grouped_effects(groups=4)
    with model:
        with pytest.raises(ValueError, match="local_family must be one of"):
            pmsg.SGLD(local_vars=["u"], local_family="fullrank")
        with pytest.raises(ValueError, match="num_mc_samples must be a positive integer"):
            pmsg.SGLD(local_vars=["u"], num_mc_samples=0)
        with pytest.raises(ValueError, match="apply to local_vars, which were not given"):
            pmsg.SGLD(local_family="markov")
        with pytest.raises(ValueError, match="in both vars and local_vars"):
            pmsg.SGLD(vars=["mu", "u"], local_vars=["u"])
        with pytest.raises(ModelNotSupportedError, match="no global variable is left"):
            pmsg.SGLD(local_vars=["mu", "u"])
        with pytest.raises(ModelNotSupportedError, match="use SGLD, ConstantSGD, IASG or SGFS"):
            pmsg.SAGALD(local_vars=["u"])


@pytest.mark.slow
def test_a_frozen_q_is_fit_where_the_chain_samples_on_radon():
    """Radon (12 573 rows, 386 county intercepts local, the markov q frozen for the draws),
    ConstantSGD with default arguments but the family named, against posteriordb's reference
    by the correctness table's rule (``verdict``: 0.1 sd and 10%, widened by Bonferroni-z Monte Carlo standard
    errors). While q was updated from minibatches through tuning and fit on the full data only
    at its end, the tuning chain sat ~5 posterior sds low in log σ_α and measured the gradient
    noise there, 2.8x what the draws then saw: the sds of μ_α and σ_α came out 0.63x. Now q is
    refit on the full data before each tuning measurement (1.01x, 1.00x)."""
    name = "radon_all-radon_variable_intercept_centered"
    with build(name):
        step = pmsg.ConstantSGD(local_vars=["alpha"], local_family="markov")
        idata = pm.sample(
            step=step,
            draws=500,
            tune=300,
            chains=2,
            cores=1,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
    assert step.freeze_locals
    scored = score(idata, reference(name), names=["mu_alpha", "sigma_alpha", "sigma_y", "beta"])
    result = verdict("ConstantSGD", scored)
    assert result["pass"], (result["failures"], scored["table"])


@pytest.mark.slow  # 20-60 s, compiling (tests/README.md: the loop's budget)
def test_a_frozen_q_without_automatic_tuning_still_adapts_while_tuning():
    # A fixed step has no tuner, hence no tuning measurements to refit q at: q then adapts
    # by minibatch steps while tuning, as before (found by review: it stayed at its start).
    rng = np.random.default_rng(0)
    y = rng.poisson(3, size=200)
    with pm.Model():
        s = pm.HalfNormal("s", 0.3)
        z = pm.GaussianRandomWalk("z", sigma=s, init_dist=pm.Normal.dist(1, 1), shape=200)
        pm.Poisson("y", pm.math.exp(z), observed=y)
        step = pmsg.ConstantSGD(step_size=1e-3, local_vars=["z"], batch_size=50)
        seen = {}
        stop = step.stop_tuning

        def spy():
            seen["count"] = int(step.chain_state[1].local["count"])
            stop()

        step.stop_tuning = spy
        pm.sample(
            step=step,
            draws=2,
            tune=20,
            chains=1,
            cores=1,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
    assert step.tuner is None and step.freeze_locals and step.hybrid.family_name == "markov"
    assert seen["count"] == 20 * step.thin
