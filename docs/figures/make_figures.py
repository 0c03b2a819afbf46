"""Make the figures and result tables of the documentation from real runs.

Every sampler page shows one run of its step method through ``pm.sample(step=...)`` on the
same generated Bayesian linear regression, whose posterior is known in closed form:

- N = 10 000 rows, D = 3 coefficients, features equicorrelated at ρ = 0.6 (so the posterior
  is correlated and a diagonal method shows it), noise sd 1 known, prior β ~ N(0, 10² I);
- exact posterior N(μ, Σ) with Σ = (XᵀX + I/100)⁻¹, μ = Σ Xᵀy;
- 2 chains, ``cores=1``, ``batch_size=100`` (so one pass over the data is 100 iterations),
  the sampler's defaults otherwise unless the page says so.

Each ``<sampler>.png`` has the three marginals over the exact density, a trace of the
standardised draws against the data passes, and the joint draws of (β₀, β₁) over the exact
1- and 2-sd ellipses; ``<sampler>_table.md`` holds ``pmsg.compare`` against 4000 exact
draws and the run's settings, included by the page under the figure.

The comparison guide's ``compare_density.png``, ``compare_forest.png`` and
``compare_table.md`` are IASG against PyMC's NUTS on a generated logistic regression
(N = 10 000, D = 4 plus an intercept): ``pmsg.compare`` and ``pmsg.plot_compare``.

Run from the repository root (each figure takes well under a minute on one core)::

    .venv/bin/python docs/figures/make_figures.py            # all
    .venv/bin/python docs/figures/make_figures.py sgld iasg  # some

The PNGs and tables are committed; the docs build does not run this script.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import arviz as az  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pymc as pm  # noqa: E402

import pymc_sgmcmc as pmsg  # noqa: E402

OUT = Path(__file__).resolve().parent
ROOT = OUT.parent.parent
N, D, RHO, BATCH = 10_000, 3, 0.6, 100
PRIOR_SD = 10.0
CHAINS = 2
COLOURS = ("C0", "C1", "C2")

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*BLAS.*")


@dataclass(frozen=True)
class Run:
    """One sampler run for a page."""

    name: str
    title: str
    code: str  # the step= expression, shown in the table
    make: Callable[[], pm.step_methods.compound.BlockedStep]
    draws: int
    tune: int


RUNS = [
    Run(
        "sgld",
        "SGLD",
        "pmsg.SGLD(batch_size=100)",
        lambda: pmsg.SGLD(batch_size=BATCH),
        draws=2000,
        tune=100,
    ),
    Run(
        "constant_sgd",
        "Constant SGD",
        "pmsg.ConstantSGD(batch_size=100)",
        lambda: pmsg.ConstantSGD(batch_size=BATCH),
        draws=1000,
        tune=50,
    ),
    Run(
        "constant_sgd_diagonal",
        "Constant SGD, diagonal",
        'pmsg.ConstantSGD(batch_size=100, preconditioner="diagonal")',
        lambda: pmsg.ConstantSGD(batch_size=BATCH, preconditioner="diagonal"),
        draws=1000,
        tune=50,
    ),
    Run(
        "iasg",
        "IASG",
        "pmsg.IASG(batch_size=100)",
        lambda: pmsg.IASG(batch_size=BATCH),
        draws=1000,
        tune=20,
    ),
    Run(
        "sgfs",
        "SGFS",
        "pmsg.SGFS(batch_size=100)",
        lambda: pmsg.SGFS(batch_size=BATCH),
        draws=1000,
        tune=50,
    ),
    Run(
        "sgfs_hmax",
        "SGFS, h_max = B/N²",
        "pmsg.SGFS(batch_size=100, h_max=1e-6)",
        lambda: pmsg.SGFS(batch_size=BATCH, h_max=BATCH / N**2),
        draws=1000,
        tune=50,
    ),
    Run(
        "sghmc",
        "SGHMC, B = N/4",
        "pmsg.SGHMC(batch_size=2500)",
        lambda: pmsg.SGHMC(batch_size=N // 4),
        draws=1000,
        tune=100,
    ),
    Run(
        "sghmc_constant_sgd",
        "Constant SGD, B = N/4 (for the SGHMC page)",
        "pmsg.ConstantSGD(batch_size=2500)",
        lambda: pmsg.ConstantSGD(batch_size=N // 4),
        draws=1000,
        tune=100,
    ),
    Run(
        "sagald",
        "SAGA-LD",
        "pmsg.SAGALD(batch_size=100)",
        lambda: pmsg.SAGALD(batch_size=BATCH),
        draws=500,
        tune=50,
    ),
    Run(
        "svrgld",
        "SVRG-LD",
        "pmsg.SVRGLD(batch_size=100)",
        lambda: pmsg.SVRGLD(batch_size=BATCH),
        draws=500,
        tune=50,
    ),
]


def regression_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Generated regression data and its exact posterior mean and covariance."""
    rng = np.random.default_rng(seed)
    corr = np.full((D, D), RHO) + (1 - RHO) * np.eye(D)
    X = rng.normal(size=(N, D)) @ np.linalg.cholesky(corr).T
    y = X @ np.array([1.0, -0.5, 0.25]) + rng.normal(size=N)
    cov = np.linalg.inv(X.T @ X + np.eye(D) / PRIOR_SD**2)
    return X, y, cov @ X.T @ y, cov


