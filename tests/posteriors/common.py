"""Reference posteriors for the correctness tests and benchmarks: loading, the Laplace
approximation, and scoring draws against a reference.

A reference is a mapping ``{variable name: draws}`` with draws shaped
``(chains, draws, *variable shape)`` on the constrained scale (what ``idata.posterior``
holds), from posteriordb's gold-standard Stan runs, a long NUTS run checked against a second
one, or a closed-form posterior — never from this package's own samplers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pymc as pm
import pytensor
from scipy import optimize

DATA = Path(__file__).parent / "data"

__all__ = [
    "DATA",
    "assert_agree",
    "diagnostics",
    "flat",
    "laplace",
    "load_reference",
    "ok",
    "save_reference",
    "score",
]


def assert_agree(ours: Any, reference: Any, names: list[str]) -> None:
    """Every scalar of ``names`` in ``ours`` against a NUTS ``reference`` (results of
    ``pm.sample``, or their posteriors as ``xarray.Dataset``): its mean within 0.1 reference sd and its sd within 10%, widened by three
    Monte Carlo standard errors from both runs' bulk ESS (``sqrt(1/ESS_ours + 1/ESS_ref)``
    sds for a mean, ``sqrt(1/(2 ESS_ours) + 1/(2 ESS_ref))`` for an sd ratio)."""
    import arviz as az
    import xarray as xr
    from stack import dataset

    ours, reference = (r if isinstance(r, xr.Dataset) else dataset(r) for r in (ours, reference))
    ess_ours = az.ess(ours[names], method="bulk")
    ess_ref = az.ess(reference[names], method="bulk")
    for name in names:
        a = ours[name].values.reshape(-1, *ours[name].shape[2:])
        b = reference[name].values.reshape(-1, *reference[name].shape[2:])
        e1, e2 = np.asarray(ess_ours[name].values), np.asarray(ess_ref[name].values)
        mean_tol = 0.1 + 3 * np.sqrt(1 / e1 + 1 / e2)
        sd_tol = 0.1 + 3 * np.sqrt(1 / (2 * e1) + 1 / (2 * e2))
        shift = np.abs(a.mean(0) - b.mean(0)) / b.std(0)
        ratio = a.std(0) / b.std(0)
        assert np.all(shift <= mean_tol), (name, "mean shift / sd", shift, mean_tol)
        assert np.all(np.abs(ratio - 1) <= sd_tol), (name, "sd ratio", ratio, sd_tol)


def load_reference(path: str | Path) -> dict[str, np.ndarray]:
    """``{name: (chains, draws, *shape)}`` from an ``.npz`` written by :func:`save_reference`."""
    with np.load(path) as f:
        return {k: np.asarray(f[k], dtype=np.float64) for k in f.files}


def save_reference(path: str | Path, draws: Mapping[str, np.ndarray]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **{k: np.asarray(v) for k, v in draws.items()})


def flat(draws: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{"beta[0]": (chains, draws)}``: one entry per scalar of every variable."""
    out: dict[str, np.ndarray] = {}
    for name, value in draws.items():
        value = np.asarray(value, dtype=np.float64)
        shape = value.shape[2:]
        if not shape:
            out[name] = value
            continue
        for idx in np.ndindex(*shape):
            out[f"{name}[{','.join(map(str, idx))}]"] = value[(slice(None), slice(None), *idx)]
    return out


def _posterior_draws(draws: Any) -> dict[str, np.ndarray]:
    if hasattr(draws, "posterior"):
        draws = draws.posterior
    if hasattr(draws, "data_vars"):
        return {k: np.asarray(draws[k].values) for k in draws.data_vars}
    return {k: np.asarray(v) for k, v in draws.items()}


