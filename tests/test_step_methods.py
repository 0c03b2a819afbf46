"""The step methods through pm.sample: InferenceData, stats, seeds, chains, processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import arviz as az
import numpy as np
import pymc as pm
import pytest
from pymc.sampling.mcmc import assign_step_methods
from stack import STEP_METHODS, groups

import pymc_sgmcmc as pmsg

SAMPLE = dict(
    draws=30, tune=10, chains=2, cores=1, progressbar=False, compute_convergence_checks=False
)


@pytest.fixture
def model(small_regression):
    # A fresh model per test: pm.sample_posterior_predictive leaves a model unusable for a
    # later model.logp() in PyMC 5.28 (seen with this model), so tests do not share one.
    return small_regression.model()


def test_registered_but_never_auto_assigned(model):
    assert pmsg.SGLD in STEP_METHODS and pmsg.ConstantSGD in STEP_METHODS
    _, selected = assign_step_methods(model, None, methods=STEP_METHODS)
    assert list(selected) == [pm.NUTS]


@pytest.mark.parametrize("step_cls", [pmsg.SGLD, pmsg.ConstantSGD])
def test_inference_data_groups_and_stats(model, step_cls):
    with model:
        idata = pm.sample(step=step_cls(batch_size=100), random_seed=1, **SAMPLE)
        pm.sample_posterior_predictive(
            idata, progressbar=False, random_seed=2, extend_inferencedata=True
        )
    for group in (
        "posterior",
        "sample_stats",
        "observed_data",
        "constant_data",
        "posterior_predictive",
    ):
        assert group in groups(idata), group
    post = idata.posterior
    assert post["beta"].dims == ("chain", "draw", "feature")
    assert post["beta"].shape == (2, 30, 3)
    # the deterministic is computed for every saved draw
    X = idata.constant_data["X"].values
    np.testing.assert_allclose(post["mu_first"].values, post["beta"].values @ X[0], rtol=1e-10)
    stats = idata.sample_stats
    for name in ("step_size", "data_passes", "minibatch_loss", "grad_norm", "diverging"):
        assert name in stats, name
        assert np.all(np.isfinite(stats[name].values.astype(float)))
    # one draw = one pass over the data by default (thin = N/B = 20 iterations of 100 rows)
    np.testing.assert_allclose(np.diff(stats["data_passes"].values, axis=1), 1.0)
    assert not stats["diverging"].any()
    assert float(stats["step_size"].min()) > 0
    az.summary(idata)
    az.plot_trace(idata, var_names=["beta"])
    # attrs name the sampler, its settings and each chain's tuned values
    for group in ("posterior", "sample_stats"):
        assert idata[group].attrs["sgmcmc_samplers"] == step_cls.__name__
    (settings,) = json.loads(idata.posterior.attrs["sgmcmc_settings"])
    assert settings["sampler"] == step_cls.__name__ and settings["batch_size"] == 100
    assert len(settings["chains"]) == 2 and settings["tuned_in"] == "sampled chains"
    assert "sgmcmc_tuned" not in idata.sample_stats  # moved into the attrs
    if step_cls is pmsg.SGLD:
        tuned = [c["step_size"] for c in settings["chains"]]
        np.testing.assert_allclose(tuned, stats["step_size"].values[:, -1])
    else:
        assert all(np.all(np.isfinite(c["preconditioner_value"])) for c in settings["chains"])
    assert "sampling_time" in idata.posterior.attrs  # PyMC's own attrs are kept


def test_same_seed_same_draws_and_cores_do_not_matter(model):
    with model:
        a = pm.sample(step=pmsg.SGLD(batch_size=100), random_seed=11, **SAMPLE)
        b = pm.sample(step=pmsg.SGLD(batch_size=100), random_seed=11, **SAMPLE)
        c = pm.sample(step=pmsg.SGLD(batch_size=100), random_seed=12, **SAMPLE)
        d = pm.sample(step=pmsg.SGLD(batch_size=100), random_seed=11, **{**SAMPLE, "cores": 2})
    np.testing.assert_array_equal(a.posterior["beta"].values, b.posterior["beta"].values)
    np.testing.assert_array_equal(a.posterior["beta"].values, d.posterior["beta"].values)
    assert not np.allclose(a.posterior["beta"].values, c.posterior["beta"].values)
    # chains differ from each other (each chain starts its own key and state)
    assert not np.allclose(a.posterior["beta"].values[0], a.posterior["beta"].values[1])


def test_state_persists_across_draws_and_thin_sets_iterations(model):
    with model:
        idata = pm.sample(
            step=pmsg.ConstantSGD(batch_size=50, thin=3, momentum=0.5), random_seed=3, **SAMPLE
        )
    passes = idata.sample_stats["data_passes"].values
    # tuning draws are burn-in: the first kept draw has 10 draws × 3 iterations behind it
    np.testing.assert_allclose(passes[:, 0], 11 * 3 * 50 / 2000)
    np.testing.assert_allclose(np.diff(passes, axis=1), 3 * 50 / 2000)


def test_the_full_batch_chain_saves_a_draw_per_cube_root_of_the_dimension_iterations():
    """On the full batch every sampler runs MALA, whose step scales as D^(-1/3): 4 iterations
    a draw up to 64 dimensions, round(D^(1/3)) above. At D = 2 001 (2 000 random intercepts
    of 2 rows) 4 left θ with 86 effective draws of 800; 13 gives 336 (benchmarks/RESULTS.md).
    A user's thin is kept."""
    from posteriors.hierarchical import build_random_intercepts

    from pymc_sgmcmc.adapter.step import mala_thin

    assert [mala_thin(d) for d in (1, 64, 201, 2001)] == [4, 4, 6, 13]
    with build_random_intercepts(200, 2):  # N = 400 rows: the full batch; D = 201
        assert pmsg.SGLD().thin == 6
        assert pmsg.SGLD(thin=2).thin == 2
        assert pmsg.SGLD(batch_size=100).thin == 4  # N/B iterations: one pass


