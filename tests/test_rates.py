"""Exact checks of the tuning in whitened coordinates: on a Gaussian target the tuned step and
injected noise give the posterior covariance exactly (discrete Lyapunov equation), whatever the
gradient noise — the property that makes the samplers right where Fisher's identity fails."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import solve_discrete_lyapunov

from pymc_sgmcmc.adapter.step import default_batch_size
from pymc_sgmcmc.tuning import Whitening, effective_window, iasg_rule, iasg_window, langevin_rule
from pymc_sgmcmc.tuning.rates import noise_budget


def _spd(d, seed, cond=1e6):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (q * np.logspace(0, np.log10(cond), d)) @ q.T


def _stationary(step, injected, whitening, curvature, noise):
    """Stationary covariance (θ units) of θ ← θ − h A⁻¹(∇U + e) + L ξ on a Gaussian target."""
    a_z = whitening.to_whitened(curvature)
    s_z = whitening.to_whitened(noise)
    p = step if np.ndim(step) == 2 else step * np.eye(a_z.shape[0])
    f = np.eye(a_z.shape[0]) - p @ a_z
    sigma_z = solve_discrete_lyapunov(f, p @ s_z @ p.T + injected)
    lt = whitening.factor()
    return lt @ sigma_z @ lt.T


@pytest.mark.parametrize("share", [1.0, 0.25])
@pytest.mark.parametrize(
    "case",
    ["fisher", "prior_only_direction", "full_batch", "overdispersed_data"],
)
def test_langevin_rule_gives_the_posterior_covariance_exactly(share, case):
    d, n, b = 5, 100_000, 256
    curvature = _spd(d, 0, cond=1e10)  # natural units: condition number 1e10
    per_datum = curvature / n  # Fisher's identity A = N C
    if case == "prior_only_direction":
        w, v = np.linalg.eigh(per_datum)
        w[0] = 0.0  # the data do not inform one direction: C is singular there
        per_datum = (v * w) @ v.T
    if case == "overdispersed_data":
        per_datum = 3.0 * per_datum
    noise = n**2 / b * per_datum * (0.0 if case == "full_batch" else 1.0)
    whitening = Whitening.from_curvature(curvature)
    rates = langevin_rule(
        whitening.to_whitened(noise), noise_share=share, step_cap=0.25, temperature=1.0
    )
    sigma = _stationary(rates.preconditioner(), rates.injected, whitening, curvature, noise)
    target = np.linalg.inv(curvature)
    sd_ratio = np.sqrt(np.diag(sigma) / np.diag(target))
    np.testing.assert_allclose(sd_ratio, 1.0, rtol=1e-6)
    np.testing.assert_allclose(sigma, target, rtol=1e-5, atol=1e-12 * np.abs(target).max())
    assert rates.noise_share <= share + 1e-12
    if case == "full_batch":
        assert rates.step_size == pytest.approx(0.25)  # the cap: no noise to limit it
        np.testing.assert_allclose(rates.steps, 0.25)
    if case == "prior_only_direction":
        # the direction only the prior informs takes the capped step, the others the noise's
        assert rates.steps.max() == pytest.approx(0.25)
        assert rates.steps.min() < 0.01
    if case == "overdispersed_data" and share == 1.0:
        # over-dispersed data: smaller steps (3x the noise), not wider draws
        np.testing.assert_allclose(rates.steps.max(), 2 / (3 * n / b * 1.0 + 1), rtol=0.02)


def test_langevin_rule_with_momentum_and_temperature():
    d = 4
    curvature = _spd(d, 1, cond=1e4)
    noise = 50.0 * curvature
    whitening = Whitening.from_curvature(curvature)
    for momentum in (0.3, 0.8):
        rates = langevin_rule(
            whitening.to_whitened(noise),
            noise_share=1.0,
            step_cap=0.25,
            temperature=2.0,
            momentum=momentum,
        )
        # v' = (1−μ) v − h(A_z z + ε) + ξ ; z' = z + v' : the AR(2) of each whitened coordinate
        h, mu = rates.step_size, momentum
        a_z = whitening.to_whitened(curvature)
        s_z = whitening.to_whitened(noise)
        eye = np.eye(d)
        f = np.block([[eye - h * a_z, (1 - mu) * eye], [-h * a_z, (1 - mu) * eye]])
        v = h**2 * s_z + rates.injected
        g = np.block([[v, v], [v, v]])
        sigma = solve_discrete_lyapunov(f, g)[:d, :d]
        np.testing.assert_allclose(sigma, 2.0 * np.eye(d), atol=1e-8)


def test_noise_budget_without_momentum_is_the_ar1_formula():
    for h in (0.01, 0.3, 1.5):
        assert noise_budget(h) == pytest.approx(h * (2 - h))
        assert noise_budget(h, momentum=1.0) == pytest.approx(h * (2 - h))


@pytest.mark.parametrize("dispersion", [1.0, 3.0])
@pytest.mark.parametrize("target", [10.0, 49.0, 390.0])
def test_iasg_window_mean_has_the_posterior_variance(target, dispersion):
    """In the Fisher regime (S_z = N/B) nothing is injected but where the window is an
    integer; with data over-dispersed 3x the step shrinks along the noisy directions until the
    window's relaxation (W_eff ≈ W + 1/h) covers their noise: never wider draws."""
    d = 3
    curvature = _spd(d, 2, cond=1e8)
    n_over_b = target
    noise = dispersion * n_over_b * curvature  # S_z = dispersion · N/B
    whitening = Whitening.from_curvature(curvature)
    h = min(0.5, 3.0 / target)
    window = iasg_window(target, h)
    rates = iasg_rule(whitening.to_whitened(noise), step_size=h, window=window)
    a_z = whitening.to_whitened(curvature)
    p = rates.preconditioner()
    f = np.eye(d) - p @ a_z
    sigma = solve_discrete_lyapunov(f, p @ whitening.to_whitened(noise) @ p + rates.injected)
    acc, power = np.zeros((d, d)), np.eye(d)
    for k in range(1, window):
        power = power @ f
        term = power @ sigma
        acc += (1 - k / window) * (term + term.T)
    mean_cov = (sigma + acc) / window
    # The window's mean has exactly the posterior's covariance: the integer window's extra
    # length (W_eff ≥ N/B) is made up by injected noise.
    np.testing.assert_allclose(mean_cov, np.eye(d), atol=1e-8)
    assert effective_window(window, h) >= target
    assert rates.overdispersion == pytest.approx(1.0)
    if dispersion > 1:
        assert rates.steps.max() < h


