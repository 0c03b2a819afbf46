"""SG-MCMC against NUTS on Bayesian logistic regression: time to an accurate posterior (issue 6).

One PyMC model, for every ``N`` in ``--sizes`` (default 10⁴, 10⁵, 10⁶), ``D = 20``::

    with pm.Model():
        beta = pm.Normal("beta", 0, 1, shape=20)
        pm.Bernoulli("y", logit_p=pm.Data("X", X) @ beta, observed=y)

on generated data (seed ``--seed``): standard-normal features standardised column by column,
``β* ~ N(0, 0.5²)``, ``y ~ Bernoulli(σ(X β*))``.

``--design natural`` replaces it with the natural-units logistic regression of the stress case
``natural_logistic`` (``tests/posteriors/stress.py``, whose data generator it calls): five raw
predictors — age (years), income ($), hour of day, distance (miles), air time (minutes,
correlated 0.99 with distance) — an intercept, ``Normal(0, 10)`` priors::

    with pm.Model():
        intercept = pm.Normal("intercept", 0, 10)
        beta = pm.Normal("beta", 0, 10, shape=5)
        pm.Bernoulli("y", logit_p=intercept + pm.Data("X", X) @ beta, observed=y)

(at ``N = 10⁶`` and ``--seed 0`` the data are the stress case's ``"full"`` data, row for row).
Its reference is the Laplace approximation (``tests/posteriors/common.laplace``, 20 000 i.i.d.
draws, as the correctness benchmark's; ``--ref-kind laplace``, the default for this design):
a NUTS reference would need NUTS to get there, and on this posterior it gets lost (see
``tests/posteriors/make_stress_references.py``), so a NUTS run that does not match Laplace
counts as not reaching the accuracy. ``--ref-kind nuts`` makes the numpyro reference instead.
The criteria cover ``intercept`` and ``beta``; ``--d`` is ignored (6 parameters). Only the
time-to-accuracy rows run for this design (``--no-throughput``).

Every sampler below runs the model; every measurement runs in a fresh interpreter
(``_report.run_script``), which regenerates the data, so nothing compiled or tuned is shared
between runs.

Reference
    A long numpyro NUTS run per ``N`` (``--ref-chains`` × ``--ref-draws`` after ``--ref-tune``
    warm-up draws), cached in ``--ref-dir`` (default ``/tmp``, outside the repository) as
    ``bench_ref_N<N>_D<D>_seed<seed>_<chains>x<draws>.nc`` and reused when present (the
    report says which). The timed runs never reuse it except to be compared with it.

Time to accuracy (one row per sampler and N)
    Wall time from before the step object is built (SG samplers: ``pmsg.IASG()`` etc. build
    the bridge) or before ``pm.sample`` is called (NUTS) to its return — compilation, tuning
    and warm-up included — of a run whose posterior passes all three criteria against the
    reference: every ``|mean − ref mean| ≤ --mean-tol`` (0.1) reference sds, every sd within
    ``--sd-tol`` (10%) of the reference sd, min bulk ESS ≥ ``--target-ess`` (400) over the 20
    coefficients (``pmsg.compare``). Protocol: the first attempt's draws are predicted to give
    ``1.25 × target`` ESS, from a prior ESS per draw per sampler at the first N and from the
    ESS per draw the sampler reached at the previous N afterwards; a failed attempt is rerun
    (fresh process, same seed) with ``max(2×, 1.25 × target / ESS ×)`` the draws (at most 8×),
    at most ``--max-attempts`` times and while the next attempt is predicted to take less
    than ``--max-attempt-seconds``; otherwise "not reached", with the time extrapolated from
    the last attempt's ESS per second. The table reports the passing attempt's wall time, the
    number of attempts and the wall time of all attempts together.

    - SG samplers: ``pmsg.sample(step=pmsg.<Sampler>(), chains=--chains, ...)`` (4 vmapped
      chains, two groups on the two cores), default settings (``batch_size = 256``, one pass
      per draw) and the tuning length the sampler's documentation page uses (IASG 20; SGLD
      300; the others 50). The ``--pm-sample-top`` fastest are rerun through
      ``pm.sample(step=..., chains=--chains, cores=2)`` from the draws that passed.
    - NUTS: ``pm.sample(nuts_sampler="numpyro" | "nutpie")`` and PyMC's default NUTS,
      ``--nuts-chains`` chains (default 2: one per core, which is the fastest way to 400
      ESS on two cores with 1000 warm-up draws per chain), default warm-up (1000) and
      target acceptance. numpyro runs in its own process (``pymc.sampling.jax`` rewrites
      ``XLA_FLAGS``). PyMC's default NUTS first makes a short run (100 + 100 draws); if the
      full protocol is predicted to take more than ``--pymc-max-seconds`` its time to ``target``
      ESS is extrapolated (marked so) from the short run's seconds per gradient evaluation
      and the tree sizes and ESS per draw of its full run at the largest smaller N (or, if
      none, the short run's own), accuracy not checked.

    The ratio column is each wall time over the fastest NUTS's at the same N.

ESS per data pass
    min bulk ESS / the data passes of the kept draws (``pmsg.compare``'s ``ess_per_pass``;
    passes summed over chains). For NUTS, a gradient evaluation is one pass: ESS / Σ
    ``n_steps`` of the kept draws.

Seconds per data pass (one chain, one core, ``B = --batch-size``, default 256 as the samplers)
    - each SG sampler: ``pmsg.sample(chains=1)`` with a callback timestamping every draw: the
      time of the draws after tuning (compiled during tuning) over their data passes; best
      of two calls on the same step object (the second is compiled already);
    - full-data gradient of the log-posterior: ``throughput.time_full_gradient`` (bridge)
      and ``time_full_gradient_by_hand`` (hand-written ``jax.numpy``);
    - the floor: a bare jitted ``lax.scan`` of SGLD over contiguous minibatch slices of a
      once-shuffled copy with the hand-written gradient — ``throughput.make_bare_pass``
      (offsets and noise drawn with ``split``/``randint``/``normal`` at every iteration), and
      the same loop with them drawn once per pass before the scan, as the package does
      (``floor_pass`` below; the lower of the two is "the floor");
    - BlackJAX: ``blackjax.sgld`` with ``blackjax.sgmcmc.gradients.grad_estimator`` on the
      same hand-written log-density (per-row log-likelihood, ``vmap``-ed by BlackJAX),
      minibatches of ``B`` uniform random indices (``jax.random.randint``) gathered from the
      data at every step, in a jitted ``lax.scan`` of ``ceil(N/B)`` steps.

    Micro-benchmarks: best of ``--repeats`` of the mean of several calls after a compiling
    call. Linearity: seconds per pass divided by ``N`` (per million rows) and the log-log slope
    between the two largest sizes (1 = linear).

Peak memory
    Peak RSS (``resource.getrusage(...).ru_maxrss``) of each run's process minus its RSS after
    its imports (before the data are made): the data, the model, compilation and sampling.
    PyMC's default NUTS (and ``pm.sample(step=..., cores=2)``) sample in worker processes, whose
    peak RSS (the largest one, their imports included) is reported separately.

Load: every row records ``os.getloadavg()`` at its start and the CPU that *other* processes
used while it ran (machine busy time from ``/proc/stat`` minus this run's own processes).

Run from the repository root::

    .venv/bin/python benchmarks/nuts_comparison.py --quick    # smoke run, N = 10⁴, prints only
    .venv/bin/python benchmarks/nuts_comparison.py            # the full run (hours), appends
                                                              # to RESULTS.md, writes the figure
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import resource
import shlex
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import REPO, ScriptTimeout, append_section, run_script  # noqa: E402
from nuts_comparison_figures import make_figure  # noqa: E402
from nuts_comparison_render import (  # noqa: E402
    NUTS_SAMPLERS,
    VARIANTS,
    machine_lines,
    passes_criteria,
    render,
    sg_s_per_pass,
)

HEADING = "## SG-MCMC vs NUTS: time to an accurate posterior (issue 6)"
INTRO = (
    "`benchmarks/nuts_comparison.py`: Bayesian logistic regression, D = 20; time to a posterior "
    "within 0.1 sd on every mean and 10% on every sd of a long NUTS reference with ≥ 400 ESS, "
    "for each SG sampler and for NUTS (PyMC, nutpie, numpyro); seconds per data pass against "
    "a bare JAX loop, a full gradient and BlackJAX; peak memory. See its docstring."
)
SG_SAMPLERS = ("IASG", "IASG-lr10", "ConstantSGD", "SGFS", "SGLD", "SAGALD", "SVRGLD")
# nutpie's JAX backend (for the logp and its gradient) instead of its default, numba.
NUTPIE_JAX = {"backend": "jax", "gradient_backend": "jax"}


def pymc_major() -> int:
    """PyMC's major version (the script runs on PyMC 5 and 6)."""
    import pymc as pm

    return int(pm.__version__.split(".")[0])


