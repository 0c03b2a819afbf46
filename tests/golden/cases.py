"""Golden cases: small, fixed-seed sampler runs whose draws must stay bit for bit the same.

Each case builds a small PyMC model on generated data (fixed seeds) and runs one sampler
through one driver, returning the ``arviz.InferenceData``. ``tests/golden/record.py`` hashes
the results into ``draws.json``; ``tests/test_golden.py`` reruns every case and compares.
These runs check *identity*, not accuracy: tuning and draws are a few dozen iterations.

Every case is a :class:`Case` in :data:`CASES`. Cases that need two JAX devices
(``devices=2``) run in a fresh interpreter with ``XLA_FLAGS`` set before JAX starts (this
file is that interpreter's script: ``python cases.py --run ID --out FILE``); the parent
reads the pickled InferenceData back, so every case is called the same way, through
:func:`run_case`.

Run as a script to list the cases: ``python tests/golden/cases.py``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*BLAS.*")

# Short runs: these check identity, not accuracy.
TUNE, DRAWS, CHAINS = 20, 20, 2
QUIET = dict(progressbar=False, compute_convergence_checks=False)
SHARDED_XLA_FLAGS = "--xla_force_host_platform_device_count=2"

# ---------------------------------------------------------------------------------------
# Data and models (generated with fixed seeds; cached per process)
# ---------------------------------------------------------------------------------------


@functools.cache
def linreg_data(n: int = 3000, d: int = 4, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    beta = rng.normal(size=d)
    y = X @ beta + 0.8 * rng.normal(size=n)
    return X, y


@functools.cache
def logreg_data(n: int = 4000, d: int = 3, seed: int = 12) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    beta = 0.7 * rng.normal(size=d)
    y = (rng.random(n) < 1 / (1 + np.exp(-(0.3 + X @ beta)))).astype(np.int64)
    return X, y


@functools.cache
def hier_data(n: int = 3000, groups: int = 12, seed: int = 13):
    rng = np.random.default_rng(seed)
    g = rng.integers(0, groups, size=n)
    x = rng.normal(size=n)
    u = 1.0 + 0.5 * rng.normal(size=groups)
    y = u[g] + 0.8 * x + rng.normal(size=n)
    return g, x, y


def linreg_model(rows: int | None = None):
    """Linear regression, D = 4: ``beta`` (vector), ``sigma`` (log-transformed) and a
    deterministic. ``rows``: build it on the first rows only, in ``pm.Data`` containers
    named ``X`` and ``y_obs`` (the placeholder of an out-of-core run)."""
    import pymc as pm

    X, y = linreg_data()
    if rows is not None:
        X, y = X[:rows], y[:rows]
    d = X.shape[1]
    with pm.Model(coords={"feature": [f"x{i}" for i in range(d)]}) as model:
        Xd = pm.Data("X", X)
        yd = pm.Data("y_obs", y)
        beta = pm.Normal("beta", 0.0, 1.0, dims="feature")
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Deterministic("beta_sum", beta.sum())
        pm.Normal("y", Xd @ beta, sigma, observed=yd)
    return model


def logreg_model():
    """Logistic regression, D = 3 plus an intercept."""
    import pymc as pm

    X, y = logreg_data()
    with pm.Model() as model:
        alpha = pm.Normal("alpha", 0.0, 2.0)
        beta = pm.Normal("beta", 0.0, 1.0, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=alpha + pm.Data("X", X) @ beta, observed=y)
    return model


def hier_model():
    """Partially pooled group means with a slope: ``u_j ~ N(mu, tau)`` (centred, the local
    vector), ``y_i ~ N(u[g_i] + b x_i, sigma)``; globals ``mu``, ``tau``, ``b``, ``sigma``."""
    import pymc as pm

    g, x, y = hier_data()
    groups = int(g.max()) + 1
    with pm.Model(coords={"group": np.arange(groups)}) as model:
        gd = pm.Data("g", g)
        xd = pm.Data("x", x)
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 1.0)
        u = pm.Normal("u", mu, tau, dims="group")
        b = pm.Normal("b", 0.0, 1.0)
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", u[gd] + b * xd, sigma, observed=y)
    return model


MODELS: dict[str, Callable[[], Any]] = {
    "linreg": linreg_model,
    "logreg": logreg_model,
    "hier": hier_model,
}

# ---------------------------------------------------------------------------------------
# Drivers
# ---------------------------------------------------------------------------------------


def _pm_sample(model, make_step, seed, **extra):
    import pymc as pm

    with model:
        step = make_step()
        return pm.sample(
            step=step,
            tune=TUNE,
            draws=DRAWS,
            chains=CHAINS,
            cores=1,
            random_seed=seed,
            **QUIET,
            **extra,
        )


def _pmsg_sample(model, make_step, seed, cores=1):
    import pymc_sgmcmc as pmsg

    # cores is always given: its default depends on the machine's CPUs, and the grouping of
    # chains into vmapped batches may change the rounding (pmsg.sample's docstring).
    with model:
        step = make_step()
        return pmsg.sample(
            step=step,
            tune=TUNE,
            draws=DRAWS,
            chains=CHAINS,
            cores=cores,
            random_seed=seed,
            **QUIET,
        )


def _streamed(make_step, seed, rows=500):
    """Out-of-core: the model on the first ``rows`` rows in pm.Data, the full arrays as
    ``numpy.memmap`` files given through ``data=``."""
    X, y = linreg_data()
    with tempfile.TemporaryDirectory(prefix="golden-ooc-") as tmp:
        np.save(Path(tmp) / "X.npy", X)
        np.save(Path(tmp) / "y.npy", y)
        Xm = np.load(Path(tmp) / "X.npy", mmap_mode="r")
        ym = np.load(Path(tmp) / "y.npy", mmap_mode="r")
        assert isinstance(Xm, np.memmap) and isinstance(ym, np.memmap)
        idata = _pm_sample(
            linreg_model(rows=rows), lambda: make_step(data={"X": Xm, "y_obs": ym}), seed
        )
    return idata


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[], Any]  # -> arviz.InferenceData
    description: str
    subprocess_env: tuple[tuple[str, str], ...] = ()  # run in a fresh interpreter with these


def _steps():
    import pymc_sgmcmc as pmsg

    return pmsg


def _mk(sampler: str, **kwargs) -> Callable[..., Any]:
    """A step factory: ``pmsg.<sampler>(**kwargs, **more)`` (built inside the model)."""

    def make(**more):
        return getattr(_steps(), sampler)(**kwargs, **more)

    return make


def _case_pm(case_id, model, sampler, seed, desc, **kwargs):
    make = _mk(sampler, **kwargs)
    return Case(case_id, lambda: _pm_sample(MODELS[model](), make, seed), desc)


def _case_pmsg(case_id, model, sampler, seed, desc, cores=1, **kwargs):
    make = _mk(sampler, **kwargs)
    return Case(case_id, lambda: _pmsg_sample(MODELS[model](), make, seed, cores=cores), desc)


def _case_stream(case_id, sampler, seed, desc, **kwargs):
    make = _mk(sampler, **kwargs)
    return Case(case_id, lambda: _streamed(make, seed), desc)


def _case_sharded(case_id, model, sampler, seed, desc, **kwargs):
    make = _mk(sampler, devices=2, **kwargs)
    return Case(
        case_id,
        lambda: _pm_sample(MODELS[model](), make, seed),
        desc,
        subprocess_env=(("XLA_FLAGS", SHARDED_XLA_FLAGS),),
    )


CASES: list[Case] = [
    # --- pm.sample(step=..., chains=2, cores=1): every sampler, defaults ---
    _case_pm("pm-iasg-linreg-s1", "linreg", "IASG", 1, "IASG() defaults"),
    _case_pm("pm-iasg-linreg-s2", "linreg", "IASG", 2, "IASG() defaults, second seed"),
    _case_pm("pm-constantsgd-linreg-s1", "linreg", "ConstantSGD", 1, "ConstantSGD() defaults"),
    _case_pm("pm-sgfs-logreg-s1", "logreg", "SGFS", 1, "SGFS() defaults (full)"),
    _case_pm("pm-sgld-logreg-s1", "logreg", "SGLD", 1, "SGLD() defaults"),
    _case_pm("pm-sgld-logreg-s2", "logreg", "SGLD", 2, "SGLD() defaults, second seed"),
    _case_pm("pm-sagald-linreg-s1", "linreg", "SAGALD", 1, "SAGALD() defaults"),
    _case_pm("pm-svrgld-logreg-s1", "logreg", "SVRGLD", 1, "SVRGLD() defaults"),
    _case_pm(
        "pm-sghmc-linreg-s1",
        "linreg",
        "SGHMC",
        1,
        "SGHMC(batch_size=1000): friction below 1",
        batch_size=1000,
    ),
    # --- pm.sample: non-default arguments ---
    _case_pm(
        "pm-iasg-diagonal-logreg-s1",
        "logreg",
        "IASG",
        1,
        'IASG(preconditioner="diagonal")',
        preconditioner="diagonal",
    ),
    _case_pm(
        "pm-constantsgd-diagonal-logreg-s1",
        "logreg",
        "ConstantSGD",
        1,
        'ConstantSGD(preconditioner="diagonal")',
        preconditioner="diagonal",
    ),
    _case_pm(
        "pm-constantsgd-momentum-linreg-s1",
        "linreg",
        "ConstantSGD",
        1,
        "ConstantSGD(momentum=0.5)",
        momentum=0.5,
    ),
    _case_pm(
        "pm-sgfs-diagonal-hmax-linreg-s1",
        "linreg",
        "SGFS",
        1,
        'SGFS(preconditioner="diagonal", h_max=1e-3)',
        preconditioner="diagonal",
        h_max=1e-3,
    ),
    _case_pm(
        "pm-sgld-fixed-linreg-s1",
        "linreg",
        "SGLD",
        1,
        "SGLD(step_size=1e-4, preconditioner=None)",
        step_size=1e-4,
        preconditioner=None,
    ),
    _case_pm(
        "pm-sgld-rmsprop-logreg-s1",
        "logreg",
        "SGLD",
        1,
        'SGLD(preconditioner="rmsprop")',
        preconditioner="rmsprop",
    ),
    _case_pm(
        "pm-sgld-full-linreg-s1",
        "linreg",
        "SGLD",
        1,
        'SGLD(preconditioner="full")',
        preconditioner="full",
    ),
    _case_pm(
        "pm-sgld-random-batch100-linreg-s1",
        "linreg",
        "SGLD",
        1,
        'SGLD(minibatch="random", batch_size=100)',
        minibatch="random",
        batch_size=100,
    ),
    # --- pmsg.sample(step=..., chains=2, cores=1): the vectorised driver, every sampler ---
    _case_pmsg("pmsg-iasg-linreg-s1", "linreg", "IASG", 1, "IASG(), pmsg.sample"),
    _case_pmsg(
        "pmsg-constantsgd-logreg-s1",
        "logreg",
        "ConstantSGD",
        1,
        "ConstantSGD(momentum=0.5), pmsg.sample",
        momentum=0.5,
    ),
    _case_pmsg("pmsg-sgfs-linreg-s1", "linreg", "SGFS", 1, "SGFS(), pmsg.sample"),
    _case_pmsg("pmsg-sgld-logreg-s1", "logreg", "SGLD", 1, "SGLD(), pmsg.sample"),
    _case_pmsg(
        "pmsg-sgld-logreg-s1-cores2",
        "logreg",
        "SGLD",
        1,
        "SGLD(), pmsg.sample(cores=2): two groups of one chain in threads",
        cores=2,
    ),
    _case_pmsg(
        "pmsg-sgld-rmsprop-linreg-s1",
        "linreg",
        "SGLD",
        1,
        'SGLD(preconditioner="rmsprop"), pmsg.sample',
        preconditioner="rmsprop",
    ),
    _case_pmsg("pmsg-sagald-logreg-s1", "logreg", "SAGALD", 1, "SAGALD(), pmsg.sample"),
    _case_pmsg("pmsg-svrgld-linreg-s1", "linreg", "SVRGLD", 1, "SVRGLD(), pmsg.sample"),
    _case_pmsg(
        "pmsg-sghmc-logreg-s1",
        "logreg",
        "SGHMC",
        1,
        "SGHMC(batch_size=1000), pmsg.sample",
        batch_size=1000,
    ),
    # --- sharded: devices=2 (two forced XLA CPU devices, in a subprocess) ---
    _case_sharded("sharded-sgld-linreg-s1", "linreg", "SGLD", 1, "SGLD(devices=2)"),
    _case_sharded("sharded-iasg-logreg-s1", "logreg", "IASG", 1, "IASG(devices=2)"),
    # --- streamed: out-of-core data= from numpy.memmap files ---
    _case_stream("stream-iasg-linreg-s1", "IASG", 1, "IASG(data=memmaps), 500-row placeholder"),
    _case_stream("stream-sgld-linreg-s1", "SGLD", 1, "SGLD(data=memmaps), 500-row placeholder"),
    # --- local_vars: the group effects u of the hierarchical model ---
    _case_pm(
        "pm-sgld-meanfield-hier-s1",
        "hier",
        "SGLD",
        1,
        'SGLD(local_vars=["u"], local_family="meanfield")',
        local_vars=["u"],
        local_family="meanfield",
    ),
    _case_pm(
        "pm-sgld-markov-hier-s1",
        "hier",
        "SGLD",
        1,
        'SGLD(local_vars=["u"], local_family="markov")',
        local_vars=["u"],
        local_family="markov",
    ),
    _case_pm(
        "pm-iasg-markov-hier-s1",
        "hier",
        "IASG",
        1,
        'IASG(local_vars=["u"], local_family="markov")',
        local_vars=["u"],
        local_family="markov",
    ),
    _case_pmsg(
        "pmsg-sgld-markov-hier-s1",
        "hier",
        "SGLD",
        1,
        'SGLD(local_vars=["u"], local_family="markov"), pmsg.sample',
        local_vars=["u"],
        local_family="markov",
    ),
]

CASES_BY_ID: dict[str, Case] = {case.id: case for case in CASES}
assert len(CASES_BY_ID) == len(CASES), "duplicate case ids"

# ---------------------------------------------------------------------------------------
# Running and hashing
# ---------------------------------------------------------------------------------------


def _package_root() -> str:
    """The directory holding the imported ``pymc_sgmcmc`` (for a subprocess's PYTHONPATH)."""
    import pymc_sgmcmc

    return str(Path(pymc_sgmcmc.__file__).resolve().parent.parent)


def run_case(case: Case, isolated: bool = False) -> Any:
    """Run ``case`` and return its InferenceData: in this process, or in a fresh interpreter
    if the case needs one (``subprocess_env``) or ``isolated`` is true."""
    if not case.subprocess_env and not isolated:
        return case.run()
    env = dict(os.environ)
    env.update(dict(case.subprocess_env))
    # The child imports the same pymc_sgmcmc as this process.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_package_root(), env.get("PYTHONPATH", "")) if p
    )
    with tempfile.TemporaryDirectory(prefix="golden-sub-") as tmp:
        out = Path(tmp) / "idata.pkl"
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--run", case.id, "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"golden case {case.id} failed in its subprocess (exit {proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        with open(out, "rb") as f:
            return pickle.load(f)


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def _as_f64(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.float64))


