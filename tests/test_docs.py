"""Every Python code block of the README and the docs runs, as written up to its sizes.

The blocks of one page run in order in one namespace (a page may build data in one block and
sample in the next), in a temporary working directory. Sizes are shrunk here, by the
substitutions in :data:`SHRINK` — never by settings in the user-facing code: ``draws``,
``tune``, ``chains`` and the generated data's rows. A page whose blocks sample a ``model``
they do not define (``with model: pm.sample(step=pmsg.SGLD())``: "your model") gets one from
:data:`MODELS`. A block that breaks, or whose run raises (a DivergenceError, a bad
posterior's self-check warning turned into an error below), fails the test; shell blocks are
not run.

The README's example is run unshrunk by :func:`test_readme_example_prints_what_the_readme_shows`,
which checks its printed table against the README's: means, sds and HDIs digit for digit at the
displayed precision, ESS within 5% and R-hat within 0.005 (they move with the last bits of the
draws on another CPU); ``examples/readme_example.py --write`` re-records it.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from stack import PYMC_6

# The README and the docs are written for today's stack (PyMC 6, ArviZ 1): their code and
# printed output are checked there; on the previous stack (Python 3.11) they are not run.
pytestmark = pytest.mark.skipif(not PYMC_6, reason="the docs show PyMC 6 / ArviZ 1 code")

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md"]
    + [
        p
        for p in (ROOT / "docs").rglob("*.md")
        if not ({"_build", "generated", "figures"} & set(p.parts))
    ]
)
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# (pattern, replacement) applied to every page's code: the sizes a CI run can afford.
SHRINK = [
    (r"\bdraws=(\d[\d_]*)", lambda m: f"draws={min(int(m.group(1).replace('_', '')), 100)}"),
    (r"\btune=(\d[\d_]*)", lambda m: f"tune={min(int(m.group(1).replace('_', '')), 50)}"),
    (r"\bchains=(\d+)", lambda m: f"chains={min(int(m.group(1)), 2)}"),
    (r"\b(100_000|50_000|20_000|10_000)\b", "4_000"),
]

# The model a page's blocks sample when they do not define one ("with model:").
_REGRESSION = """
import numpy as np, pymc as pm, pymc_sgmcmc as pmsg
_rng = np.random.default_rng(0)
_X = _rng.normal(size=(4000, 3))
_y = 0.5 + _X @ [1.0, -0.5, 0.25] + _rng.normal(size=4000)
with pm.Model(coords={"coef": ["a", "b", "c"]}) as model:
    _alpha = pm.Normal("alpha", 0, 10)
    _beta = pm.Normal("beta", 0, 10, dims="coef")
    _sigma = pm.HalfNormal("sigma", 2)
    pm.Normal("y", _alpha + pm.Data("X", _X) @ _beta, _sigma, observed=_y)
"""
_VOLATILITY = """
import numpy as np, pymc as pm, pymc_sgmcmc as pmsg
_rng = np.random.default_rng(0)
_returns = _rng.normal(size=300) * np.exp(np.cumsum(_rng.normal(0, 0.1, 300)) - 4)
with pm.Model() as model:
    _sigma = pm.Exponential("sigma", 50.0)
    _nu = pm.Exponential("nu", 0.1)
    _volatility = pm.GaussianRandomWalk(
        "volatility", sigma=_sigma, init_dist=pm.Normal.dist(-4, 1), shape=300
    )
    pm.StudentT("returns", nu=_nu, lam=np.exp(-2 * _volatility), observed=_returns)
"""
_ON_DISK = """
import numpy as np, pymc as pm, pymc_sgmcmc as pmsg
_rng = np.random.default_rng(0)
_X = _rng.normal(size=(20_000, 20))
np.save("X.npy", _X)
np.save("y.npy", (_rng.random(20_000) < 1 / (1 + np.exp(-_X @ _rng.normal(0, 0.3, 20)))).astype(float))
with pm.Model() as model:
    _b = pm.Normal("b", 0, 1, shape=3)
    pm.Normal("y", pm.Data("X", _X[:, :3]) @ _b, 1.0, observed=_X[:, 3])