def nuts_sample_kwargs(driver: str) -> dict[str, Any]:
    """``pm.sample`` arguments that select ``driver``'s NUTS on this PyMC. PyMC 6 takes
    nutpie's backends as ``backend=`` / ``compile_kwargs={"gradient_backend": ...}`` (the
    nested ``nuts_sampler_kwargs`` form is deprecated) and makes nutpie its default NUTS when
    installed, so PyMC's own NUTS is asked for by name."""
    if driver == "pymc":
        return {"nuts_sampler": "pymc"}
    if driver == "nutpie-jax":
        if pymc_major() >= 6:
            return {
                "nuts_sampler": "nutpie",
                "backend": "jax",
                "compile_kwargs": {"gradient_backend": "jax"},
            }
        return {"nuts_sampler": "nutpie", "nuts_sampler_kwargs": NUTPIE_JAX}
    return {"nuts_sampler": driver}


def stat_values(result: Any) -> Any:
    """``az.ess`` / ``az.rhat`` of a posterior as one DataArray (ArviZ 0.x returns a
    Dataset, ArviZ 1 a DataTree)."""
    import xarray as xr

    if isinstance(result, xr.DataTree):
        result = result.to_dataset()
    return result.to_array()


def posterior_and_stats(idata: Any) -> Any:
    """A result with only its posterior and sample_stats groups (InferenceData or DataTree)."""
    import arviz as az
    import xarray as xr

    if isinstance(idata, xr.DataTree):  # ArviZ 1
        return xr.DataTree.from_dict(
            {g: idata[g].to_dataset() for g in ("posterior", "sample_stats")}
        )
    return az.InferenceData(posterior=idata.posterior, sample_stats=idata.sample_stats)


# Tuning draws as on each sampler's documentation page (docs/samplers/*.md).
SG_TUNE = {
    "IASG": 20,
    "IASG-lr10": 20,
    "SGLD": 300,
    "ConstantSGD": 50,
    "SGFS": 50,
    "SAGALD": 50,
    "SVRGLD": 50,
}
# Prior ESS per draw per chain for the first attempt's budget at the first N (docs, benchmarks).
PRIOR_ESS_PER_DRAW = {
    "IASG": 0.4,  # about 0.85 per pass at about half a pass per draw
    "IASG-lr10": 0.8,
    "ConstantSGD": 0.5,
    "SGFS": 0.5,
    "SGLD": 0.03,
    "SAGALD": 0.3,
    "SVRGLD": 0.3,
    "numpyro": 0.8,
    "nutpie-jax": 0.8,
    "nutpie": 0.8,
    "pymc": 0.8,
}
MARGIN = 1.25  # budgets aim at MARGIN × target ESS


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# =========================================================================================
# Worker side: everything below up to "Parent side" runs in a fresh interpreter.
# =========================================================================================


# The model of this run (the parent sets it from --design; :func:`run` adds it to every spec).
DESIGN = "standard"


def _stress() -> Any:
    """``tests/posteriors/stress.py`` (the natural-units design's generator)."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from posteriors import stress

    return stress


def var_names(design: str) -> list[str]:
    return ["intercept", "beta"] if design == "natural" else ["beta"]


def make_data(n: int, d: int, seed: int, design: str = "standard") -> tuple[Any, Any]:
    """Standardised ``N(0, 1)`` features, ``β* ~ N(0, 0.5²)``, ``y ~ Bernoulli(σ(Xβ*))``;
    or (``design="natural"``) the stress case natural_logistic's data (``d`` ignored).

    Standardised in place (no full-size temporaries, so peak memory is the data's)."""
    import numpy as np

    if design == "natural":
        stress = _stress()
        # As stress._data("natural_logistic", "full") (the same rows at N = 10⁶, seed 0).
        rng = np.random.default_rng([stress._SEED["natural_logistic"], 1 + seed])
        X = stress._natural_predictors(rng, n)
        t = stress.NATURAL_LOGISTIC_TRUE
        eta = t["intercept"] + X @ np.asarray(t["beta"])
        y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-eta))).astype(np.int64)
        return X, y

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    beta_true = 0.5 * rng.standard_normal(d)
    X -= X.mean(axis=0)
    X /= np.sqrt(np.einsum("ij,ij->j", X, X) / n)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(X @ beta_true)))).astype(np.int64)
    return X, y


def make_model(X: Any, y: Any, design: str = "standard") -> Any:
    import pymc as pm

    if design == "natural":  # as stress.build("natural_logistic")
        with pm.Model() as model:
            Xd = pm.Data("X", X)
            intercept = pm.Normal("intercept", 0.0, 10.0)
            beta = pm.Normal("beta", 0.0, 10.0, shape=X.shape[1])
            pm.Bernoulli("y", logit_p=intercept + Xd @ beta, observed=y)
        return model
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=pm.Data("X", X) @ beta, observed=y)
    return model