def test_initvals_are_the_starting_point(model):
    start = np.array([5.0, -5.0, 5.0])
    with model:
        idata = pm.sample(
            step=pmsg.SGLD(batch_size=100, step_size=1e-12, thin=1),
            initvals={"beta": start},
            random_seed=1,
            **{**SAMPLE, "tune": 0, "draws": 2},
        )
    np.testing.assert_allclose(
        idata.posterior["beta"].values[:, 0], np.tile(start, (2, 1)), atol=1e-4
    )


def test_cores_2_runs_the_chains_in_this_process(model, monkeypatch):
    # No worker processes for our steps (pymc_sgmcmc.adapter.chains_in_process): PyMC's _mp_sample is
    # replaced by its sequential loop, so the workers' start method never matters.
    import pymc.sampling.parallel as parallel

    def no_workers(*args, **kwargs):
        raise AssertionError("PyMC's ParallelSampler was started for an SG step")

    monkeypatch.setattr(parallel, "ParallelSampler", no_workers)
    with model:
        idata = pm.sample(
            step=pmsg.SGLD(batch_size=100), random_seed=5, **{**SAMPLE, "cores": 2, "chains": 2}
        )
    assert idata.posterior["beta"].shape == (2, 30, 3)
    (settings,) = json.loads(idata.posterior.attrs["sgmcmc_settings"])
    assert settings["sampler"] == "SGLD" and len(settings["chains"]) == 2
    np.testing.assert_allclose(
        [c["step_size"] for c in settings["chains"]],
        idata.sample_stats["step_size"].values[:, -1],
    )
    assert "sgmcmc_tuned" not in idata.sample_stats