def _readable(array: np.ndarray) -> float | list:
    """The mean over chains and draws: a number for a scalar variable, else a (nested) list."""
    mean = array.mean(axis=(0, 1))
    return float(mean) if mean.ndim == 0 else mean.tolist()


def digest(idata: Any) -> dict[str, Any]:
    """The hashes and readable numbers of one case's result.

    ``posterior_sha256``: SHA-256 over every posterior variable sorted by name, each fed as
    its name, its shape and its values as float64 C-contiguous bytes (chain and draw order as
    returned). ``step_size_sha256``: the same for ``sample_stats["step_size"]``.
    ``variables``: per variable its shape, its own SHA-256, its mean over chains and draws
    and its values (raveled, as float64 written with repr: they round-trip exactly);
    ``step_size``: the step sizes' values. The values are what ``test_golden`` compares, to
    a stated tolerance; the hashes are the same-machine check.
    """
    posterior = idata["posterior"]
    total = hashlib.sha256()
    variables = {}
    for name in sorted(posterior.data_vars):
        values = _as_f64(posterior[name].values)
        total.update(name.encode())
        total.update(repr(values.shape).encode())
        total.update(values.tobytes())
        variables[name] = {
            "shape": list(values.shape),
            "sha256": _sha256(values),
            "mean": _readable(values),
            "values": values.ravel().tolist(),
        }
    step_size = _as_f64(idata["sample_stats"]["step_size"].values)
    return {
        "posterior_sha256": total.hexdigest(),
        "step_size_sha256": _sha256(step_size),
        "step_size_mean": float(step_size.mean()),
        "step_size": step_size.ravel().tolist(),
        "variables": variables,
    }


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="run one case and pickle its InferenceData to --out")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.run is None:
        for case in CASES:
            env = " ".join(f"{k}={v}" for k, v in case.subprocess_env)
            print(f"{case.id:40s} {case.description}" + (f"  [{env}]" if env else ""))
        return 0
    idata = CASES_BY_ID[args.run].run()
    with open(args.out, "wb") as f:
        pickle.dump(idata, f)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