def build_step(sampler: str, n: int, batch_size: int | None = None) -> Any:
    """``pmsg.<sampler>()`` with its defaults, or a variant of :data:`VARIANTS`."""
    import pymc_sgmcmc as pmsg

    kwargs: dict[str, Any] = {} if batch_size is None else {"batch_size": batch_size}
    if sampler in VARIANTS:
        cls, _, extra = VARIANTS[sampler]
        kwargs.update(extra(n, batch_size or min(256, n)))
        sampler = cls
    return getattr(pmsg, sampler)(**kwargs)


def _rss_mb() -> float:
    """Current resident set size of this process (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peaks_mb() -> tuple[float, float]:
    """Peak RSS of this process and of its largest waited-for child (MB; Linux: KB units)."""
    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    )


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("pymc", "pymc_sgmcmc", "jax", "numpyro", "pytensor"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _criteria(idata: Any, ref_path: str, names: list[str] | None = None) -> dict[str, Any]:
    """``pmsg.compare`` against the reference: the numbers the criteria read."""
    import arviz as az
    import numpy as np

    import pymc_sgmcmc as pmsg

    ref = az.from_netcdf(ref_path)
    df = pmsg.compare(idata, ref, var_names=names or ["beta"])
    out = {
        "max_abs_mean_diff": float(np.max(np.abs(df["mean_diff_sd"]))),
        "sd_ratio_min": float(df["sd_ratio"].min()),
        "sd_ratio_max": float(df["sd_ratio"].max()),
        "ess_min": float(df["ess"].min()),
        "ess_per_pass": float(df["ess"].min() / df.attrs["data_passes"]),
        "passes_kept": float(df.attrs["data_passes"]),
        "gaussian_kl": float(df.attrs["gaussian_kl"]),
        "chains": int(idata.posterior.sizes["chain"]),
        "draws": int(idata.posterior.sizes["draw"]),
    }
    stats = idata.sample_stats
    if "data_passes" in stats:  # SG: every pass of every chain, tuning included
        out["passes_total"] = float(stats["data_passes"].max("draw").sum())
    if "n_steps" in stats:  # NUTS: one gradient evaluation = one pass over the data
        kept = float(stats["n_steps"].sum())
        out["grad_evals_kept"] = kept
        out["ess_per_pass"] = out["ess_min"] / kept
        warm = getattr(idata, "warmup_sample_stats", None)
        if warm is not None and "n_steps" in warm:
            out["grad_evals_warmup"] = float(warm["n_steps"].sum())
            out["steps_per_warmup_draw"] = float(warm["n_steps"].mean())
        out["steps_per_draw"] = float(stats["n_steps"].mean())
    return out


def _tta(spec: dict) -> dict:
    """One time-to-accuracy attempt (SG sampler or NUTS)."""
    driver, sampler = spec["driver"], spec["sampler"]
    if driver == "numpyro":
        import numpyro  # noqa: F401
        import pymc.sampling.jax  # noqa: F401  (rewrites XLA_FLAGS: in this process only)
    elif driver.startswith("nutpie"):
        import nutpie  # noqa: F401
    import arviz  # noqa: F401
    import pymc as pm

    import pymc_sgmcmc as pmsg

    _quiet()
    base = _rss_mb()
    load = os.getloadavg()
    design = spec.get("design", "standard")
    X, y = make_data(spec["n"], spec["d"], spec["seed"], design)
    model = make_model(X, y, design)
    del X
    common = dict(
        draws=spec["draws"],
        tune=spec["tune"],
        chains=spec["chains"],
        random_seed=spec["chain_seed"],
        progressbar=False,
        compute_convergence_checks=False,
    )
    t0 = time.perf_counter()
    with model:
        if driver in ("pmsg", "pm"):
            step = build_step(sampler, spec["n"])
            t_step = time.perf_counter() - t0
            if driver == "pmsg":
                idata = pmsg.sample(step=step, **common)
            else:
                idata = pm.sample(step=step, cores=spec["cores"], **common)
        else:
            t_step = 0.0
            if driver == "pymc":
                idata = pm.sample(
                    cores=spec["cores"],
                    discard_tuned_samples=False,
                    **nuts_sample_kwargs(driver),
                    **common,
                )
            else:
                idata = pm.sample(**nuts_sample_kwargs(driver), **common)
    wall = time.perf_counter() - t0
    peak, child_peak = _peaks_mb()
    out = {
        "wall": wall,
        "step_build": t_step,
        "sampling_time_attr": float(idata.posterior.attrs.get("sampling_time", float("nan"))),
        "load_start": load,
        "load_end": os.getloadavg(),
        "base_rss": base,
        "peak_rss": peak,
        "child_peak_rss": child_peak,
    }
    if driver in ("pmsg", "pm"):
        out["step_size"] = float(idata.sample_stats["step_size"].mean())
        out["thin"] = int(step.thin)
        if hasattr(step, "learning_rate"):
            out["learning_rate"] = float(step.learning_rate)
    out.update(_criteria(idata, spec["ref"], var_names(spec.get("design", "standard"))))
    return out


def _grad_time(spec: dict) -> dict:
    """Seconds per gradient evaluation of the log-density PyMC's NUTS compiles
    (``model.logp_dlogp_function``, the function its leapfrog steps call): the median of
    ``spec['calls']`` calls after a first one, and the compilation time."""
    import numpy as np

    _quiet()
    design = spec.get("design", "standard")
    X, y = make_data(spec["n"], spec["d"], spec["seed"], design)
    model = make_model(X, y, design)
    del X
    t0 = time.perf_counter()
    fn = model.logp_dlogp_function(ravel_inputs=True)
    fn.set_extra_values({})
    x = np.zeros(spec["d"])
    fn(x)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(spec["calls"]):
        t = time.perf_counter()
        fn(x + 0.01 * len(times))
        times.append(time.perf_counter() - t)
    return {
        "s_per_grad_eval": float(np.median(times)),
        "compile": compile_s,
        "load_start": os.getloadavg(),
    }


def _reference(spec: dict) -> dict:
    """The long numpyro NUTS reference, saved to ``spec['path']``."""
    import arviz as az
    import numpyro  # noqa: F401
    import pymc as pm
    import pymc.sampling.jax  # noqa: F401

    _quiet()
    design = spec.get("design", "standard")
    X, y = make_data(spec["n"], spec["d"], spec["seed"], design)
    model = make_model(X, y, design)
    del X
    names = var_names(design)
    if spec.get("ref_kind") == "laplace":
        return _laplace_reference(spec, model, names)
    t0 = time.perf_counter()
    with model:
        idata = pm.sample(
            draws=spec["draws"],
            tune=spec["tune"],
            chains=spec["chains"],
            nuts_sampler="numpyro",
            random_seed=spec["chain_seed"],
            progressbar=False,
            compute_convergence_checks=False,
        )
    wall = time.perf_counter() - t0
    ess = stat_values(az.ess(idata.posterior, var_names=names, method="bulk"))
    rhat = stat_values(az.rhat(idata.posterior, var_names=names))
    keep = posterior_and_stats(idata)
    keep.posterior.attrs.update(
        {
            "bench_wall_seconds": wall,
            "bench_created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "bench_draws": spec["draws"],
            "bench_tune": spec["tune"],
        }
    )
    tmp = spec["path"] + ".part"
    keep.to_netcdf(tmp)
    os.replace(tmp, spec["path"])
    return {
        "wall": wall,
        "ess_min": float(ess.min()),
        "rhat_max": float(rhat.max()),
        "load_start": os.getloadavg(),
    }


def _laplace_reference(spec: dict, model: Any, names: list[str]) -> dict:
    """The Laplace approximation (``tests/posteriors/common.laplace``: exact-Hessian Newton
    to the mode, 20 000 i.i.d. draws), saved to ``spec['path']`` as a one-chain posterior."""
    import arviz as az

    _stress()
    from posteriors.common import laplace

    t0 = time.perf_counter()
    fit = laplace(model, draws=20_000, seed=spec["chain_seed"])
    wall = time.perf_counter() - t0
    if not fit["converged"]:
        raise RuntimeError("Laplace did not converge")
    posterior = {k: fit["draws"][k] for k in names}
    if int(az.__version__.split(".")[0]) >= 1:
        idata = az.from_dict({"posterior": posterior})
    else:
        idata = az.from_dict(posterior=posterior)
    idata.posterior.attrs.update(
        {
            "bench_wall_seconds": wall,
            "bench_created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "bench_kind": "laplace",
        }
    )
    tmp = spec["path"] + ".part"
    idata.to_netcdf(tmp)
    os.replace(tmp, spec["path"])
    return {
        "wall": wall,
        "ess_min": 20_000.0,
        "rhat_max": float("nan"),
        "load_start": os.getloadavg(),
    }


def _sg_pass(spec: dict) -> dict:
    """Seconds per data pass of one SG sampler through ``pmsg.sample(chains=1)``."""
    import pymc as pm  # noqa: F401

    import pymc_sgmcmc as pmsg

    _quiet()
    base = _rss_mb()
    load = os.getloadavg()
    design = spec.get("design", "standard")
    X, y = make_data(spec["n"], spec["d"], spec["seed"], design)
    model = make_model(X, y, design)
    del X
    draws, tune = spec["draws"], spec["tune"]
    with model:
        step = build_step(spec["sampler"], spec["n"], spec["batch_size"])
        results = []
        for call in range(2):
            marks: dict[int, tuple[float, float]] = {}

            def callback(trace: Any, draw: Any, marks: dict = marks) -> None:
                marks[draw.draw_idx] = (time.perf_counter(), float(draw.stats[0]["data_passes"]))

            t0 = time.perf_counter()
            pmsg.sample(
                step=step,
                draws=draws,
                tune=tune,
                chains=1,
                random_seed=call,
                progressbar=False,
                compute_convergence_checks=False,
                callback=callback,
            )
            total = time.perf_counter() - t0
            (t_a, p_a), (t_b, p_b) = marks[tune - 1], marks[tune + draws - 1]
            results.append(
                {"s_per_pass": (t_b - t_a) / (p_b - p_a), "passes": p_b - p_a, "wall": total}
            )
    peak, _ = _peaks_mb()
    best = min(results, key=lambda r: r["s_per_pass"])
    return {
        **best,
        "first_wall": results[0]["wall"],
        "all_s_per_pass": [r["s_per_pass"] for r in results],
        "batch_size": step.batch_size,
        "thin": step.thin,
        "load_start": load,
        "load_end": os.getloadavg(),
        "base_rss": base,
        "peak_rss": peak,
    }


def floor_pass(n: int, b: int, grad_fn: Any) -> Any:
    """Jitted ``(key, θ, X_padded, y_padded) -> θ``: one pass of ``ceil(n/b)`` SGLD steps on
    contiguous slices, offsets and noise drawn once per pass before the scan (as the
    package's draw does), ``grad_fn(θ, X_batch, y_batch)`` the minibatch gradient."""
    import jax
    import jax.numpy as jnp
    from throughput import STEP_SIZE

    iterations = math.ceil(n / b)

    @jax.jit
    def one_pass(key: Any, theta: Any, Xp: Any, yp: Any) -> Any:
        k_start, k_noise = jax.random.split(key)
        starts = jax.random.randint(k_start, (iterations,), 0, n)
        noise = jax.random.normal(k_noise, (iterations, theta.shape[0]), theta.dtype)

        def body(theta: Any, inputs: Any) -> Any:
            start, z = inputs
            xb = jax.lax.dynamic_slice_in_dim(Xp, start, b)
            yb = jax.lax.dynamic_slice_in_dim(yp, start, b)
            g = grad_fn(theta, xb, yb)
            return theta + 0.5 * STEP_SIZE * g + math.sqrt(STEP_SIZE) * z, None

        theta, _ = jax.lax.scan(body, theta, (starts, noise))
        return jnp.asarray(theta)

    return one_pass


def blackjax_pass(n: int, b: int) -> Any:
    """Jitted one pass (``ceil(n/b)`` steps) of ``blackjax.sgld`` with random-index batches."""
    import blackjax
    import jax
    from throughput import STEP_SIZE, hand_loglik_rows, hand_logprior

    def loglik_one(theta: Any, row: Any) -> Any:
        x, y = row
        return hand_loglik_rows(theta, x, y)  # x: (D,), a scalar log-likelihood

    grad = blackjax.sgmcmc.gradients.grad_estimator(hand_logprior, loglik_one, n)
    sgld = blackjax.sgld(grad)
    iterations = math.ceil(n / b)

    @jax.jit
    def one_pass(key: Any, theta: Any, X: Any, y: Any) -> Any:
        def body(theta: Any, key: Any) -> Any:
            k_idx, k_step = jax.random.split(key)
            idx = jax.random.randint(k_idx, (b,), 0, n)
            return sgld.step(k_step, theta, (X[idx], y[idx]), STEP_SIZE), None

        theta, _ = jax.lax.scan(body, theta, jax.random.split(key, iterations))
        return theta

    return one_pass


def _micro(spec: dict) -> dict:
    """Full gradients, bare loops or BlackJAX: seconds per pass (best of repeats)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import throughput as tp

    import pymc_sgmcmc as pmsg

    _quiet()
    base = _rss_mb()
    load = os.getloadavg()
    n, b, what = spec["n"], spec["batch_size"], spec["what"]
    repeats, calls = spec["repeats"], spec["calls"]
    X_np, y_np = make_data(n, spec["d"], spec["seed"])
    out: dict[str, Any] = {}
    if what == "fullgrad":
        model = make_model(X_np, y_np)
        problem = pmsg.build_problem(model)
        X, y = (jnp.asarray(a) for a in problem.data)
        tp.check_same_density(problem, X, y)
        out["full_grad_bridge"] = tp.time_full_gradient(problem, repeats, calls)
        out["full_grad_hand"] = tp.time_full_gradient_by_hand(X, y, repeats, calls)
    elif what == "floor":
        Xp, yp = tp.block_layout(X_np, y_np, b, spec["seed"])
        del X_np
        grad = jax.grad(tp.hand_logdensity(n, b))
        out["bare_loop"] = tp.time_bare_loop(Xp, yp, n, b, grad, repeats, calls)
        one_pass = floor_pass(n, b, grad)
        key, theta = jax.random.PRNGKey(0), jnp.zeros(Xp.shape[1])
        tp.warm_up(lambda: one_pass(key, theta, Xp, yp))
        out["floor_pass_prng"] = tp.best_time(lambda: one_pass(key, theta, Xp, yp), repeats, calls)
    elif what == "blackjax":
        X, y = jnp.asarray(X_np), jnp.asarray(y_np)
        del X_np
        one_pass = blackjax_pass(n, b)
        key, theta = jax.random.PRNGKey(0), jnp.zeros(X.shape[1])
        tp.warm_up(lambda: one_pass(key, theta, X, y))
        out["blackjax_sgld"] = tp.best_time(lambda: one_pass(key, theta, X, y), repeats, calls)
    else:
        raise ValueError(what)
    peak, _ = _peaks_mb()
    out.update(load_start=load, load_end=os.getloadavg(), base_rss=base, peak_rss=peak)
    return out


def worker(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    kind = spec["kind"]
    fn = {
        "tta": _tta,
        "reference": _reference,
        "sg_pass": _sg_pass,
        "micro": _micro,
        "grad_time": _grad_time,
    }[kind]
    result = fn(spec)
    print("RESULT" + json.dumps(result), flush=True)


_WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "benchmarks")
    import nuts_comparison
    nuts_comparison.worker(sys.argv[1:])
    """
)


