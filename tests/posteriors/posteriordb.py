"""Eleven posteriordb posteriors written in PyMC, and their reference draws.

Each model has the priors and the parameterisation of its Stan program (stan-dev/posteriordb,
BSD 3-Clause, copyright the Stan Developers): a parameter without a prior statement gets a
flat prior (``pm.Flat``, or ``pm.HalfFlat`` under ``<lower=0>``), a ``<lower=0>`` parameter
with a normal or Cauchy prior the half distribution of the same scale, ``ordered[K]`` PyMC's
ordered transform; every ``transformed data`` step is reproduced (indices shifted from Stan's
base 1 to 0). The PyMC variables carry the names of the Stan parameters.

Row-aligned data have the observation axis first — design columns and index arrays as
``pm.Data``, responses as ``observed=`` arrays of length N — so the stochastic-gradient
samplers can minibatch along it.

The data (``data/<name>/data.json``) are the database's files as they are. The references
(``data/<name>/reference.npz``, read with :func:`reference`) hold ``{PyMC name: (chains,
draws, *shape)}`` on the constrained scale: for nine posteriors the database's gold-standard
Stan draws (10 chains × 1000), for radon and wells a long NUTS run checked against an
independent one (``make_references.py`` regenerates them and runs the checks).
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pymc as pm
import pytensor.tensor as pt

from .common import DATA, load_reference

__all__ = ["NAMES", "NO_GOLD_STANDARD", "build", "load_data", "reference"]

NAMES = [
    "sblrc-blr",
    "kidiq_with_mom_work-kidscore_interaction_c2",
    "kidiq_with_mom_work-kidscore_mom_work",
    "mesquite-logmesquite_logvas",
    "mesquite-mesquite",
    "kilpisjarvi_mod-kilpisjarvi",
    "low_dim_gauss_mix-low_dim_gauss_mix",
    "nes1972-nes",
    "eight_schools-eight_schools_noncentered",
    "radon_all-radon_variable_intercept_centered",
    "wells_data-wells_interaction_model",
]

# The two whose references are our own NUTS runs (make_references.py), not posteriordb's.
NO_GOLD_STANDARD = [
    "radon_all-radon_variable_intercept_centered",
    "wells_data-wells_interaction_model",
]


@cache
def _load(name: str) -> dict:
    with open(DATA / name / "data.json") as f:
        return json.load(f)


def load_data(name: str) -> dict[str, np.ndarray]:
    """The Stan data of ``name`` as NumPy arrays (a fresh copy)."""
    if name not in NAMES:
        raise KeyError(f"unknown posterior {name!r}; one of {NAMES}")
    return {k: np.asarray(v) for k, v in _load(name).items()}


def reference(name: str) -> dict[str, np.ndarray]:
    """``{PyMC variable name: (chains, draws, *shape)}`` reference draws (float64)."""
    if name not in NAMES:
        raise KeyError(f"unknown posterior {name!r}; one of {NAMES}")
    return load_reference(DATA / name / "reference.npz")


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


# -- the models --------------------------------------------------------------------------


def _sblrc_blr(d):
    with pm.Model() as model:
        X = pm.Data("X", _f(d["X"]))
        beta = pm.Normal("beta", 0.0, 10.0, shape=int(d["D"]))
        sigma = pm.HalfNormal("sigma", 10.0)
        pm.Normal("y", X @ beta, sigma, observed=_f(d["y"]))
    return model


def _linear(columns: dict[str, np.ndarray], y: np.ndarray, name_y: str) -> pm.Model:
    """``y ~ normal(beta[1] + sum_k beta[k+1] * column_k, sigma)``, flat priors on beta and
    sigma > 0: the kidiq, mesquite and nes programs."""
    X = np.column_stack([_f(c) for c in columns.values()])
    with pm.Model() as model:
        Xd = pm.Data("X", X)  # (N, K): the Stan program's predictors, in its order
        beta = pm.Flat("beta", shape=X.shape[1] + 1)
        sigma = pm.HalfFlat("sigma")
        pm.Normal(name_y, beta[0] + Xd @ beta[1:], sigma, observed=_f(y))
    return model


def _kidscore_interaction_c2(d):
    c2_mom_hs = _f(d["mom_hs"]) - 0.5
    c2_mom_iq = _f(d["mom_iq"]) - 100.0
    inter = c2_mom_hs * c2_mom_iq
    cols = {"c2_mom_hs": c2_mom_hs, "c2_mom_iq": c2_mom_iq, "inter": inter}
    return _linear(cols, d["kid_score"], "kid_score")


def _kidscore_mom_work(d):
    w = d["mom_work"]
    cols = {"work2": w == 2, "work3": w == 3, "work4": w == 4}
    return _linear(cols, d["kid_score"], "kid_score")


def _logmesquite_logvas(d):
    diam1, diam2 = _f(d["diam1"]), _f(d["diam2"])
    cols = {
        "log_canopy_volume": np.log(diam1 * diam2 * _f(d["canopy_height"])),
        "log_canopy_area": np.log(diam1 * diam2),
        "log_canopy_shape": np.log(diam1 / diam2),
        "log_total_height": np.log(_f(d["total_height"])),
        "log_density": np.log(_f(d["density"])),
        "group": _f(d["group"]),
    }
    return _linear(cols, np.log(_f(d["weight"])), "log_weight")


def _mesquite(d):
    keys = ["diam1", "diam2", "canopy_height", "total_height", "density", "group"]
    return _linear({k: d[k] for k in keys}, d["weight"], "weight")


def _nes(d):
    age = d["age_discrete"]
    cols = {
        "real_ideo": d["real_ideo"],
        "race_adj": d["race_adj"],
        "age30_44": age == 2,
        "age45_64": age == 3,
        "age65up": age == 4,
        "educ1": d["educ1"],
        "gender": d["gender"],
        "income": d["income"],
    }
    return _linear(cols, d["partyid7"], "partyid7")


def _kilpisjarvi(d):
    with pm.Model() as model:
        x = pm.Data("x", _f(d["x"]))
        alpha = pm.Normal("alpha", float(d["pmualpha"]), float(d["psalpha"]))
        beta = pm.Normal("beta", float(d["pmubeta"]), float(d["psbeta"]))
        sigma = pm.HalfFlat("sigma")
        pm.Normal("y", alpha + beta * x, sigma, observed=_f(d["y"]))
    return model


def _low_dim_gauss_mix(d):
    # log_mix(theta, lp1, lp2) = log(theta * exp(lp1) + (1 - theta) * exp(lp2)): theta weighs
    # the component of mu[1] (the smaller mean, by the ordering).
    with pm.Model() as model:
        mu = pm.Normal(
            "mu",
            0.0,
            2.0,
            shape=2,
            transform=pm.distributions.transforms.ordered,
            initval=np.array([-1.0, 1.0]),
        )
        sigma = pm.HalfNormal("sigma", 2.0, shape=2)
        theta = pm.Beta("theta", 5.0, 5.0)
        pm.NormalMixture(
            "y", w=pt.stack([theta, 1.0 - theta]), mu=mu, sigma=sigma, observed=_f(d["y"])
        )
    return model


def _eight_schools_noncentered(d):
    J = int(d["J"])
    with pm.Model() as model:
        sigma = pm.Data("sigma", _f(d["sigma"]))  # data (row-aligned), not a parameter
        theta_trans = pm.Normal("theta_trans", 0.0, 1.0, shape=J)
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfCauchy("tau", 5.0)
        theta = pm.Deterministic("theta", theta_trans * tau + mu)
        pm.Normal("y", theta, sigma, observed=_f(d["y"]))
    return model


def _radon_centered(d):
    with pm.Model() as model:
        county_idx = pm.Data("county_idx", np.asarray(d["county_idx"], dtype=np.int64) - 1)
        floor_measure = pm.Data("floor_measure", _f(d["floor_measure"]))
        sigma_y = pm.HalfNormal("sigma_y", 1.0)
        sigma_alpha = pm.HalfNormal("sigma_alpha", 1.0)
        mu_alpha = pm.Normal("mu_alpha", 0.0, 10.0)
        beta = pm.Normal("beta", 0.0, 10.0)
        alpha = pm.Normal("alpha", mu_alpha, sigma_alpha, shape=int(d["J"]))
        mu = alpha[county_idx] + floor_measure * beta
        pm.Normal("log_radon", mu, sigma_y, observed=_f(d["log_radon"]))
    return model


def _wells_interaction(d):
    dist100 = _f(d["dist"]) / 100.0
    arsenic = _f(d["arsenic"])
    x = np.column_stack([dist100, arsenic, dist100 * arsenic])
    with pm.Model() as model:
        xd = pm.Data("x", x)
        alpha = pm.Flat("alpha")
        beta = pm.Flat("beta", shape=3)
        pm.Bernoulli("switched", logit_p=alpha + xd @ beta, observed=np.asarray(d["switched"]))
    return model


_BUILDERS = {
    "sblrc-blr": _sblrc_blr,
    "kidiq_with_mom_work-kidscore_interaction_c2": _kidscore_interaction_c2,
    "kidiq_with_mom_work-kidscore_mom_work": _kidscore_mom_work,
    "mesquite-logmesquite_logvas": _logmesquite_logvas,
    "mesquite-mesquite": _mesquite,
    "kilpisjarvi_mod-kilpisjarvi": _kilpisjarvi,
    "low_dim_gauss_mix-low_dim_gauss_mix": _low_dim_gauss_mix,
    "nes1972-nes": _nes,
    "eight_schools-eight_schools_noncentered": _eight_schools_noncentered,
    "radon_all-radon_variable_intercept_centered": _radon_centered,
    "wells_data-wells_interaction_model": _wells_interaction,
}
assert list(_BUILDERS) == NAMES


def build(name: str) -> pm.Model:
    """The PyMC model of posterior ``name`` (one of :data:`NAMES`), a new one each call."""
    return _BUILDERS[name](load_data(name))
