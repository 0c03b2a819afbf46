"""Above ``DENSE_MAX_DIM`` (500) dimensions a dense whitening does not fit. The default
looks for the posterior's nested structure (one grouping factor: dense globals, a block per
group, the cross terms; pymc_sgmcmc.tuning.structure) and falls back to a diagonal
whitening without it (docs/tuning.md, "When a dense matrix does not fit"). This checks both
end to end on a model with 600 random effects, whose posterior is Gaussian and known in
closed form:

    a_g ~ N(0, 1) (g = 1..600),  b ~ N(0, 1),  y_n ~ N(a_{g(n)} + b·x_n, 1),

with 20 rows per group (N = 12 000: minibatches of 256 by the default rule) and x in its own
units (mean 5, sd 2), so b is coupled to every group effect. Reference: 8 000 exact draws.
Under the diagonal fallback IASG's window misses the coupled direction's variance (b's sd
came out 0.55x): what is tested for it is that it says so; under the structured whitening
the coupled direction is whitened and IASG is quiet.
Pass rule (tests/posteriors/common.py ``verdict``): every one of the 601 means within 0.1
reference sd and sd within 10% (0.15 / 15% for SGLD), widened by z Monte Carlo standard
errors from both sets of draws' ESS (z ≈ 4.1: Bonferroni over 601 parameters at 5%).
"""

from __future__ import annotations

import json

import arviz as az
import numpy as np
import pymc as pm
import pytest
from posteriors.common import score, verdict
from stack import dataset

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.tuning import DENSE_MAX_DIM

pytestmark = pytest.mark.slow
GROUPS, ROWS = 600, 20


def build():
    """(model, exact reference draws)."""
    rng = np.random.default_rng(11)
    group = np.repeat(np.arange(GROUPS), ROWS)
    x = rng.normal(5.0, 2.0, GROUPS * ROWS)
    a_true = rng.normal(0.0, 1.0, GROUPS)
    y = a_true[group] + 0.7 * x + rng.normal(0.0, 1.0, GROUPS * ROWS)
    # Exact posterior of theta = (a_1..a_G, b): precision X'X + I, mean Σ X'y.
    X = np.zeros((GROUPS * ROWS, GROUPS + 1))
    X[np.arange(GROUPS * ROWS), group] = 1.0
    X[:, -1] = x
    precision = X.T @ X + np.eye(GROUPS + 1)
    cov = np.linalg.inv(precision)
    mean = cov @ (X.T @ y)
    draws = rng.multivariate_normal(mean, cov, size=8000)
    reference = {"a": draws[None, :, :GROUPS], "b": draws[None, :, GROUPS]}
    with pm.Model(coords={"group": np.arange(GROUPS)}) as model:
        a = pm.Normal("a", 0.0, 1.0, dims="group")
        b = pm.Normal("b", 0.0, 1.0)
        xs = pm.Data("x", x)
        g = pm.Data("g", group)
        pm.Normal("y", a[g] + b * xs, 1.0, observed=y)
    return model, reference


@pytest.fixture(scope="module")
def random_effects():
    return build()


# SGLD takes the same quarter of its noise from the minibatch here and gives the same draws.
@pytest.mark.parametrize("sampler", ["ConstantSGD"])
def test_the_structured_whitening_gives_the_posterior_of_600_random_effects(
    random_effects, sampler
):
    model, reference = random_effects
    with model:
        step = getattr(pmsg, sampler)()
        assert step.problem.dim == GROUPS + 1 > DENSE_MAX_DIM
        idata = pm.sample(
            draws=1000,
            tune=300,
            chains=2,
            cores=1,
            step=step,
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
        )
    settings = json.loads(idata.sample_stats.attrs["sgmcmc_settings"])
    entry = settings[0] if isinstance(settings, list) else settings
    assert entry["whitening"] == "structured", entry["whitening"]
    scored = score(idata, reference)
    result = verdict(sampler, scored)
    # Under the diagonal fallback b (coupled to every group effect: x uncentred) mixed
    # slowly, ESS 70 of 2000 draws (sd 0.88x, inside the allowance that ESS gives);
    # whitened with its cross terms, 630 (sd 1.01x).
    ess_b = float(az.ess(dataset(idata)[["b"]])["b"])
    assert ess_b >= 300, ess_b
    assert result["pass"], (result["worst"], scored["mc_dmean"], scored["mc_sd_ratio"])


def test_iasg_warns_that_a_diagonal_window_misses_the_coupled_direction(random_effects):
    model, _ = random_effects
    with model, pytest.warns(UserWarning, match="slowest direction relaxes"):
        step = pmsg.IASG(preconditioner="diagonal")
        pm.sample(
            draws=20,
            tune=200,
            chains=1,
            cores=1,
            step=step,
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
        )
    assert step.whitening_kind == "diagonal"


STATES, COUNTIES, PER_COUNTY = 30, 600, 10


