"""Our own wall time on two software stacks, same machine, same data, same seed (PyMC 6 port).

For each sampler in ``--samplers`` (IASG, SGLD) and each Python interpreter in ``--pythons``
(default: the PyMC 6 stack ``/work/venv312`` and the PyMC 5 stack ``/work/venv311``, both with
this repository installed editable), a fresh interpreter generates nuts_comparison.py's data
(standardised logistic regression, ``N`` = ``--n``, D = 20, seed 0), builds its model and times

- ``first``: ``pmsg.sample(step=pmsg.<Sampler>(), chains=4, ...)`` from before the step is
  built to the return (bridge, compilation, tuning and draws; as nuts_comparison.py's rows),
- ``again``: a second ``pmsg.sample`` call on the same step (compiled: tuning and draws only),
- ``pm_sample``: with ``--pm-sample``, ``pm.sample(step=pmsg.<Sampler>(), chains=4,
  cores=2)`` on a fresh step (PyMC's own driver, worker processes).

With ``--micro`` the rounds instead time JAX alone, per data pass (B = 256, one core's
worth of work, best of 3): nuts_comparison.py's ``micro`` measurements ``floor`` (a bare
jitted SGLD ``lax.scan`` over contiguous minibatches: ``bare_loop``, ``floor_pass_prng``) and
``fullgrad`` (a full-data gradient through the package's bridge, ``full_grad_bridge``, and
written by hand in ``jax.numpy``, ``full_grad_hand``): what the JAX/XLA version alone changes.

Rounds alternate the interpreters (A B, then B A, ...) so a drift of the shared machine falls
on both; each row records the 1-minute load average at its start and the CPU that other
processes used while it ran. The report gives per stack the median and range over the rounds
and the median of the per-round ratios (new / old).

Run from the repository root (any interpreter; the children use ``--pythons``)::

    python benchmarks/stack_ab.py --rounds 4 --json benchmarks/results/stack_ab_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

# (tune, draws) per chain: IASG as nuts_comparison.py's first attempt at N = 10⁶ (4 × (20 + 320));
# SGLD a short fixed run (its documented 300 tuning draws take minutes on a loaded machine;
# the time per draw is what is compared).
RUNS = {"IASG": (20, 320), "SGLD": (50, 150)}

_WORKER = r"""
import json, os, sys, time, warnings, logging
sys.path.insert(0, "benchmarks")
warnings.filterwarnings("ignore")
for name in ("pymc", "pymc_sgmcmc", "jax", "pytensor"):
    logging.getLogger(name).setLevel(logging.ERROR)
spec = json.loads(sys.argv[1])
import numpy as np
import pymc as pm
import pymc_sgmcmc as pmsg
from nuts_comparison import make_data, make_model
load = os.getloadavg()
X, y = make_data(spec["n"], 20, 0)
model = make_model(X, y)
del X
out = {"load_start": load, "pymc": pm.__version__, "python": sys.version.split()[0]}
import jax
out["jax"] = jax.__version__
common = dict(draws=spec["draws"], tune=spec["tune"], chains=4, random_seed=1,
              progressbar=False, compute_convergence_checks=False)
with model:
    t0 = time.perf_counter()
    step = getattr(pmsg, spec["sampler"])()
    idata = pmsg.sample(step=step, **common)
    out["first"] = time.perf_counter() - t0
    beta = idata.posterior["beta"].values
    out["beta_mean"] = beta.mean(axis=(0, 1))[:3].tolist()
    t0 = time.perf_counter()
    pmsg.sample(step=step, **common)
    out["again"] = time.perf_counter() - t0
    if spec["pm_sample"]:
        t0 = time.perf_counter()
        step2 = getattr(pmsg, spec["sampler"])()
        pm.sample(step=step2, cores=2, **common)
        out["pm_sample"] = time.perf_counter() - t0
out["load_end"] = os.getloadavg()
print("RESULT" + json.dumps(out), flush=True)
"""


def run_one(python: str, spec: dict) -> dict:
    from nuts_comparison import Meter

    meter = Meter()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, "-c", _WORKER, json.dumps(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "others": meter.others()}
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    out["others"] = meter.others()
    out["elapsed"] = time.perf_counter() - t0
    return out


MICRO_KEYS = ("bare_loop", "floor_pass_prng", "full_grad_bridge", "full_grad_hand")


def run_micro(python: str, what: str, n: int) -> dict:
    """nuts_comparison.py's ``micro`` measurement ``what`` under ``python`` (seconds per pass)."""
    from nuts_comparison import _WORKER as NC_WORKER
    from nuts_comparison import Meter

    spec = {
        "kind": "micro",
        "what": what,
        "n": n,
        "d": 20,
        "seed": 0,
        "batch_size": 256,
        "repeats": 3,
        "calls": 3,
        "design": "standard",
    }
    meter = Meter()
    proc = subprocess.run(
        [python, "-c", NC_WORKER, json.dumps(spec)], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "others": meter.others()}
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    out["others"] = meter.others()
    return out