def test_an_unguarded_script_samples_with_cores_2_and_nuts_is_left_alone():
    # A plain script without `if __name__ == "__main__":` (how users write them): SG fits
    # with cores=1 and cores=2 and a compound SG + Metropolis step with cores=2 after JAX
    # started, then NUTS with cores=2. With forkserver workers (until
    # 0.1) the script was re-executed in every worker and failed in its bootstrapping phase;
    # PyMC's own choice of start method for NUTS must be untouched.
    script = textwrap.dedent(
        """
        import multiprocessing
        import numpy as np, pymc as pm, pymc_sgmcmc as pmsg
        import pymc.sampling.mcmc as mcmc
        print("START", flush=True)
        rng = np.random.default_rng(0)
        X = rng.normal(size=(500, 2)); y = X @ [1.0, 2.0] + rng.normal(size=500)
        with pm.Model():
            b = pm.Normal("b", 0, 1, shape=2)
            s = pm.HalfNormal("s", 2.0)
            pm.Normal("y", X @ b, s, observed=y)
            kw = dict(draws=50, tune=50, chains=2, random_seed=1, progressbar=False,
                      compute_convergence_checks=False)
            one = pm.sample(step=pmsg.IASG(batch_size=50), cores=1, **kw)
            two = pm.sample(step=pmsg.IASG(batch_size=50), cores=2, **kw)
            assert np.array_equal(one.posterior["b"].values, two.posterior["b"].values)
            # a compound step (the discrete-variable recipe) runs in this process too
            mixed = pm.sample(step=[pmsg.SGLD(vars=[b], batch_size=50), pm.Metropolis([s])],
                              cores=2, **kw)
            assert mixed.posterior["s"].shape == (2, 50)
            assert not hasattr(mcmc._initialize_multiprocessing_context, "__wrapped__")
            nuts = pm.sample(cores=2, **kw)
        assert nuts.posterior["b"].shape == (2, 50, 2)
        print("OK", flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("START") == 1  # never re-executed by a worker
    assert "OK" in out.stdout
    assert "bootstrapping phase" not in out.stderr


def test_divergence_is_reported_not_returned_as_nan(model):
    with model:
        with pytest.raises(pmsg.DivergenceError, match="Reduce step_size"):
            pm.sample(
                step=pmsg.ConstantSGD(step_size=10.0, batch_size=100), random_seed=1, **SAMPLE
            )


def test_schedule_step_size(model):
    schedule = pmsg.schedules.polynomial_decay(a=1e-4, b=10.0, gamma=0.55)
    with model:
        idata = pm.sample(
            step=pmsg.SGLD(step_size=schedule, batch_size=100), random_seed=1, **SAMPLE
        )
    eps = idata.sample_stats["step_size"].values[0]
    assert np.all(np.diff(eps) < 0)
    it = idata.sample_stats["data_passes"].values[0] * 2000 / 100
    np.testing.assert_allclose(eps, 1e-4 * (10.0 + it - 1) ** -0.55, rtol=1e-10)


def test_a_pymc_whose_wrapped_internals_changed_is_refused_naming_them():
    import types

    import pymc.sampling.mcmc as mcmc
    import pymc.sampling.parallel as parallel

    from pymc_sgmcmc.adapter.hooks import check_pymc_internals

    check_pymc_internals()  # the installed PyMC passes
    changed = types.SimpleNamespace(**vars(mcmc))
    changed._sample = lambda chain, draws, step, trace, progress_manager: None  # no callback

    class _Process:
        def __init__(self, name, msg_pipe, chain):
            pass

    moved = types.SimpleNamespace(**{**vars(parallel), "_Process": _Process})
    with pytest.raises(ImportError) as info:
        check_pymc_internals({"pymc.sampling.mcmc": changed, "pymc.sampling.parallel": moved})
    message = str(info.value)
    assert "pymc.sampling.mcmc._sample has no parameter(s) ['callback']" in message
    assert "_Process's argument 10 is not 'chain'" in message
    assert "PyMC 5.28 and 6.x" in message
