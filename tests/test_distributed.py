"""Several hosts: ``jax.distributed`` processes, each holding only its own rows.

The multi-process checks start two local processes on the CPU (JAX's CPU collectives over
TCP) with the environment variables ``pmsg.distributed.initialize()`` reads, and compare their
draws with one process that holds the same pieces as shards on forced XLA CPU devices (the
same layout simulated). Time: ~2 min of CPU, most of it XLA compilation in each process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pymc as pm
import pytest

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.distributed import DataLayoutError, check_partition

# The data, the model and the runs, shared by the single-process simulation ("sim") and the
# two processes ("dist"). The rows are sorted by y before they are cut into two unequal
# shards, so neither shard is a sample of the data: the tuning's blocks and the minibatch
# gradient must weigh the shards right to get the posterior.
_COMMON = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np, pymc as pm, pymc_sgmcmc as pmsg

    MODE = sys.argv[1]
    if MODE == "sim":
        pass  # XLA_FLAGS gives this process two CPU devices
    else:
        pmsg.distributed.initialize()  # JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, ...
    ME = pmsg.distributed.process_index()

    rng = np.random.default_rng(3)
    n, d = 20_000, 3
    X = rng.normal(size=(n, d))
    y = X @ np.array([0.5, -1.0, 2.0]) + rng.normal(size=n)
    order = np.argsort(y)
    X, y = X[order], y[order]
    CUT = 12_000
    PARTS = [(0, X[:CUT], y[:CUT]), (CUT, X[CUT:], y[CUT:])]

    def model():
        with pm.Model() as m:
            b = pm.Normal("b", 0, 1, shape=d)
            pm.Normal("y", pm.Data("X", X[:100]) @ b, 1.0, observed=pm.Data("y_obs", y[:100]))
        return m

    def shards():
        if MODE == "sim":
            # The pieces two processes with two devices each make of their halves.
            cuts = [0, CUT // 2, CUT, CUT + (n - CUT) // 2, n]
            return [pmsg.RowShard({"X": X[a:b], "y_obs": y[a:b]}, start=a)
                    for a, b in zip(cuts[:-1], cuts[1:])]
        s, a, c = PARTS[ME]
        return pmsg.RowShard({"X": a.copy(), "y_obs": c.copy()}, start=s)

    def run(step, **kwargs):
        with model():
            return pm.sample(step=step, random_seed=1, progressbar=False,
                             compute_convergence_checks=False, **kwargs)
    """
)

_DRAWS = _COMMON + textwrap.dedent(
    """
    out = {"process": ME, "processes": pmsg.distributed.process_count()}
    # The simulation draws enough for the exact-posterior test; the two processes draw the
    # first few of the same draws (a draw does not depend on how many follow it): every
    # iteration of two processes crosses the loopback, ~0.5 ms each.
    FEW = MODE != "sim"
    idata = run(pmsg.IASG(data=shards()), draws=10 if FEW else 250, tune=60, chains=2)
    out["iasg"] = idata.posterior["b"].values.tolist()
    import arviz as az
    out["iasg_ess"] = az.ess(idata)["b"].values.tolist()
    # Every process holding every row, devices="all" (sim: devices=2): sharding.py's claim.
    with model():
        pm.set_data({"X": X, "y_obs": y})
        idata = pm.sample(step=pmsg.SGLD(batch_size=200, devices="all" if MODE != "sim" else 4),
                          draws=10 if FEW else 30, tune=20, chains=1, random_seed=1,
                          progressbar=False,
                          compute_convergence_checks=False)
    out["all"] = idata.posterior["b"].values.tolist()
    print("RESULT" + json.dumps(out), flush=True)
    """
)

_BAD_LAYOUT = _COMMON + textwrap.dedent(
    """
    s, a, c = PARTS[ME]
    start = s - 10 if ME == 1 else s  # process 1 claims rows 11990..: ten rows twice
    try:
        with model():
            pmsg.IASG(data=pmsg.RowShard({"X": a, "y_obs": c}, start=start))
        result = {"error": None}
    except Exception as err:
        result = {"error": [type(err).__name__, str(err)]}
    # 3 001 rows over two processes, 1 000 and 2 001: the default batch (every row, N <=
    # 4096) is capped at two devices times the smaller shard (each device draws its share
    # from its own rows) and kept a multiple of the two devices.
    lo, hi = (0, 1000) if ME == 0 else (1000, 3001)
    with model():
        step = pmsg.SGLD(data=pmsg.RowShard({"X": X[lo:hi], "y_obs": y[lo:hi]}, start=lo))
    result["odd_batch"] = [step.problem.data_size, step.batch_size]
    import warnings
    with warnings.catch_warnings(record=True) as caught, model():
        warnings.simplefilter("always")
        pmsg.SGLD()  # no shards, one device: every process would sample alone
    result["alone"] = [str(w.message) for w in caught]
    print("RESULT" + json.dumps(result), flush=True)
    """
)

