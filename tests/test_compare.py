"""pmsg.compare / plot_compare: exact checks on generated draws with known answers."""

from __future__ import annotations

from typing import Any

import arviz as az
import matplotlib
import numpy as np
import pandas as pd
import pytest
import scipy.stats
from stack import dataset, drop_groups, from_dict

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.adapter.compare import data_passes, energy_distance, gaussian_kl

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

FEATURES = ["x0", "x1", "x2"]


def _idata(draws: dict) -> Any:
    """A result of (chain, draw, ...) arrays; beta has dims ("feature",)."""
    return from_dict({"posterior": draws}, coords={"feature": FEATURES}, dims={"beta": ["feature"]})


def _exact_moments(rng, mean, cov, n):
    """n draws whose sample mean and covariance (ddof=1) are exactly ``mean`` and ``cov``."""
    z = rng.normal(size=(n, len(mean)))
    z -= z.mean(axis=0)
    z = z @ np.linalg.inv(np.linalg.cholesky(np.cov(z, rowvar=False))).T
    return mean + z @ np.linalg.cholesky(cov).T


def _closed_form_kl(mean_q, cov_q, mean_p, cov_p):
    precision_p = np.linalg.inv(cov_p)
    delta = mean_p - mean_q
    return 0.5 * (
        np.trace(precision_p @ cov_q)
        + delta @ precision_p @ delta
        - len(mean_q)
        + np.linalg.slogdet(cov_p)[1]
        - np.linalg.slogdet(cov_q)[1]
    )


@pytest.fixture
def draws():
    rng = np.random.default_rng(3)
    beta = rng.normal([1.0, -2.0, 0.5], [0.3, 1.0, 2.0], size=(2, 400, 3))
    return {"beta": beta, "sigma": np.exp(rng.normal(size=(2, 400)))}


def test_identical_draws_agree_exactly(draws):
    idata = _idata(draws)
    df = pmsg.compare(idata, idata)
    assert list(df.index) == ["beta[x0]", "beta[x1]", "beta[x2]", "sigma"]
    assert list(df.index) == list(az.summary(idata, kind="stats").index)
    np.testing.assert_array_equal(df["mean_diff_sd"], 0.0)
    np.testing.assert_array_equal(df["sd_ratio"], 1.0)
    np.testing.assert_array_equal(df["mean"], df["ref_mean"])
    np.testing.assert_array_equal(df["sd"], df["ref_sd"])
    summary = az.summary(idata, kind="stats")
    np.testing.assert_allclose(df["mean"], summary["mean"], atol=1e-3)  # summary rounds
    np.testing.assert_allclose(df["sd"], summary["sd"], atol=1e-3)
    assert abs(df.attrs["gaussian_kl"]) < 1e-12
    assert df.attrs["gaussian_kl_dim"] == 4
    assert df.attrs["energy_distance"] == 0.0
    assert df.attrs["var_names"] == ["beta", "sigma"]
    # The same draws as a mapping of (chain, draw, *shape) or flat (draw, *shape) arrays.
    flat = {"beta": draws["beta"].reshape(-1, 3), "sigma": draws["sigma"].ravel()}
    for reference in (draws, flat, idata.posterior):
        other = pmsg.compare(idata, reference)
        pd.testing.assert_frame_equal(other, df)
        assert other.attrs["energy_distance"] == 0.0


