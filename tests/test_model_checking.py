"""pmsg.log_likelihood and pmsg.loo_subsample against PyMC's and ArviZ's full computations.

Real PyMC models, small (N = 2 000-4 000 rows), and draws that need no sampler: the equality
tests need any draws at all, the LOO tests draws from the exact (conjugate Gaussian)
posterior, made with NumPy.
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytest
from stack import dataset, from_dict, groups, loo, loo_elpd, loo_p, loo_pointwise, result

import pymc_sgmcmc as pmsg

warnings.filterwarnings("ignore", message=".*BLAS.*")


# ---------------------------------------------------------------------------------------
# log_likelihood: the same numbers as pm.compute_log_likelihood, on the selected rows
# ---------------------------------------------------------------------------------------

N_REG = 2000


@pytest.fixture(scope="module")
def regression():
    """A regression with labelled rows, a pm.Data design and a log-transformed scale."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N_REG, 2))
    y = X @ [1.0, -2.0] + 0.5 + rng.normal(size=N_REG)
    coords = {"obs": [f"row{i}" for i in range(N_REG)], "feature": ["a", "b"]}
    with pm.Model(coords=coords) as model:
        Xd = pm.Data("X", X, dims=("obs", "feature"))
        alpha = pm.Normal("alpha", 0, 5)
        beta = pm.Normal("beta", 0, 1, dims="feature")
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", alpha + Xd @ beta, sigma, observed=y, dims="obs")
    chains, draws = 2, 150
    idata = from_dict(
        {
            "posterior": {
                "alpha": rng.normal(0.5, 0.03, size=(chains, draws)),
                "beta": rng.normal([1.0, -2.0], 0.03, size=(chains, draws, 2)),
                "sigma": rng.lognormal(0.0, 0.02, size=(chains, draws)),
            }
        },
        coords={"feature": ["a", "b"]},
        dims={"beta": ["feature"]},
    )
    reference = pm.compute_log_likelihood(
        idata, model=model, extend_inferencedata=False, progressbar=False
    )
    return model, idata, reference


def test_all_rows_equal_pm_compute_log_likelihood(regression):
    model, idata, reference = regression
    out = pmsg.log_likelihood(idata, model)
    ll = out.log_likelihood
    assert ll["y"].dims == reference["y"].dims == ("chain", "draw", "obs")
    np.testing.assert_allclose(ll["y"].values, reference["y"].values, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ll["obs"].values, reference["obs"].values)
    np.testing.assert_array_equal(ll["row_index"].values, np.arange(N_REG))
    assert ll.attrs["n_rows_total"] == N_REG
    # a new InferenceData: the caller's idata is not extended unless asked
    assert "log_likelihood" not in groups(idata)
    assert loo_elpd(loo(out)) == pytest.approx(
        loo_elpd(loo(result(posterior=dataset(idata), log_likelihood=reference)))
    )


def test_subsample_equals_the_same_columns(regression):
    model, idata, reference = regression
    ll = pmsg.log_likelihood(idata, model, rows=300, random_seed=4).log_likelihood
    rows = ll["row_index"].values
    assert rows.size == 300 and np.unique(rows).size == 300
    assert np.all(np.diff(rows) > 0)
    # the row coordinate keeps the model's labels of those rows, row_index their numbers
    np.testing.assert_array_equal(ll["obs"].values, reference["obs"].values[rows])
    np.testing.assert_allclose(
        ll["y"].values, reference["y"].values[:, :, rows], rtol=1e-12, atol=1e-12
    )
    # the same seed, the same rows (two models are checked on the same rows)
    again = pmsg.log_likelihood(idata, model, rows=300, random_seed=4).log_likelihood
    np.testing.assert_array_equal(again["row_index"].values, rows)
    # explicit indices, in the caller's order
    picked = np.array([1999, 0, 17])
    ll = pmsg.log_likelihood(idata, model, rows=picked).log_likelihood
    np.testing.assert_array_equal(ll["row_index"].values, picked)
    np.testing.assert_allclose(
        ll["y"].values, reference["y"].values[:, :, picked], rtol=1e-12, atol=1e-12
    )


