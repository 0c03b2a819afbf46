"""SGFS (Ahn et al. 2012; Mandt et al. 2017 §5.2): the tuned H and injected noise exactly, and
the stationary distribution against the exact posterior (full) and Corollary 6's Lyapunov
prediction (diagonal).

The tests through a driver run through ``pmsg.sample`` (the ``sample_path`` fixture; it
draws what ``pm.sample(step=...)`` draws: test_sampling.py). Statistical tolerances as in
``test_correctness_tuned.py``: means within 0.15 posterior sd and sds within 15% (variances
within 15% for the Lyapunov test), each asserted together with an ESS large enough that the
threshold is at least 3.5 Monte Carlo sds (a variance has relative Monte Carlo sd √(2/ESS)).
"""

from __future__ import annotations

import dataclasses
import json

import arviz as az
import numpy as np
import pymc as pm
import pytest

from pymc_sgmcmc.sgfs import SGFS, sgfs_noise_floor

Z = 3.5
SAMPLE = dict(
    chains=2, cores=1, random_seed=11, progressbar=False, compute_convergence_checks=False
)


def _regression_model(n: int, scales, seed: int = 0) -> pm.Model:
    rng = np.random.default_rng(seed)
    d = len(scales)
    X = rng.normal(size=(n, d)) * scales
    y = X @ rng.normal(size=d) + rng.normal(size=n)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0.0, 1.0, shape=d)
        pm.Normal("y", pm.Data("X", X) @ beta, 1.0, observed=y)
    return model


@pytest.fixture
def known_noise():
    rng = np.random.default_rng(0)
    L = rng.normal(size=(4, 4))
    c = L @ L.T + 4 * np.eye(4)
    c[3, :3] = c[:3, 3] = 0.01  # a direction of small gradient variance
    c[3, 3] = 1e-3
    return c


# -- exact ----------------------------------------------------------------------------------


def test_noise_floor_is_mandts_rule(known_noise):
    n, b, h_max = 1000, 10, 2e-5  # floor 2B/(N² h_max) = 1
    raised, increase = sgfs_noise_floor(known_noise, n, b, h_max)
    diag = np.diag(known_noise)
    # EE_kk = max(0, 2/h_max − N² C_kk / B), in per-datum units (B/N²)·EE_kk
    ee = np.maximum(0.0, 2 / h_max - n**2 * diag / b)
    np.testing.assert_allclose(increase, b / n**2 * ee, rtol=1e-12)
    assert increase[:3].max() == 0.0 and increase[3] > 0
    np.testing.assert_allclose(raised, known_noise + np.diag(increase), rtol=1e-12)
    np.testing.assert_allclose(np.diag(raised)[3], 1.0, rtol=1e-12)
    # a (D,) diagonal gives the same floor; the temperature T scales it (the rate is T·H)
    np.testing.assert_allclose(sgfs_noise_floor(diag, n, b, h_max)[1], increase, rtol=1e-12)
    np.testing.assert_allclose(sgfs_noise_floor(diag, n, b, h_max, 2.0)[0][3], 2.0, rtol=1e-12)
    with pytest.raises(ValueError, match="h_max"):
        sgfs_noise_floor(diag, n, b, 0.0)


