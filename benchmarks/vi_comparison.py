"""What a PyMC 6 user tries first on a large logistic regression, against IASG: time to draws
and their accuracy (PyMC 6 port, acceptance point 4).

nuts_comparison.py's model and data (``make_data`` / ``make_model``: ``beta ~ N(0, 1)``,
D = 20, standardised features, seed ``--seed``) at ``N`` = ``--n`` (default 10⁶), and its
long numpyro NUTS reference (``nuts_comparison.ensure_reference``: reused from ``--ref-dir``
when cached, else made there). Each method runs with its default arguments in a fresh
interpreter (data generated there; compilation included in the time):

- ``pathfinder``: ``pymc_extras.fit_pathfinder(random_seed=1)`` (4 paths, 1000 draws),
- ``dadvi``: ``pymc_extras.inference.fit_dadvi(random_seed=1)`` (30 fixed draws, trust-ncg,
  1000 draws),
- ``advi``: ``pm.fit(method="advi", random_seed=1)`` (10 000 iterations, full data), then
  ``.sample(1000)``,
- ``IASG``: ``pmsg.sample(step=pmsg.IASG(), chains=4, tune=20, draws=--iasg-draws,
  random_seed=1)`` (nuts_comparison.py's protocol; 640 draws per chain passed at N = 10⁶).

Time to draws: wall time from the call (for IASG: from building the step) to the draws in
hand. Accuracy against the reference over the 20 coefficients: the largest
|mean − reference mean| / reference sd and the range of sd / reference sd (all draws pooled);
for IASG also its min bulk ESS. Every row records the 1-minute load average at its start and
the CPU that other processes used while it ran (cores).

Run from the repository root::

    python benchmarks/vi_comparison.py --ref-dir /work/bench_scratch/ref \
        --json benchmarks/results/vi_comparison_1e6_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import ScriptTimeout, run_script  # noqa: E402

METHODS = ("pathfinder", "dadvi", "advi", "IASG")
LABEL = {
    "pathfinder": "pymc-extras `fit_pathfinder` (defaults)",
    "dadvi": "pymc-extras `fit_dadvi` (defaults)",
    "advi": '`pm.fit(method="advi")` + `.sample(1000)`',
    "IASG": "IASG (`pmsg.sample`, 4 × (20 + {draws}))",
}

_WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "benchmarks")
    import vi_comparison
    vi_comparison.worker(sys.argv[1:])
    """
)


def _beta_draws(idata) -> Any:  # noqa: F821
    import numpy as np

    beta = np.asarray(idata.posterior["beta"].values)
    return beta.reshape(-1, beta.shape[-1])


def _accuracy(draws, ref_path: str) -> dict:
    import arviz as az

    ref = _beta_draws(az.from_netcdf(ref_path))
    mean, sd = ref.mean(0), ref.std(0, ddof=1)
    dmean = abs(draws.mean(0) - mean) / sd
    ratio = draws.std(0, ddof=1) / sd
    return {
        "max_abs_dmean": float(dmean.max()),
        "sd_ratio_min": float(ratio.min()),
        "sd_ratio_max": float(ratio.max()),
        "n_draws": int(draws.shape[0]),
    }


def worker(argv: list[str]) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("pymc", "pymc_extras", "pymc_sgmcmc", "jax", "pytensor"):
        logging.getLogger(name).setLevel(logging.ERROR)
    spec = json.loads(argv[0])
    import pymc as pm
    from nuts_comparison import make_data, make_model

    load = os.getloadavg()
    X, y = make_data(spec["n"], spec["d"], spec["seed"])
    model = make_model(X, y)
    del X
    method = spec["method"]
    out: dict = {"load_start": load}
    with model:
        t0 = time.perf_counter()
        if method == "pathfinder":
            import pymc_extras as pmx

            idata = pmx.fit_pathfinder(random_seed=1, progressbar=False)
        elif method == "dadvi":
            from pymc_extras.inference import fit_dadvi

            idata = fit_dadvi(random_seed=1, progressbar=False)
        elif method == "advi":
            approx = pm.fit(method="advi", random_seed=1, progressbar=False)
            out["fit_seconds"] = time.perf_counter() - t0
            idata = approx.sample(1000, random_seed=1)
        elif method == "IASG":
            import pymc_sgmcmc as pmsg

            step = pmsg.IASG()
            idata = pmsg.sample(
                step=step,
                draws=spec["iasg_draws"],
                tune=20,
                chains=4,
                random_seed=1,
                progressbar=False,
                compute_convergence_checks=False,
            )
        else:
            raise ValueError(method)
        out["wall"] = time.perf_counter() - t0
    out.update(_accuracy(_beta_draws(idata), spec["ref"]))
    if method == "IASG":
        import arviz as az

        import pymc_sgmcmc as pmsg

        df = pmsg.compare(idata, az.from_netcdf(spec["ref"]), var_names=["beta"])
        out["ess_min"] = float(df["ess"].min())
    out["load_end"] = os.getloadavg()
    print("RESULT" + json.dumps(out), flush=True)


