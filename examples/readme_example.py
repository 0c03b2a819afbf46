"""The README's example (and the getting-started page's first model): runs its code block as
written and compares or rewrites its output.

    python examples/readme_example.py           # run it, print the output and whether it matches
    python examples/readme_example.py --write   # run it and rewrite the README's output block
    python examples/readme_example.py --page getting_started --write   # the docs page's

The code is the page's first ``python`` block under its section ("## Example" in the README,
"## A first model" in docs/getting_started.md), run unchanged; its output is the summary
table the block prints, in the first ``text`` block after it. ``tests/test_docs.py`` runs
the same function and checks the page's table against it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = {  # name: (file, section)
    "readme": (README, "## Example"),
    "getting_started": (ROOT / "docs" / "getting_started.md", "## A first model"),
}
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(text: str, section: str = "## Example") -> tuple[re.Match, re.Match]:
    """The example's code block and its output block (the first text block after it)."""
    section = text.index(section)
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


def run(page: str = "readme") -> list[str]:
    """Run a page's example code and return its printed table."""
    path, section = PAGES[page]
    code, _ = blocks(path.read_text(), section)
    buffer = io.StringIO()
    namespace: dict = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(buffer):
        exec(compile(code.group(2), f"{path.name} (example)", "exec"), namespace)
    return table(buffer.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the page's output")
    parser.add_argument("--page", choices=sorted(PAGES), default="readme")
    args = parser.parse_args()
    printed = run(args.page)
    print("\n".join(printed))
    path, section = PAGES[args.page]
    text = path.read_text()
    _, output = blocks(text, section)
    if args.write:
        start, end = output.span(2)
        path.write_text(text[:start] + "\n".join(printed) + "\n" + text[end:])
        print(f"rewrote the output block of {path}")
    else:
        same = table(output.group(2)) == printed
        print("matches the README" if same else "differs from the README (--write to update)")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
