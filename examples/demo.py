"""Demo: a Bayesian linear regression on generated data, sampled with IASG and with NUTS.

Prints ``pmsg.compare(sg, nuts)`` — per parameter the SG and NUTS means and sds, the
difference in NUTS sds, the sd ratio, ESS, ESS per second and per data pass — with the exact
conjugate posterior beside them, and writes ``pmsg.plot_compare``'s figures to
``demo_output/demo_posteriors.png`` (marginals, with the exact density) and
``demo_output/demo_forest.png``.

Run with ``./run demo`` (sets everything up), or ``python examples/demo.py --n 100000``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
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
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument(
        "--sampler",
        default="IASG",
        choices=["IASG", "SGLD", "ConstantSGD", "SGFS", "SAGALD", "SVRGLD"],
        help="the SG step method (its defaults: it tunes itself)",
    )
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

    common = dict(chains=4, random_seed=1, progressbar=True)
    with model():
        t0 = time.perf_counter()
        sg = pm.sample(
            draws=args.draws,
            tune=300,
            step=getattr(pmsg, args.sampler)(batch_size=args.batch_size),
            **common,
        )
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

    # pmsg.compare: per scalar parameter, the SG sampler against NUTS (mean difference in NUTS sds, sd
    # ratio, ESS, ESS per second and per data pass), and the joint Gaussian KL / energy
    # distance in the attrs.
    table = pmsg.compare(sg, nuts, var_names=["intercept", "beta"])
    table.insert(2, "exact_mean", exact_mean)
    table.insert(5, "exact_sd", exact_sd)
    pd.set_option("display.float_format", lambda v: f"{v:.4g}")
    pd.set_option("display.width", 200)
    print(f"\nLinear regression, N = {args.n:,}, D = {args.d + 1}, batch size {args.batch_size}")
    print(f"{args.sampler} (mean, sd, ess...) against NUTS (ref_*) and the exact posterior:")
    print(table.to_string())
    print(
        f"joint: Gaussian KL({args.sampler} || NUTS) = {table.attrs['gaussian_kl']:.3g}, energy distance "
        f"{table.attrs['energy_distance']:.3g} (in NUTS sds)"
    )
    passes = float(sg.sample_stats["data_passes"].values[:, -1].mean())
    print(
        f"\n{args.sampler}: {t_sg:.1f} s for 2 chains ({passes:.0f} passes over the data each), "
        f"step size {float(sg.sample_stats['step_size'].values[0, -1]):.3g} (automatic); "
        f"NUTS (PyMC default): {t_nuts:.1f} s."
    )

    args.out.mkdir(parents=True, exist_ok=True)
    figures = pmsg.plot_compare(
        sg, nuts, var_names=["intercept", "beta"], labels=(args.sampler, "NUTS")
    )
    for ax, k in zip(figures.density.axes, range(len(names)), strict=False):
        grid = np.linspace(*ax.get_xlim(), 200)
        density = np.exp(-0.5 * ((grid - exact_mean[k]) / exact_sd[k]) ** 2)
        ax.plot(grid, density / (exact_sd[k] * np.sqrt(2 * np.pi)), "k:", lw=1, label="exact")
    paths = [args.out / "demo_posteriors.png", args.out / "demo_forest.png"]
    figures.density.savefig(paths[0], dpi=120)
    figures.forest.savefig(paths[1], dpi=120)
    print("figures: " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
