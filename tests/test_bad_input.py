"""Bad input: each case raises a clear exception naming the variable at fault and the fix.

One test (or parametrized group) per case of the reliability page's table; each asserts the
exception type and a fragment of its message. A ``step=`` that covers only some variables is
not bad input: it is supported, and tested here against PyMC's conditional gradient.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pymc as pm
import pytest
from pymc.exceptions import ImputationWarning

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.errors import DataShapeError, ModelNotSupportedError

N = 300
SAMPLE = dict(
    draws=30, tune=10, chains=2, cores=1, progressbar=False, compute_convergence_checks=False
)


def _data(n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    return X, X @ [1.0, -1.0] + 0.5 * rng.normal(size=n)


def _regression(n: int = N) -> pm.Model:
    """b ~ N(0, 1), s ~ HalfNormal, y ~ N(X b, s), with a Deterministic and pm.Data X."""
    X, y = _data(n)
    with pm.Model() as model:
        Xd = pm.Data("X", X)
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Deterministic("b_sum", b.sum())
        pm.Normal("y", Xd @ b, s, observed=y)
    return model


# --- 1. discrete free variables ---------------------------------------------------------


def test_discrete_free_variable_is_refused_with_the_fix():
    with pm.Model() as model:
        k = pm.Poisson("k", 3.0)
        pm.Normal("y", k, 1.0, observed=np.zeros(10))
    with pytest.raises(ModelNotSupportedError, match=r"'k' is discrete.*pm\.Metropolis"):
        pmsg.build_problem(model)


# --- 2. no observed data ----------------------------------------------------------------


def test_model_without_observed_data_says_what_to_do():
    with pm.Model() as model:
        pm.Normal("x", 0, 1)
    with pytest.raises(ModelNotSupportedError, match=r"no observed variables.*pm\.sample\(\)"):
        pmsg.build_problem(model)


# --- 3. batch_size outside 1..N ---------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_size", "error", "fragment"),
    [
        (0, ValueError, r"batch_size must be a positive integer, got 0"),
        (-3, ValueError, r"batch_size must be a positive integer, got -3"),
        (2_001, DataShapeError, r"batch_size=2001 .*N=2000.*Choose batch_size <= 2000"),
        (2.5, TypeError, r"batch_size must be an integer, got 2\.5"),
    ],
)
def test_batch_size_outside_one_to_n(small_regression, batch_size, error, fragment):
    with small_regression.model():
        with pytest.raises(error, match=fragment):
            pmsg.SGLD(batch_size=batch_size)


def test_batch_size_larger_than_n_names_n(small_regression):
    with small_regression.model():
        with pytest.raises(DataShapeError, match=r"N=2000"):
            pmsg.SGLD(batch_size=5000)


@pytest.mark.parametrize("batch_size", [0, N + 1])
def test_build_problem_checks_batch_size_itself(batch_size):
    with pytest.raises(DataShapeError, match=rf"batch_size={batch_size} .*\['y'\]"):
        pmsg.build_problem(_regression(), batch_size=batch_size)


# --- 4. data containers with disagreeing leading axes -----------------------------------


def test_data_containers_with_disagreeing_leading_axes():
    rng = np.random.default_rng(0)
    with pm.Model() as model:
        X = pm.Data("X", rng.normal(size=(101, 2)))
        beta = pm.Normal("beta", 0, 1, shape=2)
        pm.Normal("y", X @ beta, 1.0, observed=rng.normal(size=100))
    with pytest.raises(DataShapeError, match=r"not row-aligned.*'X': 101"):
        pmsg.build_problem(model)


def test_override_with_disagreeing_leading_axes():
    rng = np.random.default_rng(0)
    with pm.Model() as model:
        X = pm.Data("X", rng.normal(size=(100, 2)))
        g = pm.Data("g", rng.normal(size=30))
        beta = pm.Normal("beta", 0, 1, shape=2)
        pm.Normal("y", X @ beta + g.sum(), 1.0, observed=rng.normal(size=100))
    with pytest.raises(DataShapeError, match="share one leading"):
        pmsg.build_problem(model, minibatch_data=["X", "g"])


# --- 5. observed data with missing values (PyMC's automatic imputation) -----------------


def _imputed_model(kind: str) -> pm.Model:
    X, y = _data()
    missing = np.zeros(N, dtype=bool)
    missing[[3, 17, 250]] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImputationWarning)
        with pm.Model() as model:
            b = pm.Normal("b", 0, 1, shape=2)
            if kind == "nan":
                pm.Normal("y", X @ b, 1.0, observed=np.where(missing, np.nan, y))
            elif kind == "masked":
                pm.Normal("y", X @ b, 1.0, observed=np.ma.masked_array(y, mask=missing))
            elif kind == "no covariates":
                pm.Normal("y", b[0], 1.0, observed=np.where(missing, np.nan, y))
            elif kind == "multivariate":
                # a missing entry inside a row's support: PyMC's general PartialObservedRV
                Y = np.column_stack([y, y]).copy()
                Y[3, 0] = np.nan
                pm.MvNormal("y", b, np.eye(2), observed=Y)
    return model


@pytest.mark.parametrize("kind", ["nan", "masked", "no covariates", "multivariate"])
def test_missing_observed_values_are_refused(kind):
    model = _imputed_model(kind)
    # what PyMC made of it: an imputation free variable, an observed part, a Deterministic
    assert [rv.name for rv in model.free_RVs] == ["b", "y_unobserved"]
    assert [rv.name for rv in model.observed_RVs] == ["y_observed"]
    assert [d.name for d in model.deterministics] == ["y"]
    with pytest.raises(
        ModelNotSupportedError,
        match=r"observed data of 'y' have missing values.*drop those rows.*pm\.sample\(\) "
        r"\(NUTS\).*'y_observed'.*'y_unobserved'",
    ):
        pmsg.build_problem(model)


def test_missing_observed_values_are_refused_whatever_vars_covers():
    # Sampling the imputed entries with another step does not make the rows line up again.
    model = _imputed_model("nan")
    with model:
        with pytest.raises(ModelNotSupportedError, match=r"'y' have missing values"):
            pmsg.SGLD(vars=[model["b"]])


def test_a_deterministic_of_an_observed_variable_is_not_taken_for_an_imputation():
    X, y = _data()
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        obs = pm.Normal("y", X @ b, 1.0, observed=y)
        pm.Deterministic("resid", obs - X @ b)
    assert pmsg.build_problem(model).minibatched_observed == ("y",)


# --- 6. pm.Minibatch / total_size in the model ------------------------------------------
# A model written for minibatch ADVI is sampled as its full-data equivalent (tests/
# test_advi_models.py); refused only where it has none.


def _pm_minibatch_model(kind: str) -> pm.Model:
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "total_size not provided ..."
        with pm.Model() as model:
            b = pm.Normal("b", 0, 1, shape=2)
            if kind == "minibatch + total_size":
                Xm, ym = pm.Minibatch(pm.Data("X", X), pm.Data("y_data", y), batch_size=30)
                pm.Normal("y", Xm @ b, 1.0, observed=ym, total_size=N)
            elif kind == "minibatch + wrong total_size":
                Xm, ym = pm.Minibatch(pm.Data("X", X), pm.Data("y_data", y), batch_size=30)
                pm.Normal("y", Xm @ b, 1.0, observed=ym, total_size=10 * N)
            elif kind == "minibatch without total_size":
                Xm, ym = pm.Minibatch(X, y, batch_size=30)
                pm.Normal("y", Xm @ b, 1.0, observed=ym)
            elif kind == "minibatched covariate only":
                Xm = pm.Minibatch(X, batch_size=30)
                pm.Normal("y", Xm @ b, 1.0, observed=y[:30])
            elif kind == "potential on a minibatch":
                Xm, ym = pm.Minibatch(X, y, batch_size=30)
                pm.Normal("y", Xm @ b, 1.0, observed=ym, total_size=N)
                pm.Potential("penalty", -((Xm @ b) ** 2).sum())
            elif kind == "free variable on a minibatch":
                Xm, ym = pm.Minibatch(X, y, batch_size=30)
                z = pm.Normal("z", Xm @ b, 1.0)
                pm.Normal("y", z, 1.0, observed=ym, total_size=N)
    return model


def test_pm_minibatch_with_total_size_is_read_as_the_full_data_model():
    problem = pmsg.build_problem(_pm_minibatch_model("minibatch + total_size"))
    full = pmsg.build_problem(_regression())
    assert problem.data_size == N
    assert problem.data_names == ("y", "X") and problem.minibatched_observed == ("y",)
    np.testing.assert_array_equal(problem.data[1], full.data[full.data_names.index("X")])
    model = _pm_minibatch_model("minibatch + total_size")
    forced = pmsg.build_problem(model, minibatch_data=[model["y"], "X"])
    assert forced.data_names == ("y", "X") and forced.model is model
    # The user's pm.Minibatch batch_size (30) is not the sampler's.
    with _pm_minibatch_model("minibatch + total_size"):
        assert pmsg.SGLD().batch_size == N  # N <= 4096 rows: one full batch by default
        assert pmsg.SGLD(batch_size=50).batch_size == 50


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "minibatch + wrong total_size",
            r"Observed variable 'y' has total_size=3000, but the full data that pm\.Minibatch "
            r"slices have N=300 rows.*Pass total_size=300",
        ),
        (
            "minibatched covariate only",
            r"Observed variable 'y' reads covariates through pm\.Minibatch \(rows of an array "
            r"of shape \(300, 2\) with batch_size=30\) but not its observed data.*"
            r"pm\.Minibatch\(X, y, batch_size=\.\.\.\)",
        ),
        (
            "potential on a minibatch",
            r"Potential 'penalty' reads data through pm\.Minibatch.*no full-data equivalent",
        ),
        (
            "free variable on a minibatch",
            r"Free variable 'z' reads data through pm\.Minibatch.*local_vars=",
        ),
    ],
    ids=["wrong total_size", "covariate only", "potential", "free variable"],
)
def test_pm_minibatch_without_a_full_data_equivalent_is_refused(kind, message):
    model = _pm_minibatch_model(kind)
    with pytest.raises(ModelNotSupportedError, match=message):
        pmsg.build_problem(model)
    with model:
        with pytest.raises(ModelNotSupportedError, match=message):
            pmsg.SGLD(batch_size=30)


def test_pm_minibatch_without_total_size_warns_and_samples_the_full_data_model():
    model = _pm_minibatch_model("minibatch without total_size")
    with model:
        with pytest.warns(
            UserWarning,
            match=r"Observed variable 'y' reads its rows through pm\.Minibatch \(batch_size=30\) "
            r"without total_size=.*full data \(all N=300 rows\).*weighted its likelihood as 30 "
            r"rows instead of 300.*total_size=300",
        ) as record:
            step = pmsg.SGLD(batch_size=50)
        assert record[0].filename == __file__  # points at the user's line
        idata = pm.sample(step=step, **SAMPLE, random_seed=3)
    assert step.problem.data_size == N
    assert np.isfinite(idata.posterior["b"].values).all()


def test_total_size_other_than_the_number_of_rows_is_refused():
    # Full data with total_size=: PyMC would rescale the likelihood by total_size/N; the
    # samplers sample the full-data posterior, so only total_size = N has a meaning.
    X, y = _data()
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", X @ b, 1.0, observed=y, total_size=10 * N)
    with pytest.raises(
        ModelNotSupportedError,
        match=r"Observed variable 'y' has total_size=3000, but the full data have N=300 rows"
        r".*Pass total_size=300 .*or drop total_size=",
    ):
        pmsg.build_problem(model)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", X @ b, 1.0, observed=y, total_size=N)
    assert pmsg.build_problem(model).data_size == N


# --- 7. unknown keyword arguments and bad settings --------------------------------------


def test_unknown_keyword_is_refused():
    with _regression():
        with pytest.raises(
            TypeError, match=r"unknown keyword argument\(s\) \['stepsize'\].*step_size"
        ):
            pmsg.SGLD(stepsize=0.1)


def test_bad_arguments():
    with _regression():
        with pytest.raises(ValueError, match="preconditioner"):
            pmsg.SGLD(preconditioner="adam")
        with pytest.raises(ValueError, match="momentum"):
            pmsg.ConstantSGD(momentum=1.5)
        with pytest.raises(ValueError, match="step_size must be positive"):
            pmsg.SGLD(step_size=-1.0)
        with pytest.raises(ValueError, match="thin"):
            pmsg.SGLD(thin=0)


def test_iasg_at_a_large_batch_fraction_needs_no_warning():
    """N/B = 2 (N = 300, B = 150): one iterate at ε = 0.5 has the variance of
    (2 − ε)/ε = 3 > N/B posterior units' worth of iterates, so the window is one iterate; the
    injected noise makes up what the minibatch does not give (pymc_sgmcmc.tuning.rates), so a
    small ε no longer makes the draws too narrow and nothing warns."""
    with _regression():
        step = pmsg.IASG(batch_size=150)
        assert step.learning_rate == pytest.approx(0.5) and step.window == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pmsg.IASG(batch_size=150, learning_rate=0.1)
            pmsg.IASG(batch_size=30)


@pytest.mark.parametrize("preconditioner", ["diagonal", "scalar"])
def test_iasg_warns_when_correlations_outlast_the_window(preconditioner):
    """Features correlated at ρ = 0.95 (N = 5000, D = 5, B = 50): a diagonal or scalar
    preconditioner leaves the correlation matrix's smallest eigenvalue 1 − ρ = 0.05, so that
    direction relaxes in about 1/(ε·0.05) = 200 iterations (ε = 0.1; computed from the tuned P
    and the Hessian: 206, estimated 207-242 at six keys) against a window of 90. Measured with
    300 draws of one chain: the draws' sds 0.45-0.53x exact along every coefficient, min bulk
    ESS 17; the former check, from the diagonal of Ĉ only, said nothing. Independent features
    (slowest rate 0.09 against ε = 0.1) do not warn."""

    def model(rho: float) -> pm.Model:
        rng = np.random.default_rng(0)
        d = 5
        cov = rho * np.ones((d, d)) + (1 - rho) * np.eye(d)
        X = rng.normal(size=(5000, d)) @ np.linalg.cholesky(cov).T
        with pm.Model() as m:
            b = pm.Normal("b", 0, 10, shape=d)
            pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=X.sum(1) + rng.normal(size=5000))
        return m

    kwargs = {**SAMPLE, "draws": 1, "tune": 30, "chains": 1}
    with model(0.95):
        step = pmsg.IASG(batch_size=50, preconditioner=preconditioner)
        with pytest.warns(UserWarning, match=r"relaxes in about (1[89]\d|2\d\d) iterations"):
            pm.sample(step=step, random_seed=1, **kwargs)
    with model(0.0), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*relaxes in about")
        pm.sample(
            step=pmsg.IASG(batch_size=50, preconditioner=preconditioner), random_seed=1, **kwargs
        )


# --- 8. non-finite initial points -------------------------------------------------------


@pytest.mark.parametrize(
    ("initvals", "name"),
    [({"b": np.array([np.nan, 0.0])}, "b"), ({"s": -1.0}, "s_log__")],
)
def test_non_finite_initial_point_names_the_variable(initvals, name):
    # PyMC 5.28 does not check the initial point when step= is given; the step does.
    with _regression():
        with pytest.raises(
            ValueError, match=rf"non-finite values for \['{name}'\].*finite `initvals=`"
        ):
            pm.sample(
                step=pmsg.SGLD(batch_size=50),
                initvals=initvals,
                random_seed=1,
                **{**SAMPLE, "draws": 1, "tune": 0, "chains": 1},
            )


# --- 9. a step= covering only some variables (supported) --------------------------------


def test_compound_step_with_a_pymc_sampler():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 2))
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", X @ b, s, observed=X @ [1.0, -1.0] + 0.5 * rng.normal(size=400))
        step = [pmsg.SGLD(vars=[b], batch_size=50), pm.Metropolis([s])]
        idata = pm.sample(step=step, random_seed=1, **{**SAMPLE, "draws": 200, "tune": 200})
    assert "sampler_0__step_size" not in idata.sample_stats  # stats are un-prefixed by ArviZ
    np.testing.assert_allclose(idata.posterior["b"].mean(("chain", "draw")), [1.0, -1.0], atol=0.15)
    np.testing.assert_allclose(float(idata.posterior["s"].mean()), 0.5, atol=0.1)


def test_partial_step_uses_the_conditional_gradient(float64):
    model = _regression()
    b = model["b"]
    problem = pmsg.build_problem(model, vars=[b])
    assert [v.name for v in problem.var_infos] == ["b"]
    assert [v.name for v in problem.fixed_infos] == ["s_log__"]
    point = {"b": np.array([0.3, -0.7]), "s_log__": np.array(np.log(0.8))}
    f = problem.jax_functions()
    full_data = tuple(jnp.asarray(a) for a in problem.data)  # batch = every row: scale N/N
    theta = jnp.asarray(problem.ravel(point))
    fixed = problem.fixed_values(point)
    ours = jax.grad(f["logdensity"])(theta, fixed, full_data)
    pymc_grad = model.compile_dlogp(vars=[b])(point)
    np.testing.assert_allclose(np.asarray(ours), pymc_grad, rtol=1e-8)
    # and it follows the other variable's current value
    moved = {**point, "s_log__": np.array(np.log(2.0))}
    ours_moved = jax.grad(f["logdensity"])(theta, problem.fixed_values(moved), full_data)
    np.testing.assert_allclose(
        np.asarray(ours_moved), model.compile_dlogp(vars=[b])(moved), rtol=1e-8
    )
    assert not np.allclose(ours_moved, ours)


# --- 10. vars= / hyper_vars= naming something that is not a free variable ---------------


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("y", r"'y', which is an observed variable"),
        ("observed RV", r"'y', which is an observed variable"),
        ("b_sum", r"'b_sum', which is a Deterministic.*pass the free variables it depends on"),
        ("X", r"'X', which is a data container \(pm\.Data\)"),
        ("bb", r"'bb', which is not the name of any variable of the model \(did you mean 'b'\?\)"),
        ("other model", r"'b', which is not a variable of this model"),
        (3, r"3, which is of type int, neither a random variable nor a name"),
    ],
)
def test_vars_naming_something_not_free_is_refused(entry, fragment):
    model = _regression()
    if entry == "observed RV":
        entry = model["y"]
    elif entry == "other model":
        with pm.Model():
            entry = pm.Normal("b", 0, 1)
    with pytest.raises(ValueError, match=rf"`vars` contains {fragment}.*from \['b', 's'\]"):
        pmsg.build_problem(model, vars=[entry])
    with model:
        with pytest.raises(ValueError, match=r"`vars` contains .*from \['b', 's'\]"):
            pmsg.SGLD(vars=[entry])


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("y", r"'y', which is an observed variable"),
        ("b_sum", r"'b_sum', which is a Deterministic"),
        ("X", r"'X', which is a data container \(pm\.Data\)"),
        ("bb", r"'bb', which is not the name of any variable of the model \(did you mean 'b'\?\)"),
    ],
)
def test_local_vars_naming_something_not_free_is_refused(entry, fragment):
    """Issue 7: ``local_vars`` that are not free variables name the variable and the fix."""
    model = _regression()
    with model:
        with pytest.raises(
            ValueError, match=rf"`local_vars` contains {fragment}.*from \['b', 's'\]"
        ):
            pmsg.SGLD(local_vars=[entry])


def test_vars_accepts_free_variables_value_variables_and_their_names():
    model = _regression()
    for entry in (model["s"], "s", model.rvs_to_values[model["s"]], "s_log__"):
        problem = pmsg.build_problem(model, vars=[entry])
        assert [v.name for v in problem.var_infos] == ["s_log__"]


@pytest.mark.parametrize(
    ("hyper", "vars", "fragment"),
    [
        ("y", None, r"'y', which is not one of this step's free variables \['b', 's_log__'\]"),
        ("b_sum", None, r"'b_sum', which is not one of this step's free variables"),
        ("sigma", None, r"'sigma', which is not one of this step's free variables"),
        ("s", ["b"], r"'s', which is not one of this step's free variables \['b'\]"),
    ],
)
def test_hyper_vars_naming_a_non_free_variable(hyper, vars, fragment):
    with _regression():
        with pytest.raises(ValueError, match=rf"hyper_vars contains {fragment}"):
            pmsg.ConstantSGD(vars=vars, hyper_vars=[hyper])


# --- 11. minibatch_data naming something that is not data -------------------------------


def test_minibatch_data_naming_something_not_in_the_model():
    with pytest.raises(
        ValueError,
        match=r"minibatch_data names 'Xx', which is not a variable of the model "
        r"\(did you mean 'X'\?\).*from \['X', 'y'\]",
    ):
        pmsg.build_problem(_regression(), minibatch_data=["Xx"])


@pytest.mark.parametrize("entry", ["b", "b_sum"])
def test_minibatch_data_naming_a_random_variable(entry):
    with pytest.raises(
        ValueError,
        match=rf"minibatch_data entry '{entry}' is neither a data container.*from \['X', 'y'\]",
    ):
        pmsg.build_problem(_regression(), minibatch_data=[entry])


# --- non-finite values in minibatched data ---------------------------------------------------


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_design_matrix_is_refused_naming_the_container_and_row(value):
    # NaN or inf in a design matrix used to surface as "IASG diverged in draw 0 ... Reduce
    # step_size": a data problem reported as a sampler problem. (pm.Data refuses NaN itself;
    # a numpy matrix in the graph and inf in pm.Data reached the sampler.)
    X, y = _data()
    X[17, 1] = value
    X[40, 0] = value
    with pm.Model():
        Xd = pm.Data("X", X) if np.isinf(value) else X
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", Xd @ b, 1.0, observed=y)
        with pytest.raises(
            DataShapeError, match=r"\(300x2\) have non-finite.* 2 of 300 rows, the first at row 17"
        ) as info:
            pmsg.IASG()
    assert "drop those rows" in str(info.value)


def test_target_accept_with_an_sg_step_says_it_is_nuts_own():
    with _regression():
        with pytest.raises(ValueError, match=r"target_accept.*the step is IASG.*target_bias"):
            pm.sample(step=pmsg.IASG(), target_accept=0.9, **SAMPLE)


def test_a_step_built_outside_a_model_is_bound_by_the_sampler():
    model = _regression()
    step = pmsg.IASG(batch_size=50)  # no model in context: waits for one
    assert "not bound to a model yet" in repr(step)
    with pytest.raises(AttributeError, match=r"IASG\(\) has no model yet.*model=model"):
        _ = step.problem
    kwargs = dict(draws=20, tune=10, chains=1, progressbar=False, random_seed=3)
    vectorised = pmsg.sample(step=step, model=model, **kwargs)
    # pm.sample binds it too (the same draws as pmsg.sample for a seed, built in the model)
    drawn = pm.sample(step=step, model=model, compute_convergence_checks=False, **kwargs)
    np.testing.assert_array_equal(vectorised.posterior["b"], drawn.posterior["b"])
    assert drawn.posterior.attrs["sgmcmc_samplers"] == "IASG"
    with pytest.raises(TypeError, match=r"IASG\(\) was built with no model.*model=model"):
        step.bind()


# --- messages that name the fix (the workflow issue's item 5) ------------------------------


def test_an_observed_column_of_shape_n_by_1_is_named_with_ravel():
    X, y = _data()
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y[:, None])
        with pytest.raises(
            DataShapeError,
            match=rf"'y' has data of shape \({N}, 1\).*observed=y\.ravel\(\) \(shape \({N},\)\)",
        ):
            pmsg.SGLD()


def test_inf_in_the_observed_y_names_y_in_the_fix_not_x():
    X, y = _data()
    y[5] = np.inf
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
        with pytest.raises(DataShapeError, match=r"'y'.*non-finite") as info:
            pmsg.SGLD()
    message = str(info.value)
    assert "mask = np.isfinite(y)," in message and "y[mask]" in message
    assert "np.isfinite(X)" not in message


def test_missing_values_say_drop_the_rows_first():
    X, y = _data()
    y[3] = np.nan
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        with pytest.warns(ImputationWarning):
            pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
        with pytest.raises(ModelNotSupportedError) as info:
            pmsg.SGLD()
    message = str(info.value)
    assert message.index("drop those rows") < message.index("PyMC split")
    assert "pm.Data predictor" in message


@pytest.mark.parametrize("sampler", ["IASG", "ConstantSGD", "SGFS", "SGLD"])
def test_a_full_preconditioner_above_500_dimensions_is_refused_naming_the_fix(sampler):
    """Above 500 dimensions the tuning measures the curvature and the noise as diagonals: a
    preconditioner="full" there was a diagonal whitening under a dense name (IASG then took
    the shorter window of a dense one and skipped its window warning, whose advice was to
    pass "full"). Every sampler refuses it, before compiling, and "auto" (SGFS's default
    too) takes the diagonal."""
    rng = np.random.default_rng(0)
    groups = np.arange(6000) % 600
    with pm.Model():
        u = pm.Normal("u", 0, 1, shape=600)
        pm.Normal("y", u[groups], 1.0, observed=rng.normal(size=6000))
        with pytest.raises(ValueError, match=r"preconditioner='full'.*preconditioner='diagonal'"):
            getattr(pmsg, sampler)(preconditioner="full")
        if sampler != "SGLD":
            assert getattr(pmsg, sampler)().whitening_kind == "diagonal"
