"""Numerical faults, reproducibility and interruption: loud failures, kept draws, equal seeds.

The faults are injected into the real compiled loop: a subclass of SGLD whose minibatch
gradient becomes infinite from a given inner iteration on (the rest of the machinery —
PyMC's pm.sample, the JAX scan, ArviZ — is the real thing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pymc as pm
import pytest
from stack import groups, result_type

import pymc_sgmcmc as pmsg

N, B = 400, 40  # thin = N / B = 10 inner iterations per draw
SAMPLE = dict(chains=1, cores=1, progressbar=False, compute_convergence_checks=False)


class FaultySGLD(pmsg.SGLD):
    """SGLD whose gradient is +inf at every inner iteration ``>= fault_at`` (counted over the
    chain, tuning included), and fine before."""

    def __init__(self, vars=None, *, fault_at: int, fault_until: int | None = None, **kwargs):
        super().__init__(vars, **kwargs)
        self.fault_at = int(fault_at)
        self.fault_until = fault_until

    def _make_iteration(self, fns, kernel_step, data):
        import jax
        import jax.numpy as jnp

        grad_logdensity = jax.grad(fns["logdensity"])
        start = self.fault_at
        stop = self.fault_until if self.fault_until is not None else 2**31 - 1

        def iteration(normal, state, batch, row_ids, next_row_ids, fixed, params):
            grad = grad_logdensity(state.position, fixed, batch)
            broken = (state.iteration >= start) & (state.iteration < stop)
            grad = jnp.where(broken, jnp.inf, grad)
            state, info = kernel_step(normal, state, lambda _: grad, params)
            return state, info, grad

        return iteration


def regression_model(seed: int = 0) -> pm.Model:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, 2))
    y = X @ np.array([1.0, -0.5]) + rng.normal(size=N)
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ beta, 1.0, observed=y)
    return model


def test_divergence_after_tuning_stops_the_chain_and_keeps_the_draws_before():
    tune, fault_draw = 20, 35  # the gradient breaks in the 16th draw after tuning
    with regression_model():
        step = FaultySGLD(batch_size=B, fault_at=fault_draw * (N // B) + 3)
        with pytest.raises(pmsg.DivergenceError) as info:
            pm.sample(step=step, draws=100, tune=tune, random_seed=1, **{**SAMPLE, "chains": 2})
    error = info.value
    message = str(error)
    assert "2 chain(s) diverged after tuning" in message
    assert f"diverged in draw {fault_draw} (after tuning)" in message
    assert "at inner iteration 4 of 10" in message
    assert "Reduce step_size" in message
    assert error.chains == [(0, fault_draw), (1, fault_draw)]
    idata = error.idata
    assert isinstance(idata, result_type())
    # the 15 good draws after tuning and the flagged one, for both chains
    draws = fault_draw - tune + 1
    assert idata.posterior["beta"].shape == (2, draws, 2)
    assert np.all(np.isfinite(idata.posterior["beta"].values))
    diverging = idata.sample_stats["diverging"].values
    assert not diverging[:, :-1].any() and diverging[:, -1].all()
    # the flagged draw repeats the last finite one: nothing new is claimed from it
    np.testing.assert_array_equal(
        idata.posterior["beta"].values[:, -1], idata.posterior["beta"].values[:, -2]
    )
    # the draws before the divergence are those of an unbroken run with the same seed
    with regression_model():
        ok = pm.sample(
            step=pmsg.SGLD(batch_size=B),
            draws=draws - 1,
            tune=tune,
            random_seed=1,
            **{**SAMPLE, "chains": 2},
        )
    np.testing.assert_array_equal(
        idata.posterior["beta"].values[:, :-1], ok.posterior["beta"].values
    )


def test_divergence_with_cores_2_is_reported_with_the_draws_so_far():
    with regression_model():
        step = FaultySGLD(batch_size=B, fault_at=30 * (N // B))
        with pytest.raises(pmsg.DivergenceError) as info:
            pm.sample(
                step=step, draws=60, tune=10, random_seed=2, **{**SAMPLE, "chains": 2, "cores": 2}
            )
    error = info.value
    assert "diverged in draw 30 (after tuning)" in str(error)
    assert error.idata is not None
    posterior = error.idata.posterior["beta"].values
    assert 1 <= posterior.shape[1] <= 21 and np.all(np.isfinite(posterior))


def test_a_tuning_draw_that_diverges_is_redone_at_a_smaller_step():
    # Broken for one draw's worth of iterations during tuning: the retries (same state and
    # randomness, halved step) hit the same broken iterations, so the retries run out.
    with regression_model():
        step = FaultySGLD(batch_size=B, fault_at=5 * (N // B))
        with pytest.raises(pmsg.DivergenceError, match=r"draw 5 \(tuning\).*again after 6 retries"):
            pm.sample(step=step, draws=10, tune=20, random_seed=3, **SAMPLE)


def test_too_large_a_fixed_step_is_reduced_during_tuning():
    # ConstantSGD at P = 0.05 on this model's curvature (about N = 400 per unit) is unstable:
    # 0.05 * 400 = 20 > 2. Tuning halves it until the draws are finite (0.05 / 16 · 400 =
    # 1.25 < 2) and keeps that factor, which the attrs report.
    with regression_model():
        idata = pm.sample(
            step=pmsg.ConstantSGD(step_size=0.05, batch_size=B),
            draws=20,
            tune=10,
            random_seed=4,
            **SAMPLE,
        )
    assert np.all(np.isfinite(idata.posterior["beta"].values))
    assert not idata.sample_stats["diverging"].values.any()
    (settings,) = json.loads(idata.posterior.attrs["sgmcmc_settings"])
    factor = settings["chains"][0]["divergence_step_factor"]
    assert factor <= 1 / 16 and factor >= 1 / 64


def test_a_step_that_diverges_without_tuning_is_an_error_not_nan_draws():
    with regression_model():
        with pytest.raises(pmsg.DivergenceError) as info:
            pm.sample(
                step=pmsg.ConstantSGD(step_size=10.0, batch_size=B),
                draws=10,
                tune=0,
                random_seed=1,
                **SAMPLE,
            )
    assert "diverged in draw 0 (after tuning)" in str(info.value)
    assert info.value.idata.posterior["beta"].shape == (1, 1, 2)  # the flagged first draw
    assert np.all(np.isfinite(info.value.idata.posterior["beta"].values))


# --- reproducibility ----------------------------------------------------------------------


@pytest.mark.parametrize("step_cls", [pmsg.SGLD, pmsg.IASG, pmsg.SAGALD])
def test_equal_seeds_give_bitwise_equal_draws_with_cores_1_and_2(step_cls):
    def run(seed, cores):
        with regression_model():
            return pm.sample(
                step=step_cls(batch_size=B),
                draws=15,
                tune=10,
                random_seed=seed,
                **{**SAMPLE, "chains": 2, "cores": cores},
            )

    a, b, c, d = run(7, 1), run(7, 1), run(7, 2), run(8, 1)
    for group in ("posterior", "sample_stats"):
        for name in ("beta",) if group == "posterior" else ("step_size", "minibatch_loss"):
            np.testing.assert_array_equal(a[group][name].values, b[group][name].values)
            np.testing.assert_array_equal(a[group][name].values, c[group][name].values)
    assert not np.any(a.posterior["beta"].values == d.posterior["beta"].values)


# --- interruption and writing as we go ------------------------------------------------------

_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import signal, sys, numpy as np, pymc as pm, pymc_sgmcmc as pmsg
    # Ctrl-C as in a terminal: a shell's background job (e.g. a CI runner's) inherits SIGINT
    # ignored, and Python then leaves it ignored instead of raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4000, 2)); y = X @ [1.0, -0.5] + rng.normal(size=4000)

    def callback(trace, draw):
        if draw.draw_idx == 30:
            print("RUNNING", flush=True)
        elif draw.draw_idx > 30 and draw.draw_idx % 100 == 0:
            print("AT", draw.draw_idx, flush=True)  # still sampling

    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
        idata = pm.sample(step=pmsg.SGLD(batch_size=20), draws=10**6, tune=10, chains=1,
                          cores=1, random_seed=1, progressbar=False, callback=callback,
                          compute_convergence_checks=False)
    values = idata.posterior["b"].values
    assert np.all(np.isfinite(values))
    print("DRAWS", values.shape[1], flush=True)
    """
)