# =========================================================================================
# Parent side
# =========================================================================================


class Meter:
    """CPU used by other processes while a measurement ran (cores, on average)."""

    def __init__(self) -> None:
        from throughput import system_busy_seconds

        self._busy = system_busy_seconds
        self.busy0 = system_busy_seconds()
        self.own0 = self._own()
        self.wall0 = time.perf_counter()

    @staticmethod
    def _own() -> float:
        return sum(
            getattr(resource.getrusage(who), f)
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
            for f in ("ru_utime", "ru_stime")
        )

    def others(self) -> float:
        busy = self._busy() - self.busy0
        own = self._own() - self.own0
        return max(busy - own, 0.0) / max(time.perf_counter() - self.wall0, 1e-9)


def run(spec: dict, timeout: float | None = None) -> dict:
    """``spec`` in a fresh interpreter; the result with ``others`` (cores) and ``elapsed``;
    ``{"error": ...}`` if it failed, with ``killed`` (seconds) if killed at ``timeout``."""
    spec = {**spec, "design": spec.get("design", DESIGN)}
    meter = Meter()
    load = os.getloadavg()
    t0 = time.perf_counter()
    try:
        result = run_script(_WORKER, json.dumps(spec), timeout=timeout)
    except ScriptTimeout as err:
        result = {"error": str(err), "killed": err.seconds, "load_start": load}
    except RuntimeError as err:
        result = {"error": str(err)[-1500:]}
    result["others"] = meter.others()
    result["elapsed"] = time.perf_counter() - t0
    return result