def test_chunking_gives_identical_values(regression):
    model, idata, _ = regression
    whole = pmsg.log_likelihood(idata, model, rows=500).log_likelihood["y"].values
    # 7 does not divide the 300 draws: the last chunk is padded and cut
    chunked = pmsg.log_likelihood(idata, model, rows=500, chunk_draws=7).log_likelihood["y"].values
    np.testing.assert_array_equal(chunked, whole)


def test_extend_inferencedata_adds_the_group(regression):
    model, idata, _ = regression
    copy = idata.copy()
    out = pmsg.log_likelihood(copy, model, rows=50, extend_inferencedata=True)
    assert out is copy and "log_likelihood" in groups(copy)
    assert copy.log_likelihood["y"].shape == (2, 150, 50)


def test_refuses_above_the_memory_budget_naming_the_size(regression):
    model, idata, _ = regression
    # 2 000 rows x 300 draws x 8 bytes = 4.8 MB
    with pytest.raises(ValueError, match=r"2,000 rows × 300 draws × 8 bytes is 4\.8 MB") as err:
        pmsg.log_likelihood(idata, model, memory_budget=1e6)
    assert "rows=" in str(err.value)
    # a subsample under the budget is computed
    ll = pmsg.log_likelihood(idata, model, rows=100, memory_budget=1e6).log_likelihood
    assert ll["y"].shape == (2, 150, 100)


def test_the_documented_limit_one_million_rows_two_thousand_draws():
    """10⁶ rows × 2 000 draws × 8 bytes = 16 GB is refused before anything is computed."""
    rng = np.random.default_rng(1)
    n = 1_000_000
    x = rng.normal(size=n)
    y = 1.0 + x + rng.normal(size=n)
    with pm.Model() as model:
        a = pm.Normal("a")
        b = pm.Normal("b")
        pm.Normal("y", a + b * pm.Data("x", x), 1.0, observed=y)
    idata = from_dict(
        {"posterior": {"a": rng.normal(size=(4, 500)), "b": rng.normal(size=(4, 500))}}
    )
    with pytest.raises(ValueError, match=r"1,000,000 rows × 2,000 draws × 8 bytes is 16\.0 GB"):
        pmsg.log_likelihood(idata, model)


def test_multivariate_and_minibatch_models():
    """An MvNormal's logp drops its core axis (one value per row, as PyMC's); a model written
    for minibatch ADVI (pm.Minibatch + total_size) is read on its full data, as the samplers
    read it."""
    rng = np.random.default_rng(3)
    n = 400
    Y = rng.normal(size=(n, 2))
    x = rng.normal(size=n)
    with pm.Model() as mv:
        mu = pm.Normal("mu", shape=2)
        pm.MvNormal("Y", mu + x[:, None], cov=np.eye(2), observed=Y)
    idata = from_dict({"posterior": {"mu": rng.normal(size=(2, 30, 2))}})
    ref = pm.compute_log_likelihood(idata, model=mv, extend_inferencedata=False, progressbar=False)
    ll = pmsg.log_likelihood(idata, mv, rows=50).log_likelihood
    rows = ll["row_index"].values
    np.testing.assert_allclose(ll["Y"].values, ref["Y"].values[:, :, rows], rtol=1e-12)

    X = rng.normal(size=(n, 2))
    y = X @ [1.0, 2.0] + rng.normal(size=n)
    with pm.Model() as full:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
    with pm.Model() as advi:
        Xb, yb = pm.Minibatch(X, y, batch_size=50)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", Xb @ b, 1.0, observed=yb, total_size=n)
    idata = from_dict({"posterior": {"b": rng.normal([1.0, 2.0], 0.05, size=(2, 30, 2))}})
    np.testing.assert_array_equal(
        pmsg.log_likelihood(idata, advi).log_likelihood["y"].values,
        pmsg.log_likelihood(idata, full).log_likelihood["y"].values,
    )


