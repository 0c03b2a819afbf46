"""Golden draws: every case of ``tests/golden/cases.py`` must give the draws (and tuned step
sizes) recorded in ``tests/golden/draws.json``, to a relative tolerance of
:data:`RELATIVE_TOLERANCE`.

Why a tolerance, not the hashes: the last bits of a float64 sum depend on the CPU's vector
width (an AMD EPYC with AVX-512 gave β = −0.1608882809642921 where this machine recorded
−0.16088828096429214). 1e-10 is far above that rounding (and what the chains' dynamics make
of it over 40 draws) and far below any algorithmic change (which moves draws by 1e-4 and
more). The hashes stay as the same-machine check: equal hashes are reported as such.

A refactoring that should change nothing must pass this unchanged. A deliberate change of
the draws re-records the fixture in the same commit and names the change in the commit
message (``tests/golden/README.md``). The fixture is recorded on today's stack (PyMC 6, JAX
0.12) and compared on that stack's releases (major.minor of JAX and PyMC as recorded);
elsewhere — the previous stack, PyMC 5 / JAX 0.10 — the test is skipped, saying why.

Marked ``golden`` (``pytest -m golden`` runs only these; ``-m "not golden"`` leaves them
out).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"


def _load(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, GOLDEN / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cases = _load("pymc_sgmcmc_golden_cases", "cases.py")
record = _load("pymc_sgmcmc_golden_record", "record.py")

FIXTURE_PATH = GOLDEN / "draws.json"
FIXTURE = json.loads(FIXTURE_PATH.read_text()) if FIXTURE_PATH.exists() else None


RELATIVE_TOLERANCE = 1e-10
COMPARED = ("jax", "pymc")  # their major.minor must be the recorded ones


def _minor(version: str | None) -> str | None:
    return None if version is None else ".".join(version.split(".")[:2])


def _version_skip_reason() -> str | None:
    if FIXTURE is None:
        return f"no golden fixture at {FIXTURE_PATH}: run tests/golden/record.py"
    installed = record.library_versions()
    recorded = FIXTURE["versions"]
    differ = {
        name: (recorded.get(name), installed.get(name))
        for name in COMPARED
        if _minor(recorded.get(name)) != _minor(installed.get(name))
    }
    if differ:
        listed = ", ".join(f"{n} recorded {r} / installed {i}" for n, (r, i) in differ.items())
        return (
            "golden draws were recorded on another stack and are compared on its releases only "
            f"({listed}); re-record with tests/golden/record.py on a new stack "
            f"(the fixture is from commit {FIXTURE.get('commit')})"
        )
    return None


def _side_by_side(case_id: str, recorded: dict, now: dict) -> str:
    lines = [
        f"golden case {case_id!r} ({recorded.get('description', '')}) changed its draws "
        f"(fixture recorded at commit {FIXTURE.get('commit')}).",
        f"  posterior sha256: recorded {recorded['posterior_sha256'][:16]}…, "
        f"now {now['posterior_sha256'][:16]}…",
        f"  step_size sha256: recorded {recorded['step_size_sha256'][:16]}…, "
        f"now {now['step_size_sha256'][:16]}…"
        + ("" if recorded["step_size_sha256"] == now["step_size_sha256"] else "  (differs)"),
        f"  {'mean of':<24} {'recorded':>24} {'now':>24}",
        f"  {'step_size':<24} {recorded['step_size_mean']!r:>24} {now['step_size_mean']!r:>24}",
    ]
    names = sorted(set(recorded["variables"]) | set(now["variables"]))
    for name in names:
        old = recorded["variables"].get(name)
        new = now["variables"].get(name)
        if old is None or new is None:
            lines.append(
                f"  {name:<24} {'(absent)' if old is None else 'present':>24} "
                f"{'(absent)' if new is None else 'present':>24}"
            )
            continue
        flag = "" if old["sha256"] == new["sha256"] else "  (differs)"
        if old["shape"] != new["shape"]:
            flag += f"  (shape {old['shape']} -> {new['shape']})"
        old_mean, new_mean = old["mean"], new["mean"]
        if isinstance(old_mean, list) or isinstance(new_mean, list):
            lines.append(f"  {name:<24}{flag}")
            lines.append(f"    recorded {old_mean}")
            lines.append(f"    now      {new_mean}")
        else:
            lines.append(f"  {name:<24} {old_mean!r:>24} {new_mean!r:>24}{flag}")
    lines.append(
        "If this change is deliberate, re-record (python tests/golden/record.py) in the same "
        "commit and name the change in its message; see tests/golden/README.md."
    )
    return "\n".join(lines)


@pytest.mark.golden
@pytest.mark.parametrize("case", cases.CASES, ids=[c.id for c in cases.CASES])
def test_golden_draws(case):
    reason = _version_skip_reason()
    if reason:
        pytest.skip(reason)
    recorded = FIXTURE["cases"].get(case.id)
    assert recorded is not None, (
        f"golden case {case.id!r} is in cases.py but not in {FIXTURE_PATH.name}: record it "
        f"(python tests/golden/record.py --only {case.id}) in the commit that adds it"
    )
    now = cases.digest(cases.run_case(case))
    if (
        now["posterior_sha256"] == recorded["posterior_sha256"]
        and now["step_size_sha256"] == recorded["step_size_sha256"]
    ):
        return  # bit for bit (the same machine and releases)
    assert _close(recorded, now), _side_by_side(case.id, recorded, now)


def _close(recorded: dict, now: dict) -> bool:
    """The draws and step sizes equal to :data:`RELATIVE_TOLERANCE` (relative to each
    variable's largest magnitude, so that a value near zero is not held to 1e-10 of itself)."""
    pairs = [(recorded["step_size"], now["step_size"])]
    if set(recorded["variables"]) != set(now["variables"]):
        return False
    for name, old in recorded["variables"].items():
        if old["shape"] != now["variables"][name]["shape"]:
            return False
        pairs.append((old["values"], now["variables"][name]["values"]))
    for old, new in pairs:
        old, new = np.asarray(old, dtype=float), np.asarray(new, dtype=float)
        scale = max(float(np.max(np.abs(old), initial=0.0)), 1e-300)
        if old.shape != new.shape or np.any(np.abs(new - old) > RELATIVE_TOLERANCE * scale):
            return False
    return True


@pytest.mark.golden
def test_golden_fixture_has_no_stale_cases():
    if FIXTURE is None:
        pytest.skip(f"no golden fixture at {FIXTURE_PATH}: run tests/golden/record.py")
    stale = sorted(set(FIXTURE["cases"]) - set(cases.CASES_BY_ID))
    assert not stale, (
        f"{FIXTURE_PATH.name} has cases that cases.py no longer defines: {stale}; re-record"
    )
