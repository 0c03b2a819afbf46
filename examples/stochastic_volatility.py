"""Example 1: stochastic volatility on real S&P 500 returns, NUTS vs the hybrid sampler.

The model is the PyMC example gallery's "Stochastic Volatility model" unchanged: a Gaussian
random walk for the log-volatility with step size ``step_size ~ Exponential(10)`` and
``init_dist=Normal(0, 100)``, and StudentT returns with ``nu ~ Exponential(0.1)`` and
precision ``exp(-2 * volatility)``. The data are the daily S&P 500 closing prices that the
``arch`` package ships (no download): as in the docs, the prices from 2008-05-02 on, log
returns ``np.log(Close).diff()`` with the first (missing) one dropped, i.e. 2 684 returns
from 2008-05-05 to 2018-12-31.

The hybrid (:func:`fit_hybrid`): SGLD for the globals ``step_size`` and ``nu`` and a
variational distribution for the volatility path — ``pmsg.SGLD(local_vars=["volatility"],
local_family="markov", preconditioner="full")``. The script fits NUTS (nutpie, the fastest
NUTS here), then the hybrid, in the same run, and prints the targets (hybrid vs NUTS):

* posterior mean of ``step_size`` (σ) within 25 % of NUTS's, of ``nu`` within 25 %;
* correlation of the posterior-mean volatility paths (of ``exp(volatility)``) ≥ 0.98;
* mean width of the 90 % band of ``exp(volatility)`` between 0.7× and 1.3× NUTS's;
* wall time below NUTS's.

Run::

    .venv/bin/python examples/stochastic_volatility.py                       # NUTS (+ hybrid)
    .venv/bin/python examples/stochastic_volatility.py --save-nuts /tmp/sv.nc
    .venv/bin/python examples/stochastic_volatility.py --load-nuts /tmp/sv.nc  # reuse NUTS

Figures go to ``demo_output/stochastic_volatility/`` (gitignored): ``volatility_paths.png``
(the posterior mean of ``exp(volatility)`` with its 90 % band over the absolute returns, one
panel per fit, an overlay, and the band width per day) and ``globals.png`` (posteriors of
``step_size`` and ``nu``).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import arviz as az
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pymc as pm  # noqa: E402

import pymc_sgmcmc as pmsg  # noqa: E402

warnings.filterwarnings("ignore", message=".*BLAS.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")

START = "2008-05-02"  # first price used, as in the PyMC docs (their SP500.csv starts here)
END = None  # to the end of the arch data (2018-12-31)

#: Pass/fail rules for :func:`compare_fits`'s metrics: (lower, upper) bounds, None = open.
TARGETS: dict[str, tuple[float | None, float | None]] = {
    "sigma_mean_ratio": (0.75, 1.25),
    "nu_mean_ratio": (0.75, 1.25),
    "vol_path_corr": (0.98, None),
    "band_width_ratio": (0.7, 1.3),
    "time_ratio": (None, 1.0),
}

#: Fastest NUTS measured for this model on the 2-core development machine.
DEFAULT_NUTS_SAMPLER = "nutpie"


# --------------------------------------------------------------------------------------
# Data and model
# --------------------------------------------------------------------------------------


def load_returns(start: str | None = START, end: str | None = END) -> pd.DataFrame:
    """Daily S&P 500 log returns from the prices that ``arch`` ships.

    Returns a DataFrame indexed by date with columns ``Close`` and ``change``
    (``np.log(Close).diff()``), prices restricted to ``[start, end]`` first and the leading
    NaN dropped, as the PyMC docs do with their ``SP500.csv``. With the defaults: 2 684 rows,
    2008-05-05 .. 2018-12-31.
    """
    from arch.data import sp500

    prices = sp500.load()[["Close"]].loc[start:end].copy()
    prices["change"] = np.log(prices["Close"]).diff()
    returns = prices.dropna()
    returns.index.name = "Date"
    return returns


def build_model(returns: pd.DataFrame) -> pm.Model:
    """The PyMC docs' stochastic volatility model, exactly, on ``returns["change"]``."""
    with pm.Model(coords={"time": returns.index.values}) as model:
        step_size = pm.Exponential("step_size", 10)
        volatility = pm.GaussianRandomWalk(
            "volatility", sigma=step_size, dims="time", init_dist=pm.Normal.dist(0, 100)
        )
        nu = pm.Exponential("nu", 0.1)
        pm.StudentT(
            "returns",
            nu=nu,
            lam=np.exp(-2 * volatility),
            observed=returns["change"],
            dims="time",
        )
    return model