def build_counties_in_states():
    """Counties within states, the states' effects in the counties' prior (a county-in-state
    model): ``theta ~ N(0, 10)``, ``s ~ N(0, 1)`` (30 states), ``c_j ~ N(theta + s[state_j],
    0.5)`` (600 counties, 20 per state), ``b ~ N(0, 1)``, ``y ~ N(c[county] + b·x, 1)`` with x
    in its own units (mean 5, sd 2), 10 rows per county (N = 6 000). D = 632. Gaussian: the
    posterior's precision and mean in closed form. Returns (model, exact reference draws)."""
    rng = np.random.default_rng(12)
    d = 2 + STATES + COUNTIES  # theta, b, s, c: the model's raveled order
    county = np.repeat(np.arange(COUNTIES), PER_COUNTY)
    state = np.arange(COUNTIES) % STATES
    x = rng.normal(5.0, 2.0, county.size)
    s_true = rng.normal(0.0, 1.0, STATES)
    c_true = 0.3 + s_true[state] + rng.normal(0.0, 0.5, COUNTIES)
    y = c_true[county] + 0.7 * x + rng.normal(0.0, 1.0, county.size)
    theta, b, s0, c0 = 0, 1, 2, 2 + STATES
    prior = np.zeros((COUNTIES, d))  # c_j - theta - s[state_j], sd 0.5
    prior[np.arange(COUNTIES), c0 + np.arange(COUNTIES)] = 1.0
    prior[:, theta] = -1.0
    prior[np.arange(COUNTIES), s0 + state] = -1.0
    rows = np.zeros((county.size, d))
    rows[np.arange(county.size), c0 + county] = 1.0
    rows[:, b] = x
    precision = rows.T @ rows + prior.T @ prior / 0.25
    precision[theta, theta] += 1 / 100.0
    precision[b, b] += 1.0
    precision[s0 + np.arange(STATES), s0 + np.arange(STATES)] += 1.0
    cov = np.linalg.inv(precision)
    mean = cov @ (rows.T @ y)
    draws = rng.multivariate_normal(mean, cov, size=8000)[None]
    reference = {
        "theta": draws[..., theta],
        "b": draws[..., b],
        "s": draws[..., s0 : s0 + STATES],
        "c": draws[..., c0:],
    }
    with pm.Model() as model:
        th = pm.Normal("theta", 0.0, 10.0)
        slope = pm.Normal("b", 0.0, 1.0)
        s = pm.Normal("s", 0.0, 1.0, shape=STATES)
        c = pm.Normal("c", th + s[state], 0.5, shape=COUNTIES)
        pm.Normal("y", c[pm.Data("county", county)] + slope * pm.Data("x", x), 1.0, observed=y)
    return model, reference


@pytest.mark.parametrize("sampler", ["ConstantSGD", "IASG"])
def test_counties_in_states_get_the_states_among_the_globals_and_the_posterior(sampler):
    """The states' effects, tied to the rows only through the counties' prior, join the
    globals of the arrowhead (pymc_sgmcmc.tuning.structure: exact for this Gaussian); every
    one of the 632 means and sds within tolerance, and theta and b (coupled to every county:
    x uncentred) mix. The minibatch's noise is correlated across the whitened coordinates
    (theta sees every county's through the whitening's cross terms): the injected noise
    completes it whole (StructuredWhitening.injection_factor) — with its diagonal only,
    theta's sd was 0.88x (ConstantSGD) and 0.91x (IASG), within the verdict's allowance and
    silent; now 1.01x and 1.00x."""
    model, reference = build_counties_in_states()
    with model:
        step = getattr(pmsg, sampler)()
        idata = pmsg.sample(
            step=step,
            draws=1000,
            tune=300,
            chains=2,
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
        )
    settings = json.loads(dataset(idata, "sample_stats").attrs["sgmcmc_settings"])
    entry = (settings[0] if isinstance(settings, list) else settings)["chains"][0]
    assert entry["whitening"] == "structured", entry
    assert "s (in a prior only)" in entry["structure"], entry["structure"]
    assert entry["noise_over_budget"] <= 1.0, entry  # the exact injection is in force
    scored = score(idata, reference)
    result = verdict(sampler, scored)
    ess = az.ess(dataset(idata)[["theta", "b"]])
    assert min(float(ess["theta"]), float(ess["b"])) >= 200, ess
    assert result["pass"], (result["worst"], scored["mc_dmean"], scored["mc_sd_ratio"])
    # theta's sd, the quantity the diagonal injection got wrong: exact on this Gaussian up to
    # the tuning's measurements (3%) and three Monte Carlo sds of an sd ratio (its ESS and the
    # reference's 8 000 draws) — 0.08 at ESS 1 900, which 0.88x and 0.91x were outside
    ratio = float(dataset(idata)["theta"].std()) / float(reference["theta"].std())
    allowance = 3.0 * np.sqrt(1.0 / (2.0 * float(ess["theta"])) + 1.0 / (2.0 * 8000))
    assert abs(ratio - 1.0) <= 0.03 + allowance, (ratio, allowance)
