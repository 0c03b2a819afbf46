"""The bridge: per-row log-likelihoods + log-prior reproduce PyMC's log-density exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pymc as pm
import pytest

import pymc_sgmcmc as pmsg

# The tests call the bridge's JAX functions themselves: in float64 (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("float64")


def _multi_output_model(seed: int = 0) -> pm.Model:
    """Two observed variables sharing X, a transformed scale, and a full-batch observation."""
    rng = np.random.default_rng(seed)
    n = 500
    X = rng.normal(size=(n, 2))
    with pm.Model(coords={"obs": np.arange(n)}) as model:
        Xd = pm.Data("X", X, dims=("obs", "f"))
        beta = pm.Normal("beta", 0, 1, shape=2)
        a = pm.Normal("a", 0, 1)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y1", Xd @ beta, 1.0, observed=X @ [1.0, -1.0] + rng.normal(size=n), dims="obs")
        pm.StudentT("y2", nu=5, mu=a + Xd[:, 0] * beta[1], sigma=s, observed=rng.normal(size=n))
        pm.Normal("z", a, 0.5, observed=np.array([0.2, -0.1, 0.4]))
        pm.Potential("pot", -0.5 * a**2)
    return model


def _random_point(model: pm.Model, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=np.shape(v)) for k, v in model.initial_point().items()}


def test_problem_structure():
    model = _multi_output_model()
    problem = pmsg.build_problem(model)
    assert problem.data_size == 500
    assert set(problem.minibatched_observed) == {"y1", "y2"}
    assert problem.full_observed == ("z",)
    assert set(problem.data_names) == {"X", "y1", "y2"}
    assert {v.name for v in problem.var_infos} == {"beta", "a", "s_log__"}
    assert problem.dim == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_plus_prior_equals_model_logp(seed):
    model = _multi_output_model()
    problem = pmsg.build_problem(model)
    f = problem.jax_functions()
    logp = model.compile_logp()
    point = _random_point(model, seed)
    theta = jnp.asarray(problem.ravel(point))
    data = tuple(jnp.asarray(a) for a in problem.data)
    ours = float(f["logprior"](theta, ()) + jnp.sum(f["loglik_rows"](theta, (), data)))
    np.testing.assert_allclose(ours, float(logp(point)), rtol=1e-8)


def test_minibatch_gradients_over_a_partition_average_to_the_full_gradient():
    model = _multi_output_model()
    problem = pmsg.build_problem(model)
    f = problem.jax_functions()
    theta = jnp.asarray(problem.ravel(_random_point(model, 3)))
    data = tuple(jnp.asarray(a) for a in problem.data)
    batch = 50
    grads = [
        f["logdensity_and_grad"](theta, (), tuple(a[i : i + batch] for a in data))[1]
        for i in range(0, problem.data_size, batch)
    ]
    full = jax.grad(lambda th: f["logprior"](th, ()) + jnp.sum(f["loglik_rows"](th, (), data)))(
        theta
    )
    dlogp = model.compile_dlogp()(_random_point(model, 3))
    np.testing.assert_allclose(np.mean(grads, axis=0), full, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(full, dlogp, rtol=1e-8)


def test_per_example_gradients_sum_to_the_row_gradient():
    model = _multi_output_model()
    problem = pmsg.build_problem(model)
    f = problem.jax_functions()
    theta = jnp.asarray(problem.ravel(_random_point(model, 4)))
    batch = tuple(jnp.asarray(a[:7]) for a in problem.data)
    per_example = f["per_example_grads"](theta, (), batch)
    assert per_example.shape == (7, problem.dim)
    total = jax.grad(lambda th: jnp.sum(f["loglik_rows"](th, (), batch)))(theta)
    np.testing.assert_allclose(per_example.sum(axis=0), total, rtol=1e-10)


def test_explicit_minibatch_override_keeps_other_data_in_full():
    model = _multi_output_model()
    problem = pmsg.build_problem(model, minibatch_data=["X", "y1"])
    assert problem.minibatched_observed == ("y1",)
    assert set(problem.full_observed) == {"y2", "z"}
    f = problem.jax_functions()
    point = _random_point(model, 5)
    theta = jnp.asarray(problem.ravel(point))
    data = tuple(jnp.asarray(a) for a in problem.data)
    ours = float(f["logprior"](theta, ()) + jnp.sum(f["loglik_rows"](theta, (), data)))
    np.testing.assert_allclose(ours, float(model.compile_logp()(point)), rtol=1e-8)


def test_fixed_variables_enter_as_inputs():
    model = _multi_output_model()
    problem = pmsg.build_problem(model, vars=[model["beta"]])
    assert [v.name for v in problem.fixed_infos] == ["a", "s_log__"]
    point = _random_point(model, 6)
    f = problem.jax_functions()
    theta = jnp.asarray(problem.ravel(point))
    data = tuple(jnp.asarray(a) for a in problem.data)
    fixed = problem.fixed_values(point)
    ours = float(f["logprior"](theta, fixed) + jnp.sum(f["loglik_rows"](theta, fixed, data)))
    np.testing.assert_allclose(ours, float(model.compile_logp()(point)), rtol=1e-8)


def test_plain_numpy_design_matrix_is_sliced_with_the_observations(small_regression):
    reg = small_regression
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=reg.X.shape[1])
        pm.Normal("y", reg.X @ beta, 1.0, observed=reg.y)
    problem = pmsg.build_problem(model)
    assert len(problem.data) == 2  # X (a constant in the graph) and y
    point = _random_point(model, 7)
    f = problem.jax_functions()
    theta = jnp.asarray(problem.ravel(point))
    data = tuple(jnp.asarray(a) for a in problem.data)
    ours = float(f["logprior"](theta, ()) + jnp.sum(f["loglik_rows"](theta, (), data)))
    np.testing.assert_allclose(ours, float(model.compile_logp()(point)), rtol=1e-8)


def test_integer_data_container_observed_through_a_cast():
    # PyMC wraps an integer pm.Data container observed by a Bernoulli in a Cast.
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2))
    y = (rng.random(300) < 0.5).astype(np.int64)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Bernoulli("y", logit_p=pm.Data("X", X) @ b, observed=pm.Data("y_obs", y))
    problem = pmsg.build_problem(model)
    assert problem.data_size == 300 and set(problem.data_names) == {"X", "y_obs"}
    point = model.initial_point()
    ours = float(problem.jax_functions()["logdensity"](problem.ravel(point), (), problem.data))
    np.testing.assert_allclose(ours, float(model.compile_logp()(point)), rtol=1e-8)