def test_sigint_during_pm_sample_returns_the_draws_so_far():
    """Ctrl-C stops the sampling and pm.sample returns the draws so far (see
    :func:`_interrupt_a_sampling_child`). The child is run a second time if the first one
    did not stop within its deadline: in two full test runs on a loaded 2-core machine
    (2026-11-25) the child ran on past 240 s although alone it stops in 2.4 s, with or
    without the self-check's log; a Ctrl-C that never works fails both attempts."""
    try:
        _interrupt_a_sampling_child()
    except subprocess.TimeoutExpired as first:
        try:
            _interrupt_a_sampling_child()
        except subprocess.TimeoutExpired as second:
            raise AssertionError(f"the child did not stop twice: {first}; {second}") from second


def _interrupt_a_sampling_child():
    """Ctrl-C stops the sampling and pm.sample returns the draws so far.

    An interrupt is occasionally lost (seen in 2 of 3 full test runs one day: the child
    sampled on for two minutes; never reproduced alone). The likely cause is CPython's: a
    KeyboardInterrupt raised inside a Python ``__eq__``/``__hash__`` that C code calls
    through ``PyDict_GetItem`` is cleared.
    A user then presses Ctrl-C again; so does this test, but only when the child is
    provably still sampling — a progress line printed more than 3 s after the last SIGINT
    — so that a second interrupt never hits PyMC's clean-up of the first."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPT_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[tuple[float, str]] = []
    errors: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.strip()))

    def read_stderr() -> None:
        errors.append(proc.stderr.read())

    # Both pipes are drained by threads only (communicate() would race the stdout reader).
    readers = [threading.Thread(target=f, daemon=True) for f in (read, read_stderr)]
    try:
        line = proc.stdout.readline()
        if line.strip() != "RUNNING":
            proc.kill()  # before reading its stderr: a child blocked on a full stdout never ends
            pytest.fail(f"{line!r}\n{proc.stderr.read()[-3000:]}")
        for reader in readers:
            reader.start()
        time.sleep(0.5)
        sent = [time.monotonic()]
        proc.send_signal(signal.SIGINT)
        deadline = sent[0] + 240
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if any(t > sent[-1] + 3 and text.startswith("AT") for t, text in lines):
                sent.append(time.monotonic())  # the interrupt was lost: press Ctrl-C again
                proc.send_signal(signal.SIGINT)
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
        for reader in readers:
            reader.join(timeout=10)
    finally:
        proc.kill()
    err = "".join(errors)
    assert proc.returncode == 0, err[-3000:]
    assert len(sent) <= 3, f"{len(sent)} interrupts were needed"
    out = " ".join(text for _, text in lines)
    draws = int(out.split("DRAWS")[1].split()[0])
    assert 20 <= draws < 10**6


_WRITER_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, pymc as pm, pymc_sgmcmc as pmsg
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4000, 2)); y = X @ [1.0, -0.5] + rng.normal(size=4000)
    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 2.0)
        pm.Normal("y", pm.Data("X", X) @ b, s, observed=y)
        writer = pmsg.DrawWriter(sys.argv[1], flush_every=10)

        reached = set()

        def callback(trace, draw):
            writer(trace, draw)
            if draw.draw_idx == 250:
                reached.add(draw.chain)
                if len(reached) == 2:  # both chains (they run one after the other)
                    print("RUNNING", flush=True)

        # The first chain ends at 300 draws, the second is killed after its 250th.
        pm.sample(step=pmsg.SGLD(batch_size=20), draws=290, tune=10, chains=2, cores=2,
                  random_seed=1, progressbar=False, callback=callback,
                  compute_convergence_checks=False)
    """
)