def test_whitening_handles_natural_units_and_a_diagonal_fallback():
    curvature = _spd(6, 3, cond=1e12)
    w = Whitening.from_curvature(curvature)
    lt = w.factor()
    # condition number 1e12: float64 resolves the inverse to ~1e-16 x 1e12 relative
    inverse = np.linalg.inv(curvature)
    np.testing.assert_allclose(lt @ lt.T, inverse, rtol=1e-3, atol=1e-9 * np.abs(inverse).max())
    np.testing.assert_allclose(w.to_whitened(curvature), np.eye(6), atol=1e-4)
    diag = Whitening.from_curvature(np.diag(curvature))
    assert not diag.dense
    np.testing.assert_allclose(diag.to_whitened(np.diag(curvature)), np.ones(6))
    # an indefinite measurement (away from a mode) gives a positive metric
    indefinite = np.diag([4.0, -1.0, 1e-30])
    w2 = Whitening.from_curvature(indefinite)
    assert np.all(w2.eigenvalues > 0)


@pytest.mark.parametrize(
    "n, expected",
    [
        (50, 50),
        (256, 256),
        (4096, 4096),
        (4097, 256),
        (20_000, 256),
        (65_536, 256),
        (10**5, 256),
        (10**6, 1024),
        (10**7, 4096),
        (10**8, 8192),
    ],
)
def test_default_batch_size_rule(n, expected):
    b = default_batch_size(n)
    assert b == expected
    assert 1 <= b <= n
    if n > 4096:
        assert n / b >= min(np.sqrt(n) / 1.5, 16)  # minibatches stay small against N