# --------------------------------------------------------------------------------------
# Fits
# --------------------------------------------------------------------------------------


def fit_nuts(
    model: pm.Model,
    sampler: str = DEFAULT_NUTS_SAMPLER,
    *,
    draws: int = 1000,
    tune: int = 1000,
    chains: int = 2,
    seed: int = 1,
    target_accept: float = 0.8,
    progressbar: bool = False,
    **sample_kwargs,
) -> az.InferenceData:
    """NUTS with ``pm.sample(nuts_sampler=sampler)``, timed with ``time.perf_counter``.

    ``sampler`` is ``"nutpie"``, ``"numpyro"``, ``"blackjax"`` or ``"pymc"``. The wall time
    of the whole ``pm.sample`` call (compilation, tuning, draws and conversion) is stored as
    ``posterior.attrs["wall_time"]`` (seconds), next to the sampler's own
    ``sampling_time``; ``posterior.attrs["cpu_time"]`` is the CPU time of the call (this
    process's threads and the worker processes it waited for, see :func:`cpu_seconds` — on a
    shared machine a steadier measure than the wall time); ``posterior.attrs["nuts_sampler"]``
    names the sampler. Extra keyword arguments go to ``pm.sample`` (e.g.
    ``nuts_sampler_kwargs``, ``cores``, ``mp_ctx``).
    """
    if sampler == "pymc":
        sample_kwargs.setdefault("cores", min(chains, 2))
    if sampler in ("numpyro", "blackjax"):
        # Before JAX starts, this import lets numpyro run its chains in parallel on the CPU
        # cores (it sets XLA_FLAGS=--xla_force_host_platform_device_count); imported only
        # here, so that the hybrid's worker processes keep JAX's default single device.
        import pymc.sampling.jax  # noqa: F401
    # nutpie's compilation logs a traceback from a PyTensor rewrite that fails on this graph
    # (local_subtensor_merge: "Python integer 2684 out of bounds for int8"); the rewrite is
    # skipped and the result is correct, so the log is silenced here.
    rewrite_log = logging.getLogger("pytensor.graph.rewriting.basic")
    level = rewrite_log.level
    rewrite_log.setLevel(logging.CRITICAL)
    try:
        with model:
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            idata = pm.sample(
                draws=draws,
                tune=tune,
                chains=chains,
                random_seed=seed,
                target_accept=target_accept,
                nuts_sampler=sampler,
                progressbar=progressbar,
                **sample_kwargs,
            )
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    finally:
        rewrite_log.setLevel(level)
    idata.posterior.attrs["wall_time"] = wall
    idata.posterior.attrs["cpu_time"] = cpu
    idata.posterior.attrs["nuts_sampler"] = sampler
    idata.posterior.attrs["draws"] = draws
    idata.posterior.attrs["tune"] = tune
    idata.posterior.attrs["chains"] = chains
    return idata


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and of its terminated, waited-for
    children. PyMC's own sampler with ``cores > 1`` counts only with ``mp_ctx="fork"`` (with
    forkserver/spawn the workers are not this process's children)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def fit_hybrid(
    model: pm.Model,
    *,
    draws: int = 1000,
    tune: int = 200,
    thin: int = 5,
    chains: int = 2,
    cores: int = 2,
    seed: int = 1,
    progressbar: bool = False,
    **step_kwargs,
) -> az.InferenceData:
    """SG-MCMC for the globals ``step_size`` and ``nu``, a variational path for ``volatility``.

    ``pmsg.SGLD(local_vars=["volatility"], local_family="markov", preconditioner="full")``:

    * the volatility path gets q(z | σ) with the random walk's own precision given σ plus
      learned per-day sites (a Gaussian Markov chain along the path, which the blog post's
      family was not: its q ignored how the path's posterior depends on σ, and σ collapsed to
      0.025); q takes natural-gradient steps throughout, so it follows ν too;
    * σ and ν are sampled by Langevin steps on the ELBO's gradient (one antithetic pair of
      path draws per iteration), preconditioned by the ELBO's inverse Hessian and with the
      step sized for a 5% variance bias, all tuned automatically;
    * every iteration uses all 2 684 days (``batch_size = N``: the path is sampled whole
      anyway, so minibatching the returns would save little); one saved draw is ``thin``
      iterations.

    The wall time covers building the step (the model's graphs) and ``pm.sample``, like
    :func:`fit_nuts`'s; both go into the posterior attrs.
    """
    with model:
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        step = pmsg.SGLD(
            local_vars=["volatility"],
            local_family="markov",
            preconditioner="full",
            batch_size=len(model.coords["time"]),
            thin=thin,
            **step_kwargs,
        )
        idata = pm.sample(
            draws=draws,
            tune=tune,
            chains=chains,
            cores=cores,
            step=step,
            random_seed=seed,
            progressbar=progressbar,
            compute_convergence_checks=False,
        )
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    idata.posterior.attrs["wall_time"] = wall
    idata.posterior.attrs["cpu_time"] = cpu
    idata.posterior.attrs["draws"] = draws
    idata.posterior.attrs["tune"] = tune
    idata.posterior.attrs["chains"] = chains
    idata.posterior.attrs["thin"] = thin
    return idata