def test_known_shift_and_scale(draws):
    reference = {"beta": draws["beta"].reshape(-1, 3)}
    ref_mean = reference["beta"].mean(axis=0)
    ref_sd = reference["beta"].std(axis=0, ddof=1)
    shift = np.array([0.5, -1.0, 2.0])
    shifted = _idata({"beta": draws["beta"] + shift * ref_sd})
    df = pmsg.compare(shifted, reference)
    np.testing.assert_allclose(df["mean_diff_sd"], shift, rtol=1e-12)
    np.testing.assert_allclose(df["sd_ratio"], 1.0, rtol=1e-12)
    # KL(N(μ + δ, Σ) ‖ N(μ, Σ)) = δᵀ Σ⁻¹ δ / 2, with δ = shift·sd: shiftᵀ R⁻¹ shift / 2.
    correlation = np.corrcoef(reference["beta"], rowvar=False)
    expected = 0.5 * shift @ np.linalg.solve(correlation, shift)
    np.testing.assert_allclose(df.attrs["gaussian_kl"], expected, rtol=1e-10)

    # The other way round: the reference is the shifted set.
    swapped = pmsg.compare(_idata({"beta": draws["beta"]}), shifted)
    np.testing.assert_allclose(swapped["mean_diff_sd"], -shift, rtol=1e-12)
    np.testing.assert_allclose(swapped["sd_ratio"], 1.0, rtol=1e-12)

    factor = 1.7
    scaled = _idata({"beta": ref_mean + factor * (draws["beta"] - ref_mean)})
    df = pmsg.compare(scaled, reference)
    np.testing.assert_allclose(df["sd_ratio"], factor, rtol=1e-12)
    np.testing.assert_allclose(df["mean_diff_sd"], 0.0, atol=1e-12)
    # KL(N(μ, f²Σ) ‖ N(μ, Σ)) = k (f² − 1 − 2 ln f) / 2.
    np.testing.assert_allclose(
        df.attrs["gaussian_kl"], 3 * (factor**2 - 1 - 2 * np.log(factor)) / 2, rtol=1e-10
    )


def test_gaussian_kl_matches_closed_form():
    rng = np.random.default_rng(0)
    mean_q, mean_p = np.array([0.3, -1.0, 2.0]), np.array([0.0, -0.5, 2.5])
    a, b = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    cov_q, cov_p = a @ a.T + 0.5 * np.eye(3), b @ b.T + 0.2 * np.eye(3)
    ours = _exact_moments(rng, mean_q, cov_q, 2000)
    ref = _exact_moments(rng, mean_p, cov_p, 3000)
    expected = _closed_form_kl(mean_q, cov_q, mean_p, cov_p)
    kl, dim = gaussian_kl(ours, ref)
    np.testing.assert_allclose(kl, expected, rtol=1e-10)
    assert dim == 3
    # Through compare (after standardising by the reference sd: KL is affine invariant).
    df = pmsg.compare(_idata({"beta": ours[None]}), {"beta": ref})
    np.testing.assert_allclose(df.attrs["gaussian_kl"], expected, rtol=1e-10)
    # Not symmetric: the swapped divergence is the other closed form.
    np.testing.assert_allclose(
        gaussian_kl(ref, ours)[0], _closed_form_kl(mean_p, cov_p, mean_q, cov_q), rtol=1e-10
    )


def test_gaussian_kl_with_singular_covariance():
    rng = np.random.default_rng(1)
    mean_q, mean_p = np.array([0.2, 0.1]), np.zeros(2)
    cov_q, cov_p = np.array([[1.5, 0.3], [0.3, 0.8]]), np.array([[1.0, -0.4], [-0.4, 2.0]])
    ours = _exact_moments(rng, mean_q, cov_q, 1000)
    ref = _exact_moments(rng, mean_p, cov_p, 1500)
    expected = _closed_form_kl(mean_q, cov_q, mean_p, cov_p)

    # An affine deterministic (in both) adds a direction neither distribution spreads into.
    def with_total(x):
        return np.column_stack([x, 1.0 + x[:, 0] - 2.0 * x[:, 1]])

    kl, dim = gaussian_kl(with_total(ours), with_total(ref))
    np.testing.assert_allclose(kl, expected, rtol=1e-8)
    assert dim == 2

    # Our draws leave the reference's subspace, or collapse within it: KL(q ‖ p) = ∞.
    broken = with_total(ours)
    broken[:, 2] += 1e-3 * rng.normal(size=len(broken))
    assert gaussian_kl(broken, with_total(ref)) == (np.inf, 2)
    offset = with_total(ours)
    offset[:, 2] += 0.1
    assert gaussian_kl(offset, with_total(ref))[0] == np.inf
    collapsed = ours.copy()
    collapsed[:, 1] = 0.5
    assert gaussian_kl(collapsed, ref)[0] == np.inf
    assert np.isnan(gaussian_kl(ours[:1], ref)[0])


