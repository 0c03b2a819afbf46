"""Make the committed NUTS references of the test suite's own models (``suite.SUITE``).

    .venv/bin/python tests/posteriors/make_suite_references.py              # every reference
    .venv/bin/python tests/posteriors/make_suite_references.py ar garch     # some of them

For each model a long run and an independent check run:

- continuous models: PyMC's numpyro NUTS, 4 chains × ``draws`` after ``tune`` (``Entry``'s
  defaults: 4 000 after 1 000), checked against nutpie (its own NUTS, adaptation and numba-compiled logp, another
  seed; 4 × 2 500 after 1 000);
- the compound model (a categorical ``k`` beside continuous variables): PyMC's NUTS for the
  continuous ones and its ``CategoricalGibbsMetropolis`` for ``k`` — neither numpyro nor
  nutpie samples a discrete variable — two seeds of 4 × ``draws`` after ``tune``.

Both runs must have no divergences, R-hat ≤ 1.01 and bulk ESS ≥ 1 000 for every stored
scalar (the check run: ≥ 400), and the two must agree: per scalar the z-scores of the
differences of means and of sds (Monte Carlo errors from both runs' ESS) have an rms ≤ 1.5
and none beyond 4. Otherwise that reference is not written (the others are; the script then
exits non-zero). The long run is stored,
thinned by ``thin``, as float32 in ``data/suite/<name>.npz``; the thinned draws must pass
the same R-hat and ESS bounds.

Run it on its own: importing pymc.sampling.jax rewrites XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ → `posteriors` package

import arviz as az  # noqa: E402
import pymc as pm  # noqa: E402

from posteriors.common import diagnostics, ok, save_reference  # noqa: E402
from posteriors.suite import SUITE, Entry, path  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=RuntimeWarning)

CHECK = dict(draws=2500, tune=1000)
SEEDS = (20261127, 20261128)


def _draws(idata, names) -> dict[str, np.ndarray]:
    """The stored variables; a categorical ``k`` as the indicator ``k_is_3`` (the compound
    model's true group), which is what its test compares."""
    post = idata.posterior if hasattr(idata, "posterior") else idata["posterior"]
    out = {k: np.asarray(post[k].values, dtype=np.float64) for k in names if k != "k"}
    if "k" in names:
        out["k_is_3"] = (np.asarray(post["k"].values) == 3).astype(np.float64)
    return out


def _scalars(draws: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in draws.items():
        flat = v.reshape(v.shape[0], v.shape[1], -1)
        for j in range(flat.shape[2]):
            out[f"{k}[{j}]" if flat.shape[2] > 1 or v.ndim > 2 else k] = flat[:, :, j]
    return out


def _run(entry: Entry, sampler: str, seed: int, draws: int, tune: int):
    model = entry.build()
    t = time.perf_counter()
    if entry.compound:
        with model:
            cont = [model[n] for n in entry.names if n != "k"]
            step = [
                pm.NUTS(cont, target_accept=entry.target_accept),
                pm.CategoricalGibbsMetropolis([model["k"]]),
            ]
            idata = pm.sample(
                step=step,
                draws=draws,
                tune=tune,
                chains=4,
                cores=2,
                random_seed=seed,
                progressbar=False,
                compute_convergence_checks=False,
            )
    elif sampler == "numpyro":
        with model:
            idata = pm.sample(
                draws=draws,
                tune=tune,
                chains=4,
                nuts_sampler="numpyro",
                target_accept=entry.target_accept,
                random_seed=seed,
                progressbar=False,
                compute_convergence_checks=False,
            )
    else:
        import nutpie

        compiled = nutpie.compile_pymc_model(model)
        idata = nutpie.sample(
            compiled,
            draws=draws,
            tune=tune,
            chains=4,
            seed=seed,
            target_accept=entry.target_accept,
            progress_bar=False,
        )
    return idata, time.perf_counter() - t


def _agreement(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float]:
    """rms and max |z| over the scalars of the mean and sd differences of two runs."""
    z = []
    for k, x in _scalars(a).items():
        y = _scalars(b)[k]
        if np.ptp(x) == 0:
            continue
        ex, ey = float(az.ess(x, method="bulk")), float(az.ess(y, method="bulk"))
        sd = np.sqrt(0.5 * (x.var() + y.var()))
        z.append((x.mean() - y.mean()) / (sd * np.sqrt(1 / ex + 1 / ey)))
        # relative sd difference over its Monte Carlo error, from the ESS of the squares
        ex2 = float(az.ess((x - x.mean()) ** 2, method="bulk"))
        ey2 = float(az.ess((y - y.mean()) ** 2, method="bulk"))
        kx = np.mean((x - x.mean()) ** 4) / x.var() ** 2
        ky = np.mean((y - y.mean()) ** 4) / y.var() ** 2
        se = np.sqrt((kx - 1) / (4 * ex2) + (ky - 1) / (4 * ey2))
        z.append(np.log(x.std() / y.std()) / se)
    z = np.asarray(z)
    return float(np.sqrt(np.mean(z**2))), float(np.max(np.abs(z)))


def make(name: str) -> None:
    entry = SUITE[name]
    long, t_long = _run(entry, "numpyro", SEEDS[0], entry.draws, entry.tune)
    d_long = diagnostics(_draws(long, entry.names), long)
    print(f"{name}: long run {d_long} in {t_long:.0f} s", flush=True)
    if entry.compound:
        check, t_check = _run(entry, "compound", SEEDS[1], entry.draws, entry.tune)
    else:
        check, t_check = _run(entry, "nutpie", SEEDS[1], **CHECK)
    d_check = diagnostics(_draws(check, entry.names), check)
    print(f"{name}: check run {d_check} in {t_check:.0f} s", flush=True)
    if not (ok(d_long, 1000) and ok(d_check, 400)):
        raise SystemExit(f"{name}: a run failed its diagnostics; nothing written")
    rms, worst = _agreement(_draws(long, entry.names), _draws(check, entry.names))
    print(f"{name}: the two runs' mean and sd z-scores: rms {rms:.2f}, max {worst:.2f}")
    if rms > 1.5 or worst > 4:
        raise SystemExit(f"{name}: the two runs disagree; nothing written")
    stored = {
        k: v[:, :: entry.thin].astype(np.float32) for k, v in _draws(long, entry.names).items()
    }
    d_stored = diagnostics(stored)
    if not ok(d_stored, 1000):
        raise SystemExit(f"{name}: the thinned draws fail {d_stored}; nothing written")
    save_reference(path(name), stored)
    print(
        f"{name}: wrote {path(name)} ({path(name).stat().st_size // 1024} kB), thinned {d_stored}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"some of {', '.join(SUITE)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.names) - set(SUITE)
    if unknown:
        parser.error(f"unknown reference(s) {sorted(unknown)}; known: {', '.join(SUITE)}")
    failed = []
    for name in args.names or list(SUITE):
        try:
            make(name)
        except SystemExit as stop:  # this reference is not written; the others still are
            print(stop, flush=True)
            failed.append(name)
    if failed:
        raise SystemExit(f"not written: {', '.join(failed)}")


if __name__ == "__main__":
    main()
