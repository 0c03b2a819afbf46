"""pmsg.sample: the vectorised driver against pm.sample(step=...) — groups, stats, attrs,
seeds, divergence, progress bar and bad input. The statistical tests run through pmsg.sample
only (``conftest.STATISTICAL_PATH``); that what they check holds for pm.sample too rests on
:func:`test_same_seed_same_draws_as_pm_sample` — every sampler, draw for draw."""

from __future__ import annotations

import json
import pickle

import cloudpickle
import jax
import numpy as np
import pymc as pm
import pytest
from stack import groups
from test_faults import B, FaultySGLD, N, regression_model

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.errors import DivergenceError, ModelNotSupportedError

QUIET = dict(progressbar=False, compute_convergence_checks=False)
SMALL = dict(draws=12, tune=8, chains=2, random_seed=5, **QUIET)

SAMPLERS = {
    "SGLD": lambda: pmsg.SGLD(batch_size=B),
    "IASG": lambda: pmsg.IASG(batch_size=B),
    "ConstantSGD": lambda: pmsg.ConstantSGD(batch_size=B, momentum=0.5),
    "SGFS": lambda: pmsg.SGFS(batch_size=B, h_max=1e-3),
    "SAGALD": lambda: pmsg.SAGALD(batch_size=B),
    "SVRGLD": lambda: pmsg.SVRGLD(batch_size=B),
    "SGHMC": lambda: pmsg.SGHMC(batch_size=B),
    # little gradient noise: a friction below 1, re-chosen at every retune (a chain's copy of
    # the step once left it at 1 in pmsg.sample while its step was tuned for 0.45)
    "SGHMC-light": lambda: pmsg.SGHMC(batch_size=N // 2),
    # the statistical tests run through pmsg.sample only (conftest.STATISTICAL_PATH): what
    # they check of a setting holds for pm.sample because of this test
    "IASG-temperature": lambda: pmsg.IASG(batch_size=B, temperature=2.0),
}


@pytest.fixture
def model(small_regression):
    return small_regression.model()


def _both(model, make_step, **kwargs):
    """The same run through pm.sample (one process) and pmsg.sample, with one step object
    (nothing of a run carries over into the next but the compiled functions)."""
    with model:
        step = make_step()
        a = pm.sample(step=step, cores=1, **kwargs)
        b = pmsg.sample(step=step, **kwargs)
    return a, b


def test_groups_variables_dims_and_attrs_are_pm_samples(model):
    start = {"beta": np.array([0.5, -0.5, 0.25])}
    kwargs = {**SMALL, "discard_tuned_samples": False, "initvals": start}
    a, b = _both(model, lambda: pmsg.ConstantSGD(batch_size=100), **kwargs)
    assert groups(a) == groups(b)
    assert "warmup_posterior" in groups(b) and "warmup_sample_stats" in groups(b)
    for group in groups(a):
        assert set(a[group].data_vars) == set(b[group].data_vars), group
        assert dict(a[group].sizes) == dict(b[group].sizes), group
        for name, var in a[group].data_vars.items():
            assert var.dims == b[group][name].dims, (group, name)
            assert var.dtype == b[group][name].dtype, (group, name)
        for coord in a[group].coords:
            np.testing.assert_array_equal(a[group][coord].values, b[group][coord].values)
        assert set(a[group].attrs) == set(b[group].attrs), group
    for name in ("step_size", "data_passes", "minibatch_loss", "grad_norm", "diverging"):
        assert name in b.sample_stats, name
    assert b.posterior["beta"].dims == ("chain", "draw", "feature")
    assert b.posterior.attrs["tuning_steps"] == 8
    assert b.posterior.attrs["sgmcmc_samplers"] == "ConstantSGD"
    (sa,), (sb,) = (json.loads(x.posterior.attrs["sgmcmc_settings"]) for x in (a, b))
    assert sa == sb  # every chain's tuned preconditioner, the same numbers
    assert len(sb["chains"]) == 2 and sb["tuned_in"] == "sampled chains"
    assert "sgmcmc_tuned" not in b.sample_stats
    # the deterministic, on every saved draw
    X = b.constant_data["X"].values
    np.testing.assert_allclose(b.posterior["mu_first"], b.posterior["beta"].values @ X[0])
    # the same start (initvals) and the same tuning draws
    np.testing.assert_allclose(b.warmup_posterior["beta"], a.warmup_posterior["beta"], rtol=1e-9)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_same_seed_same_draws_as_pm_sample(model, name):
    """Same initial points, keys and minibatches. The vmapped program may round differently in
    the last bits (it is a different XLA program), so the draws are compared to 1e-9
    relative; measured here (float64, XLA:CPU) they are bitwise equal."""
    a, b = _both(model, SAMPLERS[name], **SMALL)
    np.testing.assert_allclose(b.posterior["beta"], a.posterior["beta"], rtol=1e-9, atol=0)
    for stat in ("step_size", "data_passes", "minibatch_loss", "grad_norm"):
        np.testing.assert_allclose(b.sample_stats[stat], a.sample_stats[stat], rtol=1e-9)
    np.testing.assert_array_equal(b.sample_stats["diverging"], a.sample_stats["diverging"])


@pytest.mark.parametrize("family", ["markov", "meanfield"])
def test_local_variables_draw_what_pm_sample_draws(family):
    # The statistical tests of local variables run through pm.sample, the others through
    # pmsg.sample: the two draw the same here too (a frozen markov q, refit during tuning,
    # and a meanfield q that keeps adapting).
    rng = np.random.default_rng(2)
    g = rng.integers(0, 6, 600)
    y = rng.normal(0.3 * g, 1.0)
    with pm.Model() as hier:
        mu = pm.Normal("mu", 0.0, 1.0)
        u = pm.Normal("u", mu, 0.5, shape=6)
        pm.Normal("y", u[pm.Data("g", g)], 1.0, observed=y)
    make = lambda: pmsg.SGLD(local_vars=["u"], local_family=family, batch_size=100)  # noqa: E731
    a, b = _both(hier, make, **SMALL)
    for name in ("mu", "u"):
        np.testing.assert_allclose(b.posterior[name], a.posterior[name], rtol=1e-9, atol=0)


def test_a_step_sampled_again_draws_what_a_fresh_one_draws(model):
    # pmsg.sample leaves the step holding its last chain's tuner; a second run must tune this
    # step, not that chain's copy (SGHMC's friction once stayed at 1 in the second run while
    # its step was tuned for 0.3: sds 0.5-0.6x).
    with model:
        step = pmsg.SGHMC(batch_size=N // 2)
        first = pmsg.sample(step=step, **SMALL)
        again = pmsg.sample(step=step, **SMALL)
        then = pm.sample(step=step, cores=1, **SMALL)
    np.testing.assert_array_equal(again.posterior["beta"], first.posterior["beta"])
    np.testing.assert_allclose(then.posterior["beta"], first.posterior["beta"], rtol=1e-9)


def test_seeds_reproduce_and_differ_and_cores_do_not_matter(model, tmp_path):
    with model:
        step = pmsg.SGLD(batch_size=100)  # one step object, reused: nothing carries over
        writer = pmsg.DrawWriter(tmp_path / "draws")
        a = pmsg.sample(step=step, cores=1, callback=writer, **SMALL)
        # left as pm.sample(cores=1) leaves it: the last chain's tuned step
        (settings,) = json.loads(a.posterior.attrs["sgmcmc_settings"])
        assert step.step_size_value == settings["chains"][-1]["step_size"]
        assert step.chain_settings == []  # moved into the attrs
        b = pmsg.sample(step=step, cores=1, **SMALL)
        c = pmsg.sample(step=step, cores=1, **{**SMALL, "random_seed": 6})
        d = pmsg.sample(step=step, cores=2, **SMALL)  # two groups of one chain, in threads
    np.testing.assert_array_equal(a.posterior["beta"], b.posterior["beta"])
    np.testing.assert_array_equal(a.sample_stats["step_size"], b.sample_stats["step_size"])
    np.testing.assert_allclose(d.posterior["beta"], a.posterior["beta"], rtol=1e-9, atol=0)
    assert not np.any(a.posterior["beta"].values == c.posterior["beta"].values)
    assert not np.allclose(a.posterior["beta"][0], a.posterior["beta"][1])
    # the callback saw every draw (pmsg.DrawWriter: draws written as they come)
    written = pmsg.read_draws(tmp_path / "draws")
    np.testing.assert_array_equal(written.posterior["beta"], a.posterior["beta"])
    # a chain whose file is empty (its process killed before the first write) is left out,
    # named, and the complete chain is returned
    (tmp_path / "draws" / "chain-0.bin").write_bytes(b"")
    with pytest.warns(UserWarning, match=r"chain-0\.bin holds no complete draws.*chains 1"):
        kept = pmsg.read_draws(tmp_path / "draws")
    assert list(kept.posterior.chain.values) == [1]
    np.testing.assert_array_equal(kept.posterior["beta"][0], a.posterior["beta"][1])


# --- divergence ----------------------------------------------------------------------------


def test_divergence_after_tuning_is_pm_samples():
    tune, fault_draw = 20, 35
    errors = []
    for driver in (pm.sample, pmsg.sample):
        with regression_model():
            step = FaultySGLD(batch_size=B, fault_at=fault_draw * (N // B) + 3)
            extra = {"cores": 1} if driver is pm.sample else {}
            with pytest.raises(DivergenceError) as info:
                driver(step=step, draws=100, tune=tune, random_seed=1, chains=2, **extra, **QUIET)
        errors.append(info.value)
    ours, theirs = errors[1], errors[0]
    assert str(ours) == str(theirs)
    assert f"diverged in draw {fault_draw} (after tuning)" in str(ours)
    assert ours.chains == [(0, fault_draw), (1, fault_draw)]
    beta = ours.idata.posterior["beta"].values
    assert beta.shape == (2, fault_draw - tune + 1, 2) and np.all(np.isfinite(beta))
    diverging = ours.idata.sample_stats["diverging"].values
    assert diverging[:, -1].all() and not diverging[:, :-1].any()
    np.testing.assert_array_equal(beta[:, -1], beta[:, -2])  # the flagged draw repeats
    np.testing.assert_array_equal(beta, theirs.idata.posterior["beta"].values)


def test_a_state_booked_from_the_compiled_loop_pickles():
    # A chain stopped mid-chunk keeps such a state, and the step's last chain is the user's
    # step afterwards: pickling it must work (its __getattr__ once recursed on unpickling).
    from pymc_sgmcmc._chain_run import _DrawnState
    from pymc_sgmcmc.kernels.sgld import SGLDState

    final = SGLDState(np.zeros(2), np.zeros(2), np.int32(7))
    drawn = _DrawnState(final, position=np.ones(2), iteration=np.int32(5))
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        restored = loads(dumps(drawn))
        np.testing.assert_array_equal(restored.position, np.ones(2))
        assert int(restored.iteration) == 5
        np.testing.assert_array_equal(restored.square_avg, final.square_avg)  # from final


def test_small_state_leaves_are_stacked_and_split_on_the_host():
    # Eager JAX ops cost ~0.1 ms each, so small leaves go through NumPy; a leaf over 1 MB per
    # chain (SAGA-LD's table at large N) stays on the device both ways.
    import jax.numpy as jnp

    from pymc_sgmcmc._chain_engine import _HOST_LEAF_BYTES, _Engine

    engine = _Engine.__new__(_Engine)
    engine.jax, engine.jnp = jax, jnp
    big_rows = _HOST_LEAF_BYTES // (4 * 4) + 1  # just over 1 MB of float32 per chain
    trees = [
        {
            "small": jnp.full(3, c, jnp.float32),
            "medium": jnp.full((big_rows // 2, 4), c, jnp.float32),  # 0.5 MB, 1.5 MB stacked
            "big": jnp.full((big_rows, 4), c, jnp.float32),
        }
        for c in range(3)
    ]
    stacked = engine.stack(trees)
    assert isinstance(stacked["small"], np.ndarray) and isinstance(stacked["big"], jax.Array)
    assert isinstance(stacked["medium"], np.ndarray)
    for c in range(3):
        one = engine.take(stacked, c)
        assert isinstance(one["small"], np.ndarray) and isinstance(one["big"], jax.Array)
        assert isinstance(one["medium"], np.ndarray)
        np.testing.assert_array_equal(one["medium"], np.full((big_rows // 2, 4), float(c)))
        np.testing.assert_array_equal(one["small"], np.full(3, float(c)))
        np.testing.assert_array_equal(one["big"], np.full((big_rows, 4), float(c)))


def test_a_too_large_fixed_step_is_flagged_and_never_nan():
    with regression_model():
        with pytest.raises(DivergenceError) as info:
            pmsg.sample(
                step=pmsg.ConstantSGD(step_size=10.0, batch_size=B),
                draws=10,
                tune=0,
                chains=2,
                random_seed=1,
                **QUIET,
            )
    assert "diverged in draw 0 (after tuning)" in str(info.value)
    idata = info.value.idata
    assert idata.posterior["beta"].shape == (2, 1, 2)  # the flagged first draw of each chain
    assert np.all(np.isfinite(idata.posterior["beta"].values))
    assert idata.sample_stats["diverging"].values.all()


def _outcome(driver, make_step, **kwargs):
    with regression_model():
        try:
            return driver(step=make_step(), **kwargs), None
        except DivergenceError as error:
            return error.idata, str(error)


def test_diverged_tuning_draws_are_retried_per_chain():
    # As in test_faults: the fixed rate 0.05 is unstable (0.05 · 400 = 20 > 2); each chain's
    # tuning halves it until its draws are finite, and keeps that factor. (Chain 1 of this
    # seed still explodes slowly after tuning: both drivers must say so alike.)
    kwargs = dict(draws=20, tune=10, chains=2, random_seed=4, **QUIET)
    (a, error_a), (b, error_b) = (
        _outcome(driver, lambda: pmsg.ConstantSGD(step_size=0.05, batch_size=B), **kwargs)
        for driver in (lambda **kw: pm.sample(cores=1, **kw), pmsg.sample)
    )
    assert error_a == error_b
    np.testing.assert_array_equal(b.posterior["beta"], a.posterior["beta"])
    (sa,), (sb,) = (json.loads(x.posterior.attrs["sgmcmc_settings"]) for x in (a, b))
    factors = [c["divergence_step_factor"] for c in sb["chains"]]
    assert factors == [c["divergence_step_factor"] for c in sa["chains"]]
    assert all(1 / 64 <= f <= 1 / 16 for f in factors)
    with regression_model():
        step = FaultySGLD(batch_size=B, fault_at=5 * (N // B))
        with pytest.raises(DivergenceError, match=r"draw 5 \(tuning\).*again after 6 retries"):
            pmsg.sample(step=step, draws=10, tune=20, chains=2, random_seed=3, **QUIET)


class _RaisesAtTuningDraw(pmsg.SGLD):
    """SGLD whose host part raises at a tuning draw, naming its chain's seed: the chains
    reach it in the same draw, so the error that comes out says which chain was met first."""

    def _after_draw(self, stats):
        super()._after_draw(stats)
        if self._draw_index == 3:
            raise RuntimeError(f"chain seeded {self._host_seed}")


def test_the_first_chains_error_is_raised_as_pm_sample_meets_it(model):
    # pmsg.sample advances every chain's draw side by side; when several raise, the error is
    # the lowest chain's — the one pm.sample(cores=1), which runs chain 0 first, meets.
    raised = []
    for driver in (lambda **kw: pm.sample(cores=1, **kw), pmsg.sample):
        with model, pytest.raises(RuntimeError, match="chain seeded") as info:
            driver(
                step=_RaisesAtTuningDraw(batch_size=B),
                draws=5,
                tune=5,
                chains=3,
                random_seed=7,
                **QUIET,
            )
        raised.append(str(info.value))
    assert raised[0] == raised[1]


def test_a_step_whose_parameters_move_after_tuning_is_refused():
    class Drifting(pmsg.SGLD):
        def _params(self, iteration):
            params = super()._params(iteration)
            params["step_size"] = params["step_size"] / (1 + iteration)
            return params

    with regression_model():
        with pytest.raises(RuntimeError, match="changed the parameters"):
            pmsg.sample(step=Drifting(batch_size=B), draws=5, tune=2, chains=1, **QUIET)


# --- progress bar --------------------------------------------------------------------------


def test_progress_bar_moves_between_chunks_or_stays_silent(model, monkeypatch):
    from pymc.progress_bar import MCMCProgressBarManager

    seen = []
    original = MCMCProgressBarManager.update

    def update(self, chain_idx, is_last, draw, tuning, stats):
        if self._show_progress:
            seen.append((chain_idx, draw, is_last))
        return original(self, chain_idx, is_last, draw, tuning, stats)

    monkeypatch.setattr(MCMCProgressBarManager, "update", update)
    kwargs = dict(draws=40, tune=5, chains=2, chunks=4, random_seed=1)
    with model:
        step = pmsg.SGLD(batch_size=100)
        pmsg.sample(step=step, progressbar=True, compute_convergence_checks=False, **kwargs)
        assert [d for c, d, last in seen if c == 0 and not last] == list(range(45))
        assert sum(last for _, _, last in seen) == 2
        seen.clear()
        pmsg.sample(step=step, progressbar=False, compute_convergence_checks=False, **kwargs)
        assert seen == []


# --- bad input ------------------------------------------------------------------------------


def test_bad_input_is_refused_with_the_fix(model, tmp_path):
    with model:
        step = pmsg.SGLD(batch_size=100)
        with pytest.raises(TypeError, match="one step method of pymc_sgmcmc"):
            pmsg.sample(step=pm.NUTS())
        with pytest.raises(TypeError, match="compound step"):
            pmsg.sample(step=[step])
        for bad in ({"draws": 0}, {"tune": -1}, {"chains": 0}, {"chains": 2.0}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                pmsg.sample(step=step, **bad)
        with pytest.raises(ValueError, match="chunks"):
            pmsg.sample(step=step, chunks=0)
        with pytest.raises(ValueError, match="cores"):
            pmsg.sample(step=step, cores=0)
        with pytest.raises(ValueError, match="random_seed=-1"):
            pmsg.sample(step=step, random_seed=-1)
        with pytest.raises(ModelNotSupportedError, match="devices=2"):
            pmsg.sample(step=pmsg.SGLD(batch_size=100, devices=2))
    with pm.Model():
        with pytest.raises(ValueError, match="another model"):
            pmsg.sample(step=step)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2))
    with pm.Model() as two:
        s = pm.HalfNormal("s", 1.0)
        w = pm.Normal("w", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ w, s, observed=X @ [1.0, 2.0])
        with pytest.raises(ModelNotSupportedError, match=r"not \['s_log__'\].*pm.sample\(step=\["):
            pmsg.sample(step=pmsg.SGLD(vars=[w], batch_size=50))
        np.save(tmp_path / "X.npy", X)
        np.save(tmp_path / "y.npy", X @ [1.0, 2.0])
        on_disk = {k: np.load(tmp_path / f"{k}.npy", mmap_mode="r") for k in ("X", "y")}
        with pytest.raises(ModelNotSupportedError, match="out-of-core"):
            pmsg.sample(step=pmsg.SGLD(batch_size=50, data=on_disk))
    del two


def test_pm_sample_runs_four_chains_side_by_side_on_two_cores(model, caplog):
    """pm.sample(step=..., chains=4, cores=2): the chains run in two groups side by side (the
    engine of pmsg.sample; its worker processes when the run is long enough, see
    chain_method="auto") and draw what one chain after another draws."""
    kwargs = dict(draws=12, tune=8, chains=4, random_seed=5, **QUIET)
    with model:
        step = pmsg.SGLD(batch_size=100)
        one_by_one = pm.sample(step=step, cores=1, **kwargs)
        with caplog.at_level("INFO", logger="pymc"):
            side_by_side = pm.sample(step=step, cores=2, **kwargs)
    assert "in groups of 2+2 chains" in caplog.text
    np.testing.assert_allclose(
        side_by_side.posterior["beta"].values, one_by_one.posterior["beta"].values, rtol=1e-9
    )
    assert side_by_side.posterior.attrs["sgmcmc_samplers"] == "SGLD"


def test_auto_chain_method_takes_processes_for_long_runs_only(model, monkeypatch):
    from pymc_sgmcmc.adapter import sampling
    from pymc_sgmcmc.adapter.sampling import resolve_chain_method

    with model:
        step = pmsg.IASG(batch_size=100)
    # Whether an earlier test in this pytest worker left the worker processes up is not
    # this test's business: "auto" takes them whenever they are (checked last).
    monkeypatch.setattr(sampling, "workers_running", lambda: False)
    # this model: N = 2 000 rows, D = 3, 1 pass per draw
    assert resolve_chain_method("auto", step, 4, 1000, 1000, 2) == "vectorized"
    assert resolve_chain_method("auto", step, 4, 10**6, 10**6, 2) == "processes"
    assert resolve_chain_method("auto", step, 4, 10**6, 10**6, 1) == "vectorized"  # one group
    assert resolve_chain_method("vectorized", step, 4, 10**6, 10**6, 2) == "vectorized"
    monkeypatch.setattr(sampling, "workers_running", lambda: True)
    assert resolve_chain_method("auto", step, 4, 1000, 1000, 2) == "processes"
