"""The test suite's own models that are checked against NUTS, and their committed references.

A NUTS run made inside each test would cost CI ~100 s in all (short runs, 2–4 chains of
1 000–3 000 draws); the references are instead long runs made once by
``make_suite_references.py`` and checked there against a second, independent run (another
sampler or another seed). A test loads the stored draws with :func:`reference` and keeps
its tolerance, derived from the ESS of both runs.

``reference(name)`` returns an ``xarray.Dataset`` shaped like a posterior group,
``(chain, draw, *shape)``, so ``assert_agree`` and ``az.ess`` read it as they read
``pm.sample``'s result. The draws are thinned (by the factor in ``SUITE``) and stored as
float32 in ``data/suite/<name>.npz``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import xarray as xr

DATA = Path(__file__).parent / "data" / "suite"


def logistic_model(n: int, d: int, seed: int, scales) -> Callable[[], pm.Model]:
    """A builder of a PyMC logistic regression on generated data (N(0,1) prior on β)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * np.asarray(scales)
    true = rng.normal(size=d) * 0.5
    y = rng.random(n) < 1 / (1 + np.exp(-(X @ true)))

    def build() -> pm.Model:
        with pm.Model() as model:
            beta = pm.Normal("beta", 0, 1, shape=d)
            pm.Bernoulli("y", logit_p=pm.Data("X", X) @ beta, observed=y)
        return model

    return build


def multi_output_model() -> pm.Model:
    """Two observed variables sharing X, plus one full-batch observed variable."""
    rng = np.random.default_rng(3)
    n = 5_000
    X = rng.normal(size=(n, 2))
    y1 = X @ [0.5, -0.3] + rng.normal(size=n)
    y2 = 0.2 + X @ [0.5, -0.3] * 0.8 + 0.7 * rng.normal(size=n)
    with pm.Model() as model:
        Xd = pm.Data("X", X)
        beta = pm.Normal("beta", 0, 1, shape=2)
        a = pm.Normal("a", 0, 1)
        s = pm.HalfNormal("s", 1)
        mu = Xd @ beta
        pm.Normal("y1", mu, 1.0, observed=y1)
        pm.Normal("y2", a + 0.8 * mu, s, observed=y2)
        pm.Normal("z", a, 0.05, observed=np.array([0.21, 0.18, 0.22]))
    return model


COMPOUND_N, COMPOUND_GROUPS, COMPOUND_ROWS = 20_000, 10, 40
COMPOUND_CONTINUOUS = ["a", "b", "g", "s"]