def render(data: dict) -> str:
    lines = [
        "| method | time to draws (s) | draws | max \\|Δmean\\| (ref. sd) | sd ratio range "
        "| × IASG's time | load (1 min) / others (cores) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    iasg = next((r for r in data["rows"] if r["method"] == "IASG" and "wall" in r), None)
    for r in data["rows"]:
        label = LABEL[r["method"]].format(draws=data["args"]["iasg_draws"])
        load = f"{r['load_start'][0]:.1f} / {r['others']:.2f}" if r.get("load_start") else "?"
        if "wall" not in r:
            why = (r.get("error", "?").strip().splitlines() or ["?"])[-1]
            if why.startswith("killed after"):  # ScriptTimeout: a lower bound
                lines.append(
                    f"| {label} | > {data['args']['timeout']:.0f} (killed at the time "
                    f"limit, no draws) | | | | | {load} |"
                )
            else:
                lines.append(f"| {label} | failed: {why[:120]} | | | | | {load} |")
            continue
        extra = f" (fit {r['fit_seconds']:.0f})" if "fit_seconds" in r else ""
        ess = f", min ESS {r['ess_min']:.0f}" if "ess_min" in r else ""
        ratio = f"{r['wall'] / iasg['wall']:.1f}×" if iasg else "—"
        lines.append(
            f"| {label} | {r['wall']:.1f}{extra} | {r['n_draws']}{ess} | "
            f"{r['max_abs_dmean']:.3f} | {r['sd_ratio_min']:.3f}–{r['sd_ratio_max']:.3f} | "
            f"{ratio} | {load} |"
        )
    return "\n".join(lines)


def main() -> None:
    import nuts_comparison as nc

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--iasg-draws", type=int, default=640)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref-dir", default="/tmp")
    p.add_argument("--ref-draws", type=int, default=1000)
    p.add_argument("--ref-tune", type=int, default=1000)
    p.add_argument("--ref-chains", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per method")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--render", type=Path, default=None, help="only render an earlier JSON")
    args = p.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return
    ref_args = nc.parse_args(
        [
            "--sizes", str(args.n), "--seed", str(args.seed), "--ref-dir", args.ref_dir,
            "--ref-draws", str(args.ref_draws), "--ref-tune", str(args.ref_tune),
            "--ref-chains", str(args.ref_chains),
        ]
    )  # fmt: skip
    ref = nc.ensure_reference(ref_args, args.n)
    data = {
        "command": " ".join(["python", "benchmarks/vi_comparison.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "reference": ref,
        "load_start": os.getloadavg(),
        "rows": [],
    }
    for method in [m for m in args.methods.split(",") if m]:
        spec = {
            "method": method,
            "n": args.n,
            "d": 20,
            "seed": args.seed,
            "ref": ref["path"],
            "iasg_draws": args.iasg_draws,
        }
        meter = nc.Meter()
        t0 = time.perf_counter()
        try:
            r = run_script(_WORKER, json.dumps(spec), timeout=args.timeout)
        except ScriptTimeout as err:
            r = {"error": str(err), "load_start": os.getloadavg()}
        except RuntimeError as err:
            r = {"error": str(err)[-1500:], "load_start": os.getloadavg()}
        r.update(method=method, others=meter.others(), elapsed=time.perf_counter() - t0)
        data["rows"].append(r)
        msg = (
            f"{r['wall']:.1f} s, max|dmean| {r['max_abs_dmean']:.3f}, sd ratio "
            f"{r['sd_ratio_min']:.3f}-{r['sd_ratio_max']:.3f}"
            if "wall" in r
            else "FAILED " + (r["error"].strip().splitlines() or ["?"])[-1][:300]
        )
        print(
            f"[{time.strftime('%H:%M:%S')}] {method}: {msg} (load "
            f"{r['load_start'][0]:.1f}, others {r['others']:.2f})",
            file=sys.stderr,
            flush=True,
        )
        data["load_end"] = os.getloadavg()
        if args.json:
            args.json.write_text(json.dumps(data, indent=1, default=str))
    print(render(data))


if __name__ == "__main__":
    main()
