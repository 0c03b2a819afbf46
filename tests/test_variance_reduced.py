"""SAGA-LD and SVRG-LD (Dubey et al. 2016): exact kernel updates, unbiased estimators on a
PyMC model's own gradients, and posteriors against NUTS (through ``pmsg.sample``, the
``sample_path`` fixture; it draws what ``pm.sample(step=...)`` draws: test_sampling.py)."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pymc as pm
import pytest
from posteriors.suite import SUITE
from posteriors.suite import reference as suite_reference
from test_correctness_tuned import SAMPLE, _check_gaussian, _ess, _flat

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.kernels import saga, svrg

jax.config.update("jax_enable_x64", True)


def test_one_saga_step_matches_hand_computation_and_the_table_sum_stays_exact():
    rng = np.random.default_rng(0)
    n, d = 6, 2
    table = jnp.asarray(rng.normal(size=(n, d)))
    state = saga.init(jnp.array([0.3, -0.2]), table)
    rows = jnp.array([4, 1, 4])  # drawn with replacement: row 4 twice
    new_rows = jnp.asarray(rng.normal(size=(3, d)))
    key = jax.random.key(9)
    h = 0.01
    new, info = saga.step(
        key, state, lambda th: -th, lambda th: new_rows, rows, n, h, temperature=1.0
    )
    ghat = -np.array([0.3, -0.2]) + n / 3 * (new_rows - table[rows]).sum(0) + table.sum(0)
    xi = np.asarray(jax.random.normal(key, (d,), dtype=jnp.float64))
    np.testing.assert_allclose(new.position, np.array([0.3, -0.2]) + h / 2 * ghat + np.sqrt(h) * xi)
    np.testing.assert_allclose(info.grad_norm, np.linalg.norm(ghat))
    # rows 1 and 4 now hold the new gradients (row 4: one of its two, stored once)
    np.testing.assert_allclose(new.table[1], new_rows[1])
    assert any(np.allclose(new.table[4], new_rows[i]) for i in (0, 2))
    np.testing.assert_allclose(new.table_sum, new.table.sum(0), rtol=1e-14)

    # many steps with heavy duplication: the running sum never drifts from the rows' sum
    def body(st, k):
        k1, k2 = jax.random.split(k)
        r = jax.random.randint(k1, (4,), 0, n)
        g = jax.random.normal(k2, (4, d), dtype=jnp.float64)
        st, _ = saga.step(None, st, lambda th: -th, lambda th: g, r, n, h, normal=jnp.zeros(d))
        return st, None

    final, _ = jax.lax.scan(body, state, jax.random.split(key, 500))
    np.testing.assert_allclose(final.table_sum, final.table.sum(0), rtol=1e-12, atol=1e-12)


@pytest.fixture
def small_logistic():
    rng = np.random.default_rng(1)
    n, d = 10, 3
    X = rng.normal(size=(n, d))
    y = rng.random(n) < 0.5
    with pm.Model() as model:
        pm.Normal("beta", 0, 1, shape=d)
        pm.Bernoulli("y", logit_p=pm.Data("X", X) @ model["beta"], observed=y)
    return model, X, y


def test_saga_and_svrg_estimators_are_unbiased_over_all_minibatches(small_logistic):
    # Every ordered with-replacement minibatch of B = 3 of the N = 10 rows (10³ of them),
    # gradients from the bridge (the model's own PyTensor graph through JAX): their average
    # is the full-data gradient at θ, whatever the table's stale positions or the anchor.
    model, X, y = small_logistic
    with model:
        step = pmsg.SAGALD(batch_size=3)
    fns = step.problem.jax_functions()
    n, b = 10, 3
    data = tuple(jnp.asarray(a) for a in step.problem.data)
    rng = np.random.default_rng(2)
    theta = jnp.asarray(rng.normal(size=3))
    stale = rng.normal(size=(n, 3))  # α_i: a different stale position per row
    table = jnp.stack(
        [
            fns["per_example_grads"](jnp.asarray(stale[i]), (), tuple(a[i : i + 1] for a in data))[
                0
            ]
            for i in range(n)
        ]
    )
    state = saga.init(theta, table)
    prior = jax.grad(fns["logprior"])(theta, ())
    full = jax.grad(lambda th: fns["logdensity"](th, (), data))(theta)

    anchor = jnp.asarray(rng.normal(size=3))
    anchor_full = jnp.sum(fns["per_example_grads"](anchor, (), data), axis=0)
    combos = jnp.asarray(list(itertools.product(range(n), repeat=b)))

    def estimates(rows):
        batch = tuple(a[rows] for a in data)
        g_theta = fns["per_example_grads"](theta, (), batch)
        g_anchor = fns["per_example_grads"](anchor, (), batch)
        return (
            saga.estimator(state, prior, g_theta, rows, n),
            svrg.estimator(prior, g_theta.sum(0), g_anchor.sum(0), anchor_full, n, b),
        )

    saga_all, svrg_all = jax.jit(jax.vmap(estimates))(combos)  # one call, not 10³ eager ones
    np.testing.assert_allclose(np.asarray(saga_all).mean(0), full, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(svrg_all).mean(0), full, rtol=1e-10)


def test_svrg_refreshes_its_anchor_with_the_full_gradient():
    def full(th):
        return 10.0 * th

    def step(state):
        return svrg.step(
            None,
            state,
            lambda th: 0 * th,  # flat prior
            lambda th: th,  # minibatch row-gradient sum
            full,
            5,
            1,
            0.1,
            anchor_every=3,
            normal=jnp.zeros(1),
        )[0]

    first = step(svrg.init(jnp.array([1.0])))
    np.testing.assert_allclose(first.anchor, [1.0])
    np.testing.assert_allclose(first.anchor_grad, [10.0])
    # at θ = anchor the control variate cancels: ĝ = prior + full = 0 + 10
    np.testing.assert_allclose(first.position, [1.0 + 0.05 * 10.0])
    # the next step keeps the anchor: ĝ = (N/B)(θ − θ̃) + g̃ = 5·0.5 + 10
    second = step(first)
    np.testing.assert_allclose(second.anchor, [1.0])
    np.testing.assert_allclose(second.position, [1.5 + 0.05 * 12.5])
    # iteration 3 is the next multiple of anchor_every: a new anchor at the current position
    fourth = step(step(second))
    np.testing.assert_allclose(fourth.anchor, step(second).position)
    np.testing.assert_allclose(fourth.anchor_grad, 10.0 * step(second).position)


def test_bad_arguments_are_refused(small_logistic):
    model, *_ = small_logistic
    with model:
        with pytest.raises(ValueError, match="preconditioner"):
            pmsg.SAGALD(preconditioner="rmsprop")
        with pytest.raises(ValueError, match="anchor_every"):
            pmsg.SVRGLD(anchor_every=0)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [pmsg.SAGALD, pmsg.SVRGLD])
def test_logistic_regression_against_nuts(cls, logistic_nuts, sample_path):
    build, ref = logistic_nuts
    with build():
        ours = sample_path(draws=1000, tune=100, step=cls(batch_size=200), **SAMPLE)
    stats = ours.sample_stats
    assert not stats["diverging"].any()
    ess = min(_ess(ours, "beta"), float(ref.shape[0]) / 2)
    # The issue asks for means and sds (Dubey et al. report no correlations); the automatic
    # step mixes the softest direction in ~1.5 draws, so the ESS suffices for those.
    _check_gaussian(
        _flat(ours, "beta"), ref.mean(0), np.cov(ref, rowvar=False), ess, correlations=False
    )


@pytest.fixture(scope="module")
def logistic_nuts():
    # The committed NUTS reference (posteriors/suite.py, checked against nutpie when made).
    return SUITE["logistic_20k"].build, _flat(suite_reference("logistic_20k"), "beta")


@pytest.mark.parametrize("step_cls", [pmsg.SAGALD, pmsg.SVRGLD])
def test_a_group_seen_in_one_row_caps_the_variance_reduced_step(step_cls):
    # y_i ~ N(a[g_i], 1), a ~ N(0, 1): the group seen in one row has posterior curvature 1 + 1
    # and that row's Hessian is 1, so max_i λmax(A⁻¹ H_i) = 1/2 exactly (every other group has
    # ~100 rows, λ ≈ 1/101) and the row stiffness is (N/B)/2. The control variate feeds
    # (N/B) H_i (θ − θ_stored) back at every visit of that row: the whitened step must stay
    # below its inverse (radon's rare counties ran SAGA-LD away at the step cap 0.25).
    rng = np.random.default_rng(0)
    n = 5000
    group = np.concatenate([[0], rng.integers(1, 50, n - 1)])
    y = rng.normal(size=n)
    with pm.Model():
        a = pm.Normal("a", 0.0, 1.0, shape=50)
        pm.Normal("y", a[pm.Data("g", group)], 1.0, observed=y)
        step = step_cls()
        idata = pm.sample(step=step, draws=20, tune=20, **{**SAMPLE, "chains": 1})
    (settings,) = json.loads(idata.posterior.attrs["sgmcmc_settings"])
    tuned = settings["chains"][0]
    expected = (n / step.batch_size) / 2.0
    np.testing.assert_allclose(tuned["row_stiffness"], expected, rtol=0.02)
    assert tuned["whitened_step_size"] <= 1.0 / expected * (1 + 1e-9)


@pytest.mark.slow
def test_group_effects_informed_by_few_rows_are_not_kicked_away():
    """1 000 exact random intercepts of 20 rows (N = 20 000, B = 256: a group's rows are in a
    minibatch about once in four iterations, and between visits its gradient is the anchor's).
    SVRG-LD's noise at a group grows with the step; tuned from the noise measured at the last
    step, with SGLD's share of a quarter, the groups got steps up to 0.13 and some were kicked
    21 sds away (the worst group's |sd - 1| 0.88, the mean 0.078), silently. Now:
    every group's draws within 7 sds of the exact posterior (Gaussian: 400 000 group-draws
    pass 6 sds with probability 10⁻³), the groups' sds within 0.06 on average (the Monte
    Carlo error of one sd at ~200 effective draws is 0.05: its mean absolute value ~0.04)
    and θ right within 0.3 sd and 15% in sd."""
    from posteriors.hierarchical import build_random_intercepts, exact_random_intercepts
    from stack import dataset

    groups = 1000
    exact = exact_random_intercepts(groups, 20)
    with build_random_intercepts(groups, 20):
        idata = pmsg.sample(
            step=pmsg.SVRGLD(),
            draws=200,
            tune=200,
            chains=2,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
    u = np.asarray(dataset(idata)["u"]).reshape(-1, groups)
    z = (u - exact["u_mean"]) / exact["u_sd"]
    assert np.abs(z).max() < 7.0, np.abs(z).max()
    assert np.abs(z.std(axis=0) - 1).mean() < 0.06, np.abs(z.std(axis=0) - 1).mean()
    theta = np.asarray(dataset(idata)["theta"]).ravel()
    assert abs(theta.mean() - exact["theta_mean"]) < 0.3 * exact["theta_sd"]
    assert abs(theta.std() / exact["theta_sd"] - 1) < 0.15
