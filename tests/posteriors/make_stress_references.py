"""Regenerate the stress cases' NUTS references and print the cross-check table.

    .venv/bin/python tests/posteriors/make_stress_references.py                 # everything
    .venv/bin/python tests/posteriors/make_stress_references.py --skip-references
    .venv/bin/python tests/posteriors/make_stress_references.py --only lkj_mvnormal

1. References (``nuts`` cases of ``stress.KIND``, unless ``--skip-references``): a long
   numpyro NUTS run (PyMC's ``nuts_sampler="numpyro"``, 4 chains × 5000 draws after 1500
   tuning steps) checked against an independent nutpie run (its own NUTS, adaptation and
   numba-compiled logp, another seed; 4 × 2500 after 1000). Both must have no divergences,
   R-hat ≤ 1.01 and bulk ESS ≥ 1000 for every stored scalar, else the script stops without
   writing. The numpyro run is stored thinned by 4 as float32 in ``data/stress/<name>_ci.npz``
   (the thinned draws must pass the same R-hat and ESS bounds). The small regressions are also
   scored against their exact (1-D quadrature) posterior, ``stress.collapsed_linear``.
2. Checks of the closed-form and Laplace references (unless ``--skip-checks``):
   - natural_linear, sigma_prior_regression (exact by quadrature): the Laplace approximation
     and a long nutpie run (low-rank mass matrix, 4 × 2500 after 1000) scored against them;
   - natural_logistic (Laplace): a long nutpie run (low-rank mass matrix, started at the
     initial point without jitter, 4 × 2500 after 1000) scored against Laplace;
   - uncentred_predictor (exact): Laplace scored against it.
3. ``--full``: the N = 10⁶ references: time of each; natural_logistic's Laplace convergence;
   Laplace scored against the exact posterior of natural_linear and uncentred_predictor.
4. Builder sanity checks (unless ``--skip-sanity``): PyMC's NUTS (numpyro backend, default
   settings, 4 × 1000 after 1000, a fresh seed) on every ``ci`` case scored against
   ``stress.reference``; a run failing its diagnostics is reported as lost (divergences or
   R-hat > 1.1) or short (bulk ESS < 1000 or R-hat > 1.01). On natural_linear this run takes
   ~20 minutes (tree depth 10 throughout) and ends lost; natural_logistic's is lost at once.

Run it on its own: importing pymc.sampling.jax rewrites XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ → `posteriors` package

import pymc as pm  # noqa: E402

from posteriors import stress  # noqa: E402
from posteriors.common import diagnostics, laplace, ok, save_reference, score  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=RuntimeWarning)

LONG = dict(draws=5000, tune=1500)
THIN = 4
# random_intercepts: mu and beta mix slowly (x is uncentred, alpha centred): bulk ESS ≈ 600
# from 4 × 5000, so 4 × 15000 thinned by 12
LONG_FOR = {"random_intercepts": (dict(draws=15000, tune=1500), 12)}
# ... and nutpie's diagonal mass matrix gets bulk ESS 165 from 4 × 2500 there: its check run
# uses nutpie's low-rank mass matrix adaptation
LOW_RANK_CHECK = {"random_intercepts"}
CHECK = dict(draws=2500, tune=1000)
SANITY = dict(draws=1000, tune=1000)
SEED = 20250101


def draws_of(idata) -> dict[str, np.ndarray]:
    """Free RVs and deterministics, except chol_corr (its diagonal is a constant 1;
    corr_offdiag holds its free entries)."""
    post = idata.posterior
    return {
        k: np.asarray(post[k].values, dtype=np.float64) for k in post.data_vars if k != "chol_corr"
    }


def lkj_sufficient() -> pm.Model:
    """lkj_mvnormal's posterior written with the sufficient statistics (ȳ and the scatter
    matrix) in a ``pm.Potential``: the same priors and the same log density up to a constant
    (checked by :func:`check_equivalent`). The builder's ``pm.MvNormal(observed=(20000, 3))``
    costs 12 ms (C) to 63 ms (JAX) a gradient — PyTensor solves the 20 000 rows one by one
    (a Blockwise triangular solve) — which makes a long NUTS run take hours."""
    import pytensor.tensor as pt
    from pytensor.tensor.slinalg import solve_triangular

    y = stress.data("lkj_mvnormal")["y"]
    n, k = y.shape
    ybar = y.mean(0)
    scatter_chol = np.linalg.cholesky((y - ybar).T @ (y - ybar))
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 10.0, shape=3)
        chol, corr, _ = pm.LKJCholeskyCov(
            "chol", n=3, eta=2.0, sd_dist=pm.Exponential.dist(1.0), compute_corr=True
        )
        pm.Deterministic("corr_offdiag", corr[np.tril_indices(3, -1)])
        a = solve_triangular(chol, scatter_chol, lower=True)
        b = solve_triangular(chol, ybar - mu, lower=True)
        quad = pt.sum(a**2) + n * pt.sum(b**2)  # Σᵢ (yᵢ-μ)ᵀ Σ⁻¹ (yᵢ-μ)
        logdet = 2.0 * pt.sum(pt.log(pt.diag(chol)))
        pm.Potential("obs", -0.5 * n * k * np.log(2 * np.pi) - 0.5 * n * logdet - 0.5 * quad)
    return model


def check_equivalent(name: str, other: pm.Model, points: int = 20) -> float:
    """The largest spread, over random points in the unconstrained space, of the difference of
    the two models' log densities (0 up to rounding when they define the same posterior)."""
    a, b = stress.build(name), other
    fa, fb = a.compile_logp(), b.compile_logp()
    ip = a.initial_point()
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(points):
        pt_ = {k: v + rng.normal(0.0, 0.3, np.shape(v)) for k, v in ip.items()}
        diffs.append(float(fa(pt_)) - float(fb(pt_)))
    spread = max(diffs) - min(diffs)
    print(
        f"  {name}: logp(builder) - logp(sufficient-statistic model) spread over {points} "
        f"points: {spread:.2e} (logp ~ {float(fa(ip)):.3e})",
        flush=True,
    )
    if spread > 1e-6 * max(1.0, abs(float(fa(ip)))):
        raise SystemExit(f"{name}: the sufficient-statistic model is not equivalent")
    return spread


