"""The table of docs/choosing.md, from the correctness benchmark's results.

Reads ``benchmarks/results/posteriordb.json`` (written by ``benchmarks/posteriordb.py``:
every sampler with default arguments against gold-standard, exact or long-NUTS references)
and writes ``docs/figures/choosing_table.md``, which the page includes. Run from the
repository root after a new correctness run::

    python docs/figures/make_choosing.py
"""

from __future__ import annotations

import json
from pathlib import Path

from pymc_sgmcmc.registry import SAMPLERS as REGISTRY

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "posteriordb.json"
OUT = ROOT / "docs" / "figures" / "choosing_table.md"
SAMPLERS = [s.name for s in REGISTRY]  # the table's columns, in the registry's order

# (row label, N shown, predicate on a result) — by model shape and size.
REGRESSIONS = {
    "natural_linear",
    "natural_logistic",
    "uncentred_predictor",
    "sigma_prior_regression",
    "lkj_mvnormal",
    "two_observed",
    "prior_only_direction",
}
RADON = "radon_all-radon_variable_intercept_centered"
GROUPS = [
    (
        "Small data: 9 posteriordb posteriors and 3 stress cases (raw units, flat or wide "
        "priors, a prior-only direction)",
        "46–3 020",
        # every row read in every iteration: the exact full-batch kernel
        lambda r: r["N"] <= 4096 and not r["local_vars"],
    ),
    (
        "Regressions and GLMs in natural units (correlated and uncentred predictors, a σ "
        "prior, LKJ, two observed variables)",
        "20 000",
        lambda r: r["posterior"] in REGRESSIONS and r["N"] == 20_000,
    ),
    (
        "The same at scale (linear, logistic, uncentred predictor, prior-only direction)",
        "5·10⁴–10⁶",
        lambda r: r["posterior"] in REGRESSIONS and r["N"] >= 50_000,
    ),
    (
        "Random intercepts, 50 groups of 200 rows",
        "10 000",
        lambda r: r["posterior"] == "random_intercepts",
    ),
    (
        "Partial pooling with rare groups: radon, 386 counties (some with 1–3 houses)",
        "12 573",
        lambda r: r["posterior"] == RADON and not r["local_vars"],
    ),
    (
        "Rare groups in natural units: NYC flights, carrier and destination effects",
        "327 346",
        lambda r: r["posterior"] == "nyc_flights_plain",
    ),
    (
        'Variational locals: eight schools with `local_vars=["theta_trans"]`',
        "8",
        lambda r: bool(r["local_vars"]) and r["posterior"] != RADON,
    ),
    (
        'Variational locals: radon with `local_vars=["alpha"]`',
        "12 573",
        lambda r: bool(r["local_vars"]) and r["posterior"] == RADON,
    ),
]


def cell(results: list[dict]) -> str:
    if not results:
        return "—"
    passed = sum(bool(r["pass"]) for r in results)
    worst = max(r["max_abs_dmean"] for r in results)
    low = min(min(r["sd_ratio"]) for r in results)
    high = max(max(r["sd_ratio"]) for r in results)
    per_pass = sorted(r["min_ess"] / r["data_passes"] for r in results)
    median = per_pass[len(per_pass) // 2]
    mark = "**pass**" if passed == len(results) else "**fail**"
    if passed == len(results) and worst > 0.2:
        mark += " (as close as the Laplace approximation)"
    flagged = sum(not r.get("self_check_ok", True) for r in results)
    warned = f" (self-check warned on {flagged})" if flagged else ""
    return (
        f"{mark} {passed}/{len(results)}{warned}<br>Δmean ≤ {worst:.2f} sd<br>"
        f"sd ratio {low:.2f}–{high:.2f}<br>{median:.2g} ESS/pass"
    )


def main() -> None:
    rows = json.loads(RESULTS.read_text())
    header = "| model shape | N | " + " | ".join(SAMPLERS) + " |"
    lines = [header, "|---|---:|" + "---|" * len(SAMPLERS)]
    for label, n, keep in GROUPS:
        chosen = [r for r in rows if keep(r)]
        cells = [cell([r for r in chosen if r["sampler"] == s]) for s in SAMPLERS]
        lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    total = len(rows)
    passed = sum(bool(r["pass"]) for r in rows)
    lines += [
        "",
        f"{passed} of {total} cells pass. A cell is one sampler on one posterior, 4 chains × "
        "2 000 draws (2 × 1 000 at N ≥ 5·10⁴). It passes when every mean is within 0.1 "
        "reference sds and every sd within 10% (0.15 and 15% for the Langevin family: SGLD, "
        "SAGALD, SVRGLD, SGHMC), each widened by a Bonferroni z of Monte Carlo standard errors — "
        "or, for IASG and constant SGD (Gaussian approximations) on a skewed posterior, when "
        "no further from the reference than the Laplace approximation. Each entry: cells "
        "passed, the worst |Δmean| in reference sds, the range of sd ratios, and the median "
        "over cells of the smallest ESS per data pass (tuning passes included). With "
        "`batch_size ≥ N` every sampler runs the same exact Metropolis-adjusted Langevin "
        "kernel. — : not run.",
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