def reference_path(args: argparse.Namespace, n: int) -> Path:
    if args.design == "natural":
        kind = "laplace" if args.ref_kind == "laplace" else f"{args.ref_chains}x{args.ref_draws}"
        name = f"bench_ref_natural_N{n}_seed{args.seed}_{kind}.nc"
    else:
        name = f"bench_ref_N{n}_D{args.d}_seed{args.seed}_{args.ref_chains}x{args.ref_draws}.nc"
    return Path(args.ref_dir) / name


def ensure_reference(args: argparse.Namespace, n: int) -> dict:
    path = reference_path(args, n)
    if path.exists():
        import arviz as az

        ref = az.from_netcdf(path)
        names = var_names(args.design)
        ess = stat_values(az.ess(ref.posterior, var_names=names, method="bulk"))
        info = {
            "path": str(path),
            "reused": True,
            "wall": float(ref.posterior.attrs.get("bench_wall_seconds", float("nan"))),
            "created": str(ref.posterior.attrs.get("bench_created", "?")),
            "ess_min": float(ess.min()),
            "rhat_max": float(stat_values(az.rhat(ref.posterior, var_names=names)).max()),
        }
        log(f"N={n}: reusing the cached reference {path} (made {info['created']})")
        return info
    if args.ref_kind == "laplace":
        log(f"N={n}: reference: the Laplace approximation (20000 draws) -> {path}")
    else:
        log(
            f"N={n}: reference: numpyro NUTS {args.ref_chains} chains x "
            f"({args.ref_tune} + {args.ref_draws}) -> {path}"
        )
    spec = {
        "kind": "reference",
        "n": n,
        "d": args.d,
        "seed": args.seed,
        "chain_seed": 12345,
        "draws": args.ref_draws,
        "tune": args.ref_tune,
        "chains": args.ref_chains,
        "path": str(path),
        "ref_kind": args.ref_kind,
    }
    result = run(spec)
    if "error" in result:
        raise RuntimeError(f"reference run failed: {result['error']}")
    log(
        f"  {result['wall']:.0f} s, min ESS {result['ess_min']:.0f}, max r-hat {result['rhat_max']:.3f}"
    )
    return {"path": str(path), "reused": False, "created": "this run", **result}


def _round_draws(draws: float, chunk: int = 10) -> int:
    return int(max(chunk, chunk * math.ceil(draws / chunk)))