def compound_model() -> pm.Model:
    """20 000 rows of a linear regression in which one of ten groups of 40 rows has an
    offset ``g``; the categorical ``k`` says which (test_compound.py)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, COMPOUND_N)
    group = np.full(COMPOUND_N, -1)
    group[: COMPOUND_GROUPS * COMPOUND_ROWS] = np.repeat(np.arange(COMPOUND_GROUPS), COMPOUND_ROWS)
    y = 1 + 2 * x + rng.normal(size=COMPOUND_N)
    y[group == 3] += 0.35
    with pm.Model() as model:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 5)
        g = pm.Normal("g", 0, 1)
        s = pm.HalfNormal("s", 2)
        k = pm.Categorical("k", p=np.ones(COMPOUND_GROUPS) / COMPOUND_GROUPS)
        in_k = pm.math.eq(pm.Data("group", group), k)
        pm.Normal("y", a + b * pm.Data("x", x) + g * in_k, s, observed=y)
    return model


def ar_model(n: int, seed: int = 0) -> pm.Model:
    rng = np.random.default_rng(seed)
    y = np.zeros(n)
    for t in range(1, n):
        y[t] = 0.6 * y[t - 1] + rng.normal()
    with pm.Model() as model:
        rho = pm.Normal("rho", 0, 1, shape=1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.AR("y", rho=rho, sigma=sigma, init_dist=pm.Normal.dist(0, 1), observed=y)
    return model


def garch_model(n: int = 200, seed: int = 1) -> pm.Model:
    """GARCH(1,1) written with its recursion: s²_t = ω + α r²_{t−1} + β s²_{t−1}."""
    rng = np.random.default_rng(seed)
    r = np.zeros(n)
    s2 = 0.1
    for t in range(n):
        r[t] = np.sqrt(s2) * rng.normal()
        s2 = 0.05 + 0.1 * r[t] ** 2 + 0.8 * s2
    start = pt.as_tensor(np.var(r))
    with pm.Model() as model:
        omega = pm.HalfNormal("omega", 0.5)
        alpha = pm.Uniform("alpha", 0, 0.5)
        beta = pm.Uniform("beta", 0, 0.95)

        def step(r_prev, s2_prev, omega, alpha, beta):
            return omega + alpha * r_prev**2 + beta * s2_prev

        path = pytensor.scan(
            step,
            sequences=[pt.as_tensor(r)[:-1]],
            outputs_info=[start],
            non_sequences=[omega, alpha, beta],
            return_updates=False,
        )
        pm.Normal("r", 0, pt.sqrt(pt.concatenate([start[None], path])), observed=r)
    return model


def gp_poisson_model() -> pm.Model:
    """Counts at 11 points with a latent GP log-rate f over all of them."""
    rng = np.random.default_rng(2)
    x = np.linspace(0, 1, 11)[:, None]
    counts = rng.poisson(np.exp(np.sin(6 * x[:, 0])))
    with pm.Model() as model:
        ell = pm.Gamma("ell", 2, 4)
        eta = pm.HalfNormal("eta", 1)
        gp = pm.gp.Latent(cov_func=eta**2 * pm.gp.cov.ExpQuad(1, ell))
        f = gp.prior("f", X=x)
        pm.Poisson("counts", mu=pm.math.exp(f), observed=counts)
    return model


@dataclass(frozen=True)
class Entry:
    """How a reference is made: ``build`` the model; ``compound`` (NUTS for the continuous
    variables beside PyMC's Gibbs step for the discrete one: two seeds of that, since neither
    numpyro nor nutpie samples a discrete variable) or numpyro checked against nutpie;
    ``thin`` applied before storing; ``target_accept`` for both runs."""

    build: Callable[[], pm.Model]
    names: list[str]
    thin: int = 4
    target_accept: float = 0.8
    compound: bool = False
    draws: int = 4000
    tune: int = 1000


SUITE: dict[str, Entry] = {
    # test_correctness_tuned.py::test_iasg_logistic_regression_against_nuts
    "logistic_50k": Entry(
        logistic_model(50_000, 5, seed=5, scales=[1.0, 0.5, 2.0, 1.0, 1.0]), ["beta"], draws=2500
    ),
    # test_variance_reduced.py::test_logistic_regression_against_nuts
    "logistic_20k": Entry(
        logistic_model(20_000, 4, seed=8, scales=[1.0, 0.5, 2.0, 1.0]), ["beta"], draws=2500
    ),
    # test_correctness.py::test_multi_output_model_against_nuts
    "multi_output": Entry(multi_output_model, ["beta", "a", "s"]),
    # test_compound.py: g's ESS is ~1% of the draws (k switches only when g is near 0)
    "compound": Entry(
        compound_model, [*COMPOUND_CONTINUOUS, "k"], thin=8, compound=True, draws=40000, tune=1000
    ),
    # test_whole_likelihood.py
    # (small: stored unthinned; the GP's funnel between eta and f diverged at 0.9)
    "ar": Entry(lambda: ar_model(300), ["rho", "sigma"], thin=1, target_accept=0.9),
    "garch": Entry(garch_model, ["omega", "alpha", "beta"], thin=1, target_accept=0.9),
    "gp_poisson": Entry(gp_poisson_model, ["ell", "eta", "f"], thin=2, target_accept=0.98),
}


def path(name: str) -> Path:
    return DATA / f"{name}.npz"


def reference(name: str) -> xr.Dataset:
    """The committed NUTS draws of ``SUITE[name]`` as a posterior-shaped ``xarray.Dataset``."""
    if name not in SUITE:
        raise KeyError(f"no suite reference {name!r}; known: {sorted(SUITE)}")
    with np.load(path(name)) as f:
        arrays = {k: np.asarray(f[k], dtype=np.float64) for k in f.files}
    return xr.Dataset(
        {
            k: (("chain", "draw", *[f"{k}_dim_{i}" for i in range(v.ndim - 2)]), v)
            for k, v in arrays.items()
        }
    )