EQUIVALENT = {"lkj_mvnormal": lkj_sufficient}


def run(
    name: str,
    sampler: str,
    seed: int,
    draws: int,
    tune: int,
    low_rank: bool = False,
    jitter: bool = True,
    equivalent: bool = False,
):
    """4 chains of PyMC's numpyro NUTS (``pm.sample``, default settings) or of nutpie
    (called directly, so that jitter can be switched off: nutpie otherwise starts every
    chain at a U(-1, 1) jitter of the initial point, which in natural units puts the logistic
    regression's income coefficient at ±1 per dollar — fully saturated)."""
    model = EQUIVALENT[name]() if equivalent else stress.build(name)
    t = time.perf_counter()
    if sampler == "numpyro":
        with model:
            idata = pm.sample(
                draws=draws,
                tune=tune,
                chains=4,
                nuts_sampler="numpyro",
                random_seed=seed,
                progressbar=False,
            )
    else:
        import nutpie

        compiled = nutpie.compile_pymc_model(model, **({} if jitter else {"jitter_rvs": set()}))
        idata = nutpie.sample(
            compiled,
            draws=draws,
            tune=tune,
            chains=4,
            seed=seed,
            progress_bar=False,
            low_rank_modified_mass_matrix=low_rank,
        )
    elapsed = time.perf_counter() - t
    d = diagnostics(draws_of(idata), idata)
    d["seconds"] = round(elapsed)
    label = (
        sampler
        + (" low-rank" if low_rank else "")
        + ("" if jitter else " no-jitter")
        + (" (sufficient statistics)" if equivalent else "")
    )
    print(f"  {name}: {label} 4×{draws} after {tune}, seed {seed}: {d}", flush=True)
    return idata, label, d


def fmt(s: dict | None) -> str:
    if s is None:
        return "—"
    return (
        f"{s['max_abs_dmean']:.3f} (±{s['mc_dmean']:.3f}) | "
        f"{s['sd_ratio_min']:.3f}–{s['sd_ratio_max']:.3f} (±{s['mc_sd_ratio']:.3f})"
    )


def add(rows, name, what, s, t):
    rows.append((name, what, s, t))
    print(f"  {what}: {fmt(s)}", flush=True)


def make_reference(name: str, rows: list) -> None:
    print(f"{name}: NUTS reference", flush=True)
    eq = name in EQUIVALENT
    if eq:
        check_equivalent(name, EQUIVALENT[name]())
    long, thin = LONG_FOR.get(name, (LONG, THIN))
    a, label_a, d_a = run(name, "numpyro", SEED, **long, equivalent=eq)
    b, label_b, d_b = run(
        name, "nutpie", SEED + 1, **CHECK, equivalent=eq, low_rank=name in LOW_RANK_CHECK
    )
    if not (ok(d_a) and ok(d_b)):
        raise SystemExit(f"{name}: diagnostics fail; reference not written")
    ref = draws_of(a)
    add(
        rows,
        name,
        f"{label_b} 4×2500 vs {label_a} 4×{long['draws']}",
        score(draws_of(b), ref),
        f"{d_a['seconds']} s + {d_b['seconds']} s",
    )
    stored = {k: v[:, ::thin].astype(np.float32) for k, v in ref.items()}
    d_s = diagnostics({k: v.astype(np.float64) for k, v in stored.items()})
    if d_s["min_ess_bulk"] < 1000 or d_s["max_rhat"] > 1.01:
        raise SystemExit(f"{name}: thinned draws fail ({d_s}); reference not written")
    path = stress.reference_path(name)
    save_reference(path, stored)
    shape = next(iter(stored.values())).shape[:2]
    print(
        f"  wrote {path.name}: {path.stat().st_size / 1e6:.2f} MB, {shape} chains×draws, "
        f"stored draws {d_s}",
        flush=True,
    )
    if name in stress._LINEAR_SIGMA_SCALE:
        exact = stress.collapsed_linear(name)
        add(
            rows,
            name,
            "numpyro reference (stored) vs exact quadrature",
            score({k: v.astype(np.float64) for k, v in stored.items()}, exact),
            "",
        )
        add(rows, name, f"{label_b} vs exact quadrature", score(draws_of(b), exact), "")


