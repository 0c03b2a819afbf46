"""The step methods through pm.sample: InferenceData, stats, seeds, chains, processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import arviz as az
import numpy as np
import pymc as pm
import pytest
from pymc.sampling.mcmc import assign_step_methods

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
    assert pmsg.SGLD in pm.STEP_METHODS and pmsg.ConstantSGD in pm.STEP_METHODS
    _, selected = assign_step_methods(model, None, methods=pm.STEP_METHODS)
    assert list(selected) == [pm.NUTS]


@pytest.mark.parametrize("step_cls", [pmsg.SGLD, pmsg.ConstantSGD])
def test_inference_data_groups_and_stats(model, step_cls):
    with model:
        idata = pm.sample(step=step_cls(batch_size=100), random_seed=1, **SAMPLE)
        idata.extend(pm.sample_posterior_predictive(idata, progressbar=False, random_seed=2))
    for group in (
        "posterior",
        "sample_stats",
        "observed_data",
        "constant_data",
        "posterior_predictive",
    ):
        assert group in idata.groups(), group
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


def test_multiprocess_after_jax_started_in_this_process(model):
    # JAX has run in this pytest process; PyMC would fork and the workers would deadlock.
    # pymc_sgmcmc switches pm.sample to forkserver in that case.
    with model:
        idata = pm.sample(
            step=pmsg.SGLD(batch_size=100), random_seed=5, **{**SAMPLE, "cores": 2, "chains": 2}
        )
    assert idata.posterior["beta"].shape == (2, 30, 3)
    # tuned inside the worker processes: the values come back through the stats
    (settings,) = json.loads(idata.posterior.attrs["sgmcmc_settings"])
    assert settings["sampler"] == "SGLD" and len(settings["chains"]) == 2
    np.testing.assert_allclose(
        [c["step_size"] for c in settings["chains"]],
        idata.sample_stats["step_size"].values[:, -1],
    )
    assert "sgmcmc_tuned" not in idata.sample_stats


def test_multiprocess_in_a_fresh_process_uses_fork_and_lazy_jax():
    script = textwrap.dedent(
        """
        import numpy as np, pymc as pm, pymc_sgmcmc as pmsg
        from pymc_sgmcmc._multiprocessing import jax_backend_started
        rng = np.random.default_rng(0)
        X = rng.normal(size=(500, 2)); y = X @ [1.0, 2.0] + rng.normal(size=500)
        with pm.Model():
            b = pm.Normal("b", 0, 1, shape=2)
            pm.Normal("y", X @ b, 1.0, observed=y)
            step = pmsg.SGLD(batch_size=50)
            assert not jax_backend_started()
            idata = pm.sample(draws=20, tune=5, chains=2, cores=2, step=step, random_seed=1,
                              progressbar=False, compute_convergence_checks=False)
        assert idata.posterior["b"].shape == (2, 20, 2)
        print("OK", float(idata.posterior["b"].mean()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout


@pytest.mark.parametrize("start_jax_first", [False, True], ids=["fork", "forkserver"])
def test_multiprocess_workers_share_one_compilation_cache(start_jax_first):
    # Each worker process compiles the step again; they share a temporary JAX compilation
    # cache named by the parent (by copy under fork, in the pickled step under forkserver).
    # The second call's workers load every executable (no entry is written again) and give
    # the same draws; the parent's JAX configuration is untouched, the directory is removed
    # when the parent exits.
    script = textwrap.dedent(
        f"""
        import glob, json, os
        import numpy as np, pymc as pm, pymc_sgmcmc as pmsg, jax
        from pymc_sgmcmc._multiprocessing import worker_cache_dir
        if {start_jax_first}:
            jax.numpy.zeros(1).block_until_ready()
        rng = np.random.default_rng(0)
        X = rng.normal(size=(500, 2)); y = X @ [1.0, 2.0] + rng.normal(size=500)

        def entries():
            paths = glob.glob(os.path.join(worker_cache_dir(), "*-cache"))
            return {{os.path.basename(p): os.stat(p).st_mtime_ns for p in paths}}

        with pm.Model():
            b = pm.Normal("b", 0, 1, shape=2)
            pm.Normal("y", X @ b, 1.0, observed=y)
            step = pmsg.IASG(batch_size=50)
            kw = dict(draws=20, tune=5, chains=2, cores=2, step=step, random_seed=1,
                      progressbar=False, compute_convergence_checks=False)
            first = pm.sample(**kw).posterior["b"].values
            written = entries()
            second = pm.sample(**kw).posterior["b"].values
        print("RESULT" + json.dumps(dict(
            cache=worker_cache_dir(), files=sorted(written), rewritten=entries() != written,
            same=bool(np.array_equal(first, second)),
            parent_config=jax.config.jax_compilation_cache_dir)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line[len("RESULT") :])
    assert any(f.startswith("jit_draw-") for f in result["files"]), result["files"]
    assert not result["rewritten"]
    assert result["same"]
    assert result["parent_config"] is None
    assert not os.path.exists(result["cache"])
    assert "compilation cache" not in out.stderr  # no failed reads or writes of entries


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