def regression_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    with pm.Model(coords={"coef": [f"b{k}" for k in range(D)]}) as model:
        Xd = pm.Data("X", X)
        beta = pm.Normal("beta", 0.0, PRIOR_SD, dims="coef")
        pm.Normal("y", Xd @ beta, 1.0, observed=y)
    return model


def git_version() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "pymc_sgmcmc"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes in pymc_sgmcmc/" if dirty else "")


def provenance(wall: float) -> str:
    return (
        f"git {git_version()}; pymc {pm.__version__}, arviz {az.__version__}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (shared); "
        f"wall time {wall:.0f} s including compilation"
    )


def markdown_table(frame: pd.DataFrame, columns: dict[str, str]) -> str:
    head = "| parameter | " + " | ".join(columns.values()) + " |"
    rule = "|---|" + "---:|" * len(columns)
    rows = [
        f"| `{label}` | " + " | ".join(_fmt(c, frame.loc[label, c]) for c in columns) + " |"
        for label in frame.index
    ]
    return "\n".join([head, rule, *rows])


def _fmt(column: str, value: float) -> str:
    """Means and sds to 4 significant digits, errors and ratios to 2 decimals, ESS whole."""
    if not np.isfinite(value):
        return "—"
    if column in ("mean_diff_sd", "sd_ratio"):
        return f"{value:+.2f}" if column == "mean_diff_sd" else f"{value:.2f}"
    if column in ("ess", "ess_per_second"):
        return f"{value:.0f}"
    if column == "ess_per_pass":
        return f"{value:.3g}"
    return f"{value:.4g}"


def ellipse(mean: np.ndarray, cov: np.ndarray, radius: float) -> np.ndarray:
    angle = np.linspace(0, 2 * np.pi, 200)
    circle = np.stack([np.cos(angle), np.sin(angle)])
    return (mean[:, None] + radius * np.linalg.cholesky(cov) @ circle).T