_DEATH = _COMMON + textwrap.dedent(
    """
    def die(trace, draw):
        if ME == 1 and len(trace) == 20:
            print("DYING " + repr(time.time()), flush=True)
            os._exit(3)

    run(pmsg.SGLD(batch_size=200, data=shards()), draws=100000, tune=10, chains=1,
        callback=die)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("RESULT") :])


def _two_processes(script, timeout=600, heartbeat=None, devices=None):
    """Run ``script dist`` as processes 0 and 1; (returncode, stdout, stderr, end time) each."""
    port = _free_port()
    procs = []
    for pid in (0, 1):
        env = {**os.environ, **pmsg.distributed.local_environment(pid, 2, port)}
        env.pop("XLA_FLAGS", None)
        if devices is not None:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        if heartbeat is not None:
            env["JAX_HEARTBEAT_TIMEOUT"] = str(heartbeat)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "dist"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    deadline = time.time() + timeout
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        out.append((proc.returncode, stdout, stderr, time.time()))
    return out


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    paths = {}
    scripts = {"draws": _DRAWS, "bad": _BAD_LAYOUT, "death": _DEATH}
    for name, text in scripts.items():
        paths[name] = root / f"{name}.py"
        paths[name].write_text(text)
    return paths


def _one_process(script, devices):
    """Run ``script sim`` in one process with ``devices`` forced XLA CPU devices."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    sim = subprocess.run(
        [sys.executable, str(script), "sim"], env=env, capture_output=True, text=True, timeout=600
    )
    assert sim.returncode == 0, sim.stderr[-3000:]
    return _result(sim.stdout)


@pytest.fixture(scope="module")
def draws(scripts):
    sim = _one_process(scripts["draws"], devices=4)
    dist = _two_processes(scripts["draws"], devices=2)
    for rc, _, stderr, _ in dist:
        assert rc == 0, stderr[-3000:]
    return sim, [_result(stdout) for _, stdout, _, _ in dist]


def test_two_processes_draw_what_one_process_with_their_pieces_draws(draws):
    # Two processes with two devices each (each splits its half of the rows over its own
    # devices) against one process holding the same four pieces as four shards on four
    # devices; and every row on every host with devices="all" against devices=4. Same seed,
    # same layout, so the same draws up to the order of the gradient's four-term sum: one
    # process adds its four devices' terms in one tree, two processes add two and two and
    # then across. Measured: the IASG draws (2 chains x 310, once) differed by at most 4.6e-10
    # relative, the last bits of each sum carried through the chain; with two shards (one
    # device per process) the draws were bit-identical. Tolerance 1e-8.
    sim, (p0, p1) = draws
    assert (p0["process"], p1["process"], p0["processes"]) == (0, 1, 2)
    for key in ("iasg", "all"):
        for proc in (p0, p1):
            few = np.asarray(proc[key])
            one = np.asarray(sim[key])[:, : few.shape[1]]  # the processes draw fewer
            np.testing.assert_allclose(few, one, rtol=1e-8, atol=0)
    # both processes computed the same draws, bit for bit
    np.testing.assert_array_equal(np.asarray(p0["iasg"]), np.asarray(p1["iasg"]))


def test_sorted_unequal_shards_give_the_exact_posterior(draws):
    # Conjugate regression: the exact posterior (rows split by y: shards that are not
    # samples of the data; test_sharding has shards split by a binary outcome). Tolerances
    # from the run's ESS: a mean within 4 Monte Carlo standard errors (4 sd/sqrt(ESS)), an sd
    # within 1 +- 4/sqrt(2 ESS) plus the 10% the correctness table allows IASG.
    sim, _ = draws
    rng = np.random.default_rng(3)
    n, d = 20_000, 3
    X = rng.normal(size=(n, d))
    y = X @ np.array([0.5, -1.0, 2.0]) + rng.normal(size=n)
    cov = np.linalg.inv(X.T @ X + np.eye(d))
    mean, sd = cov @ X.T @ y, np.sqrt(np.diag(cov))
    post = np.asarray(sim["iasg"]).reshape(-1, d)
    ess = np.asarray(sim["iasg_ess"])
    assert np.all(np.abs(post.mean(0) - mean) / sd < 4 / np.sqrt(ess))
    assert np.all(np.abs(post.std(0) / sd - 1) < 0.10 + 4 / np.sqrt(2 * ess))


def test_a_layout_that_reads_rows_twice_is_refused_on_every_process(scripts):
    results = _two_processes(scripts["bad"])
    for rc, stdout, stderr, _ in results:
        assert rc == 0, stderr[-3000:]
        result = _result(stdout)
        name, message = result["error"]
        assert name == "DataLayoutError"
        assert result["odd_batch"] == [3001, 2000]
        assert any("every process samples the whole data set" in w for w in result["alone"])
        assert "rows 11990..11999 are held twice (process 0 and process 1)" in message