def score(draws: Any, reference: Mapping[str, np.ndarray], names=None) -> dict[str, Any]:
    """Draws (an InferenceData, a posterior Dataset or ``{name: (chains, draws, ...)}``)
    against a reference: per scalar parameter the mean error in reference sds, the sd ratio,
    and their Monte Carlo standard errors (from ArviZ's ESS of both sets of draws).

    Returns ``{"table": {param: {...}}, "max_abs_dmean": ..., "sd_ratio_min": ...,
    "sd_ratio_max": ..., "mc_dmean": ..., "mc_sd_ratio": ...}`` where the ``mc_*`` entries
    are the largest Monte Carlo standard errors of the two statistics over the parameters.
    """
    import arviz as az

    ours = flat(_posterior_draws(draws))
    ref = flat(dict(reference))
    keys = [k for k in ref if k in ours] if names is None else list(names)
    table = {}
    for k in keys:
        a, r = ours[k], ref[k]
        sd_r = r.std()
        ess_a = float(az.ess(a, method="bulk")) if a.shape[0] * a.shape[1] > 4 else 1.0
        ess_r = float(az.ess(r, method="bulk"))
        dmean = (a.mean() - r.mean()) / sd_r
        ratio = a.std() / sd_r
        # Standard errors: of the mean difference (in reference sds), from the bulk ESS; of
        # the sd ratio from the ESS of the squared deviations (not the bulk ESS, which NUTS
        # can push above the number of draws) and the kurtosis κ:
        # Var(s²) ≈ (κ − 1) σ⁴ / ESS, so se(s)/s ≈ √((κ − 1) / (4 ESS)).
        se_dmean = np.sqrt(ratio**2 / max(ess_a, 1.0) + 1.0 / max(ess_r, 1.0))
        se_ratio = ratio * np.sqrt(_var_of_log_sd(a) + _var_of_log_sd(r))
        table[k] = {
            "dmean": float(dmean),
            "sd_ratio": float(ratio),
            "se_dmean": float(se_dmean),
            "se_sd_ratio": float(se_ratio),
            "ess": ess_a,
            "ess_reference": ess_r,
        }
    return {
        "table": table,
        "max_abs_dmean": max(abs(t["dmean"]) for t in table.values()),
        "sd_ratio_min": min(t["sd_ratio"] for t in table.values()),
        "sd_ratio_max": max(t["sd_ratio"] for t in table.values()),
        "mc_dmean": max(t["se_dmean"] for t in table.values()),
        "mc_sd_ratio": max(t["se_sd_ratio"] for t in table.values()),
        "min_ess": min(t["ess"] for t in table.values()),
    }


def _var_of_log_sd(x: np.ndarray) -> float:
    """Variance of log(sd) estimated from ``(chains, draws)`` draws."""
    import arviz as az

    x = np.asarray(x, dtype=np.float64)
    dev = (x - x.mean()) ** 2
    if x.size < 8 or dev.mean() == 0:
        return 1.0
    ess = float(az.ess(dev, method="mean")) if x.shape[1] > 4 else float(x.size)
    ess = min(max(ess, 1.0), float(x.size)) if np.isfinite(ess) else 1.0
    kurtosis = float((dev**2).mean() / dev.mean() ** 2)
    return max(kurtosis - 1.0, 0.0) / (4.0 * ess)