def time_to_accuracy(
    args: argparse.Namespace,
    n: int,
    ref: dict,
    driver: str,
    sampler: str,
    chains: int,
    tune: int,
    draws: int,
    predict_seconds: Any,
    timeout: float | Callable[[int], float] | None = None,
) -> dict:
    """The attempt protocol of the module docstring; ``predict_seconds(draws)`` (or None)
    estimates an attempt's wall time before the first one is run; an attempt still running
    after ``timeout`` seconds (or ``timeout(draws)``) is killed and ends the protocol
    (``row['killed']``)."""
    attempts: list[dict] = []
    label = f"{sampler} ({driver})"
    total = 0.0
    capped = False
    if predict_seconds is not None and predict_seconds(draws) > args.max_attempt_seconds:
        fit = draws
        while fit > 10 and predict_seconds(fit) > args.max_attempt_seconds:
            fit = _round_draws(fit * 0.8)
        log(
            f"N={n}: {label}: {draws} draws predicted {predict_seconds(draws):.0f} s > "
            f"{args.max_attempt_seconds:.0f} s: first attempt capped at {fit} draws"
        )
        draws, capped = fit, True
    while True:
        spec = {
            "kind": "tta",
            "driver": driver,
            "sampler": sampler,
            "n": n,
            "d": args.d,
            "seed": args.seed,
            "chain_seed": 1,
            "draws": draws,
            "tune": tune,
            "chains": chains,
            "cores": 2,
            "ref": ref["path"],
        }
        limit = timeout(draws) if callable(timeout) else timeout
        log(
            f"N={n}: {label}: attempt {len(attempts) + 1}, {chains} chains x ({tune} + {draws})"
            + (f", killed after {limit:.0f} s" if limit else "")
        )
        r = run(spec, timeout=limit)
        r["draws_per_chain"] = draws
        attempts.append(r)
        total += r["elapsed"]
        if "killed" in r:
            log(f"  killed after {r['killed']:.0f} s")
            break
        if "error" in r:
            log(f"  FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            break
        ok = passes_criteria(r, args)
        log(
            f"  {r['wall']:.1f} s, min ESS {r['ess_min']:.0f}, max|dmean| "
            f"{r['max_abs_mean_diff']:.3f} sd, sd ratio {r['sd_ratio_min']:.3f}-"
            f"{r['sd_ratio_max']:.3f}, ESS/pass {r['ess_per_pass']:.3g} -> "
            f"{'PASS' if ok else 'fail'} (load {r['load_start'][0]:.1f}, others {r['others']:.2f})"
        )
        if ok or len(attempts) >= args.max_attempts:
            break
        factor = 2.0
        if r["ess_min"] > 0:
            factor = max(2.0, MARGIN * args.target_ess / r["ess_min"])
        factor = min(factor, 8.0)
        new_draws = _round_draws(draws * factor)
        # Predicted: the fixed part (wall minus the draws' share) plus the draws scaled.
        per_draw = r["sampling_time_attr"] / (draws + tune) if driver in ("pmsg", "pm") else None
        if per_draw and math.isfinite(per_draw):
            predicted = r["wall"] + (new_draws - draws) * per_draw
        else:
            predicted = r["wall"] * (new_draws + tune) / (draws + tune)
        if predicted > args.max_attempt_seconds:
            log(f"  next attempt ({new_draws} draws) predicted {predicted:.0f} s: stop")
            break
        draws = new_draws
    last = attempts[-1]
    passed = passes_criteria(last, args)
    row = {
        "n": n,
        "driver": driver,
        "sampler": sampler,
        "chains": chains,
        "tune": tune,
        "attempts": attempts,
        "n_attempts": len(attempts),
        "reached": passed,
        "total_elapsed": total,
        "final": last,
        "first_capped": capped,
    }
    if "killed" in last:
        # A lower bound on the time to accuracy: a passing run makes at least the killed
        # attempt's warm-up iterations (draws only grow between attempts), which take at least
        # their share of its iterations' time (NUTS warm-up trees are no cheaper than later
        # ones); the attempt's own wall time exceeded the limit.
        row["killed"] = last["killed"]
        row["lower_bound"] = last["killed"] * tune / (tune + draws)
        return row
    if not passed and "error" not in last and last["ess_min"] > 0:
        # Extrapolated: the fixed part plus the draws for target ESS at the last ESS per draw.
        ess_per_draw = last["ess_min"] / last["draws_per_chain"]
        need = args.target_ess / ess_per_draw
        per_draw = (
            last["sampling_time_attr"] / (last["draws_per_chain"] + tune)
            if driver in ("pmsg", "pm")
            else last["wall"] / (last["draws_per_chain"] + tune)
        )
        row["extrapolated_wall"] = last["wall"] + (need - last["draws_per_chain"]) * per_draw
    return row


def nuts_time_limit(args: argparse.Namespace, rows: list[dict], n: int) -> Callable[[int], float]:
    """``draws -> seconds`` after which a NUTS attempt is killed: ``--nuts-max-seconds``, or
    sooner once it is certainly slower than the fastest NUTS that reached the accuracy at this
    N (time ``T``): at ``T · (1000 + draws) / 1000``, when even its 1000 warm-up draws' share
    of the time exceeds ``T`` (the lower bound :func:`time_to_accuracy` reports)."""
    reached = [
        r["final"]["wall"]
        for r in rows
        if r["n"] == n and r["driver"] in NUTS_SAMPLERS and r.get("reached")
    ]
    best = min(reached, default=math.inf)

    def limit(draws: int) -> float:
        return min(args.nuts_max_seconds, best * (1000 + draws) / 1000)

    return limit


def first_draws(args: argparse.Namespace, name: str, chains: int, history: dict) -> int:
    ess_per_draw = history.get(name, PRIOR_ESS_PER_DRAW[name])
    return _round_draws(MARGIN * args.target_ess / (chains * ess_per_draw))


def remember(history: dict, name: str, row: dict) -> None:
    last = row["final"]
    if "error" not in last and last.get("ess_min", 0) > 0:
        history[name] = last["ess_min"] / (last["chains"] * last["draws_per_chain"])


def _pymc_failed_row(n: int, chains: int, result: dict) -> dict:
    """PyMC's NUTS row when the measurement its prediction needs failed (rendered as an error)."""
    return {
        "n": n,
        "driver": "pymc",
        "sampler": "pymc",
        "reached": False,
        "final": result,
        "attempts": [result],
        "n_attempts": 0,
        "total_elapsed": result["elapsed"],
        "chains": chains,
        "tune": 1000,
    }


def pymc_nuts(args: argparse.Namespace, n: int, ref: dict, history: dict, rows: list) -> dict:
    """PyMC's default NUTS: the full protocol if predicted to fit in ``--pymc-max-seconds``,
    else its time extrapolated.

    The prediction needs PyMC's seconds per gradient evaluation at this ``N`` and its tree
    sizes and ESS per draw. With a full PyMC run at a smaller N (the largest), the tree sizes
    and ESS per draw are that run's (they hardly depend on N for this model) and the seconds
    per gradient are timed directly (``_grad_time``: the compiled ``logp_dlogp_function``
    NUTS calls, one process). Without one, a short run (100 + 100 draws) gives all of them
    (its early warm-up trees are deep, so at large N it is itself long)."""
    chains = args.nuts_chains
    source = None
    for row in reversed(rows):
        if row["driver"] == "pymc" and row.get("reached") and not row.get("extrapolated"):
            source = row
            break
    short = None
    if source is not None:
        f = source["final"]
        lf_warm, lf_draw = f["steps_per_warmup_draw"], f["steps_per_draw"]
        ess_per_draw = f["ess_min"] / (f["chains"] * f["draws_per_chain"])
        fixed = f["wall"] - f["sampling_time_attr"]
        log(f"N={n}: NUTS (pymc): timing its gradient")
        spec = {"kind": "grad_time", "n": n, "d": args.d, "seed": args.seed, "calls": 30}
        timing = run(spec, timeout=args.pymc_max_seconds)
        if "error" in timing:
            log(f"  gradient timing failed: {timing['error'][-300:]}")
            return _pymc_failed_row(n, chains, timing)
        s_per_eval = timing["s_per_grad_eval"]
        source_txt = (
            f"seconds per gradient timed at this N (median of 30 calls of the compiled "
            f"logp_dlogp_function, one process); tree sizes, ESS per draw and fixed time of "
            f"PyMC's full run at N = {source['n']:,}"
        )
        measured = timing
    else:
        log(f"N={n}: NUTS (pymc): short run, {chains} chains x (100 + 100)")
        spec = {
            "kind": "tta",
            "driver": "pymc",
            "sampler": "pymc",
            "n": n,
            "d": args.d,
            "seed": args.seed,
            "chain_seed": 1,
            "draws": 100,
            "tune": 100,
            "chains": chains,
            "cores": 2,
            "ref": ref["path"],
        }
        short = run(spec, timeout=args.pymc_max_seconds)
        if "error" in short:
            log(f"  short run failed: {short['error'][-300:]}")
            return _pymc_failed_row(n, chains, short)
        evals_per_chain = (short["grad_evals_kept"] + short["grad_evals_warmup"]) / chains
        fixed = short["wall"] - short["sampling_time_attr"]
        s_per_eval = short["sampling_time_attr"] / evals_per_chain  # chains side by side
        lf_warm, lf_draw = short["steps_per_warmup_draw"], short["steps_per_draw"]
        ess_per_draw = PRIOR_ESS_PER_DRAW["pymc"]
        source_txt = (
            f"short run: {chains} chains × (100 + 100) in {short['wall']:.0f} s, its seconds "
            "per gradient and tree sizes, prior ESS/draw 0.8"
        )
        measured = short
    draws_needed = args.target_ess / (chains * ess_per_draw)
    predicted = fixed + (1000 * lf_warm + draws_needed * lf_draw) * s_per_eval
    log(f"  {s_per_eval * 1e3:.2f} ms per gradient; full protocol predicted {predicted:.0f} s")
    if predicted <= args.pymc_max_seconds:
        draws = first_draws(args, "pymc", chains, history)
        row = time_to_accuracy(
            args, n, ref, "pymc", "pymc", chains, 1000, draws, None, args.pymc_max_seconds
        )
        row["prediction"] = {"predicted": predicted, "source": source_txt}
        if short is not None:
            row["short_run"] = short
        return row
    return {
        "n": n,
        "driver": "pymc",
        "sampler": "pymc",
        "chains": chains,
        "tune": 1000,
        "attempts": [measured],
        "n_attempts": 0,
        "reached": False,
        "extrapolated": True,
        "extrapolated_wall": predicted,
        "extrapolation": {
            "s_per_grad_eval": s_per_eval,
            "fixed_seconds": fixed,
            "steps_per_warmup_draw": lf_warm,
            "steps_per_draw": lf_draw,
            "ess_per_draw_per_chain": ess_per_draw,
            "draws_needed": draws_needed,
            "source": source_txt,
        },
        "total_elapsed": measured["elapsed"],
        "final": measured,
        "short_run": short,
    }


def throughput(args: argparse.Namespace, n: int, samplers: list[str]) -> dict:
    """Seconds per data pass at ``n``: full gradients, floors, BlackJAX, each SG sampler."""
    calls = max(3, (3 * 10**6) // n) if not args.quick else 3
    out: dict[str, Any] = {"n": n, "runs": {}}
    for what in ("fullgrad", "floor", "blackjax"):
        log(f"N={n}: {what}")
        spec = {
            "kind": "micro",
            "what": what,
            "n": n,
            "d": args.d,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "repeats": args.repeats,
            "calls": calls,
        }
        r = run(spec)
        out["runs"][what] = r
        log("  " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r.items() if k in _MICRO_KEYS))
    draws = 10 * math.ceil(max(40, 4e7 / n) / 10) if not args.quick else 20
    for sampler in samplers:
        log(f"N={n}: {sampler}: seconds per pass, pmsg.sample(chains=1), {draws} draws")
        spec = {
            "kind": "sg_pass",
            "sampler": sampler,
            "n": n,
            "d": args.d,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "draws": draws,
            "tune": min(SG_TUNE[sampler], 50),
        }
        r = run(spec)
        out["runs"][sampler] = r
        if "error" in r:
            log(f"  FAILED: {r['error'][-300:]}")
        else:
            log(f"  {r['s_per_pass'] * 1e3:.2f} ms per pass ({r['passes']:.0f} passes)")
    return out


_MICRO_KEYS = (
    "full_grad_bridge",
    "full_grad_hand",
    "bare_loop",
    "floor_pass_prng",
    "blackjax_sgld",
)


# -----------------------------------------------------------------------------------------
# Main
# -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated N")
    p.add_argument("--d", type=int, default=20)
    p.add_argument(
        "--design",
        choices=("standard", "natural"),
        default="standard",
        help="standard: standardised N(0,1) features, D = --d; natural: the stress case "
        "natural_logistic (raw predictors in natural units, Normal(0, 10) priors)",
    )
    p.add_argument(
        "--ref-kind",
        choices=("nuts", "laplace"),
        default=None,
        help="reference: numpyro NUTS (default for the standard design) or the Laplace "
        "approximation (default for the natural design)",
    )
    p.add_argument("--samplers", default=",".join(SG_SAMPLERS), help="SG samplers")
    p.add_argument("--nuts", default=",".join(NUTS_SAMPLERS), help="numpyro,nutpie,pymc")
    p.add_argument("--chains", type=int, default=4, help="SG chains (pmsg.sample)")
    p.add_argument("--nuts-chains", type=int, default=2)
    p.add_argument("--target-ess", type=float, default=400)
    p.add_argument("--mean-tol", type=float, default=0.1)
    p.add_argument(
        "--speed-goal",
        type=float,
        default=10,
        help="the goal: SG time to accuracy this many times shorter than the fastest NUTS",
    )
    p.add_argument("--sd-tol", type=float, default=0.1)
    p.add_argument("--max-attempts", type=int, default=4)
    p.add_argument("--max-attempt-seconds", type=float, default=1800)
    p.add_argument("--pymc-max-seconds", type=float, default=600)
    p.add_argument(
        "--nuts-max-seconds",
        type=float,
        default=1800,
        help="numpyro/nutpie attempts are killed after this (and once slower than the fastest)",
    )
    p.add_argument(
        "--pm-sample-top", type=int, default=2, help="fastest SG samplers rerun via pm.sample"
    )
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ref-draws", type=int, default=2000)
    p.add_argument("--ref-tune", type=int, default=1000)
    p.add_argument("--ref-chains", type=int, default=4)
    p.add_argument("--ref-dir", default="/tmp")
    p.add_argument("--no-throughput", action="store_true", help="skip the per-pass timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: N = 1e4, target ESS 100")
    p.add_argument("--out", default=None, help="RESULTS.md to append to; '-' only prints")
    p.add_argument("--figure", default=None)
    p.add_argument("--json", default=None, help="raw results (written as the run goes)")
    p.add_argument("--render", default=None, help="only render this JSON of an earlier run")
    args = p.parse_args(argv)
    if args.ref_kind is None:
        args.ref_kind = "laplace" if args.design == "natural" else "nuts"
    if args.design == "natural":
        args.d = 6  # intercept + 5 coefficients (reported as D)
        args.no_throughput = True
    if args.quick:
        if args.sizes == p.get_default("sizes"):
            args.sizes = "10000"
        if args.target_ess == p.get_default("target_ess"):
            args.target_ess = 100
        args.ref_draws, args.ref_tune = min(args.ref_draws, 1000), min(args.ref_tune, 500)
        args.max_attempts = min(args.max_attempts, 2)
        args.repeats = 1
    default_out = "-" if args.quick else str(REPO / "benchmarks" / "RESULTS.md")
    args.out = args.out or default_out
    figdir = Path("/tmp") if args.quick else REPO / "benchmarks" / "figures"
    args.figure = args.figure or str(figdir / "nuts_comparison.png")
    args.json = args.json or str(figdir / "nuts_comparison.json")
    return args


def main(argv: list[str] | None = None) -> None:
    global DESIGN
    args = parse_args(argv)
    DESIGN = args.design
    argv_used = list(sys.argv[1:] if argv is None else argv)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        # The run's own options (tolerances, attempts, target ESS, ...), then those given
        # here: a re-render judges the rows by the criteria they were measured against.
        stored = shlex.split(results.get("command", ""))[2:]
        try:
            args = parse_args(stored + argv_used)
        except SystemExit:
            log(f"could not parse the stored command {results.get('command')!r}; using this one")
    else:
        results = collect(args, argv_used)
    section = render(results, args)
    make_figure(
        results["rows"],
        results["throughput"],
        results["samplers"],
        Path(args.figure),
        args.target_ess,
    )
    log(f"figure: {args.figure}")
    print(section)
    if args.out != "-":
        append_section(Path(args.out), section, HEADING, INTRO)
        log(f"appended to {args.out}")


def collect(args: argparse.Namespace, argv_used: list[str]) -> dict:
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    samplers = [s for s in args.samplers.split(",") if s.strip()]
    nuts = [s for s in args.nuts.split(",") if s.strip()]
    t0 = time.perf_counter()
    fmt = lambda la: " / ".join(f"{x:.2f}" for x in la)  # noqa: E731
    results: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": shlex.join(["python", "benchmarks/nuts_comparison.py", *argv_used]),
        "sizes": sizes,
        "samplers": samplers,
        "load_start": fmt(os.getloadavg()),
        "references": {},
        "throughput": [],
        "rows": [],
    }
    for line in machine_lines(args):
        log(line[2:])
    log(f"load average {results['load_start']}")

    def save() -> None:
        results["elapsed"] = time.perf_counter() - t0
        results["load_end"] = fmt(os.getloadavg())
        loads = [
            a["load_start"][0]
            for row in results["rows"]
            for a in row["attempts"]
            if a.get("load_start")
        ] + [
            r["load_start"][0]
            for tp in results["throughput"]
            for r in tp["runs"].values()
            if r.get("load_start")
        ]
        results["load_max"] = max(loads, default=os.getloadavg()[0])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))

    history: dict[str, float] = {}
    for n in sizes:
        ref = ensure_reference(args, n)
        results["references"][n] = ref
        save()
        if not args.no_throughput:
            results["throughput"].append(throughput(args, n, samplers))
            save()
        for sampler in samplers:
            draws = first_draws(args, sampler, args.chains, history)
            predict = None
            if results["throughput"]:
                s_pass = sg_s_per_pass(results["throughput"][-1], sampler)
                if math.isfinite(s_pass):
                    tune = SG_TUNE[sampler]
                    # 4 chains in 2 groups of 2 on the 2 cores, plus ~20 s of set-up.
                    predict = lambda d, s=s_pass, t=tune: 20 + (t + d) * s * args.chains / 2  # noqa: E731
            row = time_to_accuracy(
                args, n, ref, "pmsg", sampler, args.chains, SG_TUNE[sampler], draws, predict
            )
            remember(history, sampler, row)
            results["rows"].append(row)
            save()
        fastest: list[dict] = []
        for r in sorted(
            (r for r in results["rows"] if r["n"] == n and r["driver"] == "pmsg" and r["reached"]),
            key=lambda r: r["final"]["wall"],
        ):
            # Skip a sampler whose draws equal one already chosen (SGFS's defaults are
            # ConstantSGD's full-preconditioner draws, bit for bit).
            same = [
                q
                for q in fastest
                if q["final"]["ess_min"] == r["final"]["ess_min"]
                and q["final"]["max_abs_mean_diff"] == r["final"]["max_abs_mean_diff"]
            ]
            if not same and len(fastest) < args.pm_sample_top:
                fastest.append(r)
        for r in fastest:
            row = time_to_accuracy(
                args,
                n,
                ref,
                "pm",
                r["sampler"],
                args.chains,
                r["tune"],
                r["final"]["draws_per_chain"],
                None,
            )
            results["rows"].append(row)
            save()
        for name in nuts:
            if name == "pymc":
                row = pymc_nuts(args, n, ref, history, results["rows"])
            else:
                draws = first_draws(args, name, args.nuts_chains, history)
                row = time_to_accuracy(
                    args,
                    n,
                    ref,
                    name,
                    name,
                    args.nuts_chains,
                    1000,
                    draws,
                    None,
                    nuts_time_limit(args, results["rows"], n),
                )
            if not row.get("extrapolated"):
                remember(history, name, row)
            results["rows"].append(row)
            save()
    save()
    return results


if __name__ == "__main__":
    main()
