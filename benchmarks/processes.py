"""NUTS after SG fits in an unguarded script (issue 25).

Until 0.1, importing ``pymc_sgmcmc`` and running an SG fit changed how PyMC ran NUTS with
``cores > 1`` (forkserver workers, the script re-executed in each); now a ``pm.sample`` with
one of our steps runs its chains in this process and a NUTS-only call is PyMC's own. This
measures what is left of that: the wall time of the *same* NUTS call in four plain scripts
(no ``if __name__ == "__main__":`` guard), each run as ``python script.py`` in a fresh
interpreter:

``A``
    ``import pymc as pm, pymc_sgmcmc as pmsg``; a linear regression (``N`` rows, 3
    coefficients and an intercept, generated data, fixed seed); ``pm.sample(step=pmsg.IASG(),
    cores=1, chains=2)``, then the same with ``cores=2``; then the timed NUTS call
    ``pm.sample(cores=2, chains=2, draws=1000, tune=1000, random_seed=...)``;
``B1``
    the same script without the two SG fits (still imports ``pymc_sgmcmc``);
``B0``
    the same script without the SG fits and without importing ``pymc_sgmcmc``;
``B2``
    ``B1`` with the NUTS call made twice, the second timed: what a process's first
    ``pm.sample`` pays once (imports, compilation set-up) is paid before the timed call, as the
    SG fits pay it in ``A``.

Only the NUTS call is timed (``time.perf_counter`` around it: PyMC's compilation of the model
against the warm on-disk cache, its worker processes, tuning and draws, the conversion to
InferenceData); PyMC's own ``sampling_time`` (its workers' tuning and draws, no compilation)
is recorded beside it. The scripts are run round after round, the order rotated every round
(``A B1 B0 B2``, ``B1 B0 B2 A``, ...); the first round is discarded (compile caches
warm-up). Reported: median, min and max NUTS seconds per script, and the ratios ``A/B1``,
``A/B0`` and ``A/B2`` — of the medians, and per round (paired, min–max). The issue's
acceptance: ``A`` within 1.3x of the script with the SG fits removed (``B1``, ``B0``).

Also checked in every run: the script's top ran exactly once (a marker printed on its first
line, counted in its stdout), it exited with 0, its NUTS draws are the same as the other
scripts' (a checksum of the posterior; same seed, same call), the start method PyMC's NUTS
used, and whether stderr mentions ``os.fork()`` (JAX's warning when a process that started
JAX forks). Load: ``os.getloadavg()`` before every run and the cores *other* processes kept
busy during the timed NUTS call (machine busy time from ``/proc/stat`` minus the script's own
and its workers' CPU time).

```bash
# ~6 min on 2 idle cores; writes benchmarks/results/processes.json, prints a markdown table
.venv/bin/python benchmarks/processes.py
.venv/bin/python benchmarks/processes.py --rounds 3 --json -   # prints only
```
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import REPO, git_state  # noqa: E402

MARKER = "SCRIPT-TOP-RAN"

_HEAD = """\
print("{marker}", flush=True)
import json, os, resource, time
import numpy as np
import pymc as pm
{import_pmsg}

def busy_seconds():
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")

def own_seconds():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

rng = np.random.default_rng({data_seed})
N = {n}
X = rng.normal(size=(N, 3))
y = 0.5 + X @ np.array([1.0, -2.0, 0.5]) + rng.normal(scale=1.5, size=N)
out = {{}}
with pm.Model():
    alpha = pm.Normal("alpha", 0, 10)
    beta = pm.Normal("beta", 0, 10, shape=3)
    sigma = pm.HalfNormal("sigma", 5)
    pm.Normal("y", alpha + X @ beta, sigma, observed=y)
"""

_SG = """\
    for cores in (1, 2):
        t0 = time.perf_counter()
        pm.sample(step=pmsg.IASG(), cores=cores, chains=2, draws={sg_draws}, tune={sg_tune},
                  random_seed=1, progressbar=False, compute_convergence_checks=False)
        out[f"sg_cores{{cores}}_seconds"] = time.perf_counter() - t0
"""

_NUTS_UNTIMED = """\
    pm.sample(cores=2, chains=2, draws={draws}, tune={tune}, random_seed={nuts_seed},
              progressbar=False)
