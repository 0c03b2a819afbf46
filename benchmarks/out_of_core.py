"""Out-of-core data: peak memory and posterior agreement of memory-mapped data (issue 7).

1. Writes a logistic regression (``N`` rows, ``D = 20`` standard-normal float64 features in
   random order, 0/1 labels as int64) to ``X.npy`` / ``y.npy`` in chunks, in a separate
   process, so the measuring processes never hold it.
2. Each run is a fresh interpreter (so ``VmHWM``, the peak resident set, is its own): it
   imports pymc / pymc_sgmcmc / jax, builds the model on a 1 000-row placeholder, reads the
   *baseline* ``VmRSS``, then runs ``pm.sample(step=pmsg.IASG(batch_size=1000,
   data={"X": X, "y": y}), chains=1)`` on the memory-maps (or, for the in-memory row,
   the same model on the arrays loaded whole). A thread samples ``RssAnon``/``RssFile``
   every 0.2 s. Reported: peak RSS above the baseline, peak anonymous and file-backed RSS,
   wall time, seconds per data pass (``sample_stats["data_passes"]``).
3. Goal: at ``N = 10⁷`` (1.6 GB on disk) the peak RSS stays under 1 GB above the baseline.
4. Agreement: the first 10⁶ rows (a file of their own: a *slice* of a memory-map is read by
   slicing, not ``preadv``) sampled out-of-core and in memory with the same settings;
   per coefficient |mean difference| in in-memory posterior sds and the sd ratio. IASG gives
   about one independent draw per pass, so with ``S`` draws a mean differs by about
   ``√(2/S)`` sd between two runs and an sd ratio by about ``√(1/S)``: with ``S = 100`` the
   tolerances 0.6 sd and 30% are four such errors — "the usual tolerances" of the tests,
   scaled to the draws a benchmark can afford.

Run from the repository root (about 10 minutes, 1.8 GB of disk)::

    .venv/bin/python benchmarks/out_of_core.py
    .venv/bin/python benchmarks/out_of_core.py --n 1000000 --subset 200000 --out -   # quick
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import REPO, append_section, git_state, run_script  # noqa: E402

D = 20

_WRITE = textwrap.dedent(
    """
    import sys, numpy as np
    path, n, d, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = np.random.default_rng(0)
    true = 0.3 * rng.normal(size=d)
    X = np.lib.format.open_memmap(f"{path}/X.npy", mode="w+", dtype=np.float64, shape=(n, d))
    y = np.lib.format.open_memmap(f"{path}/y.npy", mode="w+", dtype=np.int64, shape=(n,))
    for start in range(0, n, 1_000_000):
        stop = min(n, start + 1_000_000)
        x = rng.normal(size=(stop - start, d))
        X[start:stop] = x
        y[start:stop] = rng.random(stop - start) < 1 / (1 + np.exp(-x @ true))
    X.flush(); y.flush()
    sub = np.lib.format.open_memmap(f"{path}/X_sub.npy", mode="w+", dtype=np.float64, shape=(first, d))
    sub[:] = X[:first]; sub.flush()
    suby = np.lib.format.open_memmap(f"{path}/y_sub.npy", mode="w+", dtype=np.int64, shape=(first,))
    suby[:] = y[:first]; suby.flush()
    """
)

_RUN = textwrap.dedent(
    """
    import json, sys, threading, time, logging
    import numpy as np, pymc as pm, pymc_sgmcmc as pmsg, jax
    logging.getLogger("pymc").setLevel(logging.ERROR)
    xfile, yfile, mode, tune, draws = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024  # MB
        return out

    X = np.load(xfile, mmap_mode="r"); y = np.load(yfile, mmap_mode="r")
    if mode == "memory":
        X, y = np.asarray(X).copy(), np.asarray(y).copy()
    with pm.Model():
        # (observed= as a plain array: PyMC casts an integer pm.Data container, which the
        # bridge does not yet see through; the observed variable's name keys data=)
        Xd = pm.Data("X", np.asarray(X[:1000]))
        beta = pm.Normal("beta", 0, 1, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=Xd @ beta, observed=np.asarray(y[:1000]))
        base = status()
        peaks = {"RssAnon": 0.0, "RssFile": 0.0}
        done = False

        def watch():
            while not done:
                s = status()
                for k in peaks:
                    peaks[k] = max(peaks[k], s[k])
                time.sleep(0.2)

        thread = threading.Thread(target=watch, daemon=True); thread.start()
        t = time.perf_counter()
        step = pmsg.IASG(batch_size=1000, data={"X": X, "y": y})
        idata = pm.sample(step=step, tune=tune, draws=draws, chains=1, random_seed=1,
                          progressbar=False, compute_convergence_checks=False)
        wall = time.perf_counter() - t
        done = True; thread.join()
    end = status()
    passes = float(idata.sample_stats["data_passes"].values[0, -1])
    post = idata.posterior["beta"].values.reshape(-1, X.shape[1])
    print("RESULT" + json.dumps({
        "baseline_mb": base["VmRSS"], "peak_mb": end["VmHWM"],
        "peak_anon_mb": peaks["RssAnon"], "peak_file_mb": peaks["RssFile"],
        "base_anon_mb": base["RssAnon"], "base_file_mb": base["RssFile"],
        "wall": wall, "passes": passes, "streaming": step.streaming,
        "mean": post.mean(0).tolist(), "sd": post.std(0).tolist()}))
    """
)


def run(xfile: Path, yfile: Path, mode: str, tune: int, draws: int) -> dict:
    return run_script(_RUN, xfile, yfile, mode, tune, draws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--subset", type=int, default=1_000_000)
    parser.add_argument("--tune", type=int, default=15)
    parser.add_argument("--draws", type=int, default=25)
    parser.add_argument("--subset-draws", type=int, default=100)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args()
    path = Path(args.dir or tempfile.mkdtemp(prefix="pmsg_ooc_"))
    path.mkdir(parents=True, exist_ok=True)
    need = (args.n + args.subset) * (D + 1) * 8 * 1.1
    if shutil.disk_usage(path).free < need:
        sys.exit(f"need {need / 1e9:.1f} GB free in {path}")
    try:
        subprocess.run(
            [sys.executable, "-c", _WRITE, str(path), str(args.n), str(D), str(args.subset)],
            check=True,
        )
        size_gb = (path / "X.npy").stat().st_size / 1e9
        rows = []
        big = run(path / "X.npy", path / "y.npy", "mmap", args.tune, args.draws)
        rows.append((f"{args.n:,} rows, memory-map", big))
        print(big, flush=True)
        sub_m = run(path / "X_sub.npy", path / "y_sub.npy", "mmap", args.tune, args.subset_draws)
        rows.append((f"{args.subset:,} rows, memory-map", sub_m))
        sub_i = run(path / "X_sub.npy", path / "y_sub.npy", "memory", args.tune, args.subset_draws)
        rows.append((f"{args.subset:,} rows, in memory", sub_i))
    finally:
        if args.dir is None:
            shutil.rmtree(path, ignore_errors=True)

    over = big["peak_mb"] - big["baseline_mb"]
    z = (np.asarray(sub_m["mean"]) - sub_i["mean"]) / np.asarray(sub_i["sd"])
    ratio = np.asarray(sub_m["sd"]) / np.asarray(sub_i["sd"])
    agree = bool(np.all(np.abs(z) < 0.6) and np.all(np.abs(ratio - 1) < 0.3))
    lines = [
        f"### {_dt.date.today().isoformat()}, N = {args.n:,} (X: {size_gb:.2f} GB), D = {D}, "
        "IASG B = 1000",
        "",
        f"- git: {git_state()}; machine: {platform.platform()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}",
        "",
        "| run | baseline RSS MB | peak RSS MB | peak − baseline MB | peak anon MB | peak file-backed MB | s per pass | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['baseline_mb']:.0f} | {r['peak_mb']:.0f} | "
            f"{r['peak_mb'] - r['baseline_mb']:.0f} | {r['peak_anon_mb']:.0f} | "
            f"{r['peak_file_mb']:.0f} | {r['wall'] / r['passes']:.2f} | {r['wall']:.0f} |"
        )
    lines += [
        "",
        f"- Goal (peak RSS < 1 GB above baseline at N = {args.n:,}): "
        f"{'**met**' if over < 1024 else '**not met**'} ({over:.0f} MB).",
        f"- Agreement, {args.subset:,}-row subset, memory-map vs in memory "
        f"({args.subset_draws} draws each): max |mean diff| = {np.abs(z).max():.2f} in-memory sd, "
        f"sd ratios {ratio.min():.2f}–{ratio.max():.2f} "
        f"({'within' if agree else 'outside'} 0.6 sd / 30%).",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out != "-":
        append_section(
            Path(args.out),
            section,
            "## Out-of-core data (issue 7)",
            "`benchmarks/out_of_core.py`: memory-mapped data read in blocks (see its docstring).",
        )


if __name__ == "__main__":
    main()
