"""Variance reduction: SGLD vs SAGA-LD vs SVRG-LD at the same step settings (issue 4).

The experiment of Dubey et al. (2016), Figs. 1–2: Bayesian linear and logistic regression,
accuracy against the number of passes through the data, for SGLD and the variance-reduced
samplers ``pmsg.SAGALD`` (Algorithm 1) and ``pmsg.SVRGLD`` (Algorithm 2) run with *the same*
step sizes, the same initial point and the same minibatch size.

Data and models (generated with numpy, ``--seed``)::

    N = 20 000 training rows, 5 000 test rows, D = 10, x_n ~ N(0, Σx),
    Σx: features 0-3 equicorrelated (ρ = 0.8, ``--rho``), features 4-9 independent, unit variances

    linear:    β_true ~ N(0, I),        y_n = x_nᵀ β_true + N(0, 1)
        beta = pm.Normal("beta", 0, 1, shape=D);  pm.Normal("y", X @ beta, 1.0, observed=y)
    logistic:  β_true ~ N(0, 0.5² I),   y_n ~ Bernoulli(σ(x_nᵀ β_true))
        beta = pm.Normal("beta", 0, 1, shape=D);  pm.Bernoulli("y", logit_p=X @ beta, observed=y)

Reference posteriors: for the linear model the exact Gaussian posterior (noise sd 1 known,
precision ``I + XᵀX``); for the logistic model numpyro's NUTS through
``pm.sample(nuts_sampler="numpyro")`` (``--nuts-chains`` 2 × ``--nuts-draws`` 3000 draws after
500 tuning draws each, ≈ 1.5 min). The NUTS posterior mean has a Monte Carlo error of about
``1/√ESS`` posterior sds (≈ 0.015, printed and drawn in the figure): the floor below which
the logistic "mean error" curves cannot be read.

Samplers (``B = 10`` as in the paper, ``--batch-size``; ``tune=0``, so nothing is tuned and
every sampler starts at ``β = 0``, the prior mean, via ``initvals``; ``--chains`` 2 chains
each, sampled one after the other in one ``pm.sample`` call; the same ``random_seed`` for the
three samplers of a model)::

    pmsg.SGLD(batch_size=B, step_size=s, thin=250)
    pmsg.SAGALD(batch_size=B, step_size=s, thin=250)
    pmsg.SVRGLD(batch_size=B, step_size=s, thin=250)     # anchor_every = N/B (default)

with one of two common step settings ``s`` (``--schedules``):

``decay`` (the paper's SGLD schedule, here used for all three)
    ``pmsg.schedules.polynomial_decay(a=ε₀ b^γ, b=N/B, gamma=0.55)``, i.e.
    ``ε_t = ε₀ (1 + t B/N)^(−0.55)``: ε₀ for the first pass, then decreasing (÷ 6.6 after
    30 passes).
``constant``
    ``ε_t = ε₀``.

``ε₀`` is the rule ``pmsg.SAGALD(step_size="auto")`` uses, ``4 δ / max_k h_kk`` with
``δ = 0.05`` (``--target-bias``) and ``h`` the diagonal Hessian of the potential, here
computed exactly on all rows at the posterior mode (the sampler estimates it on 1024 rows
during tuning): the stationary variance of the stiffest coordinate of a *noise-free*
Langevin chain is then ≈ 5% too large. All three samplers are stable at ε₀
(``ε₀ λ_max(H)/2`` is printed, < 2 is stable). For SGLD this step is large: its minibatch
noise inflates the stationary variance by about ``1 + ε N² c / (4B)`` (``c`` the per-datum
gradient variance), ×60–70 in both models at ε₀ (measured), which is the handicap variance
reduction removes. (SGLD's own ``"auto"`` step for a 5% inflation would be about three orders
of magnitude smaller and would mix correspondingly slower; the paper tuned each method's step
separately, SGLD with a decreasing and SAGA-LD with a two-phase constant step.)

``thin = 250`` inner iterations per saved draw: 8 draws per pass for SGLD and SAGA-LD
(``B = 10``), 2.7 for SVRG-LD, whose iterations cost ``2B`` rows plus one full pass per anchor.
Each sampler runs for the same budget of ``--passes`` (default 30) data passes as counted by
its ``data_passes`` stat (rows whose gradient was evaluated / N; SAGA-LD's includes its one
pass to fill the gradient table at the initial point, SVRG-LD's its anchor passes): the x-axis
of every curve, so that the comparison is at equal gradient cost. Wall time is not on it.

Metrics, for each chain after each saved draw with ``data_passes > --burn-in`` (default 3
passes, the same for all samplers; the draws before it are discarded), then averaged over the
chains (so they are the expected errors of *one* chain):

mean error
    The running posterior-mean estimate (mean of the kept draws so far) minus the reference
    posterior mean, in reference posterior sds; the mean (and max) over the D coordinates.
test log-likelihood
    ``(1/N_test) Σ_i log( (1/K) Σ_k p(y_i | x_i, β_k) )`` over the K kept draws so far (the
    Monte Carlo posterior predictive), minus the same quantity for the reference posterior
    (exact predictive ``N(y; xᵀm, 1 + xᵀSx)`` for the linear model, the NUTS draws for the
    logistic one). Negative = worse than the reference, in nats per test point.

Table (appended to ``benchmarks/RESULTS.md``): for every model, step setting and sampler, the
final passes, the final mean and max mean error, the final test log-likelihood difference,
the wall time of ``pm.sample`` (compilation included) and the passes each sampler needs to
reach SGLD's final mean error — the first pass after which its curve stays at or below that
value (for SGLD itself the same criterion, so ≤ the budget) — and the ratio SGLD passes /
sampler passes (> 1: the sampler gets there with fewer passes); the same two columns for
SGLD's final test log-likelihood (the first pass after which the sampler's deficit to the
reference stays at or below SGLD's final deficit), given only when SGLD's final deficit
exceeds ``--ll-resolution`` (default 10⁻⁴ nats per test point). Below that the differences
are at the resolution of the finite test set: an error ``δ`` of the posterior mean changes
the test log-likelihood to first order by ``(1/N_test) Σ_i s_i x_iᵀδ`` (``s_i`` the test
point's score, unit variance in the linear model), of either sign and of size
``≈ √(δᵀΣxδ / N_test)``. For an error of ``z`` posterior sds in each of the D whitened
directions, ``δᵀΣxδ ≈ z² D / N``, so the first-order term is ``≈ z √(D/N) / √N_test``
(1·10⁻⁴ for z = 0.3, N = 20 000, N_test = 5 000) and larger than the systematic second-order
loss ``≈ z² D / (2N)`` (2·10⁻⁵): a sampler's predictive can beat the exact one on this test
set, and only deficits above ≈ 10⁻⁴ nats separate the samplers. The figure
(``benchmarks/figures/variance_reduction.png``) has the curves, models in rows.

Run from the repository root::

    .venv/bin/python benchmarks/variance_reduction.py --quick --out -   # smoke run (~2 min)
    .venv/bin/python benchmarks/variance_reduction.py                   # ~4 min on 2 cores
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

HEADING = "## Variance reduction: SGLD vs SAGA-LD vs SVRG-LD (issue 4)"
METHODS = ("SGLD", "SAGA-LD", "SVRG-LD")
COLORS = {"SGLD": "tab:orange", "SAGA-LD": "tab:blue", "SVRG-LD": "tab:green"}
STYLES = {"decay": "-", "constant": "--"}


# ---------------------------------------------------------------------------------------
# Data and reference posteriors
# ---------------------------------------------------------------------------------------


@dataclass
class Problem:
    kind: str  # "linear" or "logistic"
    X: np.ndarray
    y: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    mode: np.ndarray  # posterior mode (for the step-size rule)
    hess: np.ndarray  # Hessian of the potential at the mode
    exact_mean: np.ndarray | None = None  # linear only
    exact_cov: np.ndarray | None = None


def _features(rng: np.random.Generator, n: int, d: int, block: int, rho: float) -> np.ndarray:
    cov = np.eye(d)
    cov[:block, :block] = rho
    np.fill_diagonal(cov, 1.0)
    return rng.normal(size=(n, d)) @ np.linalg.cholesky(cov).T


def make_problems(
    n: int, n_test: int, d: int, block: int, rho: float, seed: int
) -> dict[str, Problem]:
    rng = np.random.default_rng(seed)
    problems = {}

    X = _features(rng, n + n_test, d, block, rho)
    beta = rng.normal(size=d)
    y = X @ beta + rng.normal(size=n + n_test)
    X, X_test, y, y_test = X[:n], X[n:], y[:n], y[n:]
    precision = np.eye(d) + X.T @ X
    cov = np.linalg.inv(precision)
    mean = cov @ (X.T @ y)
    problems["linear"] = Problem("linear", X, y, X_test, y_test, mean, precision, mean, cov)

    X = _features(rng, n + n_test, d, block, rho)
    beta = 0.5 * rng.normal(size=d)
    y = (rng.random(n + n_test) < 1.0 / (1.0 + np.exp(-(X @ beta)))).astype(np.int64)
    X, X_test, y, y_test = X[:n], X[n:], y[:n], y[n:]
    theta = np.zeros(d)
    for _ in range(50):  # Newton's method for the mode
        p = 1.0 / (1.0 + np.exp(-(X @ theta)))
        grad = X.T @ (y - p) - theta
        hess = np.eye(d) + (X * (p * (1 - p))[:, None]).T @ X
        delta = np.linalg.solve(hess, grad)
        theta = theta + delta
        if np.max(np.abs(delta)) < 1e-12:
            break
    p = 1.0 / (1.0 + np.exp(-(X @ theta)))
    hess = np.eye(d) + (X * (p * (1 - p))[:, None]).T @ X
    problems["logistic"] = Problem("logistic", X, y, X_test, y_test, theta, hess)
    return problems


def build_model(problem: Problem):
    import pymc as pm

    d = problem.X.shape[1]
    with pm.Model() as model:
        Xd = pm.Data("X", problem.X)
        beta = pm.Normal("beta", 0.0, 1.0, shape=d)
        if problem.kind == "linear":
            pm.Normal("y", Xd @ beta, 1.0, observed=problem.y)
        else:
            pm.Bernoulli("y", logit_p=Xd @ beta, observed=problem.y)
    return model


def heldout_loglik(problem: Problem, draws: np.ndarray) -> np.ndarray:
    """``log p(y_i | x_i, β_k)`` for every draw ``k`` and test row ``i``: ``(K, N_test)``."""
    eta = draws @ problem.X_test.T
    if problem.kind == "linear":
        return -0.5 * np.log(2 * np.pi) - 0.5 * (problem.y_test[None, :] - eta) ** 2
    # log σ(η) for y = 1, log σ(−η) for y = 0
    sign = np.where(problem.y_test[None, :] == 1, 1.0, -1.0)
    return -np.logaddexp(0.0, -sign * eta)


def _logmeanexp(a: np.ndarray, axis: int = 0) -> np.ndarray:
    m = a.max(axis=axis, keepdims=True)
    return np.squeeze(m, axis) + np.log(np.mean(np.exp(a - m), axis=axis))


@dataclass
class Reference:
    mean: np.ndarray
    sd: np.ndarray
    test_ll: float  # mean over test rows of the log posterior-predictive density
    mean_se: float  # Monte Carlo error of `mean` in posterior sds (max over coordinates)
    label: str


def exact_reference(problem: Problem) -> Reference:
    m, S = problem.exact_mean, problem.exact_cov
    mu = problem.X_test @ m
    var = 1.0 + np.einsum("ij,jk,ik->i", problem.X_test, S, problem.X_test)
    ll = -0.5 * np.log(2 * np.pi * var) - 0.5 * (problem.y_test - mu) ** 2 / var
    return Reference(m, np.sqrt(np.diag(S)), float(ll.mean()), 0.0, "exact")


def nuts_reference(problem: Problem, args_: dict[str, Any]) -> tuple[Reference, float]:
    _quiet()
    import arviz as az
    import pymc as pm

    saved = os.environ.get("XLA_FLAGS")  # importing pymc.sampling.jax rewrites it
    t0 = time.perf_counter()
    try:
        with build_model(problem):
            idata = pm.sample(
                draws=args_["draws"],
                tune=args_["tune"],
                chains=args_["chains"],
                nuts_sampler="numpyro",
                nuts_sampler_kwargs={"chain_method": "sequential"},
                random_seed=args_["seed"],
                progressbar=False,
                compute_convergence_checks=False,
            )
    finally:
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved
    wall = time.perf_counter() - t0
    draws = idata.posterior["beta"].values.reshape(-1, problem.X.shape[1])
    ess = az.ess(idata, var_names=["beta"], method="mean")["beta"].values
    ll = _logmeanexp(heldout_loglik(problem, draws), axis=0)
    ref = Reference(
        draws.mean(axis=0),
        draws.std(axis=0, ddof=1),
        float(ll.mean()),
        float(1.0 / np.sqrt(ess.min())),
        f"NUTS ({args_['chains']} × {args_['draws']} draws, min ESS {ess.min():.0f})",
    )
    return ref, wall


# ---------------------------------------------------------------------------------------
# One sampler run (in a worker process)
# ---------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    model: str
    method: str
    schedule: str
    eps0: float
    passes: float
    batch_size: int
    thin: int
    chains: int
    seed: int


@dataclass
class RunResult:
    spec: RunSpec
    draws: np.ndarray  # (chains, K, D)
    passes: np.ndarray  # (K,) data passes after each draw (the same for every chain)
    step_last: float
    wall: float
    error: str | None = None


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("pymc", "pymc.sampling.mcmc", "pymc.stats.convergence", "pytensor", "jax"):
        logging.getLogger(name).setLevel(logging.ERROR)


def passes_after(method: str, iterations: int, n: int, b: int) -> float:
    """The ``data_passes`` stat after ``iterations`` inner iterations (see the step methods)."""
    if method == "SGLD":
        return iterations * b / n
    if method == "SAGA-LD":
        return 1.0 + iterations * b / n
    anchors = -(-iterations // -(-n // b))
    return 2.0 * iterations * b / n + anchors


def n_draws(spec: RunSpec, n: int) -> int:
    """The most draws whose passes stay within the budget."""
    k = 1
    while passes_after(spec.method, (k + 1) * spec.thin, n, spec.batch_size) <= spec.passes + 1e-9:
        k += 1
    return k


def run_one(spec: RunSpec, problem: Problem) -> RunResult:
    _quiet()
    import pymc as pm

    import pymc_sgmcmc as pmsg

    n, d = problem.X.shape
    b = spec.batch_size
    if spec.schedule == "decay":
        gamma = 0.55
        step_size: Any = pmsg.schedules.polynomial_decay(
            a=spec.eps0 * (n / b) ** gamma, b=n / b, gamma=gamma
        )
    else:
        step_size = spec.eps0
    cls = {"SGLD": pmsg.SGLD, "SAGA-LD": pmsg.SAGALD, "SVRG-LD": pmsg.SVRGLD}[spec.method]
    t0 = time.perf_counter()
    try:
        with build_model(problem):
            step = cls(batch_size=b, step_size=step_size, thin=spec.thin)
            idata = pm.sample(
                draws=n_draws(spec, n),
                tune=0,
                chains=spec.chains,
                cores=1,
                step=step,
                initvals={"beta": np.zeros(d)},
                random_seed=spec.seed,
                progressbar=False,
                compute_convergence_checks=False,
            )
    except Exception as exc:  # a divergence is a result, not a crash
        return RunResult(
            spec,
            np.empty((spec.chains, 0, d)),
            np.empty(0),
            np.nan,
            time.perf_counter() - t0,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
        )
    wall = time.perf_counter() - t0
    passes = idata.sample_stats["data_passes"].values
    return RunResult(
        spec,
        idata.posterior["beta"].values,
        passes[0],
        float(idata.sample_stats["step_size"].values[0, -1]),
        wall,
    )


def _worker(job: tuple[str, Any, Problem]) -> tuple[str, Any]:
    what, spec, problem = job
    t0 = time.perf_counter()
    if what == "nuts":
        ref, wall = nuts_reference(problem, spec)
        print(f"  done NUTS reference ({problem.kind}): {wall:6.1f} s", flush=True)
        return what, (ref, wall)
    result = run_one(spec, problem)
    print(
        f"  done {spec.model:>8} / {spec.schedule:<8} / {spec.method:<7}: "
        f"{result.passes[-1] if result.passes.size else 0:6.1f} passes, {result.wall:6.1f} s"
        f" (worker {time.perf_counter() - t0:.1f} s)"
        + (f"  ERROR {result.error}" if result.error else ""),
        flush=True,
    )
    return what, result


# ---------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------


@dataclass
class Curves:
    passes: np.ndarray  # (K',) kept draws only
    err_mean: np.ndarray  # mean over coordinates of |running mean − ref| / sd, chain-averaged
    err_max: np.ndarray
    test_ll: np.ndarray  # running predictive test log-lik − reference, chain-averaged


def curves(r: RunResult, problem: Problem, ref: Reference, burn_in: float) -> Curves | None:
    keep = r.passes > burn_in
    if r.error or keep.sum() < 1:
        return None
    err_mean, err_max, lls = [], [], []
    for chain in r.draws:
        kept = chain[keep]
        k = np.arange(1, kept.shape[0] + 1)[:, None]
        running = np.cumsum(kept, axis=0) / k
        err = np.abs(running - ref.mean) / ref.sd
        err_mean.append(err.mean(axis=1))
        err_max.append(err.max(axis=1))
        logp = heldout_loglik(problem, kept)  # (K', N_test)
        running_lp = np.logaddexp.accumulate(logp, axis=0) - np.log(k)
        lls.append(running_lp.mean(axis=1) - ref.test_ll)
    return Curves(
        r.passes[keep],
        np.mean(err_mean, axis=0),
        np.mean(err_max, axis=0),
        np.mean(lls, axis=0),
    )


def passes_to_reach(passes: np.ndarray, values: np.ndarray, target: float) -> float:
    """First pass after which ``values`` stays ≤ ``target`` (nan if it never does)."""
    above = np.nonzero(values > target + 1e-12 * abs(target))[0]
    if above.size == 0:
        return float(passes[0])
    last = above[-1]
    return float(passes[last + 1]) if last + 1 < passes.size else float("nan")


def _reach_and_ratio(passes, values, target, sgld_reach) -> tuple[str, str]:
    reach = passes_to_reach(passes, values, target)
    if not np.isfinite(reach):
        return "never", "—"
    return f"{reach:.2f}", f"{sgld_reach / reach:.2f}"


def render_table(
    results: list[RunResult],
    problems: dict[str, Problem],
    refs: dict[str, Reference],
    burn_in: float,
    ll_resolution: float,
) -> str:
    head = (
        "| model | step | sampler | passes | mean error (sds) | max error (sds) | "
        "test LL − ref (nats ×10⁻³) | passes to SGLD's final mean error | "
        "ratio SGLD / sampler (mean error) | passes to SGLD's final test LL | "
        "ratio SGLD / sampler (test LL) | last step | wall (s) |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model in problems:
        for schedule in STYLES:
            group = [r for r in results if r.spec.model == model and r.spec.schedule == schedule]
            if not group:
                continue
            cs = {r.spec.method: curves(r, problems[model], refs[model], burn_in) for r in group}
            sgld = cs.get("SGLD")
            if sgld is not None:
                target_err, target_ll = float(sgld.err_mean[-1]), float(-sgld.test_ll[-1])
                sgld_err = passes_to_reach(sgld.passes, sgld.err_mean, target_err)
                sgld_ll = passes_to_reach(sgld.passes, -sgld.test_ll, target_ll)
            else:
                target_err = target_ll = sgld_err = sgld_ll = float("nan")
            for r in sorted(group, key=lambda r: METHODS.index(r.spec.method)):
                c = cs[r.spec.method]
                if c is None:
                    lines.append(
                        f"| {model} | {schedule} | {r.spec.method} | — | "
                        f"{r.error or 'no draws after burn-in'} | | | | | | | | {r.wall:.0f} |"
                    )
                    continue
                reach_err, ratio_err = _reach_and_ratio(c.passes, c.err_mean, target_err, sgld_err)
                if target_ll > ll_resolution:
                    reach_ll, ratio_ll = _reach_and_ratio(c.passes, -c.test_ll, target_ll, sgld_ll)
                else:
                    reach_ll, ratio_ll = "n/a: SGLD within resolution", "—"
                lines.append(
                    f"| {model} | {schedule} | {r.spec.method} | {c.passes[-1]:.1f} | "
                    f"{c.err_mean[-1]:.3f} | {c.err_max[-1]:.3f} | {1e3 * c.test_ll[-1]:+.3f} | "
                    f"{reach_err} | {ratio_err} | {reach_ll} | {ratio_ll} | "
                    f"{r.step_last:.3g} | {r.wall:.0f} |"
                )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Figure
# ---------------------------------------------------------------------------------------


def plot(
    results: list[RunResult],
    problems: dict[str, Problem],
    refs: dict[str, Reference],
    burn_in: float,
    ll_resolution: float,
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(problems)
    fig, axes = plt.subplots(len(models), 2, figsize=(12.5, 4.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        ax_err, ax_ll = axes[row]
        for r in results:
            if r.spec.model != model:
                continue
            c = curves(r, problems[model], refs[model], burn_in)
            if c is None:
                continue
            kw = dict(color=COLORS[r.spec.method], ls=STYLES[r.spec.schedule], lw=1.4)
            ax_err.plot(c.passes, c.err_mean, **kw)
            ax_ll.plot(c.passes, -c.test_ll, **kw)
        ref = refs[model]
        if ref.mean_se > 0:
            ax_err.axhline(ref.mean_se, color="0.4", lw=0.9, ls=":")
            ax_err.text(
                0.99,
                ref.mean_se,
                " reference MC error",
                transform=ax_err.get_yaxis_transform(),
                ha="right",
                va="bottom",
                fontsize=7.5,
                color="0.3",
            )
        ax_err.set_yscale("log")
        ax_err.set_ylabel(
            f"{model}: mean over coords of |running mean − {ref.label.split(' (')[0]}|\n"
            "(reference posterior sds, chain-averaged)"
        )
        ax_ll.axhline(0.0, color="k", lw=0.8)
        ax_ll.axhspan(-ll_resolution, ll_resolution, color="0.85", alpha=0.5, lw=0)
        ax_ll.text(
            0.99,
            -ll_resolution,
            f"shaded ±{ll_resolution:g}: test-set resolution ",
            transform=ax_ll.get_yaxis_transform(),
            ha="right",
            va="top",
            fontsize=7.5,
            color="0.3",
        )
        ax_ll.set_yscale("symlog", linthresh=1e-5)
        ax_ll.set_ylabel(f"{model}: reference − predictive test log-lik\n(nats per test point)")
        for ax in (ax_err, ax_ll):
            ax.set_xlabel("data passes (data_passes stat)")
            ax.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], color=COLORS[m], lw=1.6, label=m) for m in METHODS]
    handles += [
        Line2D([], [], color="k", ls=s, lw=1.2, label=f"{k} step") for k, s in STYLES.items()
    ]
    axes[0, 0].legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--n", type=int, default=20_000, help="training rows")
    p.add_argument("--n-test", type=int, default=5_000, help="held-out rows")
    p.add_argument("--d", type=int, default=10)
    p.add_argument("--block", type=int, default=4, help="size of the correlated feature block")
    p.add_argument("--rho", type=float, default=0.8, help="correlation within the block")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--thin", type=int, default=250, help="inner iterations per saved draw")
    p.add_argument("--passes", type=float, default=30.0, help="data-pass budget per chain")
    p.add_argument("--burn-in", type=float, default=3.0, help="passes discarded from averages")
    p.add_argument("--chains", type=int, default=2)
    p.add_argument(
        "--ll-resolution",
        type=float,
        default=1e-4,
        help="no test-LL ratio when SGLD's final deficit is below this (nats per test point)",
    )
    p.add_argument(
        "--target-bias", type=float, default=0.05, help="δ of the step rule ε₀ = 4δ / max h_kk"
    )
    p.add_argument("--eps0", type=float, default=None, help="override ε₀ (both models)")
    p.add_argument("--schedules", default="decay,constant", help="subset of decay,constant")
    p.add_argument("--models", default="linear,logistic")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--nuts-draws", type=int, default=3000)
    p.add_argument("--nuts-tune", type=int, default=500)
    p.add_argument("--nuts-chains", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="data seed; chains use seed + 1")
    p.add_argument("--jobs", type=int, default=2, help="parallel worker processes")
    p.add_argument("--dump", default=None, help="also pickle the draws and references here")
    p.add_argument(
        "--figure", default=str(REPO / "benchmarks" / "figures" / "variance_reduction.png")
    )
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "RESULTS.md"),
        help="markdown file to append the table to; '-' only prints",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.passes, args.burn_in = 8.0, 2.0
        args.nuts_draws, args.nuts_tune, args.nuts_chains = 1000, 300, 1
    return args


def main(argv: list[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    command = "python " + " ".join(
        shlex.quote(a)
        for a in [
            os.path.relpath(sys.argv[0], REPO)
            if argv is None
            else "benchmarks/variance_reduction.py",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    all_problems = make_problems(args.n, args.n_test, args.d, args.block, args.rho, args.seed)
    problems = {m: all_problems[m] for m in args.models.split(",")}
    eps0 = {}
    for name, pr in problems.items():
        h_max = float(np.diag(pr.hess).max())
        eps0[name] = args.eps0 if args.eps0 else 4.0 * args.target_bias / h_max
        lam = np.linalg.eigvalsh(pr.hess)
        print(
            f"{name}: N = {args.n}, D = {args.d}, B = {args.batch_size}; max h_kk = {h_max:.4g}, "
            f"Hessian eigenvalues {lam[0]:.4g} … {lam[-1]:.4g}; ε₀ = {eps0[name]:.4g} "
            f"(ε₀ λ_max / 2 = {eps0[name] * lam[-1] / 2:.3f})",
            flush=True,
        )

    specs = [
        RunSpec(
            model,
            method,
            schedule,
            eps0[model],
            args.passes,
            args.batch_size,
            args.thin,
            args.chains,
            args.seed + 1,
        )
        for model in problems
        for schedule in args.schedules.split(",")
        for method in args.methods.split(",")
    ]
    # SAGA-LD is by far the slowest per pass here (see the notes in RESULTS.md): first.
    specs.sort(key=lambda s: s.method != "SAGA-LD")
    jobs: list[tuple[str, Any, Problem]] = []
    if "logistic" in problems:
        nuts_args = dict(
            draws=args.nuts_draws, tune=args.nuts_tune, chains=args.nuts_chains, seed=args.seed + 7
        )
        jobs.append(("nuts", nuts_args, problems["logistic"]))
    jobs += [("sg", s, problems[s.model]) for s in specs]

    t0 = time.perf_counter()
    load0 = os.getloadavg()
    results: list[RunResult] = []
    refs: dict[str, Reference] = {}
    nuts_wall = float("nan")
    if "linear" in problems:
        refs["linear"] = exact_reference(problems["linear"])
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_worker, job) for job in jobs]
        for fut in cf.as_completed(futures):
            what, out = fut.result()
            if what == "nuts":
                refs["logistic"], nuts_wall = out
            else:
                results.append(out)
    elapsed = time.perf_counter() - t0
    order = {(s.model, s.schedule, s.method): i for i, s in enumerate(specs)}
    results.sort(key=lambda r: order[(r.spec.model, r.spec.schedule, r.spec.method)])

    if args.dump:
        import pickle

        with open(args.dump, "wb") as fh:
            pickle.dump({"args": vars(args), "results": results, "refs": refs}, fh)

    title = (
        f"SGLD vs SAGA-LD vs SVRG-LD at the same step: N = {args.n}, D = {args.d}, "
        f"B = {args.batch_size}, {args.chains} chains from β = 0, burn-in {args.burn_in:g} passes"
    )
    plot(results, problems, refs, args.burn_in, args.ll_resolution, Path(args.figure), title)
    table = render_table(results, problems, refs, args.burn_in, args.ll_resolution)
    ref_lines = []
    for name, ref in refs.items():
        extra = f", {nuts_wall:.0f} s" if name == "logistic" else ""
        ref_lines.append(
            f"- {name}: reference {ref.label}{extra}; reference test log-lik "
            f"{ref.test_ll:.5f} nats per test point; posterior sds "
            f"{ref.sd.min():.3g} … {ref.sd.max():.3g}"
            + (f"; MC error of the reference mean ≤ {ref.mean_se:.3f} sds" if ref.mean_se else "")
            + f"; ε₀ = {eps0[name]:.4g}"
        )
    print()
    print("\n".join(ref_lines))
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
            f"Command: `{command}` (wall time {elapsed / 60:.1f} min, {args.jobs} worker "
            "processes)\n\n"
            f"- data: N = {args.n} train, {args.n_test} test, D = {args.d}, features "
            f"{args.block} equicorrelated at ρ = {args.rho}; B = {args.batch_size}, thin = "
            f"{args.thin}, {args.chains} chains per sampler from β = 0, budget {args.passes:g} "
            f"passes, burn-in {args.burn_in:g} passes\n"
            + "".join(f"  {line}\n" for line in ref_lines)
            + f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, load average at start "
            f"{load0[0]:.2f}; python {platform.python_version()}, jax {jax.__version__}, "
            f"pymc {pm.__version__}, pymc_sgmcmc {pmsg.__version__} (git {git_state()})\n"
            f"- figure: [`{fig_rel}`]({fig_rel})\n\n"
            f"{table}\n"
        )
        append_section(
            Path(args.out),
            section,
            HEADING,
            "See the docstring of `benchmarks/variance_reduction.py` for the setup and what each column means.",
        )
        print(f"appended to {args.out}")
    return results


if __name__ == "__main__":
    main()
