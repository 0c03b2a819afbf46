"""Mandt, Hoffman & Blei (2017) Fig. 4: IASG vs SGLD vs NUTS on a linear regression (issue 3).

The experiment of §7.2 ("Iterate Averaging as Approximate MCMC"): how fast does each sampler's
estimate of the marginal posterior variances converge, measured in passes over the data?

Data and model (generated with numpy, ``--seed``)::

    N = 10 000 rows, D = 10 features, x_n ~ N(0, Σx),
    Σx: features 0-3 equicorrelated (ρ = 0.8, ``--rho``), features 4-9 independent, unit variances
    β_true ~ N(0, I),  y_n = x_nᵀ β_true + N(0, 1)

    with pm.Model():
        beta = pm.Normal("beta", 0, 1, shape=D)
        pm.Normal("y", pm.Data("X", X) @ beta, 1.0, observed=y)

Noise sd 1 is known, so the posterior is exactly Gaussian with precision ``I + XᵀX`` and mean
``(I + XᵀX)⁻¹ Xᵀy``. The correlated block makes the exact marginal variances differ by about
4× (min ≈ 1.0e-4, max ≈ 3.9e-4) and gives the Hessian a condition number of about 18, so that
"min" and "max" are different directions (the paper used Σx = I, where all ten marginal
variances are ≈ 1/N).

Two initialisations, as the paper's two columns: *random* (``initvals`` β ~ N(0, 3²), i.e.
hundreds of posterior sds from the mode; the same point for every method) and *MAP*
(``initvals`` = the exact posterior mean). Each (method, init) is one chain; the random and
MAP chains use different ``random_seed`` values (with the same seed, IASG's chains from both
inits coalesce to the same draws once the search phase has forgotten the start).

Methods (``B = 10``; one saved draw per pass over the data, ``N/B = 1000`` iterations, for SGLD):

``IASG (defaults)``
    ``pmsg.IASG(batch_size=10)``, all defaults: full preconditioner ``P = (ε/N) Ĉ⁻¹`` from the
    per-datum gradient-noise estimate, ``learning_rate="auto"`` = ``min(0.5, 3/1000)`` =
    0.003 since 4dd4176 (``min(0.5, 10/1000)`` = 0.01 before), window ``N/B = 1000``
    shortened by the finite-window correction ``pymc_sgmcmc.tuning.iasg_window`` (since
    a96b562) to 455 (888 at ε = 0.01), so a draw is 0.455 passes (0.89); ``tune``
    (``--tune``, default 10) draws of which the first ``search_draws = 5`` are the search
    phase (rate 0.5, Ĉ re-estimated each draw).
``IASG lr=0.1`` (``--iasg-extra-lr``, default 0.1; 0 disables)
    The same with ``learning_rate=0.1``. Two effects set IASG's variance here, both visible:
    (i) the finite-window term of Mandt eq. 34: the variance of a window mean is
    ``(1/N) A⁻¹ (1 − (1 − e^{−εT}) / (εT))`` to leading order, i.e. 10% too small at
    ``εT = 10`` (the default before 4dd4176; now εT = 3) and 1% at ``εT = 100`` (exact AR(1)
    factor: 0.9005 and 0.9905);
    (ii) multiplicative gradient noise: in linear regression the per-datum gradient
    covariance grows away from the mode, ``C(θ) = Σx (σ² + δᵀΣxδ) + Σx δδᵀ Σx`` for Gaussian
    x and ``δ = θ − θ̂``, and the SGD iterates spread over ``εN/(2B)`` posterior variances
    (whitened ``E δδᵀ ≈ (ε/2B) Σx⁻¹``), so the noise the window averages is larger by about
    ``1 + ε (D + 1) / (2B)``: +0.55% at ε = 0.01, +5.5% at ε = 0.1 (D = B = 10). Predicted
    variance ratios (defaults / lr = 0.1): 0.905 / 1.045 with the full window ``N/B``;
    ≈ 1.005 / 1.055 with the window correction of a96b562, which removes (i) only.
``SGLD decay``
    ``pmsg.SGLD(batch_size=10, step_size=polynomial_decay(a, b=1000, gamma=0.51))``:
    ``ε_t = a (1000 + t)^(−0.51)``. The paper's schedule is ``ε₀ / √(1000 + t)``
    (γ = 0.5), but the package requires γ ∈ (0.5, 1] (the Robbins–Monro conditions), so
    γ = 0.51. The paper's ``ε₀ = 10⁻³`` is in its own (unstated) scaling; here the update is
    ``θ ← θ + (ε/2) ∇log p̂ + N(0, ε)`` on the N-scale log posterior, which is stable for
    ``ε < 4/λ_max(I + XᵀX) ≈ 1.2·10⁻⁴``, and whose constant-step variance inflation is about
    ``ε (N²/B) C / 4 ≈ 2.5·10⁶ ε`` (C ≈ 1 per coordinate here). ``a`` (``--sgld-a``) was
    chosen (default 6e-5) by the sweep over 5e-6, 2e-5, 6e-5, 2e-4 recorded in ``RESULTS.md``:
    smaller ``a`` barely moves from the start in 2000 passes (random init), larger ``a``
    mixes faster but its variance stays inflated by the still-large steps (+50% at 2e-4).
``SGLD auto``
    ``pmsg.SGLD(batch_size=10)``: the automatic constant step (5% variance inflation in the
    worst coordinate, from the gradient-noise estimate of the tuning draws; since a96b562 the
    first 5 tuning draws search for the mode at ε = 1/ρ(H)).
``NUTS``
    PyMC's NUTS (``init="adapt_diag"``: no jitter, so the MAP start stays at the MAP;
    ``--nuts-tune`` 200 tuning draws, ``--nuts-draws`` 1000). Every leapfrog step is one
    full-data gradient, i.e. one data pass; its passes are the cumulative ``n_steps``
    including the tuning draws (``discard_tuned_samples=False``).

What is plotted (``benchmarks/figures/mandt_fig4.png``), for every method: after each kept
(post-tuning) draw ``k``, the sample variance (ddof 1) of kept draws ``1..k`` of each
coordinate; its min (dashed) and max (solid) over the ten coordinates, against the cumulative
data passes at draw ``k``, which include the tuning draws. The exact min and max marginal
variances are black horizontal lines. For the SG methods the passes are the step method's
``data_passes`` stat plus, for the auto-tuned ones (IASG, SGLD auto), the rows read by the
gradient-noise estimates of tuning (``1024`` rows at the start and after each tuning draw:
about 0.1 pass per tuning draw). This counts rows read, not gradient work: on those rows the
tuning also computes the diagonal Hessian (D Hessian-vector products) and, for IASG, a
20-step power iteration for the spectral radius of ``P·H``. Counting a Hessian-vector
product as two gradients, that is about 0.1 + 2 + 4 ≈ 6 pass-equivalents of gradient work per
tuning draw for IASG (≈ 65 for ``tune=10``) and ≈ 2 for SGLD auto (≈ 23), not on the x-axis
(as of 4de9ee7–a96b562; since a96b562 SGLD auto's 5 search draws
run the power iteration instead, ≈ 4 each; see the notes in ``RESULTS.md``).

Table columns (appended to ``benchmarks/RESULTS.md``): passes in total (tuning included),
the final min and max marginal-variance estimates over the exact min and max, the range over
coordinates of the per-coordinate ratio estimate / exact, the largest error of the posterior
mean in exact posterior sds, the wall time of ``pm.sample`` (compilation included; runs go in
``--jobs`` parallel processes), and ArviZ's bulk ESS (min over coordinates) of the kept draws
per pass in total.

Run from the repository root::

    .venv/bin/python benchmarks/mandt_fig4.py --quick --out -   # smoke run (~1 min), no RESULTS.md
    .venv/bin/python benchmarks/mandt_fig4.py                   # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import logging
import multiprocessing as mp
import os
import platform
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
from _report import append_section, git_state  # noqa: E402  (benchmarks/ is on sys.path)

HEADING = "## Mandt et al. Fig. 4: IASG vs SGLD vs NUTS (issue 3)"
NOISE_ROWS = 1024  # rows per gradient-noise estimate (pymc_sgmcmc.adapter.step._compile)

METHOD_COLORS = {
    "IASG": "tab:blue",
    "IASG lr=": "tab:cyan",
    "SGLD decay": "tab:orange",
    "SGLD auto": "tab:red",
    "NUTS": "tab:green",
}


# ---------------------------------------------------------------------------------------
# Data and exact posterior
# ---------------------------------------------------------------------------------------


@dataclass
class Problem:
    X: np.ndarray
    y: np.ndarray
    beta_true: np.ndarray
    post_mean: np.ndarray
    post_cov: np.ndarray
    random_init: np.ndarray

    @property
    def post_var(self) -> np.ndarray:
        return np.diag(self.post_cov)


def make_problem(n: int, d: int, block: int, rho: float, init_sd: float, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    cov_x = np.eye(d)
    cov_x[:block, :block] = rho
    np.fill_diagonal(cov_x, 1.0)
    X = rng.normal(size=(n, d)) @ np.linalg.cholesky(cov_x).T
    beta_true = rng.normal(size=d)
    y = X @ beta_true + rng.normal(size=n)
    precision = np.eye(d) + X.T @ X  # prior N(0, I), noise sd 1
    post_cov = np.linalg.inv(precision)
    post_mean = post_cov @ (X.T @ y)
    random_init = rng.normal(0.0, init_sd, size=d)
    return Problem(X, y, beta_true, post_mean, post_cov, random_init)


# ---------------------------------------------------------------------------------------
# One run (in a worker process)
# ---------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    method: str  # label
    kind: str  # "iasg", "sgld_decay", "sgld_auto", "nuts"
    init: str  # "random" or "MAP"
    draws: int
    tune: int
    seed: int
    batch_size: int
    learning_rate: float | None = None
    sgld_a: float | None = None
    sgld_b: float = 1000.0
    sgld_gamma: float = 0.51


@dataclass
class RunResult:
    spec: RunSpec
    draws: np.ndarray  # (draws, D), kept draws
    passes: np.ndarray  # (draws,), cumulative passes at each kept draw, tuning included
    wall: float
    ess_bulk_min: float
    step_size_last: float
    error: str | None = None


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("pymc", "pymc.sampling.mcmc", "pymc.stats.convergence", "pytensor", "jax"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_one(spec: RunSpec, problem: Problem) -> RunResult:
    _quiet()
    import arviz as az
    import pymc as pm

    import pymc_sgmcmc as pmsg

    n, d = problem.X.shape
    start = problem.post_mean if spec.init == "MAP" else problem.random_init
    initvals = {"beta": np.asarray(start, dtype=np.float64).copy()}
    common: dict[str, Any] = dict(
        draws=spec.draws,
        tune=spec.tune,
        chains=1,
        cores=1,
        initvals=initvals,
        random_seed=spec.seed,
        progressbar=False,
        compute_convergence_checks=False,
    )
    with pm.Model():
        Xd = pm.Data("X", problem.X)
        beta = pm.Normal("beta", 0.0, 1.0, shape=d)
        pm.Normal("y", Xd @ beta, 1.0, observed=problem.y)

        extra_passes = 0.0
        if spec.kind == "iasg":
            kwargs = {} if spec.learning_rate is None else {"learning_rate": spec.learning_rate}
            step = pmsg.IASG(batch_size=spec.batch_size, **kwargs)
            extra_passes = (spec.tune + 1) * min(n, max(spec.batch_size, NOISE_ROWS)) / n
        elif spec.kind == "sgld_decay":
            schedule = pmsg.schedules.polynomial_decay(
                a=spec.sgld_a, b=spec.sgld_b, gamma=spec.sgld_gamma
            )
            step = pmsg.SGLD(batch_size=spec.batch_size, step_size=schedule)
        elif spec.kind == "sgld_auto":
            step = pmsg.SGLD(batch_size=spec.batch_size)
            extra_passes = (spec.tune + 1) * min(n, max(spec.batch_size, NOISE_ROWS)) / n
        elif spec.kind == "nuts":
            step = None
        else:
            raise ValueError(spec.kind)

        t0 = time.perf_counter()
        try:
            if step is None:
                idata = pm.sample(init="adapt_diag", discard_tuned_samples=False, **common)
            else:
                idata = pm.sample(step=step, **common)
        except Exception as exc:  # a diverging SGLD schedule is a result, not a crash
            return RunResult(
                spec,
                np.empty((0, d)),
                np.empty(0),
                time.perf_counter() - t0,
                np.nan,
                np.nan,
                error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            )
        wall = time.perf_counter() - t0

    draws = idata.posterior["beta"].values[0]
    if step is None:
        warm = idata.warmup_sample_stats["n_steps"].values[0]
        kept = idata.sample_stats["n_steps"].values[0]
        passes = warm.sum() + np.cumsum(kept)
        step_size_last = float(idata.sample_stats["step_size"].values[0, -1])
    else:
        passes = idata.sample_stats["data_passes"].values[0] + extra_passes
        step_size_last = float(idata.sample_stats["step_size"].values[0, -1])
    ess = az.ess(idata, var_names=["beta"], method="bulk")["beta"].values
    return RunResult(
        spec, draws, np.asarray(passes, float), wall, float(np.min(ess)), step_size_last
    )


def _worker(args: tuple[RunSpec, Problem]) -> RunResult:
    spec, problem = args
    t0 = time.perf_counter()
    result = run_one(spec, problem)
    print(
        f"  done {spec.method:>14} / {spec.init:<6}: {result.passes[-1] if result.passes.size else 0:8.0f}"
        f" passes, {result.wall:6.1f} s (worker {time.perf_counter() - t0:.1f} s)"
        + (f"  ERROR {result.error}" if result.error else ""),
        flush=True,
    )
    return result


# ---------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------


def running_variance(draws: np.ndarray) -> np.ndarray:
    """Sample variance (ddof 1) of draws ``0..k`` for each ``k ≥ 1``: shape ``(K − 1, D)``."""
    centred = draws - draws.mean(axis=0)  # centre first: the means are ~100 sds from 0
    k = np.arange(1, draws.shape[0] + 1)[:, None]
    s1 = np.cumsum(centred, axis=0)
    s2 = np.cumsum(centred**2, axis=0)
    var = (s2 - s1**2 / k) / np.maximum(k - 1, 1)
    return var[1:]


def summarise(r: RunResult, problem: Problem) -> dict[str, Any]:
    exact_var = problem.post_var
    if r.error or r.draws.shape[0] < 2:
        return {"error": r.error or "fewer than 2 draws"}
    var = r.draws.var(axis=0, ddof=1)
    ratio = var / exact_var
    mean_err = np.abs(r.draws.mean(axis=0) - problem.post_mean) / np.sqrt(exact_var)
    total = float(r.passes[-1])
    return {
        "passes": total,
        "min_ratio": var.min() / exact_var.min(),
        "max_ratio": var.max() / exact_var.max(),
        "coord_lo": ratio.min(),
        "coord_hi": ratio.max(),
        "coord_gmean": float(np.exp(np.mean(np.log(ratio)))),
        "mean_err": mean_err.max(),
        "wall": r.wall,
        "ess": r.ess_bulk_min,
        "ess_per_pass": r.ess_bulk_min / total,
        "step": r.step_size_last,
    }


def render_table(results: list[RunResult], problem: Problem) -> str:
    head = (
        "| method | init | tune + draws | passes (total) | min var / exact min | "
        "max var / exact max | per-coord var ratio (range; geo-mean) | "
        "max \\|mean error\\| (post. sds) | wall (s) | bulk ESS min | ESS / pass | last step |"
    )
    rule = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, rule]
    for r in results:
        s = summarise(r, problem)
        sp = r.spec
        if "error" in s:
            lines.append(
                f"| {sp.method} | {sp.init} | {sp.tune} + {sp.draws} | — | {s['error']} |"
                " | | | | | | |"
            )
            continue
        lines.append(
            f"| {sp.method} | {sp.init} | {sp.tune} + {sp.draws} | {s['passes']:.0f} | "
            f"{s['min_ratio']:.3f} | {s['max_ratio']:.3f} | "
            f"{s['coord_lo']:.2f}–{s['coord_hi']:.2f}; {s['coord_gmean']:.3f} | {s['mean_err']:.2f} | "
            f"{s['wall']:.1f} | {s['ess']:.0f} | {s['ess_per_pass']:.3g} | {s['step']:.3g} |"
        )
    return "\n".join(lines)


def _color(method: str, seen: dict[str, int]) -> str:
    key = max((k for k in METHOD_COLORS if method.startswith(k)), key=len, default=None)
    if key is None:
        return "tab:gray"
    # Several values of one method (an --sgld-a sweep): darker shades of its colour.
    import matplotlib.colors as mcolors

    i = seen[key] = seen.get(key, -1) + 1
    rgb = np.asarray(mcolors.to_rgb(METHOD_COLORS[key]))
    return mcolors.to_hex(rgb * 0.6**i)


def plot(results: list[RunResult], problem: Problem, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    exact = problem.post_var
    inits = ["random", "MAP"]
    ylo, yhi = exact.min() / 30, exact.max() * 30
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.4), sharey=True)
    for ax, init in zip(axes, inits, strict=True):
        methods = []
        seen: dict[str, int] = {}
        off_scale = []
        for r in results:
            if r.spec.init != init or r.error or r.draws.shape[0] < 3:
                continue
            var = running_variance(r.draws)
            x = r.passes[1:]
            c = _color(r.spec.method, seen)
            ax.plot(x, var.max(axis=1), color=c, lw=1.4)
            ax.plot(x, var.min(axis=1), color=c, lw=1.4, ls="--")
            methods.append((r.spec.method, c))
            if var[-1].max() > yhi or var[-1].min() < ylo:
                off_scale.append(
                    f"{r.spec.method} ends off scale: min {var[-1].min():.2g}, max {var[-1].max():.2g}"
                )
        ax.axhline(exact.max(), color="k", lw=1.0)
        ax.axhline(exact.min(), color="k", lw=1.0, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(ylo, yhi)
        ax.set_xlabel("passes through the data (cumulative, tuning included)")
        ax.set_title(f"{init} initialisation")
        ax.grid(True, which="major", alpha=0.3)
        if off_scale:
            ax.text(
                0.02,
                0.02,
                "\n".join(off_scale),
                transform=ax.transAxes,
                fontsize=7.5,
                va="bottom",
                ha="left",
                color="0.2",
            )
        handles = [Line2D([], [], color=c, lw=1.6, label=m) for m, c in methods]
        handles += [
            Line2D([], [], color="k", lw=1.0, label="exact max (solid) / min (dashed)"),
            Line2D([], [], color="gray", lw=1.4, label="estimate: max over coords"),
            Line2D([], [], color="gray", lw=1.4, ls="--", label="estimate: min over coords"),
        ]
        ax.legend(handles=handles, fontsize=7.5, loc="upper right")
    axes[0].set_ylabel("marginal posterior variance\n(running sample variance of kept draws)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run (~1 min)")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--d", type=int, default=10)
    p.add_argument("--block", type=int, default=4, help="size of the correlated feature block")
    p.add_argument("--rho", type=float, default=0.8, help="correlation within the block")
    p.add_argument("--init-sd", type=float, default=3.0, help="sd of the random initial point")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--draws", type=int, default=2000, help="kept draws (= passes) per SG run")
    p.add_argument("--tune", type=int, default=10, help="tuning draws (= passes) per SG run")
    p.add_argument(
        "--sgld-a",
        default="6e-5",
        help="a of the SGLD schedule a (1000 + t)^-0.51; comma-separated for a sweep",
    )
    p.add_argument(
        "--iasg-extra-lr",
        type=float,
        default=0.1,
        help="also run IASG with this learning_rate (0: don't)",
    )
    p.add_argument("--nuts-draws", type=int, default=1000)
    p.add_argument("--nuts-tune", type=int, default=200)
    p.add_argument(
        "--methods",
        default="iasg,iasg_lr,sgld_decay,sgld_auto,nuts",
        help="comma-separated subset of iasg,iasg_lr,sgld_decay,sgld_auto,nuts",
    )
    p.add_argument("--inits", default="random,MAP")
    p.add_argument("--seed", type=int, default=0, help="data seed; chains use seed+1, seed+2")
    p.add_argument("--jobs", type=int, default=2, help="parallel worker processes")
    p.add_argument("--figure", default=str(REPO / "benchmarks" / "figures" / "mandt_fig4.png"))
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "RESULTS.md"),
        help="markdown file to append the table to; '-' only prints",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.draws, args.tune = 150, 10
        args.nuts_draws, args.nuts_tune = 200, 100
    return args


def build_specs(args: argparse.Namespace) -> list[RunSpec]:
    methods = args.methods.split(",")
    specs: list[RunSpec] = []
    for i, init in enumerate(args.inits.split(",")):
        seed = args.seed + 1 + i
        base = dict(init=init, seed=seed, batch_size=args.batch_size)
        sg = dict(draws=args.draws, tune=args.tune, **base)
        if "iasg" in methods:
            specs.append(RunSpec("IASG (defaults)", "iasg", **sg))
        if "iasg_lr" in methods and args.iasg_extra_lr > 0:
            specs.append(
                RunSpec(
                    f"IASG lr={args.iasg_extra_lr:g}",
                    "iasg",
                    learning_rate=args.iasg_extra_lr,
                    **sg,
                )
            )
        if "sgld_decay" in methods:
            for a in args.sgld_a.split(","):
                specs.append(
                    RunSpec(f"SGLD decay a={float(a):g}", "sgld_decay", sgld_a=float(a), **sg)
                )
        if "sgld_auto" in methods:
            specs.append(RunSpec("SGLD auto", "sgld_auto", **sg))
        if "nuts" in methods:
            specs.append(
                RunSpec("NUTS", "nuts", draws=args.nuts_draws, tune=args.nuts_tune, **base)
            )
    return specs


def main(argv: list[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    command = "python " + " ".join(
        shlex.quote(a)
        for a in [
            os.path.relpath(sys.argv[0], REPO) if argv is None else "benchmarks/mandt_fig4.py",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    problem = make_problem(args.n, args.d, args.block, args.rho, args.init_sd, args.seed)
    exact = problem.post_var
    print(
        f"N = {args.n}, D = {args.d}, B = {args.batch_size}; exact marginal variances "
        f"min {exact.min():.4g}, max {exact.max():.4g}; Hessian eigenvalues "
        f"{np.linalg.eigvalsh(np.linalg.inv(problem.post_cov))[[0, -1]].round(0)}",
        flush=True,
    )
    specs = build_specs(args)
    # Slow runs first so that the two workers finish together.
    cost = {"nuts": 0.5, "iasg": 1.0, "sgld_decay": 1.4, "sgld_auto": 1.4}
    order = sorted(
        range(len(specs)), key=lambda i: -cost[specs[i].kind] * (specs[i].draws + specs[i].tune)
    )
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    results: list[RunResult | None] = [None] * len(specs)
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_worker, (specs[i], problem)): i for i in order}
        for fut in cf.as_completed(futures):
            results[futures[fut]] = fut.result()
    elapsed = time.perf_counter() - t0
    done = [r for r in results if r is not None]

    title = (
        f"Mandt et al. (2017) Fig. 4 setting: linear regression, N = {args.n}, D = {args.d}, "
        f"B = {args.batch_size}, one chain per method and init"
    )
    plot(done, problem, Path(args.figure), title)
    table = render_table(done, problem)
    print()
    print(table)
    print(f"\nfigure: {args.figure}; total wall time {elapsed / 60:.1f} min")

    if args.out != "-":
        import jax
        import pymc as pm

        import pymc_sgmcmc as pmsg

        date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        fig_rel = os.path.relpath(args.figure, Path(args.out).resolve().parent)
        section = (
            f"### {date}{' (quick)' if args.quick else ''}\n\n"
            f"Command: `{command}` (wall time {elapsed / 60:.1f} min, {args.jobs} worker processes)\n\n"
            f"- data: N = {args.n}, D = {args.d}, features {args.block} equicorrelated at "
            f"ρ = {args.rho}, rest independent; exact marginal variances min "
            f"{exact.min():.4g}, max {exact.max():.4g}\n"
            f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, load average at start "
            f"{load0[0]:.2f}; python {platform.python_version()}, jax {jax.__version__}, "
            f"pymc {pm.__version__}, pymc_sgmcmc {pmsg.__version__} (git {git_state()})\n"
            f"- figure: [`{fig_rel}`]({fig_rel})\n\n"
            f"{table}\n"
        )
        append_section(
            Path(args.out),
            section,
            HEADING,
            "See the docstring of `benchmarks/mandt_fig4.py` for the setup and what each column means.",
        )
        print(f"appended to {args.out}")
    return done


if __name__ == "__main__":
    main()