# --------------------------------------------------------------------------------------
# Summaries and comparison
# --------------------------------------------------------------------------------------


def _draws(idata: az.InferenceData, name: str) -> np.ndarray:
    """(n_draws, ...) array of a posterior variable, chains stacked."""
    values = np.asarray(idata.posterior[name].values)
    return values.reshape(-1, *values.shape[2:])


def volatility_summary(idata: az.InferenceData, prob: float = 0.90) -> pd.DataFrame:
    """Posterior mean and central ``prob`` band of the volatility, per day.

    Columns ``mean``, ``lower``, ``upper`` are on the exp scale (``np.exp(volatility)``, the
    daily return scale, as the PyMC docs plot it: the mean of ``exp(volatility)`` and the
    5 %/95 % quantiles for ``prob=0.9``); ``log_mean``, ``log_lower``, ``log_upper`` on the
    log scale (``volatility`` itself). Indexed by the ``time`` coordinate.
    """
    log_vol = _draws(idata, "volatility")
    q = [(1 - prob) / 2, (1 + prob) / 2]
    log_lo, log_hi = np.quantile(log_vol, q, axis=0)
    index = idata.posterior["volatility"].coords[idata.posterior["volatility"].dims[-1]].values
    return pd.DataFrame(
        {
            "mean": np.exp(log_vol).mean(0),
            "lower": np.exp(log_lo),  # quantiles commute with the monotone exp
            "upper": np.exp(log_hi),
            "log_mean": log_vol.mean(0),
            "log_lower": log_lo,
            "log_upper": log_hi,
        },
        index=pd.Index(index, name="time"),
    )


def wall_time(idata: az.InferenceData) -> float | None:
    """``posterior.attrs["wall_time"]``, else the sampler's ``sampling_time``, else None."""
    attrs = idata.posterior.attrs
    for key in ("wall_time", "sampling_time"):
        if key in attrs:
            return float(attrs[key])
    return None


