"""Hierarchical models at scale: every sampler with default arguments against exact and NUTS
references (issue 37's acceptance grid).

Posteriors (``tests/posteriors/hierarchical.py``): exact Gaussian random intercepts
``ri_exact_J{J}_n{n}`` (J ∈ {200, 2 000, 20 000, 100 000}, n ∈ {2, 20}; closed form), the same
data with τ and σ unknown ``ri_scales_J{J}_n{n}`` (J ≤ 2 000; centred and non-centred, long
NUTS references), logistic random intercepts and slopes ``logistic_ris`` and InstEval
(NUTS). Each cell: one sampler, with ``local_vars`` (the group-level variable) or with the
group effects sampled, ``pmsg.sample(step=pmsg.X(...), draws=400, tune=300, chains=2)`` as
the issue measured.

Pass rule (the issue's; no Laplace allowance): every global within 0.1 reference sd and 10%
in sd (0.15 / 15% for SGLD, SAGALD, SVRGLD, SGHMC), widened by three Monte Carlo standard
errors from the run's ESS, which must be at least 100 (:data:`MIN_ESS`); over the groups, mean |Δmean|/sd and mean |sd ratio − 1| within
the same bounds (plus the same Monte Carlo allowance at the groups' median ESS) and no group
beyond 3× them. The self-check's verdict (a warning that names a global, or any
``SGMCMCCheckWarning``) is recorded beside it: a failing cell must warn.

Run: ``python benchmarks/hierarchical.py [--only NAME ...] [--samplers ...] [--local
{yes,no,both}] [--json PATH] [--write]``; cells append to the JSON as they finish (a rerun
skips those done), ``--from-json`` renders the table (``--write`` into RESULTS.md). A
``ri_scales_*`` name takes a parameterisation suffix, ``ri_scales_J200_n20:centered`` or
``:noncentered`` (the default); the groups are scored on ``u`` (sampled when centred, a
deterministic when not) in both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import pymc_sgmcmc as pmsg  # noqa: E402
from pymc_sgmcmc.diagnostics import SGMCMCCheckWarning  # noqa: E402
from pymc_sgmcmc.registry import SAMPLERS as REGISTRY  # noqa: E402
from pymc_sgmcmc.registry import TOLERANCES  # noqa: E402

SAMPLERS = [s.name for s in REGISTRY]
LOCAL_SAMPLERS = [s.name for s in REGISTRY if s.local_vars]
CONSTANT_SGD_FAMILY = {s.name for s in REGISTRY if s.tolerance == "constant_sgd"}
DEFAULT_NAMES = [
    "ri_exact_J200_n20",
    "ri_exact_J200_n2",
    "ri_exact_J2000_n20",
    "ri_exact_J2000_n2",
    "ri_exact_J20000_n20",
    "ri_exact_J20000_n2",
]
PARAMETERIZATIONS = ("noncentered", "centered")  # ri_scales_*: the first is the default
PARAMETERIZATION_LABELS = {"noncentered": "non-centred", "centered": "centred"}
WITHOUT_LOCALS_MAX_J = 20000  # the grid: u sampled up to J = 20 000
MIN_ESS = 100
"""A global with a smaller bulk ESS (of 800 draws) fails the cell: its Monte Carlo allowance
(3/√ESS sds) would pass anything."""


def group_variable(model) -> str:
    """The model's group-level free variable (the one ``local_vars`` takes)."""
    point = model.initial_point()
    sizes = {rv.name: point[model.rvs_to_values[rv].name].size for rv in model.free_RVs}
    return max(sizes, key=sizes.get)


def parse_name(spec: str) -> tuple[str, str | None]:
    """``"ri_scales_J200_n20:centered"`` → ``("ri_scales_J200_n20", "centered")``; a
    ``ri_scales_*`` name without a suffix is non-centred, other names have no
    parameterisation (``None``)."""
    name, _, parameterization = spec.partition(":")
    if not name.startswith("ri_scales_"):
        if parameterization:
            raise ValueError(f"{spec!r}: only ri_scales_* names take a parameterisation")
        return name, None
    parameterization = parameterization or PARAMETERIZATIONS[0]
    if parameterization not in PARAMETERIZATIONS:
        raise ValueError(f"{spec!r}: parameterisation must be one of {PARAMETERIZATIONS}")
    return name, parameterization