def test_draws_written_as_they_come_survive_a_killed_process(tmp_path):
    store = tmp_path / "run.draws"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT, str(store)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "RUNNING", proc.stderr.read()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the sampler and its workers, no clean-up
        proc.wait(timeout=60)
    finally:
        proc.kill()
    idata = pmsg.read_draws(store)
    beta = idata.posterior["b"].values
    # each chain had made at least 251 draws (10 tuning); flushed every 10: 240 written
    assert beta.shape[0] == 2 and beta.shape[1] >= 230
    assert np.all(np.isfinite(beta)) and np.all(idata.posterior["s"].values > 0)
    np.testing.assert_allclose(beta.mean(axis=(0, 1)), [1.0, -0.5], atol=0.1)
    np.testing.assert_array_equal(idata.posterior["draw"].values[:3], [10, 11, 12])
    assert "diverging" in idata.sample_stats and "step_size" in idata.sample_stats
    tuning = pmsg.read_draws(store, include_tune=True)
    assert tuning.posterior["draw"].values[0] == 0


_INTERRUPT_FIRST_CHAIN_SCRIPT = textwrap.dedent(
    """
    import os, signal, numpy as np, pymc as pm, pymc_sgmcmc as pmsg
    # Ctrl-C as in a terminal: a shell's background job (e.g. a CI runner's) inherits SIGINT
    # ignored, and Python then leaves it ignored instead of raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(4000, 2)); y = X @ [1.0, -0.5] + rng.normal(size=4000)

    def callback(trace, draw):  # Ctrl-C, delivered in the middle of chain 0
        if draw.chain == 0 and draw.draw_idx == 100:
            os.kill(os.getpid(), signal.SIGINT)

    with pm.Model():
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X) @ b, 1.0, observed=y)
        idata = pm.sample(step=pmsg.SGLD(batch_size=200), draws=400, tune=10, chains=3,
                          cores=1, random_seed=1, progressbar=False, callback=callback,
                          compute_convergence_checks=False)
    print("SHAPE", *idata.posterior["b"].shape)
    """
)