"""

_NUTS = """\
    busy0, own0 = busy_seconds(), own_seconds()
    t0 = time.perf_counter()
    idata = pm.sample(cores=2, chains=2, draws={draws}, tune={tune}, random_seed={nuts_seed},
                      progressbar=False)
    out["nuts_seconds"] = wall = time.perf_counter() - t0
    out["other_cores"] = max(busy_seconds() - busy0 - (own_seconds() - own0), 0.0) / wall
post = idata.posterior
out["checksum"] = float(sum(post[v].values.astype(np.float64).sum() for v in post.data_vars))
out["pymc_sampling_time"] = float(post.attrs.get("sampling_time", float("nan")))
out["divergences"] = int(idata.sample_stats["diverging"].values.sum())
from pymc.sampling.parallel import _initialize_multiprocessing_context
out["nuts_start_method"] = _initialize_multiprocessing_context(None).get_start_method()
print("RESULT " + json.dumps(out), flush=True)
"""

VARIANTS = {
    "A": "SG fits (cores=1, cores=2), then NUTS",
    "B1": "NUTS only, imports pymc_sgmcmc",
    "B0": "NUTS only, no pymc_sgmcmc",
    "B2": "NUTS twice, the second timed (imports pymc_sgmcmc)",
}


def script(variant: str, args: argparse.Namespace) -> str:
    fmt = dict(
        marker=MARKER,
        import_pmsg="" if variant == "B0" else "import pymc_sgmcmc as pmsg",
        data_seed=args.seed,
        n=args.n,
        sg_draws=args.sg_draws,
        sg_tune=args.sg_tune,
        draws=args.draws,
        tune=args.tune,
        nuts_seed=args.seed + 1,
    )
    first = {"A": _SG, "B2": _NUTS_UNTIMED}.get(variant, "")
    body = _HEAD + first + _NUTS
    return body.format(**fmt)


def run(path: Path, timeout: float) -> dict:
    load = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=path.parent,  # not the repository: the installed package, as a user's script
    )
    wall = time.perf_counter() - t0
    res: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
    res.update(
        returncode=proc.returncode,
        top_runs=proc.stdout.count(MARKER),
        script_seconds=wall,
        load_before=[round(x, 2) for x in load],
        fork_warning=next((ln.strip() for ln in proc.stderr.splitlines() if "os.fork()" in ln), ""),
        bootstrapping_error="bootstrapping phase" in proc.stderr,
    )
    if proc.returncode != 0:
        res["stderr_tail"] = proc.stderr[-2000:]
    return res


def ratios(a: list[float], b: list[float]) -> dict:
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "of_medians": statistics.median(a) / statistics.median(b),
        "per_round_median": statistics.median(per_round),
        "per_round_min": min(per_round),
        "per_round_max": max(per_round),
        "per_round": per_round,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds, the first discarded (6)")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--draws", type=int, default=1000)
    p.add_argument("--tune", type=int, default=1000)
    p.add_argument("--sg-draws", type=int, default=1000)
    p.add_argument("--sg-tune", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per script run (s)")
    p.add_argument("--json", default=str(REPO / "benchmarks/results/processes.json"))
    p.add_argument(
        "--render",
        metavar="FILE",
        help="re-summarise a run's JSON (rewritten in place) and print its table; runs nothing",
    )
    args = p.parse_args()
    if args.render:
        res = json.loads(Path(args.render).read_text())
        res.update(summarise(res["runs"]))
        Path(args.render).write_text(json.dumps(res, indent=1) + "\n")
        print(table(res))
        return
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the first is discarded)")

    started = dt.datetime.now().isoformat(timespec="seconds")
    names = list(VARIANTS)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pmsg_processes_") as tmp:
        paths = {}
        for v in names:
            paths[v] = Path(tmp) / f"script_{v}.py"
            paths[v].write_text(script(v, args))
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for v in order:
                res = run(paths[v], args.timeout)
                res.update(round=r, variant=v)
                runs.append(res)
                print(
                    f"round {r} {v:>2}: NUTS {res.get('nuts_seconds', float('nan')):6.2f} s, "
                    f"script {res['script_seconds']:6.1f} s, top ran {res['top_runs']}x, "
                    f"rc {res['returncode']}, load {res['load_before'][0]:.2f}, "
                    f"others {res.get('other_cores', float('nan')):.2f} cores",
                    flush=True,
                )
        scripts = {v: script(v, args) for v in names}

    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/processes.py", *sys.argv[1:]]),
        "commit": git_state(),
        "started": started,
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "render")},
        "variants": VARIANTS,
        **summarise(runs),
        "runs": runs,
        "scripts": scripts,
    }
    if args.json != "-":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(table(result))


def summarise(runs: list[dict]) -> dict:
    """Medians, ranges and ratios of the runs after the first (warm-up) round, and the checks."""
    kept = [x for x in runs if x["round"] > 0]
    names = list(VARIANTS)

    def col(v: str, key: str) -> list[float]:
        return [x[key] for x in kept if x["variant"] == v]

    secs = {v: col(v, "nuts_seconds") for v in names}
    sampling = {v: col(v, "pymc_sampling_time") for v in names}
    summary = {
        v: {
            "median": statistics.median(secs[v]),
            "min": min(secs[v]),
            "max": max(secs[v]),
            "n": len(secs[v]),
            "pymc_sampling_time_median": statistics.median(sampling[v]),
            "other_cores_max": max(col(v, "other_cores")),
        }
        for v in names
    }
    checksums = {round(x["checksum"], 6) for x in runs if "checksum" in x}
    return {
        "summary": summary,
        "ratio_A_B1": ratios(secs["A"], secs["B1"]),
        "ratio_A_B0": ratios(secs["A"], secs["B0"]),
        "ratio_A_B2": ratios(secs["A"], secs["B2"]),
        "sampling_time_ratio_A_B1": ratios(sampling["A"], sampling["B1"]),
        "sampling_time_ratio_A_B0": ratios(sampling["A"], sampling["B0"]),
        "sampling_time_ratio_A_B2": ratios(sampling["A"], sampling["B2"]),
        "load_before_max": max(x["load_before"][0] for x in kept),
        "other_cores_max": max(x["other_cores"] for x in kept),
        "other_cores_max_warmup_round": max(
            x.get("other_cores", 0.0) for x in runs if x["round"] == 0
        ),
        "all_top_ran_once": all(x["top_runs"] == 1 for x in runs),
        "all_exit_0": all(x["returncode"] == 0 for x in runs),
        "same_nuts_draws": len(checksums) == 1,
        "nuts_start_methods": sorted({x.get("nuts_start_method", "?") for x in runs}),
        "fork_warning_in": sorted({x["variant"] for x in runs if x["fork_warning"]}),
        "fork_warnings": sorted({x["fork_warning"] for x in runs if x["fork_warning"]}),
    }


def table(res: dict) -> str:
    rows = [
        "| script | NUTS seconds: median (min–max) | of which PyMC's sampling_time (median) "
        "| runs | others' cores during NUTS (max) |",
        "|---|---|---|---|---|",
    ]
    for v, s in res["summary"].items():
        rows.append(
            f"| {v}: {res['variants'][v]} | {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) "
            f"| {s['pymc_sampling_time_median']:.2f} | {s['n']} | {s['other_cores_max']:.2f} |"
        )
    for key, what in (("ratio", "NUTS call"), ("sampling_time_ratio", "PyMC's sampling_time")):
        for b in ("B1", "B0", "B2"):
            r = res[f"{key}_A_{b}"]
            rows.append(
                f"\n{what}, A / {b}: {r['of_medians']:.3f} (of the medians); per round "
                f"{r['per_round_median']:.3f} median, {r['per_round_min']:.3f}–"
                f"{r['per_round_max']:.3f}"
            )
    rows.append(
        f"\nTop ran once in every run: {res['all_top_ran_once']}; all exited 0: "
        f"{res['all_exit_0']}; same NUTS draws in every run: {res['same_nuts_draws']}; "
        f"NUTS start method: {', '.join(res['nuts_start_methods'])}; "
        f"JAX fork warning in: {', '.join(res['fork_warning_in']) or 'none'}"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
