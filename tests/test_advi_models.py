"""Models written for minibatch ADVI (``pm.Minibatch`` + ``total_size``) are sampled as the same
model written with the full arrays (issue 25, item 4).

The SG samplers draw their own minibatches from all N rows and rescale by N/B, so a model that
reads its rows through ``pm.Minibatch(X, y, batch_size=50)`` with ``total_size=len(y)`` has one
posterior, the full-data one. The strongest check is also the cheapest: with the same seed, the
draws equal (bit for bit) those of the model written with the full arrays. Refusals
(``total_size`` other than N, ...) and the warning without ``total_size`` are in
``test_bad_input.py`` (section 6).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pymc as pm
import pytest

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.adapter.step import default_batch_size

N = 2000
COEFS = np.array([1.0, -2.0, 0.5])
SAMPLE = dict(chains=2, cores=1, progressbar=False, compute_convergence_checks=False)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, COEFS.size))
    return X, X @ COEFS + rng.normal(size=N)


def _quickstart_advi_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    """As PyMC's variational API quickstart writes a minibatch ADVI model: the minibatch of the
    NumPy arrays taken outside the model, ``total_size=len(y)`` on the likelihood."""
    X_mb, y_mb = pm.Minibatch(X, y, batch_size=50)
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=COEFS.size)
        s = pm.HalfNormal("s", 1)
        pm.Normal("obs", X_mb @ b, s, observed=y_mb, total_size=len(y))
    return model


def _full_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=COEFS.size)
        s = pm.HalfNormal("s", 1)
        pm.Normal("obs", X @ b, s, observed=y)
    return model


def _data_advi_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    """pm.Data containers sliced by pm.Minibatch inside the model (as in PyMC's GLM minibatch
    ADVI examples), with a Deterministic of the parameters."""
    with pm.Model() as model:
        Xd = pm.Data("X", X)
        yd = pm.Data("y", y)
        X_mb, y_mb = pm.Minibatch(Xd, yd, batch_size=128)
        b = pm.Normal("b", 0, 1, shape=COEFS.size)
        s = pm.Exponential("s", 1)
        pm.Deterministic("b_norm", pm.math.sqrt((b**2).sum()))
        pm.StudentT("obs", nu=5, mu=X_mb @ b, sigma=s, observed=y_mb, total_size=N)
    return model


def _data_full_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    with pm.Model() as model:
        Xd = pm.Data("X", X)
        yd = pm.Data("y", y)
        b = pm.Normal("b", 0, 1, shape=COEFS.size)
        s = pm.Exponential("s", 1)
        pm.Deterministic("b_norm", pm.math.sqrt((b**2).sum()))
        pm.StudentT("obs", nu=5, mu=Xd @ b, sigma=s, observed=yd)
    return model


def _sample(model: pm.Model, step_cls: type, **kwargs) -> tuple:
    with model:
        step = step_cls(**kwargs)
        idata = pm.sample(step=step, **SAMPLE, **SAMPLE_SIZES[step_cls])
    return step, idata


SAMPLE_SIZES = {
    pmsg.IASG: dict(draws=100, tune=50, random_seed=11),
    pmsg.SGLD: dict(draws=30, tune=20, random_seed=12),
}


def test_quickstart_advi_model_gives_the_full_data_models_draws():
    """pm.sample(step=pmsg.IASG()) inside the ADVI model: same draws as the full-data model
    (default batch size: N = 2000 rows is one full batch, Metropolis-adjusted)."""
    X, y = _data()
    advi_step, advi = _sample(_quickstart_advi_model(X, y), pmsg.IASG)
    full_step, full = _sample(_full_model(X, y), pmsg.IASG)
    # The user's pm.Minibatch batch_size (50) is not the sampler's: its default is used.
    assert advi_step.batch_size == full_step.batch_size == default_batch_size(N)
    assert advi_step.problem.data_size == N
    assert [v.name for v in advi_step.vars] == ["b", "s_log__"]
    assert set(advi.posterior.data_vars) == {"b", "s"}
    for name in ("b", "s"):
        np.testing.assert_array_equal(advi.posterior[name].values, full.posterior[name].values)
    # And the draws are the posterior's: the least-squares fit is within 4 posterior sds.
    b = advi.posterior["b"].values.reshape(-1, COEFS.size)
    ls = np.linalg.lstsq(X, y, rcond=None)[0]
    assert np.all(np.abs(b.mean(0) - ls) < 4 * b.std(0))


def test_data_minibatch_inside_the_model_gives_the_full_data_models_draws():
    """pm.Data + pm.Minibatch inside the model (StudentT likelihood, a Deterministic), with
    the sampler's own minibatches (batch_size=100, not the model's 128): same draws."""
    X, y = _data(1)
    advi_step, advi = _sample(_data_advi_model(X, y), pmsg.SGLD, batch_size=100)
    full_step, full = _sample(_data_full_model(X, y), pmsg.SGLD, batch_size=100)
    assert advi_step.batch_size == 100
    assert advi_step.problem.data_names == full_step.problem.data_names
    for name in ("b", "s", "b_norm"):
        np.testing.assert_array_equal(advi.posterior[name].values, full.posterior[name].values)
    assert advi.observed_data["obs"].shape == (N,)


def _bernoulli_models(total_size):
    rng = np.random.default_rng(2)
    X = rng.normal(size=(N, 2))
    y = (rng.random(N) < 1 / (1 + np.exp(-X @ [1.0, -1.0]))).astype("int64")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pm.Model() as advi:
            Xd, yd = pm.Data("X", X), pm.Data("y", y)
            X_mb, y_mb = pm.Minibatch(Xd, yd, batch_size=64)
            b = pm.Normal("b", 0, 1, shape=2)
            pm.Bernoulli("obs", logit_p=X_mb @ b, observed=y_mb, total_size=total_size)
    with pm.Model() as full:
        Xd, yd = pm.Data("X", X), pm.Data("y", y)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Bernoulli("obs", logit_p=Xd @ b, observed=yd)
    return advi, full


def _mvnormal_models(total_size):
    rng = np.random.default_rng(3)
    Y = rng.normal(size=(N, 2)) + [1.0, -1.0]
    with pm.Model() as advi:
        Y_mb = pm.Minibatch(Y, batch_size=40)
        mu = pm.Normal("mu", 0, 5, shape=2)
        pm.MvNormal("obs", mu, np.eye(2), observed=Y_mb, total_size=total_size)
    with pm.Model() as full:
        mu = pm.Normal("mu", 0, 5, shape=2)
        pm.MvNormal("obs", mu, np.eye(2), observed=Y)
    return advi, full


@pytest.mark.parametrize(
    ("models", "total_size"),
    [
        (_bernoulli_models, N),  # integer pm.Data observed, cast to the likelihood's dtype
        (_mvnormal_models, N),  # rows of 2 columns: total_size=N reads as [N, None]
        (_mvnormal_models, [N, Ellipsis]),
        (_mvnormal_models, [N, 2]),  # a non-row axis given its own length: no rescaling
    ],
    ids=["bernoulli-int-data", "mvnormal-int", "mvnormal-ellipsis", "mvnormal-both-axes"],
)
def test_minibatch_density_equals_the_full_data_models(models, total_size, float64):
    """The minibatch estimate of the log-density and its gradient on the same rows, and the
    per-row log-likelihoods, equal those of the full-data model."""
    advi, full = models(total_size)
    problems = [pmsg.build_problem(m) for m in (advi, full)]
    assert problems[0].data_names == problems[1].data_names
    assert problems[0].model is advi
    rows = np.arange(0, N, 7)[:100]
    batch = tuple(jnp.asarray(a[rows]) for a in problems[0].data)
    position = jnp.asarray(np.linspace(-0.5, 0.7, problems[0].dim))
    out = [p.jax_functions()["logdensity_and_grad"](position, (), batch) for p in problems]
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


def test_a_pymc_step_beside_ours_on_a_minibatch_model_is_refused():
    # Our step reads the full-data model; PyMC's Metropolis would accept or reject on the
    # log-density of a fresh random minibatch at every evaluation.
    model = _quickstart_advi_model(*_data())
    with model:
        step = [pmsg.SGLD(vars=[model["b"]]), pm.Metropolis([model["s"]])]
        with pytest.raises(
            pmsg.ModelNotSupportedError,
            match=r"pm\.Minibatch.*Metropolis.*random minibatch.*drop pm\.Minibatch and total_size",
        ):
            pm.sample(step=step, draws=5, tune=5, **SAMPLE)
