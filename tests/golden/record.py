"""Record the golden fixtures: run every case of ``cases.py`` and write ``draws.json``.

    python tests/golden/record.py                  # all cases -> tests/golden/draws.json
    python tests/golden/record.py --out /tmp/a.json  # elsewhere (e.g. to diff two runs)
    python tests/golden/record.py --isolated       # each case in a fresh interpreter
    python tests/golden/record.py --jobs 2         # cases split over 2 interpreters
    python tests/golden/record.py --only pm-sgld-logreg-s1 pm-iasg-linreg-s1

The JSON holds, per case id, the SHA-256 of the posterior (every variable, sorted by name,
float64 C-contiguous, chain and draw order as returned) and of ``sample_stats["step_size"]``,
and readable means; plus the commit the package was at and the library versions (the hashes
are only comparable on the same versions). Nothing in it depends on the time or the machine's
load, so two runs on the same commit and versions must write identical files.

``--only`` updates just those cases in an existing file (keeping the others); it refuses if
the existing file was recorded on other library versions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "draws.json"
LIBRARIES = ("jax", "jaxlib", "pymc", "pytensor", "numpy")
FORMAT = 2  # 2: the values are stored too (compared to a tolerance)


def load_cases():
    spec = importlib.util.spec_from_file_location("pymc_sgmcmc_golden_cases", HERE / "cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def library_versions() -> dict[str, str]:
    return {name: version(name) for name in LIBRARIES}


def package_commit() -> str:
    """The commit of the repository holding the imported pymc_sgmcmc, with ``-dirty`` when
    the package's files differ from it (a fixture recorded on uncommitted code)."""
    import pymc_sgmcmc

    package = Path(pymc_sgmcmc.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."],
            cwd=package,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def _run_in_jobs(selected, jobs: int, isolated: bool, cases) -> dict:
    """Run ``selected`` in ``jobs`` child interpreters (round robin), each writing its own
    JSON; returns their cases."""
    import tempfile

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (cases._package_root(), env.get("PYTHONPATH", "")) if p
    )
    out = {}
    with tempfile.TemporaryDirectory(prefix="golden-jobs-") as tmp:
        procs = []
        for k in range(jobs):
            ids = [c.id for c in selected[k::jobs]]
            if not ids:
                continue
            path = Path(tmp) / f"job{k}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(path), "--only"]
            cmd += ids + (["--isolated"] if isolated else [])
            procs.append((subprocess.Popen(cmd, env=env), path))
        failed = [p.args for p, _ in procs if p.wait() != 0]
        if failed:
            raise RuntimeError(f"golden recording jobs failed: {failed}")
        for _, path in procs:
            out.update(json.loads(path.read_text())["cases"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="+", metavar="ID", help="record only these cases")
    parser.add_argument(
        "--isolated", action="store_true", help="run each case in a fresh interpreter"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="split the cases over this many interpreters run side by side (default 1)",
    )
    args = parser.parse_args(argv)

    cases = load_cases()
    import pymc_sgmcmc

    print(f"pymc_sgmcmc from {pymc_sgmcmc.__file__}", flush=True)
    selected = cases.CASES
    if args.only:
        unknown = sorted(set(args.only) - set(cases.CASES_BY_ID))
        if unknown:
            parser.error(f"unknown case ids {unknown}; see python {HERE / 'cases.py'}")
        selected = [c for c in cases.CASES if c.id in set(args.only)]

    versions = library_versions()
    recorded = {}
    if args.only and args.out.exists():
        old = json.loads(args.out.read_text())
        if old.get("versions") != versions:
            parser.error(
                f"{args.out} was recorded on {old.get('versions')}, these are {versions}: "
                "re-record every case (without --only)."
            )
        recorded = {k: v for k, v in old["cases"].items() if k in cases.CASES_BY_ID}

    start = time.perf_counter()
    if args.jobs > 1:
        recorded.update(_run_in_jobs(selected, args.jobs, args.isolated, cases))
        selected_to_run = []
    else:
        selected_to_run = selected
    for case in selected_to_run:
        t0 = time.perf_counter()
        idata = cases.run_case(case, isolated=args.isolated)
        recorded[case.id] = {"description": case.description, **cases.digest(idata)}
        print(
            f"{case.id:40s} {time.perf_counter() - t0:6.1f} s  "
            f"{recorded[case.id]['posterior_sha256'][:16]}",
            flush=True,
        )
    total = time.perf_counter() - start

    order = [c.id for c in cases.CASES if c.id in recorded]
    fixture = {
        "format": FORMAT,
        "commit": package_commit(),
        "versions": versions,
        "settings": {"tune": cases.TUNE, "draws": cases.DRAWS, "chains": cases.CHAINS},
        "cases": {case_id: recorded[case_id] for case_id in order},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1, sort_keys=False) + "\n")
    print(f"{len(selected)} case(s) in {total:.1f} s -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