def run_cell(
    name: str,
    sampler: str,
    local: bool,
    draws: int,
    tune: int,
    seed: int,
    parameterization: str | None = None,
) -> dict:
    from posteriors import hierarchical as hier
    from stack import dataset

    model = hier.build(name, **({"parameterization": parameterization} if parameterization else {}))
    ref = hier.load_reference(name)
    with model:
        kwargs = {"local_vars": [model[group_variable(model)]]} if local else {}
        step = getattr(pmsg, sampler)(**kwargs)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idata = pmsg.sample(
                step=step, draws=draws, tune=tune, chains=2, random_seed=seed, progressbar=False
            )
        seconds = time.perf_counter() - t0
    # the posterior group against the reference's labels: the globals and the group-level
    # quantities (u for ri_scales_*: a deterministic in the non-centred form, not z)
    scored = hier.score_summary(dataset(idata, "posterior"), name)
    table = scored["table"]
    globals_ = ref["globals"]
    groups = [k for k in table if k not in globals_]
    missing = [k for k in ref["mean"] if k not in table]
    if missing or not groups:
        raise ValueError(f"{len(missing)} reference labels not in the posterior: {missing[:3]}")
    dmean, sd_ratio, ess = ({k: table[k][f] for k in table} for f in ("dmean", "sd_ratio", "ess"))
    settings = json.loads(dataset(idata, "sample_stats").attrs["sgmcmc_settings"])[0]
    chain = settings.get("chains", [{}])[0]
    messages = [
        (w.category.__name__, str(w.message)) for w in caught if issubclass(w.category, Warning)
    ]
    check = [m for c, m in messages if c == SGMCMCCheckWarning.__name__]
    return {
        "name": name,
        "parameterization": parameterization,
        "sampler": sampler,
        "local": local,
        "local_var": group_variable(model) if local else None,
        "draws": draws,
        "tune": tune,
        "seed": seed,
        "seconds": seconds,
        "whitening": chain.get("whitening"),
        "structure": chain.get("structure"),
        "globals": {
            k: {"dmean": dmean[k], "sd_ratio": sd_ratio[k], "ess": ess[k]} for k in globals_
        },
        "groups": {
            "mean_abs_dmean": float(np.mean([abs(dmean[k]) for k in groups])),
            "max_abs_dmean": float(np.max([abs(dmean[k]) for k in groups])),
            "mean_abs_sd_error": float(np.mean([abs(sd_ratio[k] - 1) for k in groups])),
            "max_abs_sd_error": float(np.max([abs(sd_ratio[k] - 1) for k in groups])),
            "median_ess": float(np.median([ess[k] for k in groups])),
            "count": len(groups),
        },
        "warnings": [m[:400] for m in check],
        "warned_globals": sorted({g for g in globals_ for m in check if g in m}),
        "other_warnings": [
            f"{c}: {m[:200]}"
            for c, m in messages
            if c != SGMCMCCheckWarning.__name__ and "Sampling" not in m
        ][:5],
    }


def verdict(cell: dict) -> dict:
    """The pass rule on one cell (module docstring)."""
    mean_tol, sd_tol = TOLERANCES[
        "constant_sgd" if cell["sampler"] in CONSTANT_SGD_FAMILY else "langevin"
    ]
    worst = []
    for k, g in cell["globals"].items():
        if g["ess"] < MIN_ESS:
            worst.append(f"{k} ESS {g['ess']:.0f}")
        mc = 3.0 / np.sqrt(max(g["ess"], 1.0))
        if abs(g["dmean"]) > mean_tol + mc:
            worst.append(f"{k} {g['dmean']:+.2f} sd")
        if abs(g["sd_ratio"] - 1) > sd_tol + mc / np.sqrt(2):
            worst.append(f"{k} sd {g['sd_ratio']:.2f}x")
    gr = cell["groups"]
    mc = 3.0 / np.sqrt(max(gr["median_ess"], 1.0))
    if gr["mean_abs_dmean"] > mean_tol + mc or gr["max_abs_dmean"] > 3 * (mean_tol + mc):
        worst.append(
            f"groups |dmean| mean {gr['mean_abs_dmean']:.2f} max {gr['max_abs_dmean']:.2f}"
        )
    if gr["mean_abs_sd_error"] > sd_tol + mc or gr["max_abs_sd_error"] > 3 * (sd_tol + mc):
        worst.append(
            f"groups |sd-1| mean {gr['mean_abs_sd_error']:.2f} max {gr['max_abs_sd_error']:.2f}"
        )
    return {"pass": not worst, "worst": worst, "warned": bool(cell["warnings"])}


