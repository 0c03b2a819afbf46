"""Shared reporting for the benchmark scripts: the package's git state and appending a run's
section to ``benchmarks/RESULTS.md`` under the script's own heading."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "ScriptTimeout", "append_section", "git_state", "run_script"]


def git_state() -> str:
    """Short HEAD hash, flagged when ``pymc_sgmcmc/`` has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "pymc_sgmcmc"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "?"
    return f"{head}{' + uncommitted changes in pymc_sgmcmc/' if dirty else ''}"


def append_section(path: Path, section: str, heading: str, intro: str) -> None:
    """Append ``section`` at the end of the ``heading`` section of ``path`` (created at the end
    of the file, with ``intro`` under it, if missing); the rest of the file is left as it is."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if heading not in text:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{intro}\n"
    start = text.index(heading) + len(heading)
    nxt = text.find("\n## ", start)
    end = len(text) if nxt < 0 else nxt + 1
    text = text[:end].rstrip("\n") + "\n\n" + section + ("\n" + text[end:] if nxt >= 0 else "")
    path.write_text(text)


class ScriptTimeout(RuntimeError):
    """A :func:`run_script` child killed at its time limit."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"killed after {seconds:.0f} s (time limit)")
        self.seconds = seconds


def run_script(
    code: str, *args: object, env: dict[str, str] | None = None, timeout: float | None = None
) -> dict:
    """Run ``code`` in a fresh interpreter with ``args`` and return the JSON it prints on a
    line starting with ``RESULT`` (a fresh process per measurement: its own peak memory, its
    own JAX device count). Past ``timeout`` seconds the child and every process it started
    (``pm.sample``'s workers) are killed and :class:`ScriptTimeout` is raised."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        start_new_session=True,  # its own process group: killed with its workers
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise ScriptTimeout(timeout) from None
    if proc.returncode != 0:
        raise RuntimeError(stderr[-3000:])
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])