def summarise(rows: list[dict], pythons: list[str], keys: list[str]) -> str:
    label = {p: f"{Path(p).parents[1].name}" for p in pythons}
    lines = [
        "| sampler | measure | "
        + " | ".join(f"{label[p]}: median (range) s" for p in pythons)
        + " | ratio new/old per round: median (range) |",
        "|---|---|" + "---:|" * len(pythons) + "---:|",
    ]
    for sampler in dict.fromkeys(r["sampler"] for r in rows):
        present = [
            k for k in (*keys, *MICRO_KEYS) if any(k in r for r in rows if r["sampler"] == sampler)
        ]
        scale = 1e3 if sampler.startswith("micro") else 1.0  # micro: ms per pass
        for key in present:
            cells, per = [], {}
            for p in pythons:
                xs = [
                    scale * r[key]
                    for r in rows
                    if r["sampler"] == sampler and r["python"] == p and key in r
                ]
                per[p] = {
                    r["round"]: scale * r[key]
                    for r in rows
                    if r["sampler"] == sampler and r["python"] == p and key in r
                }
                cells.append(
                    f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})" if xs else "—"
                )
            ratios = []
            if len(pythons) == 2:
                a, b = per[pythons[0]], per[pythons[1]]
                ratios = [a[k] / b[k] for k in a if k in b]
            rtxt = (
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
                if ratios
                else "—"
            )
            unit = " (ms / pass)" if scale != 1.0 else ""
            lines.append(f"| {sampler} | {key}{unit} | " + " | ".join(cells) + f" | {rtxt} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--pythons", nargs=2, default=["/work/venv312/bin/python", "/work/venv311/bin/python"]
    )
    p.add_argument("--samplers", nargs="*", default=list(RUNS))
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pm-sample", action="store_true")
    p.add_argument("--micro", action="store_true", help="time JAX alone (see the docstring)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--render", type=Path, default=None, help="only render an earlier JSON")
    p.add_argument(
        "--resume", action="store_true", help="append rounds to the rows already in --json"
    )
    args = p.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        keys = ["first", "again"] + (["pm_sample"] if data["args"].get("pm_sample") else [])
        print(summarise(data["rows"], data["args"]["pythons"], keys))
        return
    rows: list[dict] = []
    first_round = 0
    if args.resume and args.json and args.json.exists():
        rows = json.loads(args.json.read_text())["rows"]
        first_round = 1 + max((r["round"] for r in rows), default=-1)
    data = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_start": os.getloadavg(),
        "rows": rows,
    }
    for rnd in range(first_round, first_round + args.rounds):
        order = args.pythons if rnd % 2 == 0 else args.pythons[::-1]
        for what in ("floor", "fullgrad") if args.micro else ():
            for python in order:
                r = run_micro(python, what, args.n)
                r.update(round=rnd, sampler=f"micro:{what}", python=python)
                rows.append(r)
                print(
                    f"[{time.strftime('%H:%M:%S')}] round {rnd} {what} {python}: "
                    + ", ".join(f"{k} {r[k] * 1e3:.2f} ms" for k in MICRO_KEYS if k in r)
                    + (" ERROR" if "error" in r else "")
                    + f" (others {r['others']:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(data, indent=1))
        for sampler in args.samplers if not args.micro else ():
            tune, draws = RUNS[sampler]
            for python in order:
                spec = {
                    "sampler": sampler,
                    "n": args.n,
                    "tune": tune,
                    "draws": draws,
                    "pm_sample": args.pm_sample,
                }
                r = run_one(python, spec)
                r.update(round=rnd, sampler=sampler, python=python, tune=tune, draws=draws)
                rows.append(r)
                msg = r.get("error", "").strip().splitlines()[-1:] if "error" in r else ""
                print(
                    f"[{time.strftime('%H:%M:%S')}] round {rnd} {sampler} {python}: "
                    + (
                        f"ERROR {msg}"
                        if msg
                        else f"first {r['first']:.1f} s, again {r['again']:.1f} s"
                        + (f", pm.sample {r['pm_sample']:.1f} s" if "pm_sample" in r else "")
                        + f" (load {r['load_start'][0]:.1f}, others {r['others']:.2f})"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
                if args.json:
                    data["load_end"] = os.getloadavg()
                    args.json.write_text(json.dumps(data, indent=1))
    keys = ["first", "again"] + (["pm_sample"] if args.pm_sample else [])
    print(summarise(rows, args.pythons, keys))


if __name__ == "__main__":
    main()