@pytest.fixture
def d4_model():
    return _regression_model(1000, [1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("kind", ["full", "diagonal"])
def test_tuned_h_obeys_h_max_and_the_injected_noise_is_what_the_budget_misses(d4_model, kind):
    """SGFS takes constant SGD's rule in whitened coordinates (all the noise the minibatch
    gives, the rest injected) with the step bounded so that every ``H_kk = h (A⁻¹)_kk ≤
    h_max``; what the minibatch does not give of the budget is injected."""
    from pymc_sgmcmc.tuning import Whitening

    n, b = 1000, 10
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    curvature = (q * np.array([1e3, 2e3, 5e3, 1e4])) @ q.T
    noise = n / b * curvature  # Fisher's identity: S = (N/B) A
    whitening = Whitening.from_curvature(curvature if kind == "full" else np.diag(curvature))
    cov = whitening.covariance()
    diag = np.diag(cov) if cov.ndim == 2 else cov
    s_z = whitening.to_whitened(noise)
    with d4_model:
        free = SGFS(batch_size=b, preconditioner=kind)._rates(s_z, 1.0, whitening)
        h_max = 0.5 * free.step_size * float(diag.max())
        rates = SGFS(batch_size=b, h_max=h_max, preconditioner=kind)._rates(s_z, 1.0, whitening)
    assert (rates.step_size * diag).max() == pytest.approx(h_max)  # the bound binds
    assert rates.step_size == pytest.approx(0.5 * free.step_size)
    # what the budget misses is injected: P S P + Q = h_j(2 − h_j) along each direction j of
    # S in whitened coordinates (one h for all when S is isotropic there)
    p = rates.preconditioner()
    basis, steps = rates.basis, rates.steps
    expected = (basis * (steps * (2 - steps))) @ basis.T
    np.testing.assert_allclose(p @ s_z @ p + rates.injected, expected, atol=1e-9)


def test_arguments_are_checked(d4_model):
    with d4_model:
        for bad in (0.0, -1e-3, float("nan"), float("inf"), "1e-3", True):
            with pytest.raises(ValueError, match="h_max"):
                SGFS(h_max=bad)
        with pytest.raises(ValueError, match="'full' or 'diagonal'"):
            SGFS(preconditioner="scalar")
        with pytest.raises(TypeError, match="SGFS has no momentum"):
            SGFS(momentum=0.5)
        with pytest.raises(TypeError, match="SGFS has no step_size"):
            SGFS(step_size=1e-6)
        with pytest.raises(TypeError, match="unknown keyword") as err:
            SGFS(hmax=1e-3)
        assert "h_max" in str(err.value) and "momentum" not in str(err.value)
        assert SGFS(momentum=None, step_size="auto").preconditioner == "full"


# -- h_max through pm.sample -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["diagonal", "full"])
def test_h_max_bounds_the_step_where_the_gradient_variance_is_tiny(kind, sample_path):
    """Feature 3 is scaled by 10⁻³: only the prior informs it, so its posterior variance
    (A⁻¹)_33 ≈ 1 is about N times the others' and its step H_33 = h (A⁻¹)_33 the largest. With
    h_max = 10⁻³ the whitened step is cut to h_max / (A⁻¹)_33 and every H_kk ≤ h_max; the
    injected noise makes up the rest of the budget."""
    n, b, h_max = 2000, 100, 1e-3
    model = _regression_model(n, [1.0, 1.0, 1.0, 1e-3], seed=1)
    kwargs = {**SAMPLE, "draws": 5, "tune": 10, "chains": 1}
    with model:
        step = SGFS(batch_size=b, preconditioner=kind, h_max=h_max)
        idata = sample_path(step=step, **kwargs)
    precond = np.asarray(step.precond_value)
    h = np.diag(precond) if precond.ndim == 2 else precond
    assert np.all(h <= h_max * (1 + 1e-6)), h
    np.testing.assert_allclose(h[3], h_max, rtol=1e-6)
    assert np.all(h[:3] < 1e-5), h
    injected = step.injected_noise()
    injected = np.diag(injected) if injected.ndim == 2 else injected
    assert np.all(injected > 0)
    # the InferenceData carries the sampler's name and tuned values, as for the others
    (settings,) = json.loads(idata.posterior.attrs["sgmcmc_settings"])
    assert idata.posterior.attrs["sgmcmc_samplers"] == "SGFS"
    assert settings["h_max"] == h_max and settings["chains"][0]["tuned"]
    np.testing.assert_allclose(settings["chains"][0]["preconditioner_value"], step.precond_value)
    for name in ("step_size", "data_passes", "minibatch_loss", "grad_norm", "diverging"):
        assert name in idata.sample_stats, name
    assert not idata.sample_stats["diverging"].any()


def test_same_seed_same_draws(d4_model):
    # the same step object twice: nothing of a run survives into the next but the compilation
    kwargs = {**SAMPLE, "draws": 10, "tune": 10}
    with d4_model:
        step = SGFS(batch_size=50, h_max=1e-4)
        a = pm.sample(step=step, **kwargs).posterior["beta"].values
        b = pm.sample(step=step, **kwargs).posterior["beta"].values
        c = pm.sample(step=step, **{**kwargs, "random_seed": 12}).posterior["beta"].values
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert not np.allclose(a[0], a[1])  # each chain starts its own key and state


# -- statistical -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "h_max_factor, draws",
    [
        pytest.param(None, 800, id="defaults"),
        # h_max = B/N², half the E = 0 step: EE ≈ N²C/B is injected in every direction
        pytest.param(0.5, 1500, id="h_max_injects"),
    ],
)
def test_sgfs_full_recovers_the_exact_posterior(regression_10k, h_max_factor, draws, sample_path):
    reg = regression_10k
    n, b = reg.X.shape[0], 100
    h_max = None if h_max_factor is None else h_max_factor * 2 * b / n**2
    with reg.model():
        step = SGFS(batch_size=b, preconditioner="full", h_max=h_max)
        idata = sample_path(draws=draws, tune=50, step=step, **SAMPLE)
    beta = idata.posterior["beta"].values.reshape(-1, reg.X.shape[1])
    ess = float(az.ess(idata, var_names=["beta"])["beta"].min())
    assert 0.15 >= Z / np.sqrt(ess) and 0.15 >= Z / np.sqrt(2 * ess), f"ESS {ess:.0f}"
    z = np.abs(beta.mean(0) - reg.mean) / reg.sd
    ratio = beta.std(0) / reg.sd
    assert np.all(z < 0.15), f"mean errors in sds: {np.round(z, 3)}"
    assert np.all(np.abs(ratio - 1) < 0.15), f"sd ratios: {np.round(ratio, 3)}"
    injected = np.diag(step.injected_noise()) * b / n**2  # in units of the per-datum C
    c = np.diag(reg.per_datum_grad_cov(reg.mean))
    if h_max is None:
        # Fisher's identity holds but for the N(0, 1) prior (1/N of the curvature): little
        # is injected — the step is set by the largest eigenvalue of the measured noise, and
        # the estimate's spread of eigenvalues (a few % at 1024 rows per measurement) leaves
        # the others a little room (measured: 2–7% of C)
        assert np.all(injected < 0.15 * c), injected / c
    else:
        # h_max halves the step: about as much noise injected as the minibatch gives
        assert np.all(injected > 0.5 * c), injected / c


@pytest.mark.slow
def test_sgfs_diagonal_recovers_the_exact_posterior(regression_10k, sample_path):
    """Features 3 and 4 scaled by 0.5 and correlated at 0.3: a diagonal H leaves the
    correlations unwhitened (Corollary 6's stationary covariance was 11–16% narrower than the
    posterior here); with the whole gradient-noise covariance measured and its correlations
    corrected by the injected noise, the stationary covariance is the posterior's."""
    n, b = regression_10k.X.shape[0], 100
    rng = np.random.default_rng(7)
    X = regression_10k.X * [1.0, 1.0, 1.0, 0.5, 0.5]
    reg = dataclasses.replace(regression_10k, X=X, y=X @ rng.normal(size=5) + rng.normal(size=n))
    with reg.model():
        step = SGFS(batch_size=b, preconditioner="diagonal")
        idata = sample_path(draws=2000, tune=50, step=step, **SAMPLE)
    ess = float(az.ess(idata, var_names=["beta"])["beta"].min())
    assert 0.15 >= Z * np.sqrt(2 / ess), f"ESS {ess:.0f}"
    beta = idata.posterior["beta"].values.reshape(-1, 5)
    ratio = beta.var(0) / np.diag(reg.cov)
    assert np.all(np.abs(ratio - 1) < 0.15), f"variance ratios {np.round(ratio, 3)}"
    z = np.abs(beta.mean(0) - reg.mean) / reg.sd
    assert np.all(z < 0.15), f"mean errors in sds: {np.round(z, 3)}"
