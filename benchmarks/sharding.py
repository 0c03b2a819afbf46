"""Data-parallel gradients over several JAX devices: seconds per data pass (issue 7).

On one logistic regression (``N`` rows, ``D`` features, float64) the same
``pmsg.SGLD(batch_size=B, step_size=1e-6)`` draw (``thin = N/B``: one pass) is timed with
``devices=None`` (one device) and ``devices=k`` (the minibatch split over ``k`` devices, see
``pymc_sgmcmc.sharding``). Each setting runs in a fresh interpreter started with
``XLA_FLAGS=--xla_force_host_platform_device_count=<k>``, so the CPU is presented to JAX as
``k`` devices: this measures the *overhead* of the sharded program (a ``psum`` per iteration,
the per-device gathers) on one machine, not a speed-up — the devices share the machine's
cores (2 here). Real accelerators would each bring their own compute.

Per setting: seconds per pass = best over ``--repeats`` of ``pm.sample(draws=S, tune=0)``
divided by ``S``, after a warm-up ``pm.sample`` on the same step object (which keeps its
compiled functions). The posterior agreement of 1 vs 4 devices is a test
(``tests/test_sharding.py``), not measured here.

Run from the repository root::

    .venv/bin/python benchmarks/sharding.py                 # N = 1e6, appends to RESULTS.md
    .venv/bin/python benchmarks/sharding.py --n 100000 --out -
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import REPO, append_section, git_state, run_script  # noqa: E402

_RUN = textwrap.dedent(
    """
    import json, sys, time, logging
    import numpy as np, pymc as pm, pymc_sgmcmc as pmsg, jax
    logging.getLogger("pymc").setLevel(logging.ERROR)
    n, d, b, devices, draws, repeats = (int(a) for a in sys.argv[1:7])
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ (0.3 * rng.normal(size=d))))).astype(np.int64)
    with pm.Model():
        beta = pm.Normal("beta", 0, 1, shape=d)
        pm.Bernoulli("y", logit_p=pm.Data("X", X) @ beta, observed=y)
        step = pmsg.SGLD(batch_size=b, step_size=1e-6, devices=None if devices == 1 else devices)
        kw = dict(step=step, tune=0, chains=1, cores=1, progressbar=False,
                  compute_convergence_checks=False, random_seed=1)
        pm.sample(draws=1, **kw)  # compiles
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            pm.sample(draws=draws, **kw)
            best = min(best, (time.perf_counter() - t) / draws)
    print("RESULT" + json.dumps({"devices": len(jax.devices()), "per_pass": best}))
    """
)


def run(n: int, d: int, b: int, devices: int, draws: int, repeats: int) -> dict:
    flags = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return run_script(_RUN, n, d, b, devices, draws, repeats, env=flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--devices", default="1,2,4")
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args()
    rows = []
    for k in (int(v) for v in args.devices.split(",")):
        result = run(args.n, args.d, args.batch_size, k, args.draws, args.repeats)
        rows.append((k, result["per_pass"]))
        print(f"devices={k}: {result['per_pass']:.3f} s per pass", flush=True)
    base = rows[0][1]
    lines = [
        f"### {_dt.date.today().isoformat()}, N = {args.n:,}, D = {args.d}, B = {args.batch_size}",
        "",
        f"- git: {git_state()}; machine: {platform.platform()}, {os.cpu_count()} CPUs, python "
        f"{platform.python_version()}",
        "- CPU split into k forced host devices (XLA_FLAGS); the devices share the same cores, so"
        " the ratio is the sharded program's overhead, not a speed-up.",
        "",
        "| devices | s per data pass | ratio to 1 device |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {k} | {t:.3f} | {t / base:.2f}x |" for k, t in rows]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out != "-":
        append_section(
            Path(args.out),
            section,
            "## Data-parallel devices (issue 7)",
            "`benchmarks/sharding.py`: one SGLD pass with the minibatch split over k devices.",
        )


if __name__ == "__main__":
    main()