def test_var_names_must_be_observed_on_the_data_axis(regression):
    model, idata, _ = regression
    with pytest.raises(ValueError, match="did you mean 'y'"):
        pmsg.log_likelihood(idata, model, rows=10, var_names=["yy"])
    with pytest.raises(ValueError, match="integer row indices"):
        pmsg.log_likelihood(idata, model, rows=np.array([0.5, 1.5]))
    with pytest.raises(ValueError, match="outside 0..1999"):
        pmsg.log_likelihood(idata, model, rows=[0, N_REG])


# ---------------------------------------------------------------------------------------
# loo_subsample: the difference estimator against az.loo on every row
# ---------------------------------------------------------------------------------------

N_LOO = 4000
NOISE_SD = 1.0
PRIOR_SD = 10.0


def _conjugate(X: np.ndarray, y: np.ndarray, rng: np.random.Generator, chains=2, draws=1000):
    """A Gaussian regression with known noise and its exact posterior draws (NumPy)."""
    d = X.shape[1]
    with pm.Model() as model:
        beta = pm.Normal("beta", 0.0, PRIOR_SD, shape=d)
        pm.Normal("y", pm.Data("X", X) @ beta, NOISE_SD, observed=y)
    precision = X.T @ X / NOISE_SD**2 + np.eye(d) / PRIOR_SD**2
    cov = np.linalg.inv(precision)
    mean = cov @ X.T @ y / NOISE_SD**2
    beta_draws = rng.multivariate_normal(mean, cov, size=(chains, draws))
    idata = from_dict({"posterior": {"beta": beta_draws}})
    full = pm.compute_log_likelihood(
        idata, model=model, extend_inferencedata=False, progressbar=False
    )
    return model, idata, loo(result(posterior=dataset(idata), log_likelihood=full))


@pytest.fixture(scope="module")
def conjugate():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(N_LOO, 3))
    y = X @ [0.5, -1.0, 0.15] + NOISE_SD * rng.normal(size=N_LOO)
    full_model = _conjugate(X, y, rng)
    reduced_model = _conjugate(X[:, :2], y, rng)  # without the third covariate
    return full_model, reduced_model


