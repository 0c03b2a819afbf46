"""Demo: a Bayesian linear regression on generated data, sampled with SGLD and with NUTS.

Prints a side-by-side table of posterior means and sds (with the exact conjugate posterior
as a third column) and writes ``demo_output/demo_posteriors.png``.

Run with ``./run demo`` (sets everything up), or ``python examples/demo.py --n 100000``.
"""

from __future__ import annotations

import argparse
import time
import warnings
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=100_000, help="rows of generated data")
    parser.add_argument("--d", type=int, default=4, help="features")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("demo_output"))
    args = parser.parse_args()

    rng = np.random.default_rng(42)
    X = rng.normal(size=(args.n, args.d))
    true_beta = rng.normal(size=args.d)
    y = 0.5 + X @ true_beta + rng.normal(size=args.n)
    names = ["intercept"] + [f"x{i}" for i in range(args.d)]

    def model() -> pm.Model:
        with pm.Model(coords={"coef": names[1:]}) as m:
            Xd = pm.Data("X", X)
            intercept = pm.Normal("intercept", 0, 5)
            beta = pm.Normal("beta", 0, 1, dims="coef")
            pm.Normal("y", intercept + Xd @ beta, 1.0, observed=y)
        return m

    common = dict(chains=2, cores=1, random_seed=1, progressbar=True)
    with model():
        t0 = time.perf_counter()
        sg = pm.sample(draws=args.draws, tune=300, step=pmsg.SGLD(batch_size=args.batch_size), **common)
        t_sg = time.perf_counter() - t0
    with model():
        t0 = time.perf_counter()
        nuts = pm.sample(draws=1000, tune=1000, **common)
        t_nuts = time.perf_counter() - t0

    # Exact posterior: known noise sd 1, priors N(0, 5²) on the intercept, N(0, 1) on β.
    Z = np.column_stack([np.ones(args.n), X])
    precision = Z.T @ Z + np.diag([1 / 25] + [1.0] * args.d)
    cov = np.linalg.inv(precision)
    exact_mean, exact_sd = cov @ Z.T @ y, np.sqrt(np.diag(cov))

    def flat(idata: az.InferenceData) -> np.ndarray:
        post = idata.posterior
        return np.column_stack(
            [post["intercept"].values.reshape(-1), post["beta"].values.reshape(-1, args.d)]
        )

    sg_draws, nuts_draws = flat(sg), flat(nuts)
    table = pd.DataFrame(
        {
            "exact mean": exact_mean,
            "NUTS mean": nuts_draws.mean(0),
            "SGLD mean": sg_draws.mean(0),
            "exact sd": exact_sd,
            "NUTS sd": nuts_draws.std(0),
            "SGLD sd": sg_draws.std(0),
            "SGLD−NUTS (NUTS sds)": (sg_draws.mean(0) - nuts_draws.mean(0)) / nuts_draws.std(0),
            "SGLD/NUTS sd": sg_draws.std(0) / nuts_draws.std(0),
        },
        index=names,
    )
    pd.set_option("display.float_format", lambda v: f"{v:.4g}")
    pd.set_option("display.width", 160)
    print(f"\nLinear regression, N = {args.n:,}, D = {args.d + 1}, batch size {args.batch_size}")
    print(table.to_string())
    passes = float(sg.sample_stats["data_passes"].values[:, -1].mean())
    print(
        f"\nSGLD: {t_sg:.1f} s for 2 chains ({passes:.0f} passes over the data each), "
        f"step size {float(sg.sample_stats['step_size'].values[0, -1]):.3g} (automatic); "
        f"NUTS (PyMC default): {t_nuts:.1f} s."
    )

    args.out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(names), figsize=(3 * len(names), 2.8))
    for k, ax in enumerate(axes):
        ax.hist(nuts_draws[:, k], bins=40, density=True, alpha=0.5, label="NUTS")
        ax.hist(sg_draws[:, k], bins=40, density=True, alpha=0.5, label="SGLD")
        grid = np.linspace(*ax.get_xlim(), 200)
        ax.plot(grid, np.exp(-0.5 * ((grid - exact_mean[k]) / exact_sd[k]) ** 2)
                / (exact_sd[k] * np.sqrt(2 * np.pi)), "k", lw=1, label="exact")
        ax.set_title(names[k])
        ax.set_yticks([])
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = args.out / "demo_posteriors.png"
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
