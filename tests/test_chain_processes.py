"""pmsg.sample(chain_method="processes"): each vmapped group of chains in a worker process
pinned to one CPU. The same draws, tuned settings, warnings, errors and divergences as
``chain_method="vectorized"`` (the same code runs in the workers); the workers stay for later
calls, drop a collected step and end with ``close_workers``; Ctrl-C and a plain script (no
``__main__`` guard) behave as in one process. Each test here starts or reuses worker
processes (seconds each): three tests, ~65 s of test time."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pymc as pm
import pytest
from stack import groups
from test_faults import B, FaultySGLD, N, regression_model
from test_sampling import _RaisesAtTuningDraw

import pymc_sgmcmc as pmsg
from pymc_sgmcmc import _chain_processes
from pymc_sgmcmc.errors import DivergenceError

QUIET = dict(progressbar=False, compute_convergence_checks=False)
RUN = dict(draws=15, tune=10, chains=3, cores=2, random_seed=5, **QUIET)  # groups 2 + 1


def _hierarchy() -> pm.Model:
    rng = np.random.default_rng(2)
    g = rng.integers(0, 6, 600)
    with pm.Model() as hier:
        mu = pm.Normal("mu", 0.0, 1.0)
        u = pm.Normal("u", mu, 0.5, shape=6)
        pm.Normal("y", u[pm.Data("g", g)], 1.0, observed=rng.normal(0.3 * g, 1.0))
    return hier


def _assert_same(a, b):
    assert groups(a) == groups(b)
    for group in ("posterior", "sample_stats"):
        for name, var in a[group].data_vars.items():
            np.testing.assert_array_equal(var.values, b[group][name].values, err_msg=name)
    assert a.posterior.attrs["sgmcmc_settings"] == b.posterior.attrs["sgmcmc_settings"]


def test_processes_draw_what_the_vectorized_method_draws_and_keep_their_workers():
    """Bit for bit (IASG with markov local variables: the hybrid path, a tuned
    preconditioner), also in a second call on the same step: the workers are kept and sent
    only the step's state, tuned by the first call's last chain; the step is left holding the
    same. A step collected here is dropped by the workers with their next job."""
    make = lambda: pmsg.IASG(local_vars=["u"], local_family="markov", batch_size=100)  # noqa: E731
    runs, steps = {}, {}
    for method in ("vectorized", "processes"):
        with _hierarchy():
            steps[method] = step = make()
            runs[method] = []
            for i in range(2):
                runs[method].append(pmsg.sample(step=step, chain_method=method, **RUN))
                if method == "processes":
                    pool = _chain_processes._POOL
                    if i == 0:
                        started = [w.process for w in pool.workers]
                    assert [w.process for w in pool.workers] == started  # not started again
    for a, b in zip(runs["vectorized"], runs["processes"], strict=True):
        _assert_same(a, b)
    (settings,) = json.loads(runs["processes"][0].posterior.attrs["sgmcmc_settings"])
    assert len(settings["chains"]) == 3
    ours, theirs = steps.pop("processes"), steps.pop("vectorized")
    assert ours.chain_settings == theirs.chain_settings
    for name in ("preconditioner", "noise_factor"):
        np.testing.assert_array_equal(getattr(ours.tuned, name), getattr(theirs.tuned, name))
    assert ours._compiled is None  # compiled in the workers only

    token = _chain_processes._TOKENS[ours]
    assert len(started) == 2 and all(token in w.steps for w in pool.workers)
    del ours, step
    gc.collect()
    assert token in _chain_processes._FORGOTTEN  # sent to the workers with the next job


def test_a_workers_warnings_errors_and_divergences_reach_the_caller():
    # A warning of a chain's tuning (IASG's window against the slowest direction, as in
    # test_bad_input): raised in the caller, where pytest.warns and filters see it.
    rng = np.random.default_rng(0)
    cov = 0.95 * np.ones((5, 5)) + 0.05 * np.eye(5)
    X = rng.normal(size=(5000, 5)) @ np.linalg.cholesky(cov).T
    with pm.Model():
        b = pm.Normal("b", 0, 10, shape=5)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=X.sum(1) + rng.normal(size=5000))
        step = pmsg.IASG(batch_size=50, preconditioner="diagonal")
        with pytest.warns(UserWarning, match="relaxes in about"):
            pmsg.sample(step=step, chain_method="processes", **{**RUN, "chains": 2})
        # A filter that turns it into an error, by module: raised as in one process. (A new
        # step: IASG warns once per step.)
        step = pmsg.IASG(batch_size=50, preconditioner="diagonal")
        with warnings.catch_warnings(), pytest.raises(UserWarning, match="relaxes in about"):
            warnings.filterwarnings("error", message=".*relaxes", module="pymc_sgmcmc")
            pmsg.sample(step=step, chain_method="processes", **{**RUN, "chains": 2})

    # An error of a chain's host part: the lowest chain's, as in one process.
    raised = []
    for method in ("vectorized", "processes"):
        with regression_model(), pytest.raises(RuntimeError, match="chain seeded") as info:
            step = _RaisesAtTuningDraw(batch_size=B)
            pmsg.sample(step=step, chain_method=method, **RUN)
        raised.append(str(info.value))
    assert raised[0] == raised[1]

    # A divergence after tuning: the same error, with the draws before it.
    errors = []
    for method in ("vectorized", "processes"):
        with regression_model():
            step = FaultySGLD(batch_size=B, fault_at=35 * (N // B) + 3)
            with pytest.raises(DivergenceError) as info:
                pmsg.sample(step=step, chain_method=method, **{**RUN, "draws": 100, "tune": 20})
        errors.append(info.value)
    assert str(errors[0]) == str(errors[1])
    assert errors[1].chains == errors[0].chains == [(0, 35), (1, 35), (2, 35)]
    np.testing.assert_array_equal(
        errors[1].idata.posterior["beta"].values, errors[0].idata.posterior["beta"].values
    )


def test_a_keyboardinterrupt_from_a_callback_keeps_every_chain_whole():
    # As Ctrl-C: nothing is booked after it, so each chain holds a prefix of its draws (the
    # vectorized run's, draw for draw), never a chain with draws missing in the middle.
    def callback(trace, draw):
        if draw.chain == 0 and draw.draw_idx == 40:
            raise KeyboardInterrupt

    def nested(trace, draw):
        if draw.draw_idx == 5:
            pmsg.sample(step=pmsg.SGLD(batch_size=B), chain_method="processes", **RUN)

    runs = {}
    for method in ("vectorized", "processes"):
        with regression_model():
            step = pmsg.SGLD(batch_size=B)
            kwargs = {**RUN, "draws": 400, "chunks": 200, "discard_tuned_samples": False}
            runs[method] = pmsg.sample(step=step, chain_method=method, callback=None, **kwargs)
            if method == "processes":
                cut = pmsg.sample(step=step, chain_method=method, callback=callback, **kwargs)
                # A callback that starts another such call is refused (it would wait forever
                # for the workers it runs on).
                with pytest.raises(RuntimeError, match="inside another such call"):
                    pmsg.sample(step=step, chain_method=method, callback=nested, **kwargs)
    full = runs["vectorized"]
    assert 0 < cut.posterior.sizes["draw"] < 400
    _assert_same(full, runs["processes"])
    n = cut.posterior.sizes["draw"]
    whole = np.concatenate([full.warmup_posterior["beta"], full.posterior["beta"]], axis=1)
    for chain in np.concatenate([cut.warmup_posterior["beta"], cut.posterior["beta"]], axis=1):
        # PyMC keeps the chains (and length) that give the most draws: compared by value
        assert any(np.array_equal(chain, c[: 10 + n]) for c in whole)


def test_chain_method_is_checked_before_anything_runs():
    with regression_model():
        with pytest.raises(ValueError, match="chain_method must be one of"):
            pmsg.sample(step=pmsg.SGLD(batch_size=B), chain_method="parallel", **RUN)


# A plain script, no `if __name__ == "__main__":` — the workers must not run it again — and
# Ctrl-C in the middle of a long run: the draws so far come back, as from pm.sample.
_SCRIPT = textwrap.dedent(
    """
    import signal, sys, numpy as np, pymc as pm, pymc_sgmcmc as pmsg
    # Ctrl-C as in a terminal (a background job inherits SIGINT ignored; see test_faults).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("SCRIPT STARTS", flush=True)  # once: the workers do not run this script
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4000, 2)); y = X @ [1.0, -0.5] + rng.normal(size=4000)

    def callback(trace, draw):
        if draw.draw_idx == 30 and draw.chain == 0:
            print("RUNNING", flush=True)

    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
        idata = pmsg.sample(step=pmsg.SGLD(batch_size=20), draws=10**6, tune=10, chains=2,
                            chain_method="processes", random_seed=1, progressbar=False,
                            callback=callback, compute_convergence_checks=False)
    values = idata.posterior["b"].values
    assert np.all(np.isfinite(values))
    print("DRAWS", values.shape[1], flush=True)
    workers = [w.process for w in pmsg._chain_processes._POOL.workers]
    pmsg.close_workers()
    assert len(workers) == 2 and all(p.poll() is not None for p in workers)
    print("CLOSED", flush=True)
    """
)


def test_a_plain_script_runs_and_ctrl_c_returns_the_draws_so_far(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(_SCRIPT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        child = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
    lines = []
    try:
        deadline = time.monotonic() + 240
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("RUNNING"):
                child.send_signal(signal.SIGINT)
                break
            assert time.monotonic() < deadline, lines
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    lines += out.split()
    assert child.returncode == 0, err[-3000:]
    assert lines.count("SCRIPT STARTS") == 1
    draws = int(lines[lines.index("DRAWS") + 1])
    assert 10 < draws < 10**6
    assert "CLOSED" in lines  # pmsg.close_workers() ended them