def test_deterministic_through_compare_keeps_kl_finite():
    rng = np.random.default_rng(2)
    ours = _exact_moments(rng, np.array([0.1, 0.0, -0.2]), np.diag([1.0, 1.2, 0.9]), 800)
    ref = _exact_moments(rng, np.zeros(3), np.eye(3), 1200)
    expected = _closed_form_kl(
        np.array([0.1, 0.0, -0.2]), np.diag([1.0, 1.2, 0.9]), np.zeros(3), np.eye(3)
    )
    idata = _idata({"beta": ours[None], "mu_first": ours[None] @ [1.0, 2.0, 3.0]})
    reference = {"beta": ref, "mu_first": ref @ [1.0, 2.0, 3.0]}
    df = pmsg.compare(idata, reference)
    assert list(df.index) == ["beta[x0]", "beta[x1]", "beta[x2]", "mu_first"]
    assert df.attrs["gaussian_kl_dim"] == 3
    np.testing.assert_allclose(df.attrs["gaussian_kl"], expected, rtol=1e-8)


def test_energy_distance_exact():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=300), rng.normal(0.4, 1.3, size=200)
    # In one dimension it is SciPy's energy distance.
    np.testing.assert_allclose(energy_distance(x, y), scipy.stats.energy_distance(x, y), rtol=1e-12)
    # In several, the V-statistic by brute force; with max_draws, on the seeded subsets.
    x, y = rng.normal(size=(300, 3)), rng.normal(0.2, 1.1, size=(250, 3))

    def brute(a, b):
        def mean_dist(u, v):
            return np.linalg.norm(u[:, None] - v[None], axis=-1).mean()

        return np.sqrt(2 * mean_dist(a, b) - mean_dist(a, a) - mean_dist(b, b))

    np.testing.assert_allclose(energy_distance(x, y), brute(x, y), rtol=1e-12)
    ix = np.sort(np.random.default_rng(7).choice(300, 100, replace=False))
    iy = np.sort(np.random.default_rng(7).choice(250, 100, replace=False))
    np.testing.assert_allclose(
        energy_distance(x, y, max_draws=100, seed=7), brute(x[ix], y[iy]), rtol=1e-12
    )
    assert energy_distance(x, x, max_draws=100, seed=7) == 0.0


def test_compare_energy_distance_is_in_reference_sds(draws):
    ref = draws["beta"].reshape(-1, 3)
    ours = draws["beta"][:, ::-1] + 0.3  # another ordering of the draws, shifted
    df = pmsg.compare(_idata({"beta": ours}), {"beta": ref}, max_draws=500, seed=5)
    sd = ref.std(axis=0, ddof=1)
    expected = energy_distance(ours.reshape(-1, 3) / sd, ref / sd, max_draws=500, seed=5)
    np.testing.assert_allclose(df.attrs["energy_distance"], expected, rtol=1e-12)
    assert df.attrs["energy_distance_draws"] == (500, 500)
    # Scale-free: both sets in other units give the same number.
    rescaled = pmsg.compare(_idata({"beta": 10 * ours}), {"beta": 10 * ref}, max_draws=500, seed=5)
    np.testing.assert_allclose(
        rescaled.attrs["energy_distance"], df.attrs["energy_distance"], rtol=1e-10
    )


def _with_stats(draws, passes, warmup_passes=None, sampling_time=12.5, tuning_steps=3):
    groups = {"posterior": draws, "sample_stats": {"data_passes": passes}}
    if warmup_passes is not None:
        groups["warmup_sample_stats"] = {"data_passes": warmup_passes}
    idata = from_dict(groups, coords={"feature": FEATURES}, dims={"beta": ["feature"]})
    for group in (idata.posterior, idata.sample_stats):
        group.attrs["tuning_steps"] = tuning_steps
        if sampling_time is not None:
            group.attrs["sampling_time"] = sampling_time
    return idata