def render(cells: list[dict]) -> str:
    lines = [
        "| posterior | sampler | locals | whitening | globals: max \\|Δmean\\| / sd ratios (ESS) "
        "| groups: mean \\|Δmean\\| / mean \\|sd−1\\| (max) | verdict | self-check | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    passed = silent = false_alarms = 0
    for c in cells:
        v = verdict(c)
        g = c["globals"]
        gmax = max(abs(x["dmean"]) for x in g.values())
        ratios = ", ".join(f"{x['sd_ratio']:.2f}" for x in g.values())
        ess = min(x["ess"] for x in g.values())
        gr = c["groups"]
        verdict_text = "pass" if v["pass"] else "fail: " + "; ".join(v["worst"])
        check = (
            "warns: " + ", ".join(c["warned_globals"] or ["(locals)"]) if v["warned"] else "quiet"
        )
        passed += v["pass"]
        silent += (not v["pass"]) and (not v["warned"])
        false_alarms += v["pass"] and v["warned"]
        posterior = c["name"]
        if c.get("parameterization"):
            posterior += f" ({PARAMETERIZATION_LABELS[c['parameterization']]})"
        lines.append(
            f"| {posterior} | {c['sampler']} | {'local_vars' if c['local'] else 'sampled'} "
            f"| {c['whitening']} | {gmax:.3f} / {ratios} ({ess:.0f}) "
            f"| {gr['mean_abs_dmean']:.3f} / {gr['mean_abs_sd_error']:.3f} "
            f"({gr['max_abs_dmean']:.2f} / {gr['max_abs_sd_error']:.2f}) | {verdict_text} "
            f"| {check} | {c['seconds']:.0f} |"
        )
    lines.append("")
    lines.append(
        f"{passed} of {len(cells)} cells pass; failing and silent: {silent}; "
        f"warned on a passing cell: {false_alarms} of {passed}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=DEFAULT_NAMES)
    parser.add_argument("--samplers", nargs="*", default=SAMPLERS)
    parser.add_argument("--local", choices=("yes", "no", "both"), default="both")
    parser.add_argument("--draws", type=int, default=400)
    parser.add_argument("--tune", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--json", type=Path, default=REPO / "benchmarks" / "results" / "hierarchical.json"
    )
    parser.add_argument("--from-json", nargs="*", type=Path)
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.from_json:
        cells = [c for p in args.from_json for c in json.loads(p.read_text())]
    else:
        done = json.loads(args.json.read_text()) if args.json.exists() else []
        seen = {(c["name"], c.get("parameterization"), c["sampler"], c["local"]) for c in done}
        for spec in args.only:
            name, parameterization = parse_name(spec)
            J = int(name.split("_J")[1].split("_")[0]) if "_J" in name else 0
            for local in {"yes": [True], "no": [False], "both": [False, True]}[args.local]:
                if not local and J > WITHOUT_LOCALS_MAX_J:
                    continue
                for sampler in args.samplers:
                    if local and sampler not in LOCAL_SAMPLERS:
                        continue
                    if (name, parameterization, sampler, local) in seen:
                        continue
                    print(f"== {spec} {sampler} {'local' if local else 'sampled'}", flush=True)
                    try:
                        cell = run_cell(
                            name,
                            sampler,
                            local,
                            args.draws,
                            args.tune,
                            args.seed,
                            parameterization,
                        )
                    except Exception as err:  # a cell that errors is recorded as such
                        traceback.print_exc()
                        cell = {
                            "name": name,
                            "parameterization": parameterization,
                            "sampler": sampler,
                            "local": local,
                            "error": repr(err)[:500],
                        }
                    done.append(cell)
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(done, indent=1))
                    if "error" not in cell:
                        print(render([cell]).splitlines()[2], flush=True)
                    else:
                        print("   error:", cell["error"], flush=True)
        cells = done
    table = render([c for c in cells if "error" not in c])
    errors = [c for c in cells if "error" in c]
    print(table)
    for c in errors:
        print(
            f"error: {c['name']} {c.get('parameterization') or ''} {c['sampler']} "
            f"local={c['local']}: {c['error']}"
        )
    if args.write:
        results = REPO / "benchmarks" / "RESULTS.md"
        results.write_text(results.read_text() + "\n" + table + "\n")


if __name__ == "__main__":
    main()
