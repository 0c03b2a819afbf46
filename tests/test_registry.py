"""The sampler registry (``pymc_sgmcmc.registry``) is the one list of samplers: every sampler
the package exports is in it, registered with PyMC, and has its docs page, its rows in the
docs' tables and its API entry — so a new sampler is its module, one registry line, its page
and its test, and a forgotten place fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from stack import STEP_METHODS

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.adapter.step import SGMCMCStep
from pymc_sgmcmc.registry import SAMPLERS, TOLERANCES, spec

DOCS = Path(__file__).resolve().parents[1] / "docs"
README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_exported_sampler_is_registered_and_known_to_pymc():
    exported = {
        name
        for name in pmsg.__all__
        if isinstance(getattr(pmsg, name), type)
        and issubclass(getattr(pmsg, name), SGMCMCStep)
        and getattr(pmsg, name) is not SGMCMCStep
    }
    assert exported == {s.name for s in SAMPLERS}
    for entry in SAMPLERS:
        assert entry.cls in STEP_METHODS
        assert entry.tolerance in TOLERANCES
    assert spec("IASG").cls is pmsg.IASG
    with pytest.raises(KeyError, match="the samplers are"):
        spec("NUTS")


@pytest.mark.parametrize("entry", SAMPLERS, ids=lambda s: s.name)
def test_every_sampler_has_its_docs(entry):
    page = DOCS / "samplers" / f"{entry.page}.md"
    assert page.exists(), f"{entry.name}: no docs page {page}"
    row = re.compile(rf"^\| \[?`pmsg\.{entry.name}\(\)`", re.M)
    assert row.search((DOCS / "samplers.md").read_text()), f"{entry.name}: no row in samplers.md"
    assert row.search(README.read_text()), f"{entry.name}: no row in the README's table"
    assert re.search(rf"^\| `{entry.name}` \|", (DOCS / "choosing.md").read_text(), re.M), (
        f"{entry.name}: no row in choosing.md's table"
    )
    assert re.search(rf"^   {entry.name}$", (DOCS / "api.md").read_text(), re.M), (
        f"{entry.name}: not in api.md's autosummary"
    )


def test_capabilities_are_read_from_the_classes():
    assert not spec("SAGALD").local_vars and not spec("SVRGLD").streams
    assert spec("SGLD").local_vars and spec("IASG").streams
    assert {s.name for s in SAMPLERS if s.tolerance == "langevin"} == {
        "SGLD",
        "SAGALD",
        "SVRGLD",
        "SGHMC",
    }


# -- the user-facing pages speak about what is (the workflow issue's item 7) ------------------

HISTORY = re.compile(
    r"\b202[5-9]-\d\d-\d\d"  # a date of the project's (a data set's own dates are fine)
    r"|\b[Bb]efore [0-9a-f]{7}\b|\b[Ss]ince [0-9a-f]{7}\b|\b[Uu]ntil [0-9a-f]{7}\b"  # a commit
    r"|\bformer default\b|\bthe default before\b|\bas before 20"
)


def _user_pages() -> list[Path]:
    """README and the docs, but the benchmarks page (results are dated by nature)."""
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    return [
        p
        for p in pages
        if p.name != "benchmarks.md" and not ({"_build", "generated"} & set(p.parts))
    ]


def test_readme_is_short_and_the_pages_carry_no_history():
    assert len(README.read_text().splitlines()) <= 120
    found = []
    for page in _user_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{page.relative_to(README.parent)}:{number}: {line.strip()[:80]}")
    assert not found, "history belongs in CHANGELOG.md and benchmarks/: " + "; ".join(found)


_QUOTED_DEFAULT = re.compile(
    r"`(\w+)\s*=\s*([^`]+)`,?\s*\((?:the )?default"  # `name=value` (default ...)
    r"|\(default `?(\w+)\s*=\s*([^`),]+)`?\)"  # (default name=value)
)


@pytest.mark.parametrize("entry", SAMPLERS, ids=lambda s: s.name)
def test_the_defaults_a_sampler_page_quotes_are_the_codes(entry):
    """Every ``name=value`` a sampler page calls the default is the default of the sampler's
    signature (or of SGMCMCStep's, which it passes on)."""
    import ast
    import inspect

    defaults = {}
    for cls in reversed(entry.cls.__mro__):
        if "__init__" in cls.__dict__:
            for p in inspect.signature(cls.__init__).parameters.values():
                if p.default is not inspect.Parameter.empty:
                    defaults[p.name] = p.default
    text = (DOCS / "samplers" / f"{entry.page}.md").read_text()
    quoted = [
        (m.group(1) or m.group(3), (m.group(2) or m.group(4)).strip())
        for m in _QUOTED_DEFAULT.finditer(text)
    ]
    checked = 0
    for name, value in quoted:
        if name not in defaults:
            continue
        try:
            literal = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            continue  # an expression (N/B, ...): not a literal to compare
        assert defaults[name] == literal, (
            f"{entry.page}.md says {name}={value} is the default; the code's is {defaults[name]!r}"
        )
        checked += 1
    if entry.name in ("SGLD", "ConstantSGD", "IASG"):
        assert checked, f"{entry.page}.md quotes no default of {entry.name} that can be checked"