def test_a_lost_process_ends_the_others_naming_it(scripts):
    # Process 1 dies at its 20th draw. Process 0's next all-reduce fails at once; it names
    # process 1 and exits non-zero when JAX's heartbeat timeout (10 s here, 100 s by
    # default) confirms the loss. Measured: ~11 s after the death.
    (rc0, _, err0, end0), (rc1, out1, _, _) = _two_processes(
        scripts["death"], timeout=300, heartbeat=10
    )
    assert rc1 == 3
    died = float(next(line for line in out1.splitlines() if line.startswith("DYING")).split()[1])
    assert rc0 != 0
    assert "process 0 of 2" in err0 and "lost process 1" in err0, err0[-3000:]
    assert end0 - died < 60


# -- in one process ------------------------------------------------------------------------


def test_check_partition_accepts_a_partition_in_any_order():
    layout = check_partition([500, 0, 200], [500, 200, 300], [2, 0, 1])
    assert layout.starts == (0, 200, 500) and layout.owners == (0, 1, 2)
    assert layout.total == 1000 and layout.held_by(1) == [1]


@pytest.mark.parametrize(
    ("starts", "sizes", "message"),
    [
        ([0, 90], [100, 100], "rows 90..99 are held twice (process 0 and process 1)"),
        ([0, 110], [100, 100], "rows 100..109 are held by no process"),
        ([10, 100], [90, 100], "rows 0..9 are held by no process"),
        ([0, 0], [100, 100], "rows 0..99 are held twice"),
    ],
)
def test_check_partition_names_rows_held_twice_or_by_nobody(starts, sizes, message):
    with pytest.raises(DataLayoutError, match="partition") as info:
        check_partition(starts, sizes, [0, 1])
    assert message in str(info.value)


def _model(n=300):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 2))
    y = X @ np.ones(2) + rng.normal(size=n)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", pm.Data("X", X[:50]) @ b, 1.0, observed=pm.Data("y_obs", y[:50]))
    return m, X, y


def test_row_shard_errors_name_the_fix():
    m, X, y = _model()
    with pytest.raises(pmsg.DataShapeError, match="same number of rows"):
        pmsg.RowShard({"X": X, "y_obs": y[:10]}, start=0)
    with pytest.raises(pmsg.DataShapeError, match="first row number"):
        pmsg.RowShard({"X": X, "y_obs": y}, start=-1)
    shard = pmsg.RowShard({"X": X, "y_obs": y}, start=0)
    with m:
        with pytest.raises(pmsg.DataShapeError, match="RowShard"):
            pmsg.SGLD(data=[shard, {"X": X}])
        with pytest.raises(ValueError, match="leave devices= unset"):
            pmsg.SGLD(data=shard, devices=2)
        with pytest.raises(pmsg.ModelNotSupportedError, match="row shards"):
            pmsg.SAGALD(data=shard)
        with pytest.raises(DataLayoutError, match="rows 0..9 are held by no process"):
            pmsg.SGLD(data=pmsg.RowShard({"X": X, "y_obs": y}, start=10))
        bad = y.copy()
        bad[7] = np.nan
        with pytest.raises(pmsg.DataShapeError, match="non-finite"):
            pmsg.SGLD(data=pmsg.RowShard({"X": X, "y_obs": bad}, start=0))
        # Two shards in one process need two JAX devices (this pytest process has one).
        halves = [
            pmsg.RowShard({"X": X[:150], "y_obs": y[:150]}, start=0),
            pmsg.RowShard({"X": X[150:], "y_obs": y[150:]}, start=150),
        ]
        with pytest.raises(ValueError, match="host_platform_device_count=2 before JAX starts"):
            pmsg.SGLD(data=halves)


def test_one_shard_in_one_process_is_the_whole_data_set():
    # A single RowShard from row 0 is plain data=: the same draws for the same seed.
    m, X, y = _model()
    draws = {}
    for kind, data in {
        "shard": pmsg.RowShard({"X": X, "y_obs": y}, start=0),
        "plain": {"X": X, "y_obs": y},
    }.items():
        with m:
            step = pmsg.SGLD(data=data)
            assert step.problem.data_size == 300
            idata = pm.sample(step=step, draws=5, tune=5, chains=1, **_QUIET)
        draws[kind] = idata.posterior["b"].values
    np.testing.assert_array_equal(draws["shard"], draws["plain"])


_QUIET = dict(random_seed=1, progressbar=False, compute_convergence_checks=False)


def test_initialize_is_a_no_op_in_one_process_and_names_missing_variables(monkeypatch):
    for name in (
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "SLURM_NTASKS",
        "SLURM_JOB_ID",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    assert pmsg.distributed.initialize() is False
    assert pmsg.distributed.process_count() == 1 and pmsg.distributed.is_main_process()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(RuntimeError, match="JAX_COORDINATOR_ADDRESS"):
        pmsg.distributed.initialize()
