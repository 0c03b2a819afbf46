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