def test_all_rows_is_az_loo(conjugate):
    (model, idata, reference), _ = conjugate
    est = pmsg.loo_subsample(idata, model, rows=N_LOO)
    assert est.n_subsample == est.n_data_points == N_LOO
    assert est.subsampling_se == 0.0
    assert est.elpd_loo == pytest.approx(loo_elpd(reference), rel=1e-12)
    assert est.se == pytest.approx(reference.se, rel=1e-8)
    assert est.p_loo == pytest.approx(loo_p(reference), rel=1e-8)
    np.testing.assert_allclose(est.loo_i, loo_pointwise(reference), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(est.pareto_k, reference.pareto_k.values, rtol=1e-8, atol=1e-10)
    text = repr(est)
    assert "elpd_loo" in text and "subsampling SE" in text and "Pareto k" in text


def test_subsample_estimate_within_three_subsampling_se_of_the_full_loo(conjugate, recwarn):
    """Tolerance: given the draws, the estimator is unbiased for the full-data PSIS-LOO elpd,
    and its error over the simple random sample of m = 300 of 4 000 rows is approximately
    normal (CLT) with sd = the subsampling SE. |error| <= 3 SE has probability 0.997 per
    seed; the seeds are fixed, so the test is deterministic. The usual SE (the spread of the
    rows' elpd_i, N·Var) is estimated from the subsample too: within 10% of az.loo's."""
    (model, idata, reference), _ = conjugate
    for seed in (0, 1, 2):
        est = pmsg.loo_subsample(idata, model, rows=300, random_seed=seed)
        assert est.n_subsample == 300 and est.n_data_points == N_LOO
        assert 0 < est.subsampling_se < 0.1 * est.se
        assert abs(est.elpd_loo - loo_elpd(reference)) <= 3 * est.subsampling_se, (
            est.elpd_loo,
            loo_elpd(reference),
            est.subsampling_se,
        )
        assert est.se == pytest.approx(reference.se, rel=0.1)
        assert abs(est.p_loo - loo_p(reference)) <= 3 * est.p_loo_subsampling_se
        np.testing.assert_allclose(
            est.loo_i, loo_pointwise(reference)[est.rows], rtol=1e-10
        )  # the sampled rows' PSIS-LOO is az.loo's (the same draws, the same reff)
    # a well-specified model: no influential row among the least likely ones
    assert not [w for w in recwarn if "influential row" in str(w.message)]
    assert est.lowest_rows.size == 20 and est.lowest_pareto_k.max() <= est.good_k


def test_subsampling_se_shrinks_as_m_grows(conjugate):
    """sqrt((1 - m/N)/m) falls by 2.2x from 100 to 400 rows and 2.6x from 400 to 1 600."""
    (model, idata, reference), _ = conjugate
    ses = [pmsg.loo_subsample(idata, model, rows=m).subsampling_se for m in (100, 400, 1600)]
    assert ses[0] > ses[1] > ses[2] > 0


def test_model_comparison_on_the_same_rows(conjugate):
    """The paired difference on the same 300 rows against az.loo's difference on every row
    (tolerance as above: 3 subsampling SEs of the difference)."""
    (full_model, full_idata, full_loo), (reduced_model, reduced_idata, reduced_loo) = conjugate
    a = pmsg.loo_subsample(full_idata, full_model, rows=300)
    b = pmsg.loo_subsample(reduced_idata, reduced_model, rows=300)
    diff = a.elpd_diff(b)
    truth = loo_elpd(full_loo) - loo_elpd(reduced_loo)
    assert abs(diff.elpd_diff - truth) <= 3 * diff.subsampling_se
    # paired: the rows' common variation cancels, far below either model's own SE
    assert diff.se < 0.5 * a.se
    other_rows = pmsg.loo_subsample(reduced_idata, reduced_model, rows=300, random_seed=7)
    with pytest.raises(ValueError, match="same subsample"):
        a.elpd_diff(other_rows)


def test_an_influential_row_outside_the_subsample_is_flagged():
    """One outlier at a high-leverage point (row 7: x = (3, 3), y 30 noise sds off) has a
    Pareto k above 1 under the full PSIS-LOO. The subsample of 200 of 2 000 rows misses it;
    the check of the 20 rows least likely at the posterior mean finds it and warns."""
    rng = np.random.default_rng(5)
    n = 2000
    X = rng.normal(size=(n, 2))
    y = X @ [0.5, -1.0] + NOISE_SD * rng.normal(size=n)
    X[7] = [3.0, 3.0]
    y[7] += 30 * NOISE_SD
    model, idata, reference = _conjugate(X, y, rng)
    assert reference.pareto_k.values[7] > 1
    with pytest.warns(UserWarning, match=r"Row 7, .* is not in the subsample: an influential row"):
        est = pmsg.loo_subsample(idata, model, rows=200)
    assert 7 not in est.rows and 7 in est.lowest_rows
    assert est.lowest_pareto_k.max() == pytest.approx(reference.pareto_k.values[7], rel=1e-8)
    assert "An influential row" in repr(est)


def test_loo_subsample_after_posterior_predictive_in_the_same_result():
    """The ordinary order of work: sample, posterior predictive into the same result, then
    LOO. (PyMC 5.28's sample_posterior_predictive(..., extend_inferencedata=True) left the
    observed variable twice in model.observed_RVs, and loo_subsample failed on it.)"""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(3000, 2))
    y = X @ [1.0, -1.0] + rng.normal(size=3000)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", pm.Data("X", X) @ b, s, observed=y)
        idata = pm.sample(
            step=pmsg.IASG(),
            draws=30,
            tune=30,
            chains=2,
            cores=1,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
        before = pmsg.loo_subsample(idata, model, rows=200)
        pm.sample_posterior_predictive(
            idata, extend_inferencedata=True, progressbar=False, random_seed=2
        )
        after = pmsg.loo_subsample(idata, model, rows=200)
    assert "posterior_predictive" in groups(idata)
    assert after.elpd_loo == before.elpd_loo and after.n_subsample == 200