def compare_fits(
    idata_sg: az.InferenceData,
    idata_nuts: az.InferenceData,
    *,
    time_sg: float | None = None,
    time_nuts: float | None = None,
    prob: float = 0.90,
) -> dict[str, float]:
    """The target metrics of a fit (``idata_sg``) against NUTS (``idata_nuts``).

    Keys (ratios are fit / NUTS):

    * ``sigma_mean_ratio``, ``nu_mean_ratio``: posterior means of ``step_size`` and ``nu``;
    * ``vol_path_corr``: Pearson correlation of the posterior-mean paths of
      ``exp(volatility)``; ``vol_path_corr_log`` the same for ``volatility`` (information);
    * ``band_width_ratio``: mean over days of the width of the ``prob`` band of
      ``exp(volatility)``; ``band_width_ratio_log`` the same for ``volatility``
      (information);
    * ``time_ratio``: wall time ratio, from ``time_sg``/``time_nuts`` or else from each
      posterior's ``wall_time``/``sampling_time`` attrs (NaN if unknown);
      ``cpu_time_ratio`` the ratio of the ``cpu_time`` attrs (information; NaN if unknown).
    """
    s_sg, s_nuts = volatility_summary(idata_sg, prob), volatility_summary(idata_nuts, prob)
    if time_sg is None:
        time_sg = wall_time(idata_sg)
    if time_nuts is None:
        time_nuts = wall_time(idata_nuts)

    def mean(idata: az.InferenceData, name: str) -> float:
        return float(_draws(idata, name).mean())

    def width(s: pd.DataFrame, prefix: str = "") -> float:
        return float((s[f"{prefix}upper"] - s[f"{prefix}lower"]).mean())

    return {
        "sigma_mean_ratio": mean(idata_sg, "step_size") / mean(idata_nuts, "step_size"),
        "nu_mean_ratio": mean(idata_sg, "nu") / mean(idata_nuts, "nu"),
        "vol_path_corr": float(np.corrcoef(s_sg["mean"], s_nuts["mean"])[0, 1]),
        "vol_path_corr_log": float(np.corrcoef(s_sg["log_mean"], s_nuts["log_mean"])[0, 1]),
        "band_width_ratio": width(s_sg) / width(s_nuts),
        "band_width_ratio_log": width(s_sg, "log_") / width(s_nuts, "log_"),
        "time_ratio": (time_sg / time_nuts if time_sg is not None and time_nuts else float("nan")),
        "cpu_time_ratio": float(
            idata_sg.posterior.attrs.get("cpu_time", np.nan)
            / idata_nuts.posterior.attrs.get("cpu_time", np.nan)
        ),
    }


def targets_table(metrics: Mapping[str, float]) -> pd.DataFrame:
    """One row per metric: value, target and ``met`` (True/False; None = information)."""
    rows = []
    for key, value in metrics.items():
        lo, hi = TARGETS.get(key, (None, None))
        if key not in TARGETS:
            target, met = "(information)", None
        else:
            target = (
                f"[{lo}, {hi}]"
                if lo is not None and hi is not None
                else (f">= {lo}" if lo is not None else f"< {hi}")
            )
            met = bool(
                np.isfinite(value)
                and (lo is None or value >= lo)
                and (hi is None or (value < hi if key == "time_ratio" else value <= hi))
            )
        rows.append({"metric": key, "value": value, "target": target, "met": met})
    return pd.DataFrame(rows).set_index("metric")


def nuts_diagnostics(idata: az.InferenceData) -> dict[str, float]:
    """Divergences, ESS/r_hat of ``step_size`` and ``nu``, worst r_hat/ESS of the path, the
    mean number of leapfrog steps (= gradient evaluations) and tree depth per iteration
    (numpyro/pymc/nutpie stat names) and NUTS's mean leapfrog step size."""
    ss = idata.sample_stats
    summ = az.summary(idata, var_names=["step_size", "nu"], kind="diagnostics")
    vol = az.summary(idata, var_names=["volatility"], kind="diagnostics")
    out = {
        "divergences": int(ss["diverging"].values.sum()),
        "ess_bulk_step_size": float(summ.loc["step_size", "ess_bulk"]),
        "ess_tail_step_size": float(summ.loc["step_size", "ess_tail"]),
        "r_hat_step_size": float(summ.loc["step_size", "r_hat"]),
        "ess_bulk_nu": float(summ.loc["nu", "ess_bulk"]),
        "ess_tail_nu": float(summ.loc["nu", "ess_tail"]),
        "r_hat_nu": float(summ.loc["nu", "r_hat"]),
        "r_hat_volatility_max": float(vol["r_hat"].max()),
        "ess_bulk_volatility_min": float(vol["ess_bulk"].min()),
    }
    for name in ("n_steps", "tree_depth", "depth"):
        if name in ss:
            out[f"mean_{name}"] = float(ss[name].values.mean())
    if "n_steps" in ss:  # leapfrog steps = gradient evaluations, kept draws only (no tuning)
        out["grad_evals_draws"] = float(ss["n_steps"].values.sum())
    if "step_size" in ss:  # NUTS's leapfrog step size, not the model's step_size
        out["mean_leapfrog_step_size"] = float(ss["step_size"].values.mean())
    return out