def check_exact_or_laplace(name: str, rows: list) -> None:
    n = stress.sizes(name)["ci"]
    print(f"{name}: {stress.KIND[name]} reference at N = {n}", flush=True)
    t = time.perf_counter()
    ref = stress.reference(name, "ci")
    t_ref = time.perf_counter() - t
    if stress.KIND[name] == "exact" and name != "prior_only_direction" and name != "two_observed":
        t = time.perf_counter()
        fit = laplace(stress.build(name, "ci"), seed=1)
        add(
            rows,
            name,
            "Laplace vs exact",
            score(fit["draws"], ref),
            f"{t_ref:.0f} s (exact), {time.perf_counter() - t:.0f} s (Laplace)",
        )
    if name in ("natural_linear", "sigma_prior_regression", "natural_logistic"):
        idata, label, d = run(
            name, "nutpie", SEED + 2, **CHECK, low_rank=True, jitter=name != "natural_logistic"
        )
        if ok(d):
            add(
                rows,
                name,
                f"{label} 4×2500 vs {stress.KIND[name]}",
                score(idata, ref),
                f"{d['seconds']} s",
            )
        else:
            add(rows, name, f"{label}: NUTS failed its diagnostics {d}", None, f"{d['seconds']} s")


def full(rows: list) -> None:
    for name in (
        "natural_linear",
        "natural_logistic",
        "uncentred_predictor",
        "prior_only_direction",
    ):
        n = stress.sizes(name)["full"]
        t = time.perf_counter()
        ref = stress.reference(name, "full")
        t_ref = time.perf_counter() - t
        print(f"{name} full (N = {n}): {stress.KIND[name]} reference {t_ref:.0f} s", flush=True)
        if name in ("natural_linear", "uncentred_predictor"):
            t = time.perf_counter()
            fit = laplace(stress.build(name, "full"), seed=1)
            add(
                rows,
                f"{name} [full, N={n}]",
                "Laplace vs exact",
                score(fit["draws"], ref),
                f"{t_ref:.0f} s (exact), {time.perf_counter() - t:.0f} s (Laplace)",
            )
        else:
            rows.append(
                (
                    f"{name} [full, N={n}]",
                    f"{stress.KIND[name]} reference computed",
                    None,
                    f"{t_ref:.0f} s",
                )
            )


def sanity(name: str, rows: list) -> None:
    if name in EQUIVALENT:  # the builder's own model is too slow for NUTS (see lkj_sufficient)
        spread = check_equivalent(name, EQUIVALENT[name]())
        rows.append(
            (
                name,
                f"builder's logp = sufficient-statistic model's + const (spread "
                f"{spread:.1e}); NUTS on the builder skipped (12-63 ms a gradient)",
                None,
                "",
            )
        )
        return
    idata, label, d = run(name, "numpyro", SEED + 3, **SANITY)
    if ok(d):
        flag = ""
    elif d["max_rhat"] > 1.1 or d["divergences"]:
        flag = f" — LOST {d}"
    else:  # short: fewer than 1000 bulk ESS or R-hat in (1.01, 1.1]
        flag = f" — short of the ESS/R-hat bounds {d}"
    add(
        rows,
        name,
        f"{label} 4×1000 vs {stress.KIND[name]} reference{flag}",
        score(idata, stress.reference(name, "ci")),
        f"{d['seconds']} s",
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", default=stress.CASES)
    p.add_argument("--skip-references", action="store_true")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-sanity", action="store_true")
    p.add_argument("--full", action="store_true")
    args = p.parse_args()
    rows: list = []
    if not args.skip_references:
        for name in args.only:
            if stress.KIND[name] == "nuts":
                make_reference(name, rows)
    if not args.skip_checks:
        for name in args.only:
            if stress.KIND[name] != "nuts":
                check_exact_or_laplace(name, rows)
    if args.full:
        full(rows)
    if not args.skip_sanity:
        print("builder sanity checks: PyMC NUTS (numpyro) vs the references", flush=True)
        for name in args.only:
            sanity(name, rows)
    print("\n| case | check | max abs Δmean in sds (mc) | sd ratio (mc) | time |")
    print("| --- | --- | --- | --- | --- |")
    for name, what, s, t in rows:
        print(f"| {name} | {what} | {fmt(s) if s else '— | —'} | {t} |")


if __name__ == "__main__":
    main()
