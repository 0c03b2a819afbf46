"""Regenerate the posteriordb references and check the PyMC models against them.

    .venv/bin/python tests/posteriors/make_references.py              # references + checks
    .venv/bin/python tests/posteriors/make_references.py --skip-references   # checks only
    .venv/bin/python tests/posteriors/make_references.py --convert /work/shared/posteriordb

1. ``--convert DIR``: turn posteriordb's ``reference_draws.npz`` (Stan names ``beta[1]``,
   (10, 1000) each) of the nine posteriors that have them into ``data/<name>/reference.npz``
   (PyMC names, ``(chains, draws, *shape)``). For eight_schools the reference also gets
   ``theta_trans = (theta - mu) / tau``, an exact function of the Stan draws.
2. Unless ``--skip-references``: radon and wells, which have no gold standard, get a long
   NUTS reference (numpyro, 4 chains × 5000 draws after 2000 tuning steps) checked against
   an independent run (nutpie, its own NUTS and adaptation, numba-compiled logp, another
   seed; 4 × 2500 after 1000). Both runs must have no divergences, R-hat ≤ 1.01 and bulk
   ESS ≥ 1000 for every parameter, else the script stops without writing. The first run is
   stored (radon: thinned by 8 and as float32, to stay under 4 MB; wells: in full). The two
   runs are compared per scalar as z-scores of the differences in mean and in sd (their rms
   should be ≈ 1; the script stops above 1.5).
3. Unless ``--skip-checks``: each model's PyMC NUTS (numpyro, 4 × 2000 after 1000) and its
   Laplace approximation (common.laplace) are scored against the reference
   (common.score), and a table is printed. For radon and wells the NUTS column is the
   independent nutpie run of step 2 (when run), scored against the stored reference.

Run it on its own (importing pymc.sampling.jax rewrites XLA_FLAGS).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ → `posteriors` package

import arviz as az  # noqa: E402
import pymc as pm  # noqa: E402

from posteriors.common import DATA, laplace, save_reference, score  # noqa: E402
from posteriors.posteriordb import NAMES, NO_GOLD_STANDARD, build, reference  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

RADON, WELLS = NO_GOLD_STANDARD
# name: (draws, tune, thin, dtype) of the stored run
LONG = {RADON: (5000, 2000, 8, np.float32), WELLS: (5000, 2000, 1, np.float64)}
CHECK_RUN = dict(draws=2500, tune=1000)


def convert(src: Path) -> None:
    pattern = re.compile(r"^(\w+)\[([\d,]+)\]$")
    for name in NAMES:
        path = src / name / "reference_draws.npz"
        if not path.exists():
            continue
        groups: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
        with np.load(path) as f:
            for key in f.files:
                m = pattern.match(key)
                base, idx = (m[1], tuple(int(i) - 1 for i in m[2].split(","))) if m else (key, ())
                groups.setdefault(base, {})[idx] = np.asarray(f[key], dtype=np.float64)
        out = {}
        for base, parts in groups.items():
            if parts.keys() == {()}:
                out[base] = parts[()]
                continue
            shape = tuple(max(i[k] for i in parts) + 1 for k in range(len(next(iter(parts)))))
            assert len(parts) == int(np.prod(shape)), (name, base)
            first = next(iter(parts.values()))
            arr = np.empty(first.shape + shape)
            for idx, v in parts.items():
                arr[(slice(None), slice(None), *idx)] = v
            out[base] = arr
        if name == "eight_schools-eight_schools_noncentered":
            out["theta_trans"] = (out["theta"] - out["mu"][..., None]) / out["tau"][..., None]
        save_reference(DATA / name / "reference.npz", out)
        print(f"converted {name}: " + ", ".join(f"{k} {v.shape}" for k, v in out.items()))


def diagnostics(idata) -> dict:
    post = idata.posterior
    rhat = az.rhat(post)
    ess = az.ess(post, method="bulk")
    return {
        "divergences": int(idata.sample_stats["diverging"].sum()),
        "max_rhat": max(float(rhat[v].max()) for v in rhat.data_vars),
        "min_ess_bulk": min(float(ess[v].min()) for v in ess.data_vars),
    }


def check_diagnostics(label: str, d: dict) -> None:
    print(f"  {label}: {d}", flush=True)
    if d["divergences"] or d["max_rhat"] > 1.01 or d["min_ess_bulk"] < 1000:
        raise SystemExit(f"{label}: diagnostics fail ({d}); reference not written")


def free_draws(idata, name: str) -> dict[str, np.ndarray]:
    model = build(name)
    return {v.name: np.asarray(idata.posterior[v.name].values) for v in model.free_RVs}


def agreement(draws, ref) -> dict:
    """z-scores of two NUTS runs' means and sds, per scalar: score()'s standard error of the
    sd ratio uses the bulk ESS, which for NUTS's antithetic chains (ESS > draws for means)
    overstates how well the sd is known; here the sd's error uses the ESS of the squared
    centred draws and the kurtosis."""
    from posteriors.common import flat

    ours, theirs = flat(draws), flat(ref)
    z_m, z_s = [], []
    for k, r in theirs.items():
        a = ours[k]
        sa, sr = a.std(), r.std()
        ratio = sa / sr
        se_m = np.sqrt(ratio**2 / float(az.ess(a)) + 1 / float(az.ess(r)))
        var_term = [
            (np.mean((x - x.mean()) ** 4) / x.std() ** 4 - 1) / float(az.ess((x - x.mean()) ** 2))
            for x in (a, r)
        ]
        z_m.append((a.mean() - r.mean()) / sr / se_m)
        z_s.append((ratio - 1) / (ratio / 2 * np.sqrt(sum(var_term))))
    z_m, z_s = np.array(z_m), np.array(z_s)
    return {
        "n": len(z_m),
        "max|z_mean|": float(abs(z_m).max()),
        "rms_z_mean": float(np.sqrt((z_m**2).mean())),
        "max|z_sd|": float(abs(z_s).max()),
        "rms_z_sd": float(np.sqrt((z_s**2).mean())),
    }


def long_reference(name: str, seed: int = 20240611) -> dict:
    draws, tune, thin, dtype = LONG[name]
    print(f"{name}: numpyro NUTS, 4 chains × {draws} draws after {tune}", flush=True)
    t = time.perf_counter()
    with build(name):
        a = pm.sample(
            draws=draws,
            tune=tune,
            chains=4,
            nuts_sampler="numpyro",
            random_seed=seed,
            progressbar=False,
        )
    t_a = time.perf_counter() - t
    d_a = diagnostics(a)
    check_diagnostics(f"numpyro ({t_a:.0f} s)", d_a)
    print(
        f"{name}: nutpie NUTS, 4 chains × {CHECK_RUN['draws']} after {CHECK_RUN['tune']}",
        flush=True,
    )
    t = time.perf_counter()
    with build(name):
        b = pm.sample(
            **CHECK_RUN, chains=4, nuts_sampler="nutpie", random_seed=seed + 1, progressbar=False
        )
    t_b = time.perf_counter() - t
    d_b = diagnostics(b)
    check_diagnostics(f"nutpie ({t_b:.0f} s)", d_b)
    ref_full = free_draws(a, name)
    s = score(free_draws(b, name), ref_full)
    print(
        f"  nutpie vs numpyro: max|dmean| {s['max_abs_dmean']:.3f} sd (mc {s['mc_dmean']:.3f}),"
        f" sd ratio {s['sd_ratio_min']:.3f}-{s['sd_ratio_max']:.3f}"
        f" (mc {s['mc_sd_ratio']:.3f})",
        flush=True,
    )
    z = agreement(free_draws(b, name), ref_full)
    print(
        f"  z-scores over {z['n']} scalars: mean max {z['max|z_mean|']:.2f} rms "
        f"{z['rms_z_mean']:.2f}; sd max {z['max|z_sd|']:.2f} rms {z['rms_z_sd']:.2f}",
        flush=True,
    )
    if z["rms_z_mean"] > 1.5 or z["rms_z_sd"] > 1.5:
        raise SystemExit(f"{name}: the two NUTS runs disagree ({z}); reference not written")
    stored = {k: v[:, ::thin].astype(dtype) for k, v in ref_full.items()}
    path = DATA / name / "reference.npz"
    save_reference(path, stored)
    print(
        f"  wrote {path} ({path.stat().st_size / 1e6:.2f} MB, "
        f"{next(iter(stored.values())).shape[:2]} chains × draws, {np.dtype(dtype).name})",
        flush=True,
    )
    return {"nuts": b, "times": (t_a, t_b), "diag": (d_a, d_b), "agreement": s}


def fmt(s: dict | None) -> str:
    if s is None:
        return "—"
    return (
        f"{s['max_abs_dmean']:.3f} (±{s['mc_dmean']:.3f})  "
        f"{s['sd_ratio_min']:.3f}–{s['sd_ratio_max']:.3f} (±{s['mc_sd_ratio']:.3f})"
    )


def checks(names, nuts_runs: dict) -> None:
    rows = []
    for name in names:
        ref = reference(name)
        t = time.perf_counter()
        if name in nuts_runs:
            idata, note = nuts_runs[name], "nutpie"
        elif name in NO_GOLD_STANDARD:
            idata, note = None, ""
        else:
            with build(name):
                idata = pm.sample(
                    draws=2000,
                    tune=1000,
                    chains=4,
                    nuts_sampler="numpyro",
                    random_seed=1,
                    progressbar=False,
                )
            note = "numpyro"
        t_nuts = time.perf_counter() - t
        s_nuts = None
        if idata is not None:
            s_nuts = score(idata, ref)
            div = int(idata.sample_stats["diverging"].sum())
            note += f", {div} div" if div else ""
        t = time.perf_counter()
        try:
            lap = laplace(build(name))
            s_lap = score(lap["draws"], ref)
            lap_note = "" if lap["converged"] else "not converged"
        except Exception as e:  # noqa: BLE001 — report, don't stop the table
            s_lap, lap_note = None, f"{type(e).__name__}: {e}"[:100]
        t_lap = time.perf_counter() - t
        rows.append((name, s_nuts, note, t_nuts, s_lap, lap_note, t_lap))
        print(
            f"{name}\n  NUTS    {fmt(s_nuts)}  [{note}, {t_nuts:.0f} s]"
            f"\n  Laplace {fmt(s_lap)}  [{lap_note or 'ok'}, {t_lap:.0f} s]",
            flush=True,
        )
    print("\nmax|Δmean| in reference sds (largest MC se) and sd-ratio range (largest MC se)")
    print(f"{'posterior':46s} {'NUTS vs reference':38s} {'Laplace vs reference':38s}")
    for name, s_nuts, _, _, s_lap, lap_note, _ in rows:
        print(f"{name:46s} {fmt(s_nuts):38s} {fmt(s_lap) if s_lap else lap_note}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--convert", type=Path, help="posteriordb folder to convert the 9 from")
    p.add_argument("--skip-references", action="store_true")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--only", nargs="+", choices=NAMES, help="restrict to these posteriors")
    args = p.parse_args()
    names = args.only or NAMES
    t0 = time.perf_counter()
    if args.convert:
        convert(args.convert)
    nuts_runs = {}
    if not args.skip_references:
        for name in NO_GOLD_STANDARD:
            if name in names:
                nuts_runs[name] = long_reference(name)["nuts"]
    if not args.skip_checks:
        checks(names, nuts_runs)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
