"""Vectorised chains: wall time of ``pmsg.sample`` with 1 and 4 chains (issue 6).

On one logistic regression (``N`` rows, ``D`` features, float64, ``B = 256``: one draw is one
pass, ``N/B`` iterations) each sampler runs ``tune`` + ``draws`` draws per chain:

- ``pmsg.sample(chains=1)`` and ``pmsg.sample(chains=4)`` (default ``cores``: on this
  machine's CPU the 4 chains are two vmapped groups of 2, one thread each), and
  ``pmsg.sample(chains=4, cores=1)`` (all 4 chains in one vmapped batch, one core);
- for reference ``pm.sample(step=..., chains=4, cores=2)`` (two worker processes, each
  compiling its own draw) and ``pm.sample(step=..., chains=1, cores=1)``.

Each row runs in a fresh interpreter: a first call on a fresh step object (compilation plus
sampling), then ``--repeats`` (3) identical calls on the same step object (its compiled
functions kept: sampling only), of which the fastest is reported (single calls scatter by
±30% here); the first less it is about the compilation. The ratio column divides the
fastest compiled call by the 1-chain ``pmsg.sample`` one. The goal of issue 6 is 4 vectorised
chains in less than 2x one chain. ``pm.sample(cores=2)`` compiles in its worker processes at
every call (a step's compiled functions are not sent to them), so both its columns include
compilation.

``pmsg.sample`` has two phases that scale differently with the chains: the tuning draws (a
host round-trip per draw through every chain's own ``step()``: noise estimates, power
iterations, numpy algebra, in the chains' threads) and the sampling draws (one compiled loop
per chunk). A third and fourth call with ``draws=1`` time the tuning draws alone; the
sampling draws are the compiled call less that, and both get a ratio to one chain.

Then, per sampler, one more interpreter calls ``pmsg.sample`` with 1 and with 4 chains
alternately ``--pairs`` (7) times on one compiled step and reports the median and range of
the pairs' ratios: both sides of a pair see the same drift of the machine, which rows run in
separate interpreters minutes apart do not (their ratios moved by ±30% between re-runs).

The same pairs also run in an interpreter pinned to one CPU (there the 4 chains are one
vmapped batch: what batching saves), and side by side: one chain in each of two interpreters
pinned to the two CPUs, one alone then both at once — how much a chain slows down when the
other CPU works too, i.e. what the second CPU is worth to chains that share nothing.

Other processes' CPU use during the run is measured (``/proc/stat``); above 0.1 core on
average the table is marked contaminated.

Run from the repository root::

    .venv/bin/python benchmarks/vectorised.py                  # N = 1e5, appends to RESULTS.md
    .venv/bin/python benchmarks/vectorised.py --n 20000 --out -
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import REPO, append_section, git_state, run_script  # noqa: E402
from throughput import cpu_model, system_busy_seconds  # noqa: E402

from pymc_sgmcmc._chain_engine import _usable_cpus  # noqa: E402

_PRELUDE = textwrap.dedent(
    """
    import json, resource, sys, time, logging, warnings
    import numpy as np, pymc as pm, pymc_sgmcmc as pmsg
    logging.getLogger("pymc").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", "More chains")  # draws=1 of the tuning-only calls

    def build(sampler, n, d):
        rng = np.random.default_rng(0)
        X = rng.normal(size=(n, d))
        p = 1 / (1 + np.exp(-X @ (0.3 * rng.normal(size=d))))
        y = (rng.random(n) < p).astype(np.int64)
        with pm.Model() as model:
            beta = pm.Normal("beta", 0, 1, shape=d)
            pm.Bernoulli("y", logit_p=pm.Data("X", X) @ beta, observed=y)
            step = getattr(pmsg, sampler)(batch_size=256)
        return model, step
    """
)

_RUN = _PRELUDE + textwrap.dedent(
    """
    sampler, driver, n, d, chains, cores, draws, tune, repeats = sys.argv[1:10]
    n, d, chains, cores, draws, tune, repeats = (
        int(v) for v in (n, d, chains, cores, draws, tune, repeats))
    model, step = build(sampler, n, d)
    with model:
        run = pmsg.sample if driver == "pmsg.sample" else pm.sample
        kw = dict(step=step, draws=draws, tune=tune, chains=chains, cores=cores,
                  random_seed=1, progressbar=False, compute_convergence_checks=False)
        times, cpus = [], []
        for _ in range(1 + repeats):
            t, r = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            idata = run(**kw)
            times.append(time.perf_counter() - t)
            r2 = resource.getrusage(resource.RUSAGE_SELF)
            cpus.append(r2.ru_utime - r.ru_utime + r2.ru_stime - r.ru_stime)
        assert idata.posterior["beta"].shape == (chains, draws, d)
        best = 1 + int(np.argmin(times[1:]))
        tune_only = None
        if driver == "pmsg.sample" and tune:  # the tuning draws alone (and one draw)
            tune_times = []
            for _ in range(1 + repeats):
                t = time.perf_counter()
                run(**{**kw, "draws": 1})
                tune_times.append(time.perf_counter() - t)
            tune_only = min(tune_times[1:])
    print("RESULT" + json.dumps({"first": times[0], "second": times[best], "cpu": cpus[best],
                                 "all": times[1:], "tune_only": tune_only}))
    """
)


def _pin(arg: int) -> str:
    """A child's first lines: pin the process (and every thread it starts: XLA's pool, the
    chains' threads) to the CPU given as ``sys.argv[arg]`` (``-``: not pinned), before
    anything starts a thread, so that XLA sizes its pool for one CPU."""
    return (
        f"import os, sys\nif sys.argv[{arg}] != '-':\n"
        f"    os.sched_setaffinity(0, {{int(sys.argv[{arg}])}})\n"
    )


# Paired: pinned to one CPU, pmsg.sample's default cores is 1: the 4 chains are one vmapped
# batch, and the ratio is what batching itself saves.
_PAIRED = (
    _pin(7)
    + _PRELUDE
    + textwrap.dedent(
        """
    sampler, n, d, draws, tune, pairs = sys.argv[1:7]
    n, d, draws, tune, pairs = (int(v) for v in (n, d, draws, tune, pairs))
    model, step = build(sampler, n, d)
    kw = dict(step=step, draws=draws, tune=tune, random_seed=1, progressbar=False,
              compute_convergence_checks=False)
    ones, fours, procs = [], [], []
    sides = [(1, "vectorized", ones), (4, "vectorized", fours)]
    if sys.argv[7] == "-":  # on all CPUs: also the chains' groups in pinned worker processes
        sides.append((4, "processes", procs))
    with model:
        for chains, method, _ in sides:  # compile every shape (and start the workers) first
            pmsg.sample(chains=chains, chain_method=method, **kw)
        for _ in range(pairs):  # alternating, so that all see the same drift of the machine
            for chains, method, out in sides:
                t = time.perf_counter()
                pmsg.sample(chains=chains, chain_method=method, **kw)
                out.append(time.perf_counter() - t)
    from pymc_sgmcmc._chain_engine import _usable_cpus  # what the default cores counts
    print("RESULT" + json.dumps({"ones": ones, "fours": fours, "procs": procs,
                                 "cpus": _usable_cpus()}))
    """
    )
)

# Side by side: one chain in each of two interpreters, each pinned to its own CPU, commanded
# over stdin so that the parent can run one of them alone or both at once. How much slower a
# chain gets when the other CPU runs one too is what the machine's second CPU is worth to
# independent chains (shared cache and memory bandwidth, the host's other tenants).
_SIDE = (
    _pin(6)
    + _PRELUDE
    + textwrap.dedent(
        """
    sampler, n, d, draws, tune = sys.argv[1:6]
    n, d, draws, tune = (int(v) for v in (n, d, draws, tune))
    model, step = build(sampler, n, d)
    kw = dict(step=step, draws=draws, tune=tune, chains=1, random_seed=1, progressbar=False,
              compute_convergence_checks=False)
    with model:
        pmsg.sample(**kw)  # compile
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip() != "run":
                break
            t = time.perf_counter()
            pmsg.sample(**kw)
            print("TIME", time.perf_counter() - t, flush=True)
    """
    )
)


def side_by_side(sampler: str, n: int, d: int, draws: int, tune: int, pairs: int) -> dict:
    """One chain alone on one CPU, and one chain on each of two CPUs at once, ``pairs`` times
    (the order alternating within pairs, the lone CPU taking turns). ``together`` holds the
    wall time of both (the slower child's call): what 2 chains sharing nothing cost."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    procs = []

    def expect(proc, tag):
        for line in proc.stdout:
            if line.startswith(tag):
                return line.split()[1:]
        raise RuntimeError(
            f"side-by-side child on CPU {cpus[procs.index(proc)]} exited before {tag} "
            f"(exit code {proc.wait()}; its error is above)"
        )

    def run(which):
        for p in which:
            p.stdin.write("run\n")
            p.stdin.flush()
        return [float(expect(p, "TIME")[0]) for p in which]

    ok = False
    try:
        for c in cpus:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SIDE, sampler, *map(str, (n, d, draws, tune, c))],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                )
            )
        for p in procs:
            expect(p, "READY")
        alone, together = [], []
        for i in range(pairs):
            lone = [procs[i % 2]]
            for which in (lone, procs) if i % 4 < 2 else (procs, lone):
                times = run(which)
                if len(which) == 1:
                    alone.extend(times)
                else:
                    together.append(max(times))
        ok = True
    finally:
        for p in procs:
            with contextlib.suppress(BrokenPipeError):
                p.stdin.close()
            if not ok:
                p.kill()
            p.wait()
            p.stdout.close()
    return {"alone": alone, "together": together, "cpus": cpus}