def laplace(
    model: pm.Model, draws: int = 20_000, seed: int = 0, start: dict | None = None
) -> dict[str, Any]:
    """The Laplace approximation in PyMC's unconstrained space, pushed to the constrained
    scale by its draws.

    The mode is found by trust-region Newton with the exact Hessian (natural-units models have
    condition numbers of 10⁴–10¹², where quasi-Newton stalls); the covariance is the inverse
    Hessian there. Returns ``{"mode": point, "cov": (D, D), "draws": {name: (1, draws, ...)}}``
    with the free variables and deterministics.
    """
    value_vars = model.value_vars
    ip = model.initial_point() if start is None else start
    names = [v.name for v in value_vars]
    shapes = [np.shape(ip[n]) for n in names]
    sizes = [int(np.prod(s)) for s in shapes]

    def unravel(x: np.ndarray) -> dict[str, np.ndarray]:
        out, i = {}, 0
        for n, s, k in zip(names, shapes, sizes, strict=True):
            out[n] = x[i : i + k].reshape(s)
            i += k
        return out

    x0 = np.concatenate([np.ravel(ip[n]) for n in names]).astype(np.float64)
    logp = model.compile_logp(jacobian=True)
    dlogp = model.compile_dlogp(jacobian=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # d2logp's sign convention notice
        d2logp = model.compile_d2logp(jacobian=True)

    def f(x):
        v = -float(logp(unravel(x)))
        return v if np.isfinite(v) else 1e300

    def g(x):
        return -np.asarray(dlogp(unravel(x)), dtype=np.float64)

    def h(x):
        return np.asarray(d2logp(unravel(x)), dtype=np.float64)  # d2logp is of -logp

    res = optimize.minimize(
        f, x0, jac=g, hess=h, method="trust-exact", options={"gtol": 1e-9, "maxiter": 2000}
    )
    mode = res.x
    for _ in range(20):  # polish with plain Newton steps; converged when the Newton
        # decrement gᵀH⁻¹g (squared distance to the mode in posterior sds) is negligible
        step = np.linalg.solve(h(mode), g(mode))
        decrement = float(g(mode) @ step)
        if not 0 <= decrement < 1e-16:
            mode = mode - step
        if 0 <= decrement < 1e-12:
            break
    hess = h(mode)
    hess = 0.5 * (hess + hess.T)
    w, v = np.linalg.eigh(hess)
    if w.min() <= 0:
        raise RuntimeError(
            f"Laplace: the Hessian at the mode is not positive definite ({w.min():g})."
        )
    cov = (v / w) @ v.T
    rng = np.random.default_rng(seed)
    z = mode + rng.standard_normal((draws, mode.size)) @ (v / np.sqrt(w)).T
    outputs = model.unobserved_value_vars
    out_names = [o.name for o in outputs]
    # unobserved_value_vars returns value variables and the constrained variables (named
    # as the model names them) plus deterministics; keep the constrained ones.
    keep = [
        i
        for i, o in enumerate(outputs)
        if o.name in model.named_vars
        and model.named_vars[o.name] not in model.value_vars
        and o.name not in model.rvs_to_values.values()
    ]
    fn = pytensor.function(value_vars, [outputs[i] for i in keep], on_unused_input="ignore")
    results: dict[str, list] = {out_names[i]: [] for i in keep}
    for row in z:
        point = unravel(row)
        vals = fn(*[point[n] for n in names])
        for i, val in zip(keep, vals, strict=True):
            results[out_names[i]].append(np.asarray(val))
    draws_out = {k: np.stack(v)[None] for k, v in results.items()}
    return {
        "mode": unravel(mode),
        "cov": cov,
        "draws": draws_out,
        "converged": bool(0 <= decrement < 1e-8),
    }


CONSTANT_SGD_FAMILY = ("IASG", "ConstantSGD", "SGFS")
FAMILY_WISE = 0.05


def verdict(sampler: str, scored: dict[str, Any], laplace_scored: dict | None = None) -> dict:
    """Pass/fail of scored draws (:func:`score`) by the correctness issue's rule: every
    parameter's mean within 0.1 reference sd and its sd within 10% (IASG, ConstantSGD, SGFS) or
    0.15 and 15% (the Langevin family), each widened by ``z`` Monte Carlo standard errors of
    that parameter (``z`` Bonferroni over the parameters at a 5% family-wise rate); for the
    constant-SGD family, alternatively no further from the reference than the Laplace
    approximation (``laplace_scored``) plus that allowance (they are Gaussian approximations on
    skewed posteriors). Returns ``{"pass", "z", "failures": [param, ...], "worst": {...}}``."""
    from scipy.stats import norm

    table = scored["table"]
    z = float(norm.ppf(1 - FAMILY_WISE / (2 * max(len(table), 1))))
    family = sampler in CONSTANT_SGD_FAMILY
    tol_mean, tol_sd = (0.10, 0.10) if family else (0.15, 0.15)
    failures, worst = [], {}
    for param, row in table.items():
        mean_slack = z * row["se_dmean"]
        sd_slack = z * row["se_sd_ratio"]
        ok_mean = abs(row["dmean"]) <= tol_mean + mean_slack
        ok_sd = abs(row["sd_ratio"] - 1) <= tol_sd + sd_slack
        lap = (laplace_scored or {}).get("table", {}).get(param) if family else None
        if lap is not None:
            ok_mean = ok_mean or abs(row["dmean"]) <= abs(lap["dmean"]) + mean_slack
            ok_sd = ok_sd or abs(row["sd_ratio"] - 1) <= abs(lap["sd_ratio"] - 1) + sd_slack
        if not (ok_mean and ok_sd):
            failures.append(param)
            worst[param] = {"dmean": row["dmean"], "sd_ratio": row["sd_ratio"]}
    return {"pass": not failures, "z": z, "failures": failures, "worst": worst}


def diagnostics(draws: dict[str, np.ndarray], idata=None) -> dict:
    """Largest R-hat and smallest bulk ESS over the scalars of ``draws`` ((chains, draws, ...)
    each; constant ones skipped) and, given the run's result, its divergences, mean tree
    depth and median step size."""
    import arviz as az

    rh, es = [], []
    for v in draws.values():
        flat = v.reshape(v.shape[0], v.shape[1], -1)
        for j in range(flat.shape[2]):
            x = flat[:, :, j]
            if np.ptp(x) == 0:
                continue
            rh.append(float(az.rhat(x)))
            es.append(float(az.ess(x, method="bulk")))
    out = {"max_rhat": round(max(rh), 4), "min_ess_bulk": round(min(es))}
    if idata is not None:
        ss = idata.sample_stats if hasattr(idata, "sample_stats") else idata["sample_stats"]
        out["divergences"] = int(ss["diverging"].sum()) if "diverging" in ss else 0
        for k in ("tree_depth", "depth"):
            if k in ss:
                out["mean_depth"] = round(float(ss[k].mean()), 2)
        if "step_size" in ss:
            out["step_size"] = float(f"{float(np.median(ss['step_size'].values)):.3g}")
    return out


def ok(d: dict, min_ess: int = 1000) -> bool:
    """No divergences, R-hat <= 1.01 and bulk ESS >= ``min_ess`` (a reference's bounds)."""
    return d.get("divergences", 0) == 0 and d["max_rhat"] <= 1.01 and d["min_ess_bulk"] >= min_ess
