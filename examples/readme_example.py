"""The README's example: runs its code block as written and compares or rewrites its output.

    python examples/readme_example.py           # run it, print the output and whether it matches
    python examples/readme_example.py --write   # run it and rewrite the README's output block

The code is the README's first ``python`` block under "## Example", run unchanged; its
output is the summary table the block prints. ``tests/test_docs.py`` runs the same function
and checks the README's table against it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(text: str) -> tuple[re.Match, re.Match]:
    """The example's code block and its output block (the first text block after it)."""
    section = text.index("## Example")
    code = next(m for m in FENCE.finditer(text, section) if m.group(1) == "python")
    output = next(m for m in FENCE.finditer(text, code.end()) if m.group(1) == "text")
    return code, output


def table(printed: str) -> list[str]:
    """The lines of the last pandas table in ``printed``: its header and rows."""
    lines = printed.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"^\s+mean\s+sd\b", line)]
    if not starts:
        raise ValueError(f"no summary table in the output:\n{printed[-2000:]}")
    rows = []
    for line in lines[starts[-1] :]:
        if not line.strip():
            break
        rows.append(line.rstrip())
    return rows


def run() -> list[str]:
    """Run the README's example code and return its printed table."""
    code, _ = blocks(README.read_text())
    buffer = io.StringIO()
    namespace: dict = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(buffer):
        exec(compile(code.group(2), "README.md (example)", "exec"), namespace)
    return table(buffer.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the README's output")
    args = parser.parse_args()
    printed = run()
    print("\n".join(printed))
    text = README.read_text()
    _, output = blocks(text)
    if args.write:
        start, end = output.span(2)
        README.write_text(text[:start] + "\n".join(printed) + "\n" + text[end:])
        print(f"rewrote the output block of {README}")
    else:
        same = table(output.group(2)) == printed
        print("matches the README" if same else "differs from the README (--write to update)")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
