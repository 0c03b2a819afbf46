"""Variational EM for a prior precision (Mandt, Hoffman & Blei 2017, §4.2 and §7.3).

Multinomial logistic regression on the digits data that scikit-learn ships (1797 × 64, no
download), features scaled to [0, 1], with a Gaussian prior of precision λ on the weights.
``pmsg.ConstantSGD(hyper_vars=["lam"])`` samples the weights at the KL-optimal rate while
λ follows Robbins–Monro ascent during tuning. The result is compared with a grid: for each
λ, the MAP weights (scikit-learn's ``LogisticRegression(C=1/λ)``, the same objective) and
their validation log-loss.

Run: ``python examples/vem_digits.py`` → prints both λ and writes
``docs/figures/vem_digits.png``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pymc as pm  # noqa: E402

import pymc_sgmcmc as pmsg  # noqa: E402

warnings.filterwarnings("ignore", message=".*BLAS.*")


def load(seed: int = 0, n_train: int = 1200):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    perm = np.random.default_rng(seed).permutation(len(y))
    X, y = X[perm], y[perm]
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def validation_grid(Xt, yt, Xv, yv, grid):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    losses = []
    for lam in grid:
        clf = LogisticRegression(C=1.0 / lam, max_iter=5000).fit(Xt, yt)
        losses.append(log_loss(yv, clf.predict_proba(Xv)))
    return np.asarray(losses)


def fit_vem(Xt, yt, tune: int, draws: int, seed: int):
    with pm.Model():
        lam = pm.Gamma("lam", alpha=1.0, beta=1e-3, initval=1.0)
        W = pm.Normal("W", 0.0, sigma=1.0 / pm.math.sqrt(lam), shape=(Xt.shape[1], 10))
        b = pm.Normal("b", 0.0, 10.0, shape=10)
        pm.Categorical("y", logit_p=pm.Data("X", Xt) @ W + b, observed=yt)
        step = pmsg.ConstantSGD(batch_size=100, hyper_vars=[lam])
        idata = pm.sample(
            draws=draws,
            tune=tune,
            chains=1,
            step=step,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
        )
    trajectory = np.exp(np.asarray(step.hyper_trajectory)[:, 0])
    return float(idata.posterior["lam"].values[0, -1]), trajectory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", type=int, default=1500)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("docs/figures/vem_digits.png"))
    args = parser.parse_args()

    Xt, yt, Xv, yv = load()
    grid = np.logspace(-3, 2, 21)
    losses = validation_grid(Xt, yt, Xv, yv, grid)
    best = float(grid[np.argmin(losses)])
    t0 = time.perf_counter()
    lam_vem, trajectory = fit_vem(Xt, yt, args.tune, args.draws, seed=1)
    print(f"validation-optimal λ on the grid: {best:.3g}")
    print(
        f"variational-EM λ: {lam_vem:.3g} ({time.perf_counter() - t0:.0f} s); ratio {lam_vem / best:.2f}"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.semilogx(grid, losses, "o-", ms=3)
    ax1.axvline(best, color="k", ls=":", label=f"grid optimum {best:.2g}")
    ax1.axvline(lam_vem, color="C3", label=f"variational EM {lam_vem:.2g}")
    ax1.set_xlabel("prior precision λ")
    ax1.set_ylabel("validation log-loss")
    ax1.legend(fontsize=8)
    ax2.semilogy(trajectory)
    ax2.axhline(best, color="k", ls=":")
    ax2.set_xlabel("tuning draw")
    ax2.set_ylabel("λ")
    ax2.set_title("Robbins–Monro trajectory", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