@pytest.mark.filterwarnings("ignore:More chains:UserWarning")
def test_ess_per_second_and_per_pass(draws):
    # Chain 0: 0.5 passes per draw; chain 1: 2 passes per draw; 3 tuning draws each.
    n = draws["sigma"].shape[1]
    warmup = np.array([[0.5, 1.0, 1.5], [2.0, 4.0, 6.0]])
    kept = np.stack([1.5 + 0.5 * np.arange(1, n + 1), 6.0 + 2.0 * np.arange(1, n + 1)])
    idata = _with_stats(draws, kept, warmup)
    df = pmsg.compare(idata, draws)
    ess = az.ess(dataset(idata), method="bulk")
    np.testing.assert_array_equal(df["ess"], [*ess["beta"].values, ess["sigma"].item()])
    passes = 0.5 * n + 2.0 * n
    assert data_passes(idata) == passes
    assert df.attrs["data_passes"] == passes and df.attrs["sampling_time"] == 12.5
    np.testing.assert_allclose(df["ess_per_second"], df["ess"] / 12.5, rtol=1e-15)
    np.testing.assert_allclose(df["ess_per_pass"], df["ess"] / passes, rtol=1e-15)

    # Tuning discarded: the first kept draw's passes estimated by the others' mean.
    assert data_passes(_with_stats(draws, kept)) == pytest.approx(passes, rel=1e-14)
    # No tuning at all: everything the chain did (here a 1-pass start, as SAGA-LD's fill).
    assert data_passes(_with_stats(draws, 1.0 + kept - kept[:, :1], tuning_steps=0)) == (
        2.0 + (0.5 + 2.0) * (n - 1)
    )
    single = {"beta": draws["beta"][:, :1], "sigma": draws["sigma"][:, :1]}
    assert np.isnan(data_passes(_with_stats(single, kept[:, :1])))

    # A NUTS-like idata: no data_passes stat, no sampling_time.
    nuts = from_dict(
        {"posterior": draws, "sample_stats": {"diverging": np.zeros_like(draws["sigma"], bool)}},
        coords={"feature": FEATURES},
        dims={"beta": ["feature"]},
    )
    df = pmsg.compare(nuts, draws)
    assert df["ess_per_pass"].isna().all() and df["ess_per_second"].isna().all()
    assert np.isnan(df.attrs["data_passes"]) and np.isnan(df.attrs["sampling_time"])
    assert (df["ess"] > 0).all()


def test_real_sgld_run_counts_its_passes():
    import pymc as pm

    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 2))
    y = X @ [1.0, -1.0] + rng.normal(size=200)
    with pm.Model(coords={"feature": ["x0", "x1"]}):
        beta = pm.Normal("beta", 0, 3, dims="feature")
        pm.Normal("y", pm.math.dot(X, beta), 1, observed=y)
        idata = pm.sample(
            draws=6,
            tune=3,
            chains=2,
            cores=1,
            step=pmsg.SGLD(batch_size=50),
            random_seed=1,
            progressbar=False,
            discard_tuned_samples=False,
            compute_convergence_checks=False,
        )
    # thin = N/B = 4 iterations of B = 50 rows: one pass per draw, 6 kept draws per chain.
    df = pmsg.compare(idata, idata)
    assert df.attrs["data_passes"] == 12.0
    np.testing.assert_allclose(df["ess_per_pass"], df["ess"] / 12.0, rtol=1e-15)
    np.testing.assert_allclose(
        df["ess_per_second"], df["ess"] / idata.posterior.attrs["sampling_time"], rtol=1e-15
    )
    drop_groups(idata, "warmup_posterior", "warmup_sample_stats")
    assert data_passes(idata) == pytest.approx(12.0, rel=1e-14)