CONFIGS = (  # (driver, chains, cores)
    ("pmsg.sample", 1, 1),
    ("pmsg.sample", 4, 2),
    ("pmsg.sample", 4, 1),
    ("pm.sample", 1, 1),
    ("pm.sample", 4, 2),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=20)
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--tune", type=int, default=100)
    parser.add_argument("--samplers", default="SGLD,IASG")
    parser.add_argument("--repeats", type=int, default=3, help="compiled calls; the fastest")
    parser.add_argument(
        "--pairs",
        type=int,
        default=7,
        help="alternating 1- and 4-chain calls in one process (on all CPUs and pinned to one), "
        "and side-by-side calls; 0: none of them",
    )
    parser.add_argument(
        "--no-rows",
        action="store_true",
        help="only the paired and side-by-side measurements, not the rows",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args()
    if args.no_rows and args.pairs < 1:
        parser.error("--no-rows with --pairs 0 measures nothing")

    busy0, wall0 = system_busy_seconds(), time.perf_counter()
    own0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = []
    for sampler in args.samplers.split(",") if not args.no_rows else []:
        base = None
        for driver, chains, cores in CONFIGS:
            result = run_script(
                _RUN,
                sampler,
                driver,
                args.n,
                args.d,
                chains,
                cores,
                args.draws,
                args.tune,
                args.repeats,
            )
            base = base or result  # the first config: pmsg.sample, one chain
            ratio = result["second"] / base["second"]
            phases = "| | |"
            if result["tune_only"] is not None and base["tune_only"] is not None:
                draws_only = result["second"] - result["tune_only"]
                phases = (
                    f"| {result['tune_only'] / base['tune_only']:.2f}x "
                    f"| {draws_only / (base['second'] - base['tune_only']):.2f}x |"
                )
            rows.append(
                (sampler, driver, chains, cores, result["first"], result["second"], ratio)
                + (result["cpu"], phases)
            )
            print(
                f"{sampler} {driver} chains={chains} cores={cores}: first {result['first']:.2f} s,"
                f" compiled {' / '.join(f'{t:.2f}' for t in result['all'])} s"
                f" (fastest {ratio:.2f}x)",
                flush=True,
            )
    usable = _usable_cpus()  # what pmsg.sample's default cores counts
    can_pin = hasattr(os, "sched_setaffinity")
    paired = []
    for sampler in args.samplers.split(",") if args.pairs > 0 else []:
        for pin in ("-", min(os.sched_getaffinity(0))) if can_pin else ("-",):
            result = run_script(
                _PAIRED, sampler, args.n, args.d, args.draws, args.tune, args.pairs, pin
            )
            ratios = np.array(result["fours"]) / np.array(result["ones"])
            one, four = np.median(result["ones"]), np.median(result["fours"])
            proc = np.median(result["procs"]) if result["procs"] else None
            paired.append((sampler, result["cpus"], one, four, ratios, proc))
            print(
                f"{sampler} paired on {result['cpus']} CPU(s): ratios "
                f"{' '.join(f'{r:.2f}' for r in ratios)}",
                flush=True,
            )
    side = []
    can_side = can_pin and usable >= 2
    if args.pairs > 0 and not can_side:
        print("side by side skipped: it needs two CPUs and sched_setaffinity", flush=True)
    for sampler in args.samplers.split(",") if args.pairs > 0 and can_side else []:
        result = side_by_side(sampler, args.n, args.d, args.draws, args.tune, args.pairs)
        alone, together = np.median(result["alone"]), np.median(result["together"])
        vectorised, processes = next(
            ((four, proc) for s, k, _, four, _, proc in paired if s == sampler and k > 1),
            (None, None),
        )
        side.append((sampler, result["cpus"], alone, together, vectorised, processes))
        print(
            f"{sampler} side by side on CPUs {result['cpus']}: alone "
            f"{' '.join(f'{t:.2f}' for t in result['alone'])} s, both "
            f"{' '.join(f'{t:.2f}' for t in result['together'])} s",
            flush=True,
        )
    own = sum(
        getattr(usage, f) - getattr(usage0, f)
        for usage, usage0 in zip(
            (
                resource.getrusage(resource.RUSAGE_SELF),
                resource.getrusage(resource.RUSAGE_CHILDREN),
            ),
            own0,
            strict=True,
        )
        for f in ("ru_utime", "ru_stime")
    )
    others = max(system_busy_seconds() - busy0 - own, 0.0) / (time.perf_counter() - wall0)

    lines = [
        f"### {_dt.date.today().isoformat()}, N = {args.n:,}, D = {args.d}, B = 256, "
        f"{args.tune} tuning + {args.draws} draws per chain",
        "",
        f"- git: {git_state()}; machine: {cpu_model()}, {platform.platform()}, "
        f"{os.cpu_count()} CPUs, python "
        f"{platform.python_version()}",
        f"- other processes kept {others:.2f} cores busy on average during the run"
        + (" — TIMINGS CONTAMINATED, rerun on an idle machine" if others > 0.1 else ""),
    ]
    if rows:
        lines += [
            "- first call: a fresh step (compilation + sampling); compiled: the fastest of "
            f"{args.repeats} more identical calls on the same step object (pm.sample with "
            "cores=2 compiles in its workers every time); compilation: their difference. Ratio: "
            "compiled time over one chain of pmsg.sample.",
            "- CPU: the compiled call's CPU time in its process (all threads; not the worker "
            "processes of pm.sample with cores=2): the work, which other processes do not "
            "inflate as much as the wall time.",
            "- The two phases of `pmsg.sample` (ratios to one chain): the tuning draws, each a "
            "host round-trip through every chain's own `step()` (timed by a compiled call with "
            "`draws=1`), and the sampling draws in the compiled loop (the compiled call less "
            "that).",
            "",
            "| sampler | driver | chains | cores | first call (s) | compiled (s) "
            "| compilation (s) | ratio to 1 chain | compiled, CPU (s) | tuning draws, ratio "
            "| sampling draws, ratio |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {s} | `{drv}` | {c} | {k} | {first:.2f} | {second:.2f} | {first - second:.2f} "
            f"| {ratio:.2f}x | {'n/a' if drv == 'pm.sample' and k > 1 else f'{cpu:.2f}'} "
            f"{phases}"
            for s, drv, c, k, first, second, ratio, cpu, phases in rows
        ]
    if paired:
        lines += [
            "",
            f"Paired in one process (`--pairs {args.pairs}`): `pmsg.sample` with 1 and with 4 "
            "chains (default cores) called alternately on one compiled step, each pair's ratio "
            "of wall times — the two sides see the same drift of the machine, which separate "
            "interpreters minutes apart do not. On all CPUs, and with the process pinned to one "
            "CPU, where the default cores is 1: the 4 chains are one vmapped batch, and the ratio "
            "is what batching the chains saves on one core (4x: nothing). One chain that runs no "
            "faster on k CPUs than on one then bounds 4 chains on k CPUs from below by the "
            "pinned ratio / k.",
            "",
            "| sampler | CPUs | 1 chain, median (s) | 4 chains, median (s) | ratio, median "
            "| ratio, range |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {s} | {cpus} | {one:.2f} | {four:.2f} | {np.median(r):.2f}x "
            f"| {r.min():.2f}–{r.max():.2f}x |"
            for s, cpus, one, four, r, _ in paired
        ]
        procs = [(s, cpus, proc) for s, cpus, _, _, _, proc in paired if proc is not None]
        if procs:
            lines += [
                "",
                "The unpinned process also timed `pmsg.sample(chains=4, "
                'chain_method="processes")` in the same alternation (each group of chains in a '
                "worker process pinned to its own CPU, the workers kept from call to call): "
                + "; ".join(f"{s} {proc:.2f} s (median)" for s, cpus, proc in procs)
                + ".",
            ]
    if side:
        lines += [
            "",
            f"Side by side (`--pairs` {args.pairs} times): `pmsg.sample(chains=1)` in each of "
            "two interpreters, each pinned to its own CPU before its imports; one of them alone, "
            "and both at once (the slower one's call, i.e. the wall time of the two), the order "
            "alternating. Two chains that share nothing, one per CPU, each with its own copy "
            "of the data: 4 of them cost 2 × that wall time (without their interpreters' "
            "start-up and compilation). `pmsg.sample`'s 4 chains (the paired 2-CPU medians "
            'above, `chain_method="vectorized"` and `"processes"`) beat that only by sharing '
            "work or cached data between chains."
            + (
                f" This machine has {usable} CPUs: the side-by-side "
                "chains use two of them, `pmsg.sample` up to 4, which favours it."
                if usable > 2
                else ""
            ),
            "",
            "| sampler | CPUs | 1 chain alone, median (s) | 2 chains at once, median (s) "
            "| slowdown | 4 independent chains (s) | `pmsg.sample`, 4 chains, vectorized (s) "
            "| vectorized / independent | `pmsg.sample`, 4 chains, processes (s) "
            "| processes / independent |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s, cpus, alone, together, vectorised, processes in side:
            cells = []
            for value in (vectorised, processes):
                cells += (
                    ["", ""] if value is None else [f"{value:.2f}", f"{value / (2 * together):.2f}"]
                )
            lines.append(
                f"| {s} | {', '.join(map(str, cpus))} | {alone:.2f} | {together:.2f} "
                f"| {together / alone:.2f}x | {2 * together:.2f} | " + " | ".join(cells) + " |"
            )
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out != "-":
        append_section(
            Path(args.out),
            section,
            "## Vectorised chains: pmsg.sample (issue 6)",
            "`benchmarks/vectorised.py`: 1 vs 4 chains through `pmsg.sample` (vmapped chains, "
            "one compiled loop per chunk of draws) and, for reference, `pm.sample`.",
        )


if __name__ == "__main__":
    main()