"""
MODELS = {"docs/hierarchical.md": _VOLATILITY, "docs/reliability.md": _ON_DISK}


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    found = [(text[: m.start()].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]
    if page.name == "README.md":
        found = found[1:]  # the example: run unshrunk by the test below
    return found


def _shrink(code: str) -> str:
    for pattern, replacement in SHRINK:
        code = re.sub(pattern, replacement, code)
    # A seed where the snippet gives none, so that a run is reproducible (a snippet's
    # self-check verdict is then the same on every run, not a draw of its false alarms).
    if "random_seed" not in code:
        code = re.sub(r"\b(pm|pmsg)\.sample\(", r"\1.sample(random_seed=1, ", code)
    return code


PAGES_WITH_CODE = [p for p in PAGES if _blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    name = str(page.relative_to(ROOT))
    namespace: dict = {"__name__": f"__docs_{page.stem}__"}
    blocks = _blocks(page)
    if any(re.search(r"\bmodel\b", code) for _, code in blocks) and not any(
        re.search(r"\bas model\b|^model\s*=", code, re.M) for _, code in blocks
    ):
        exec(MODELS.get(name, _REGRESSION), namespace)
    for line, code in blocks:
        with warnings.catch_warnings():
            # A self-check warning in a docs example means the example shows a bad posterior.
            from pymc_sgmcmc.diagnostics import SGMCMCCheckWarning

            warnings.simplefilter("error", SGMCMCCheckWarning)
            try:
                exec(compile(_shrink(code), f"{name}:{line}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(
                    f"the code block at {name}:{line} failed ({type(error).__name__}: "
                    f"{error}).\nAs run (shrunk):\n{_shrink(code)}"
                ) from error


def test_substitutions_shrink_what_they_should():
    assert _shrink("pm.sample(draws=1000, tune=500, chains=4, random_seed=3)") == (
        "pm.sample(draws=100, tune=50, chains=2, random_seed=3)"
    )
    assert _shrink("size=(100_000, 3)") == "size=(4_000, 3)"
    assert _shrink("pm.sample(step=s)") == "pm.sample(random_seed=1, step=s)"


def _readme_example():
    spec = importlib.util.spec_from_file_location(
        "readme_example", ROOT / "examples" / "readme_example.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(rows: list[str]) -> dict[tuple[str, str], str]:
    header = rows[0].split()
    cells = {}
    for row in rows[1:]:
        name, *values = row.split()
        assert len(values) == len(header), row
        cells.update({(name, column): value for column, value in zip(header, values, strict=True)})
    return cells


@pytest.mark.parametrize("page", ["readme", "getting_started"])
def test_readme_example_prints_what_the_readme_shows(page):
    """The README's example and the getting-started page's first model print what the page
    shows (``examples/readme_example.py``, unshrunk)."""
    example = _readme_example()
    path, section = example.PAGES[page]
    _, output = example.blocks(path.read_text(), section)
    shown = _cells(example.table(output.group(2)))
    printed = _cells(example.run(page))
    assert shown.keys() == printed.keys()
    # The posterior summaries at the page's displayed precision: the same digits. The
    # draws are bit-for-bit reproducible for a seed on one machine and library versions;
    # on another CPU the last bits of the draws may differ, which moves the diagnostics'
    # printed decimals (ESS, R-hat) but not the displayed means, sds and intervals.
    diagnostics = {"ess_bulk": 0.05, "r_hat": 0.005}  # relative / absolute allowance
    differ = {}
    for (name, column), value in shown.items():
        now = printed[(name, column)]
        if column == "ess_bulk":
            ok = abs(float(now) - float(value)) <= diagnostics[column] * float(value)
        elif column == "r_hat":
            ok = abs(float(now) - float(value)) <= diagnostics[column]
        else:
            ok = now == value
        if not ok:
            differ[(name, column)] = (value, now)
    assert not differ, (
        f"the {page} example's output is not what the page shows (rerun "
        f"`python examples/readme_example.py --page {page} --write` if deliberate): {differ}"
    )
    if page == "readme":
        assert np.isclose(float(printed[("beta[2]", "mean")]), 2.0, atol=0.02)