def test_var_names_filter_and_defaults(draws):
    idata = _idata({**draws, "only_ours": draws["sigma"]})
    reference = {**draws, "only_theirs": draws["sigma"]}
    assert pmsg.compare(idata, reference).attrs["var_names"] == ["beta", "sigma"]
    df = pmsg.compare(idata, reference, var_names="sigma")
    assert list(df.index) == ["sigma"]
    df = pmsg.compare(idata, reference, var_names=["sigma", "beta"])
    assert list(df.index) == ["sigma", "beta[x0]", "beta[x1]", "beta[x2]"]
    with pytest.raises(ValueError, match=r"'only_theirs' is not in idata's posterior"):
        pmsg.compare(idata, reference, var_names=["beta", "only_theirs"])
    with pytest.raises(ValueError, match=r"'only_ours' is not in the reference"):
        pmsg.compare(idata, reference, var_names=["only_ours"])
    with pytest.raises(ValueError, match="share no variable"):
        pmsg.compare(idata, {"alpha": draws["sigma"]})
    with pytest.raises(ValueError, match=r"'beta': the reference array has shape \(800, 4\)"):
        pmsg.compare(idata, {"beta": np.zeros((800, 4))}, var_names="beta")
    with pytest.raises(ValueError, match="no posterior group"):
        pmsg.compare(from_dict({"sample_stats": {"a": np.zeros((1, 2))}}), reference)


def test_labels_and_alignment_by_coordinates():
    rng = np.random.default_rng(5)
    sigma = rng.normal(size=(1, 300, 2, 2))
    idata = from_dict(
        {"posterior": {"Sigma": sigma, "theta": rng.normal(size=(1, 300, 2))}},
        coords={"row": ["a", "b"], "col": [10, 20]},
        dims={"Sigma": ["row", "col"]},
    )
    df = pmsg.compare(idata, idata)
    assert list(df.index) == list(az.summary(idata, kind="stats").index)
    assert list(df.index) == [
        "Sigma[a, 10]",
        "Sigma[a, 20]",
        "Sigma[b, 10]",
        "Sigma[b, 20]",
        "theta[0]",
        "theta[1]",
    ]
    # A reference with the same dims in another order and with reversed coordinates is
    # aligned by coordinate value, so it is still the same posterior element by element.
    reordered = dataset(idata).isel(row=[1, 0]).transpose("col", "row", "draw", ...)
    df = pmsg.compare(idata, reordered)
    np.testing.assert_array_equal(df["mean_diff_sd"], 0.0)
    np.testing.assert_array_equal(df["sd_ratio"], 1.0)
    np.testing.assert_allclose(df.loc["Sigma[b, 20]", "mean"], sigma[..., 1, 1].mean())
    with pytest.raises(ValueError, match="'Sigma': the reference's coordinates"):
        pmsg.compare(idata, dataset(idata).assign_coords(row=["a", "c"]), var_names="Sigma")


def test_plot_compare_overlays_both_sets(draws):
    idata = _idata(draws)
    reference = {"beta": draws["beta"].reshape(-1, 3) + 0.1, "sigma": draws["sigma"].ravel()}
    figures = pmsg.plot_compare(idata, reference, labels=("IASG", "exact"))
    try:
        assert isinstance(figures.density, matplotlib.figure.Figure)
        assert isinstance(figures.forest, matplotlib.figure.Figure)
        assert [ax.get_title() for ax in figures.density.axes] == [
            "beta\nx0",
            "beta\nx1",
            "beta\nx2",
            "sigma",
        ]
        for figure in figures:
            legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes)]
            texts = {t.get_text() for legend in legends if legend for t in legend.get_texts()}
            assert {"IASG", "exact"} <= texts
        # Each density panel has lines of both sets.
        assert all(len(ax.get_lines()) >= 2 for ax in figures.density.axes)
        # The forest names every variable and coordinate, with an interval of each set per
        # coordinate (ArviZ 1: the labels are texts in a column of their own; ArviZ 0.x:
        # y tick labels).
        forest = figures.forest
        labels = {t.get_text() for ax in forest.axes for t in ax.texts}
        labels |= {t.get_text() for ax in forest.axes for t in ax.get_yticklabels()}
        assert {"x0", "x1", "x2"} <= {label.split("[")[-1].rstrip("]") for label in labels}
        assert any("sigma" in label for label in labels)
        assert max(len(ax.get_lines()) for ax in forest.axes) >= 2 * 4
        single = pmsg.plot_compare(idata, reference, var_names="sigma").density
        assert [ax.get_title() for ax in single.axes] == ["sigma"]
    finally:
        plt.close("all")