def test_sigint_in_a_chain_stops_the_run_and_keeps_its_draws():
    # PyMC's sequential loop swallows the interrupt, starts the next chain and, at the end,
    # keeps the longest chains: the interrupted one's draws were dropped and Ctrl-C had to
    # be pressed once per chain. With an SG step the run stops and returns the draws so far.
    # (cores=1: chains one after another. With cores > 1 they run side by side, as in
    # pmsg.sample, and Ctrl-C stops them all: test_chain_processes.)
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_FIRST_CHAIN_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SHAPE 1 91 2" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "interrupted in chain 0 after 101 draws" in done.stderr


@pytest.mark.parametrize("driver", ["pm.sample", "vectorized", "processes"])
def test_ctrl_c_while_every_chain_tunes_says_so_or_returns_the_tuning_draws(driver):
    """Ctrl-C (a KeyboardInterrupt from the callback, as a terminal's) in the 6th of 10
    tuning draws: with the tuning draws discarded there is nothing to return, and the error
    says so and what to pass (PyMC's own says "Not enough samples to build a trace"); with
    discard_tuned_samples=False the tuning draws come back."""

    def callback(trace, draw):
        if draw.draw_idx == 5:
            raise KeyboardInterrupt

    def run(**kwargs):
        kwargs = dict(draws=20, tune=10, chains=2, random_seed=1, callback=callback, **kwargs)
        kwargs.update(progressbar=False, compute_convergence_checks=False)
        step = pmsg.SGLD(batch_size=B)
        if driver == "pm.sample":
            return pm.sample(step=step, cores=1, **kwargs)
        return pmsg.sample(step=step, chain_method=driver, cores=2, **kwargs)

    with regression_model():
        with pytest.raises(pmsg.NoDrawsError, match=r"no chain got past tuning.*discard_tuned"):
            run()
        idata = run(discard_tuned_samples=False)
    warmup = idata["warmup_posterior"]["beta"].values
    assert warmup.shape[1] >= 5 and np.all(np.isfinite(warmup))
    assert "posterior" not in groups(idata) or idata["posterior"]["beta"].shape[1] == 0