def posterior_table(idata: az.InferenceData, prob: float = 0.90) -> pd.DataFrame:
    """Mean, sd, 5 % and 95 % of ``step_size`` and ``nu``, and the mean 90 % band widths."""
    q = [(1 - prob) / 2, (1 + prob) / 2]
    rows = {}
    for name in ("step_size", "nu"):
        x = _draws(idata, name)
        lo, hi = np.quantile(x, q)
        rows[name] = {"mean": x.mean(), "sd": x.std(), f"q{q[0]:.0%}": lo, f"q{q[1]:.0%}": hi}
        ess = float(az.ess(idata, var_names=[name])[name])
        rows[name]["ess_bulk"] = ess
        seconds = wall_time(idata)
        rows[name]["ess_per_s"] = ess / seconds if seconds else float("nan")
    table = pd.DataFrame(rows).T
    s = volatility_summary(idata, prob)
    table.attrs["band_width_exp"] = float((s["upper"] - s["lower"]).mean())
    table.attrs["band_width_log"] = float((s["log_upper"] - s["log_lower"]).mean())
    return table


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------


_COLORS = ["C0", "C3", "C2", "C1", "C4"]


def plot_volatility(
    returns: pd.DataFrame,
    fits: Mapping[str, az.InferenceData],
    path: Path,
    prob: float = 0.90,
) -> Path:
    """Posterior mean of ``exp(volatility)`` with its ``prob`` band over the absolute returns.

    Top row: one panel per fit, side by side. With two or more fits, an overlay below. Last
    row: the band width (upper − lower) per day for every fit, the quantity whose mean the
    band-width target compares. The y axis is cut at 1.3× the highest band so that the bands
    stay readable (the largest absolute returns of late 2008 go off the top).
    """
    names = list(fits)
    summaries = {name: volatility_summary(idata, prob) for name, idata in fits.items()}
    colors = {name: _COLORS[k % len(_COLORS)] for k, name in enumerate(names)}
    dates = returns.index
    abs_ret = returns["change"].abs()
    top = 1.3 * max(float(s["upper"].max()) for s in summaries.values())
    n_rows = 3 if len(names) > 1 else 2
    fig = plt.figure(figsize=(max(10, 6.5 * len(names)), 3.3 * n_rows), constrained_layout=True)
    grid = fig.add_gridspec(n_rows, len(names))
    axes = [fig.add_subplot(grid[0, k]) for k in range(len(names))]
    for ax, name in zip(axes, names, strict=True):
        s = summaries[name]
        ax.plot(dates, abs_ret, color="0.6", lw=0.4, label="|return|")
        ax.fill_between(
            dates,
            s["lower"],
            s["upper"],
            color=colors[name],
            alpha=0.4,
            lw=0,
            label=f"{prob:.0%} band",
        )
        ax.plot(dates, s["mean"], color=colors[name], lw=0.7, label="posterior mean")
        ax.set_ylim(0, top)
        ax.set_title(f"{name}: exp(volatility)")
        ax.set_ylabel("daily return scale")
        ax.legend(loc="upper right", fontsize=7)
    if len(names) > 1:
        ax = fig.add_subplot(grid[1, :])
        ax.plot(dates, abs_ret, color="0.75", lw=0.4, label="|return|")
        for name in names:
            s = summaries[name]
            ax.fill_between(dates, s["lower"], s["upper"], color=colors[name], alpha=0.3, lw=0)
            ax.plot(
                dates,
                s["mean"],
                color=colors[name],
                lw=0.7,
                label=f"{name}: mean and {prob:.0%} band",
            )
        ax.set_ylim(0, top)
        ax.set_title("overlay")
        ax.set_ylabel("daily return scale")
        ax.legend(loc="upper right", fontsize=7)
    ax = fig.add_subplot(grid[n_rows - 1, :])
    for name in names:
        s = summaries[name]
        width = s["upper"] - s["lower"]
        ax.plot(
            dates,
            width,
            color=colors[name],
            lw=0.7,
            label=f"{name} (mean {float(width.mean()):.3g})",
        )
    ax.set_title(f"width of the {prob:.0%} band of exp(volatility)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_globals(fits: Mapping[str, az.InferenceData], path: Path) -> Path:
    """Posterior densities of ``step_size`` (σ) and ``nu``, all fits overlaid (common bins)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), constrained_layout=True)
    for ax, var in zip(axes, ("step_size", "nu"), strict=True):
        draws = {name: _draws(idata, var) for name, idata in fits.items()}
        lo, hi = np.quantile(np.concatenate(list(draws.values())), [0.001, 0.999])
        bins = np.linspace(lo, hi, 60)
        for name, x in draws.items():
            color = _COLORS[list(fits).index(name) % len(_COLORS)]
            ax.hist(x, bins=bins, density=True, histtype="stepfilled", alpha=0.3, color=color)
            ax.hist(
                x,
                bins=bins,
                density=True,
                histtype="step",
                color=color,
                label=f"{name} (mean {x.mean():.3g}, sd {x.std():.2g})",
            )
        ax.set_yticks([])
        ax.legend(fontsize=7)
    axes[0].set_title("step_size (σ)")
    axes[1].set_title("nu")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------
# Script
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nuts-sampler",
        default=DEFAULT_NUTS_SAMPLER,
        choices=["nutpie", "numpyro", "blackjax", "pymc"],
    )
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--tune", type=int, default=1000)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--target-accept", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--save-nuts",
        type=Path,
        metavar="PATH",
        help="write the NUTS InferenceData to this netcdf file",
    )
    parser.add_argument(
        "--load-nuts",
        type=Path,
        metavar="PATH",
        help="reuse a saved NUTS InferenceData instead of sampling",
    )
    parser.add_argument("--skip-hybrid", action="store_true")
    parser.add_argument("--hybrid-draws", type=int, default=1000)
    parser.add_argument("--hybrid-tune", type=int, default=200)
    parser.add_argument("--hybrid-thin", type=int, default=5, help="iterations per saved draw")
    parser.add_argument("--out", type=Path, default=Path("demo_output/stochastic_volatility"))
    parser.add_argument("--progressbar", action="store_true")
    args = parser.parse_args(argv)

    returns = load_returns()
    print(
        f"S&P 500 log returns (arch): {len(returns)} rows, "
        f"{returns.index[0].date()} .. {returns.index[-1].date()}"
    )
    model = build_model(returns)

    if args.load_nuts is not None:
        nuts = az.from_netcdf(args.load_nuts)
        print(
            f"NUTS: loaded {args.load_nuts} "
            f"({nuts.posterior.attrs.get('nuts_sampler', '?')}, wall time "
            f"{wall_time(nuts) or float('nan'):.1f} s when it was sampled)"
        )
    else:
        nuts = fit_nuts(
            model,
            args.nuts_sampler,
            draws=args.draws,
            tune=args.tune,
            chains=args.chains,
            seed=args.seed,
            target_accept=args.target_accept,
            progressbar=args.progressbar,
        )
        print(
            f"NUTS ({args.nuts_sampler}, {args.chains} chains, {args.tune} tune + "
            f"{args.draws} draws): {wall_time(nuts):.1f} s wall, "
            f"{nuts.posterior.attrs['cpu_time']:.1f} s CPU"
        )
        if args.save_nuts is not None:
            args.save_nuts.parent.mkdir(parents=True, exist_ok=True)
            nuts.to_netcdf(args.save_nuts)
            print(f"saved {args.save_nuts}")

    pd.set_option("display.float_format", lambda v: f"{v:.4g}")
    pd.set_option("display.width", 160)
    diag = nuts_diagnostics(nuts)
    print("\nNUTS diagnostics:")
    print(pd.Series(diag).to_string())
    ref = posterior_table(nuts)
    print("\nNUTS posterior (reference):")
    print(ref.to_string())
    print(
        f"mean width of the 90% band: exp(volatility) {ref.attrs['band_width_exp']:.4g}, "
        f"volatility {ref.attrs['band_width_log']:.4g}"
    )

    fits: dict[str, az.InferenceData] = {
        f"NUTS ({nuts.posterior.attrs.get('nuts_sampler', args.nuts_sampler)})": nuts
    }
    report = [
        f"S&P 500 log returns from the `arch` package: {len(returns)} days, "
        f"{returns.index[0].date()} to {returns.index[-1].date()}. Run: `{_run_line(argv)}`, "
        f"load average before the run {LOAD_AT_START:.1f}, git {_git_state()}.",
        "",
        f"NUTS ({nuts.posterior.attrs.get('nuts_sampler', args.nuts_sampler)}, "
        f"{args.chains} chains, {args.tune} tune + {args.draws} draws): "
        f"{wall_time(nuts):.1f} s wall, {nuts.posterior.attrs.get('cpu_time', float('nan')):.1f} s CPU.",
        "",
        markdown(ref),
        "",
    ]
    if not args.skip_hybrid:
        try:
            hybrid = fit_hybrid(
                model,
                draws=args.hybrid_draws,
                tune=args.hybrid_tune,
                thin=args.hybrid_thin,
                chains=args.chains,
                seed=args.seed,
                progressbar=args.progressbar,
            )
            print(
                f"\nhybrid ({args.chains} chains, {args.hybrid_tune} tune + {args.hybrid_draws} "
                f"draws of {args.hybrid_thin} iterations): {wall_time(hybrid):.1f} s wall, "
                f"{hybrid.posterior.attrs['cpu_time']:.1f} s CPU"
            )
        except NotImplementedError as err:
            print(f"\nhybrid: not available ({err}); NUTS alone.")
        else:
            fits["hybrid"] = hybrid
            print("\nhybrid posterior:")
            print(posterior_table(hybrid).to_string())
            table = targets_table(compare_fits(hybrid, nuts))
            print("\nhybrid vs NUTS, targets:")
            print(table.to_string())
            n_met = int(table["met"].eq(True).sum())
            n_targets = int(table["met"].notna().sum())
            print(f"{n_met}/{n_targets} targets met")
            report += [
                f"Hybrid ({args.chains} chains, {args.hybrid_tune} tune + {args.hybrid_draws} "
                f"draws of {args.hybrid_thin} iterations): {wall_time(hybrid):.1f} s wall, "
                f"{hybrid.posterior.attrs['cpu_time']:.1f} s CPU.",
                "",
                markdown(posterior_table(hybrid)),
                "",
                f"Targets ({n_met}/{n_targets} met):",
                "",
                markdown(table),
                "",
            ]

    paths = [
        plot_volatility(returns, fits, args.out / "volatility_paths.png"),
        plot_globals(fits, args.out / "globals.png"),
    ]
    print("\nfigures: " + ", ".join(str(p) for p in paths))
    (args.out / "results.md").write_text("\n".join(report))
    print(f"tables: {args.out / 'results.md'}")


LOAD_AT_START = os.getloadavg()[0]


def markdown(frame: pd.DataFrame) -> str:
    """A DataFrame as a markdown table (numbers to 4 significant digits)."""

    def cell(value: object) -> str:
        if isinstance(value, float | np.floating):
            return f"{value:.4g}"
        return str(value)

    head = "| | " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|---|" + "---:|" * len(frame.columns)
    rows = [
        f"| {index} | " + " | ".join(cell(v) for v in row) + " |"
        for index, row in zip(frame.index, frame.itertuples(index=False), strict=True)
    ]
    return "\n".join([head, rule, *rows])


def _run_line(argv: list[str] | None) -> str:
    import sys

    return " ".join(["python examples/stochastic_volatility.py", *(argv or sys.argv[1:])])


def _git_state() -> str:
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "pymc_sgmcmc", "examples"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


if __name__ == "__main__":
    main()