def sampler_figure(run: Run) -> None:
    X, y, mean, cov = regression_data()
    sd = np.sqrt(np.diag(cov))
    with regression_model(X, y):
        t0 = time.perf_counter()
        idata = pm.sample(
            draws=run.draws,
            tune=run.tune,
            chains=CHAINS,
            cores=1,
            step=run.make(),
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
        wall = time.perf_counter() - t0
    exact = np.random.default_rng(2).multivariate_normal(mean, cov, size=4000)
    table = pmsg.compare(idata, {"beta": exact})
    draws = idata.posterior["beta"].values  # (chain, draw, D)
    passes = idata.sample_stats["data_passes"].values

    fig = plt.figure(figsize=(11, 6.2), layout="constrained")
    grid = fig.add_gridspec(2, 3)
    for k in range(D):
        ax = fig.add_subplot(grid[0, k])
        grid_k = np.linspace(mean[k] - 4.5 * sd[k], mean[k] + 4.5 * sd[k], 300)
        ax.hist(
            draws[..., k].ravel(),
            bins=40,
            density=True,
            color=COLOURS[k],
            alpha=0.45,
            range=(grid_k[0], grid_k[-1]),
            label=run.title,
        )
        ax.plot(
            grid_k,
            np.exp(-0.5 * ((grid_k - mean[k]) / sd[k]) ** 2) / (sd[k] * np.sqrt(2 * np.pi)),
            color="k",
            lw=1.5,
            label="exact",
        )
        ax.set_title(
            f"β[{k}]: mean error {table['mean_diff_sd'].iloc[k]:+.2f} sd, "
            f"sd ratio {table['sd_ratio'].iloc[k]:.2f}",
            fontsize=9,
        )
        ax.set_yticks([])
        if k == 0:
            ax.legend(fontsize=8, loc="upper left")
    ax = fig.add_subplot(grid[1, :2])
    for k in range(D):
        ax.plot(
            passes[0], (draws[0, :, k] - mean[k]) / sd[k], lw=0.6, color=COLOURS[k], label=f"β[{k}]"
        )
    ax.axhline(0, color="k", lw=0.8)
    for level in (-2, 2):
        ax.axhline(level, color="k", lw=0.5, ls=":")
    ax.set_xlabel("data passes (chain 0, sampling draws)")
    ax.set_ylabel("(draw − exact mean) / exact sd")
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    ax = fig.add_subplot(grid[1, 2])
    ax.scatter(draws[..., 0].ravel(), draws[..., 1].ravel(), s=2, alpha=0.3, color="C0")
    for radius in (1, 2):
        pts = ellipse(mean[:2], cov[:2, :2], radius)
        ax.plot(pts[:, 0], pts[:, 1], color="k", lw=1)
    ax.set_xlabel("β[0]")
    ax.set_ylabel("β[1]")
    ax.set_title("joint draws over the exact 1- and 2-sd ellipses", fontsize=9)
    fig.suptitle(
        f"{run.title}: step={run.code}\n{CHAINS} chains × {run.draws} draws "
        f"(tune={run.tune}); linear regression, N = {N}, D = {D}, features "
        f"correlated ρ = {RHO}, exact posterior in black",
        fontsize=10,
    )
    fig.savefig(OUT / f"{run.name}.png", dpi=110)
    plt.close(fig)

    step_size = float(idata.sample_stats["step_size"].values[:, -1].mean())
    attrs = table.attrs
    lines = [
        f"Run: `pm.sample(step={run.code}, draws={run.draws}, tune={run.tune}, "
        f"chains={CHAINS}, cores=1, random_seed=1)`, made by `docs/figures/make_figures.py "
        f"{run.name}` ({provenance(wall)}). Reference: 4000 draws of the exact posterior.",
        "",
        markdown_table(
            table,
            {
                "mean": "mean",
                "ref_mean": "exact mean",
                "sd": "sd",
                "ref_sd": "exact sd",
                "mean_diff_sd": "mean error (exact sds)",
                "sd_ratio": "sd ratio",
                "ess": "bulk ESS",
                "ess_per_pass": "ESS per pass",
            },
        ),
        "",
        f"Data passes of the kept draws (both chains): {attrs['data_passes']:.0f}; "
        f"Gaussian KL(draws ‖ exact) = {attrs['gaussian_kl']:.3g}; energy distance "
        f"{attrs['energy_distance']:.3g} exact sds; `step_size` stat after tuning "
        f"(mean diagonal of the preconditioner) {step_size:.3g}.",
        "",
    ]
    (OUT / f"{run.name}_table.md").write_text("\n".join(lines))
    print(f"{run.name}: {wall:.0f} s", flush=True)
    print(table.round(3).to_string(), flush=True)


def logistic_data(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(10_000, 4))
    logit = -0.5 + X @ np.array([1.0, -1.0, 0.5, 0.0])
    return X, rng.binomial(1, 1 / (1 + np.exp(-logit)))


def compare_figure() -> None:
    X, y = logistic_data()
    with pm.Model(coords={"feature": ["x0", "x1", "x2", "x3"]}) as model:
        Xd = pm.Data("X", X)
        intercept = pm.Normal("intercept", 0.0, 5.0)
        beta = pm.Normal("beta", 0.0, 2.0, dims="feature")
        pm.Bernoulli("y", logit_p=intercept + Xd @ beta, observed=y)
    common = dict(
        chains=CHAINS, cores=1, random_seed=1, progressbar=False, compute_convergence_checks=False
    )
    with model:
        t0 = time.perf_counter()
        sg = pm.sample(draws=1000, tune=20, step=pmsg.IASG(batch_size=200), **common)
        t_sg = time.perf_counter() - t0
        t0 = time.perf_counter()
        nuts = pm.sample(draws=1000, tune=500, **common)
        t_nuts = time.perf_counter() - t0
    table = pmsg.compare(sg, nuts)
    figures = pmsg.plot_compare(
        sg,
        nuts,
        labels=("IASG", "NUTS"),
        density_kwargs={"figsize": (11, 5.5), "textsize": 10},
        forest_kwargs={"figsize": (7, 3.5), "textsize": 10},
    )
    figures.density.set_layout_engine("constrained")  # ArviZ's titles overlap the ticks
    figures.density.savefig(OUT / "compare_density.png", dpi=110, bbox_inches="tight")
    figures.forest.savefig(OUT / "compare_forest.png", dpi=110, bbox_inches="tight")
    plt.close("all")
    nuts_table = pmsg.compare(nuts, sg)  # NUTS's own ESS per second, same labels
    attrs = table.attrs
    lines = [
        "Made by `docs/figures/make_figures.py compare` "
        f"({provenance(t_sg + t_nuts)}): IASG `pm.sample(step=pmsg.IASG(batch_size=200), "
        f"draws=1000, tune=20, chains=2, cores=1)` took {t_sg:.0f} s, NUTS "
        f"`pm.sample(draws=1000, tune=500, chains=2, cores=1)` {t_nuts:.0f} s "
        "(both including compilation).",
        "",
        markdown_table(
            table,
            {
                "mean": "IASG mean",
                "ref_mean": "NUTS mean",
                "sd": "IASG sd",
                "ref_sd": "NUTS sd",
                "mean_diff_sd": "mean error (NUTS sds)",
                "sd_ratio": "sd ratio",
                "ess": "IASG ESS",
                "ess_per_second": "IASG ESS/s",
                "ess_per_pass": "IASG ESS/pass",
            },
        ),
        "",
        f'Whole posterior: `table.attrs["gaussian_kl"]` = {attrs["gaussian_kl"]:.3g} '
        f'(in {attrs["gaussian_kl_dim"]} dimensions), `table.attrs["energy_distance"]` = '
        f"{attrs['energy_distance']:.3g} NUTS sds (on {attrs['energy_distance_draws'][0]} "
        f"and {attrs['energy_distance_draws'][1]} draws). NUTS's own bulk ESS per second: "
        f"{nuts_table['ess_per_second'].min():.0f}–{nuts_table['ess_per_second'].max():.0f}; "
        f"IASG's: {table['ess_per_second'].min():.0f}–{table['ess_per_second'].max():.0f}.",
        "",
    ]
    (OUT / "compare_table.md").write_text("\n".join(lines))
    print(f"compare: IASG {t_sg:.0f} s, NUTS {t_nuts:.0f} s", flush=True)
    print(table.round(3).to_string(), flush=True)


def random_effects_figure() -> None:
    """The hierarchical guide's check: local variables on Gaussian random effects with a
    closed-form posterior, ``"markov"`` and ``"meanfield"`` against the exact one.

    ``y_ij ~ N(u_j, 1)``, ``u_j ~ N(μ, 0.5)``, ``μ ~ N(0, 10)``, 40 groups of 2–59 rows
    (1 200 rows in all); SGLD samples μ, the effects ``u`` are ``local_vars``."""
    sigma, tau, prior_sd, groups = 1.0, 0.5, 10.0, 40
    rng = np.random.default_rng(0)
    counts = rng.integers(2, 60, size=groups)
    g = np.repeat(np.arange(groups), counts)
    y = (1.0 + tau * rng.normal(size=groups))[g] + sigma * rng.normal(size=g.size)
    precision = np.zeros((groups + 1, groups + 1))
    shift = np.zeros(groups + 1)
    precision[0, 0] = groups / tau**2 + 1 / prior_sd**2
    for j in range(groups):
        precision[j + 1, j + 1] = counts[j] / sigma**2 + 1 / tau**2
        precision[0, j + 1] = precision[j + 1, 0] = -1 / tau**2
        shift[j + 1] = y[g == j].sum() / sigma**2
    cov = np.linalg.inv(precision)
    mean = cov @ shift
    sd = np.sqrt(np.diag(cov))
    exact = np.random.default_rng(1).multivariate_normal(mean, cov, size=4000)
    reference = {"mu": exact[:, 0], "u": exact[:, 1:]}

    with pm.Model(coords={"group": np.arange(groups)}) as model:
        index = pm.Data("g", g)
        mu = pm.Normal("mu", 0, prior_sd)
        u = pm.Normal("u", mu, tau, dims="group")
        pm.Normal("y", u[index], sigma, observed=y)

    fits, tables, start = {}, [], time.perf_counter()
    for family in ("markov", "meanfield"):
        with model:
            fits[family] = pm.sample(
                draws=1000,
                tune=300,
                chains=CHAINS,
                cores=1,
                random_seed=3,
                progressbar=False,
                compute_convergence_checks=False,
                step=pmsg.SGLD(local_vars=["u"], local_family=family),
            )
        frame = pmsg.compare(fits[family], reference, var_names=["mu", "u"])
        tables.append(
            {
                "local_family": f'`"{family}"`',
                "μ: mean error (sd)": f"{frame.loc['mu', 'mean_diff_sd']:+.2f}",
                "μ: sd ratio": f"{frame.loc['mu', 'sd_ratio']:.2f}",
                "u: max abs mean error (sd)": f"{frame.drop('mu')['mean_diff_sd'].abs().max():.2f}",
                "u: sd ratios": (
                    f"{frame.drop('mu')['sd_ratio'].min():.2f}–"
                    f"{frame.drop('mu')['sd_ratio'].max():.2f}"
                ),
                "min ESS": f"{frame['ess'].min():.0f}",
            }
        )
    wall = time.perf_counter() - start

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    grid = np.linspace(mean[0] - 4 * sd[0], mean[0] + 4 * sd[0], 200)
    axes[0].plot(
        grid,
        np.exp(-0.5 * ((grid - mean[0]) / sd[0]) ** 2) / (sd[0] * np.sqrt(2 * np.pi)),
        "k",
        lw=1.5,
        label="exact",
    )
    for (family, idata), colour in zip(fits.items(), ("C0", "C3"), strict=True):
        draws = idata.posterior["mu"].values.ravel()
        axes[0].hist(draws, bins=40, density=True, histtype="step", color=colour, label=family)
        post_u = idata.posterior["u"]
        err = (post_u.mean(("chain", "draw")).values - mean[1:]) / sd[1:]
        ratio = post_u.std(("chain", "draw")).values / sd[1:]
        axes[1].scatter(counts, err, s=12, color=colour, label=family)
        axes[2].scatter(counts, ratio, s=12, color=colour, label=family)
    axes[0].set_title("global μ: draws vs exact marginal")
    axes[1].axhline(0, color="k", lw=0.8)
    axes[1].set_title("effects u: mean error in posterior sds")
    axes[1].set_xlabel("rows in the group")
    axes[2].axhline(1, color="k", lw=0.8)
    axes[2].set_title("effects u: sd / exact sd")
    axes[2].set_xlabel("rows in the group")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "random_effects.png", dpi=110)
    plt.close(fig)
    head = list(tables[0])
    table = "\n".join(
        ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        + ["| " + " | ".join(row[k] for k in head) + " |" for row in tables]
    )
    (OUT / "random_effects_table.md").write_text(table + "\n\n" + provenance(wall) + "\n")
    print(f"random_effects: {wall:.0f} s")


def main() -> None:
    names = [run.name for run in RUNS] + ["compare", "random_effects"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("figures", nargs="*", help=f"some of {names} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.figures) - set(names))
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; choose from {names}")
    chosen = args.figures or names
    for run in RUNS:
        if run.name in chosen:
            sampler_figure(run)
    if "compare" in chosen:
        compare_figure()
    if "random_effects" in chosen:
        random_effects_figure()


if __name__ == "__main__":
    main()
