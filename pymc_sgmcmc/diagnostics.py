r"""The self-check every run gets: is this chain sampling the posterior?

Three checks, each a number per parameter with a stated tolerance, recorded in the attrs of
``posterior`` and ``sample_stats`` (``sgmcmc_diagnostics``, JSON) and warned about — naming the
parameters — as PyMC warns about divergences.

1. **Predicted stationary covariance vs the measured curvature** (after tuning). With the
   tuned step and injected noise frozen, the chain's stationary covariance on a Gaussian with
   the curvature ``A`` measured last (and the gradient noise measured there) is solved from
   the discrete Lyapunov equation in whitened coordinates and compared with ``A⁻¹``
   (:func:`predicted_sd_ratio`). It fails where the rates cannot match the curvature: data
   whose gradient noise exceeds it (over-dispersion, ``N·C > A``), a diagonal whitening of a
   strongly coupled posterior, a curvature that moved since it was averaged. Tolerance: sds
   within :data:`PREDICTED_SD_TOLERANCE` (10%).

2. **Stein's identity on the draws** (after sampling). For any density :math:`p \propto
   e^{-U}` and fixed matrix ``M``, integration by parts gives

   .. math::

       E_p\big[(\theta_k - \mu_k)\,(M\nabla\log p(\theta))_k\big] = -M_{kk},\qquad E_p[M\nabla\log p(\theta)] = 0.

   With ``M = A⁻¹`` the per-draw term :math:`t_k = -(\theta_k - \bar\theta_k)(A^{-1}
   \nabla\log p)_k / (A^{-1})_{kk}` has mean 1 under the posterior — exactly, whatever its
   shape — and, if the draws came from :math:`\mathcal N(\mu, \Sigma)` on a Gaussian posterior,
   mean :math:`\Sigma_{kk}/(A^{-1})_{kk}`: the draws' variance relative to the posterior's. Its
   variance per independent draw is about 2, so ``s_k = mean(t_k)`` estimates each parameter's
   variance ratio to about :math:`\sqrt{2/\mathrm{ESS}}` without knowing the posterior. The
   gradient at each draw is a minibatch estimate with an SVRG control variate at the chain's
   position after tuning (its full-data gradient is taken once), so the minibatch noise barely
   adds to that error; with ``local_vars`` the joint density's gradient with respect to the
   globals at the draw of the locals is used (Stein's identity holds for the joint), without
   the control variate. A parameter is flagged when :math:`|s_k - 1|` exceeds
   :data:`STEIN_TOLERANCE` (0.2 in variance, ≈10% in sd) plus ``z`` Monte Carlo standard
   errors, ``z`` Bonferroni-corrected over the checked parameters at a 5% family-wise rate.

3. **Movement** (after sampling). Per parameter, the mean squared jump between consecutive
   draws in posterior sds, :math:`m_k = \overline{(\Delta\theta_k)^2}/(2(A^{-1})_{kk})`, is
   ``1 − ρ`` for draws with lag-1 autocorrelation ρ; a chain whose relaxation time
   ``1/m_k`` exceeds :data:`MAX_RELAXATION_PASSES` data passes does not move (e.g. a step far
   too small).

4. **The chains agree** (after sampling), on every coordinate of the posterior — the checks
   above follow at most :data:`MAX_CHECKED` of them. Rank-normalised split R̂ (Vehtari et al.
   2021; the larger of the bulk and the folded one) above :data:`RHAT_TOLERANCE` names the
   coordinate: one chain sitting far from the others (a group effect kicked 67 sds away in
   tuning and relaxing too slowly to come back), or a chain still drifting. Chains of at
   least :data:`RHAT_MIN_DRAWS` draws; cost ``O(D · draws · log draws)``, in chunks of
   coordinates.

Over-dispersed data (the largest eigenvalue of ``N·C`` in whitened coordinates above 1.5) are
reported in the attrs (``fisher_ratio_max``); they warn only through the checks above, i.e.
where the draws then move beyond tolerance.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy.linalg import solve_discrete_lyapunov
from scipy.special import ndtri
from scipy.stats import norm, rankdata

__all__ = [
    "MAX_CHECKED",
    "MAX_RELAXATION_PASSES",
    "PREDICTED_SD_TOLERANCE",
    "STEIN_TOLERANCE",
    "NoStructureWarning",
    "SGMCMCCheckWarning",
    "check_chains_agree",
    "check_draws",
    "predicted_sd_ratio",
    "run_checks",
    "split_rhat",
]

PREDICTED_SD_TOLERANCE = 0.10
STEIN_TOLERANCE = 0.20
SHIFT_TOLERANCE = 0.20  # posterior sds
FAMILY_WISE_RATE = 0.05
MAX_RELAXATION_PASSES = 100.0
MAX_CHECKED = 512  # coordinates checked per chain (all of them up to this many)
RHAT_TOLERANCE = 1.2
"""Rank-normalised split R̂ above which the chains disagree on a coordinate. The check is a
net for gross failures on the coordinates the Stein check does not follow (a chain stuck or
kicked far from the others: R̂ ≈ 2.2 for one of two chains 67 sds away), not a convergence
criterion (PyMC's own warns from 1.01): two chains whose means differ by 1.15 sds give
about 1.2 (1.5 sds: 1.32), and with 25 effective draws in each half-chain R̂ exceeds 1.2
by chance with probability about 3·10⁻⁷ per coordinate (1.1: 10⁻³, a false alarm in four
runs of ten with 400 coordinates)."""
RHAT_MIN_DRAWS = 50  # per chain; shorter chains are not compared
RHAT_CHUNK = 4096  # coordinates ranked at a time (memory: chains·draws·chunk values)
MIN_GLOBAL_ESS = 100.0
"""A global of a hierarchical model with fewer effective draws is reported: its mean and sd
are then known to no better than ±0.3 of its sd, whatever the sampler's accuracy (issue 37's
rule; the chains relax slowly along it — a funnel, a ridge)."""

_log = logging.getLogger("pymc")


class SGMCMCCheckWarning(UserWarning):
    """The self-check found draws that do not match the posterior (or do not move)."""


class NoStructureWarning(UserWarning):
    """Group effects sit beside globals above the dense whitening's dimension, but no nested
    structure was found (:mod:`pymc_sgmcmc.tuning.structure`): the whitening is diagonal."""


MOMENTUM_CHECK_MAX_DIM = 200  # the predicted sd ratio with momentum, up to this many dims


def check_indices(sizes: Sequence[int], limit: int = MAX_CHECKED) -> np.ndarray:
    """The raveled coordinates the Stein and movement checks follow: all of them up to
    ``limit``; above, every coordinate of the small variables and evenly spaced ones of the
    large."""
    total = int(sum(sizes))
    if total <= limit:
        return np.arange(total)
    small = [s for s in sizes if s <= 16]
    budget = max(limit - sum(small), 0)
    large = [s for s in sizes if s > 16]
    per_large = max(1, budget // max(len(large), 1))
    out, start = [], 0
    for s in sizes:
        if s <= 16:
            out.extend(range(start, start + s))
        else:
            out.extend(np.linspace(start, start + s - 1, min(s, per_large)).astype(int).tolist())
        start += s
    return np.unique(np.asarray(out[:limit], dtype=int))


def predicted_sd_ratio(
    preconditioner: np.ndarray,
    injected: np.ndarray,
    whitening: Any,
    curvature: np.ndarray,
    noise: np.ndarray,
    window: int | None = None,
    momentum: float | None = None,
) -> np.ndarray:
    r"""Per-parameter sd of the stationary chain (or of IASG's window means, ``window``) on a
    Gaussian with curvature ``curvature`` and gradient-noise covariance ``noise`` (θ units),
    for the frozen whitened preconditioner ``P_z`` and injected noise ``Q``, over the sd of
    ``curvature⁻¹``. With ``momentum`` μ the chain is the damped recursion
    :math:`v' = (1-\mu)v - P A z + \epsilon,\ z' = z + v'`, a VAR(1) in ``(z, v)``. Dense
    whitening only (else None)."""
    if not whitening.dense:
        return None
    a_z = whitening.to_whitened(curvature)
    s_z = whitening.to_whitened(noise)
    q = np.diag(injected) if np.ndim(injected) == 1 else np.asarray(injected)
    p = np.diag(preconditioner) if np.ndim(preconditioner) == 1 else np.asarray(preconditioner)
    d = a_z.shape[0]
    f = np.eye(d) - p @ a_z
    v = p @ s_z @ p.T + q
    if momentum is not None and momentum != 1.0:
        if d > MOMENTUM_CHECK_MAX_DIM:
            return None  # a 2D x 2D Lyapunov solve: ~5 s at D = 500 with one BLAS thread
        keep = (1.0 - float(momentum)) * np.eye(d)
        transition = np.block([[f, keep], [f - np.eye(d), keep]])
        both = np.block([[v, v], [v, v]])  # the same noise moves v and z
        sigma = solve_discrete_lyapunov(transition, both)[:d, :d]
        window = None  # (IASG has no momentum)
    else:
        sigma = solve_discrete_lyapunov(f, v)
    if window is not None and window > 1:
        # Variance of the mean of W consecutive iterates of the VAR(1).
        acc = np.zeros_like(sigma)
        power = np.eye(d)
        for k in range(1, window):
            power = power @ f
            term = power @ sigma
            acc += (1.0 - k / window) * (term + term.T)
        sigma = (sigma + acc) / window
    factor = whitening.factor()
    sigma_theta = factor @ sigma @ factor.T
    w, vecs = np.linalg.eigh(0.5 * (curvature + curvature.T))
    target = (vecs / np.maximum(np.abs(w), 1e-300)) @ vecs.T
    return np.sqrt(np.maximum(np.diag(sigma_theta), 0.0) / np.maximum(np.diag(target), 1e-300))


ESS = Callable[[np.ndarray], float]  # (chains, draws) -> the ESS of the mean (the host's)


def _ess(x: np.ndarray, ess: ESS) -> float:
    """ESS of the mean of a (chains, draws) array, at least 1."""
    if x.shape[1] < 4:
        return float(x.size)
    value = float(ess(np.asarray(x, dtype=np.float64)))
    return max(value, 1.0) if math.isfinite(value) else 1.0


def check_draws(
    positions: np.ndarray,
    gradients: np.ndarray,
    cov_diag: np.ndarray,
    names: Sequence[str],
    passes_per_draw: float,
    diagonal: bool = False,
    temperature: float = 1.0,
    *,
    ess: ESS,
) -> dict[str, Any]:
    """The Stein and movement checks on ``(chains, draws, k)`` unconstrained draws and their
    ``A⁻¹∇log p`` terms (``cov_diag`` the ``(k,)`` diagonal of ``A⁻¹``); ``ess`` estimates the
    effective sample size of a mean from ``(chains, draws)`` values. ``diagonal``: the
    metric ``A⁻¹`` is that diagonal (a diagonal whitening), so the identity can also be
    checked along combinations of the coordinates (:func:`_directional_stein`)."""
    positions = np.asarray(positions, dtype=np.float64)
    gradients = np.asarray(gradients, dtype=np.float64)
    chains, draws, k = positions.shape
    if k == 0:
        return {"skipped": "no coordinates checked"}
    # The target at temperature T is p^(1/T): its Stein identity is E[θ ∇log p] = −T·I and
    # its covariance T·A⁻¹, so the metric's diagonal is scaled by T (1: the posterior).
    cov_diag = np.asarray(cov_diag, dtype=np.float64)
    gradients = gradients / float(temperature)
    # Coordinates without A⁻¹ (local variables) were given M = I: the Stein term is
    # normalised by 1, and the draws' own variance stands in for the posterior's scale.
    unit = ~np.isfinite(cov_diag)
    scale = np.where(unit, positions.reshape(-1, k).var(axis=0), cov_diag)
    cov_diag = np.where(unit, 1.0, cov_diag)
    out: dict[str, Any] = {"draws": int(draws), "chains": int(chains), "checked": int(k)}
    if draws < 20:
        out["skipped"] = "fewer than 20 draws"
        return out
    centred = positions - positions.reshape(-1, k).mean(axis=0)
    terms = -centred * gradients / cov_diag
    # First order: E_p[A⁻¹∇log p] = 0; for draws shifted by δ from a Gaussian posterior the
    # mean of A⁻¹∇log p is −δ: in posterior sds, the shift of each parameter's mean.
    shifts = -gradients * math.sqrt(temperature) / np.sqrt(cov_diag)
    shifts = shifts * np.where(unit, np.sqrt(scale), 1.0)
    scale = np.where(unit, scale, scale * float(temperature))
    z = float(norm.ppf(1.0 - FAMILY_WISE_RATE / (2.0 * max(k, 1))))
    stein, shift, flagged = [], [], []
    for j in range(k):
        t = terms[:, :, j]
        ess_t = min(_ess(t, ess), float(t.size))
        s = float(t.mean())
        se = float(t.std() / math.sqrt(ess_t))
        stein.append((s, se))
        u = shifts[:, :, j]
        ess_u = min(_ess(u, ess), float(u.size))
        m, se_m = float(u.mean()), float(u.std() / math.sqrt(ess_u))
        shift.append((m, se_m))
        if abs(s - 1.0) > STEIN_TOLERANCE + z * se or abs(m) > SHIFT_TOLERANCE + z * se_m:
            flagged.append(j)
    jumps = np.diff(positions, axis=1) ** 2 / (2.0 * scale)
    movement = jumps.mean(axis=1)  # (chains, k)
    relax_passes = passes_per_draw / np.maximum(movement, 1e-300)
    stuck = sorted(
        {j for c in range(chains) for j in range(k) if relax_passes[c, j] > MAX_RELAXATION_PASSES}
    )
    # Pooled over the coordinates of each variable (e.g. 386 group effects): more power than
    # any one coordinate, the standard error assuming the coordinates' errors independent.
    pooled: dict[str, tuple[float, float]] = {}
    groups: dict[str, list[int]] = {}
    for j, name in enumerate(names):
        groups.setdefault(re.sub(r"\[.*\]", "", name), []).append(j)
    z_var = float(norm.ppf(1.0 - FAMILY_WISE_RATE / (2.0 * max(len(groups), 1))))
    for var, members in groups.items():
        if len(members) < 2:
            continue
        s = float(np.mean([stein[j][0] for j in members]))
        se = float(np.sqrt(np.sum([stein[j][1] ** 2 for j in members])) / len(members))
        pooled[var] = (s, se)
        if abs(s - 1.0) > STEIN_TOLERANCE + z_var * se:
            flagged.extend(j for j in members if j not in flagged)
            out.setdefault("pooled_flagged", []).append(var)
    if diagonal:
        directions = _directional_stein(positions, gradients, cov_diag, unit, names, ess)
        if directions:
            out["directional_stein"] = directions
            failed = [d for d in directions if d["flagged"]]
            if failed:
                out["directional_flagged"] = failed
    out["pooled_stein_ratio"] = {v: round(s, 4) for v, (s, _) in pooled.items()}
    out["stein_z"] = z
    out["stein_ratio"] = {names[j]: round(s, 4) for j, (s, _) in enumerate(stein)}
    out["stein_se"] = {names[j]: round(se, 4) for j, (_, se) in enumerate(stein)}
    out["mean_shift_sd"] = {names[j]: round(m, 4) for j, (m, _) in enumerate(shift)}
    out["mean_shift_se"] = {names[j]: round(se, 4) for j, (_, se) in enumerate(shift)}
    out["stein_flagged"] = [names[j] for j in flagged]
    out["relaxation_passes_max"] = float(relax_passes.max())
    out["stuck"] = [names[j] for j in stuck]
    return out


def split_rhat(draws: np.ndarray) -> np.ndarray:
    """Rank-normalised split R̂ of ``(chains, draws, k)`` values, ``(k,)``: the larger of the
    bulk and the folded (``|x − median|``) one (Vehtari, Gelman, Simpson, Carpenter & Bürkner
    2021). NaN for a coordinate that does not vary within the chains.

    ArviZ's ``rhat(method="rank")``, vectorised over the coordinates (tested equal to the
    host ArviZ's, ties included). Not the host's
    own: ArviZ 1's array function took 2.4× as long on 4 096 coordinates × 800 draws (2.35 s
    against 0.97 s; 10⁵ group effects would add a minute to every run), and ArviZ 0.23's
    takes one variable of one coordinate at a time."""
    draws = np.asarray(draws, dtype=np.float64)
    chains, length, k = draws.shape
    half = length // 2
    split = np.concatenate([draws[:, :half], draws[:, length - half :]], axis=0)
    flat = split.reshape(-1, k)
    folded = np.abs(split - np.median(flat, axis=0))
    rhat = np.fmax(_rhat(_rank_normalised(split)), _rhat(_rank_normalised(folded)))
    # A coordinate constant up to rounding (a correlation matrix's unit diagonal: its ranks
    # are those of the rounding errors, R̂ 1.26 on LKJ's chol_corr[2,2]) is not compared.
    rhat[np.ptp(flat, axis=0) <= 1e-9 * np.abs(flat).max(axis=0)] = np.nan
    return rhat


def _rank_normalised(x: np.ndarray) -> np.ndarray:
    """Normal scores of the pooled ranks, per coordinate (ties share their average rank;
    Blom's offsets, as ArviZ)."""
    m, n, k = x.shape
    ranks = rankdata(x.reshape(m * n, k), axis=0)
    scores = ndtri((ranks - 0.375) / (m * n + 0.25))
    return scores.reshape(m, n, k)


def _rhat(z: np.ndarray) -> np.ndarray:
    """Gelman–Rubin's potential scale reduction of ``(chains, draws, k)`` values."""
    n = z.shape[1]
    within = z.var(axis=1, ddof=1).mean(axis=0)
    between = n * z.mean(axis=1).var(axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(((n - 1) / n * within + between / n) / within)


def check_chains_agree(draws: dict[str, np.ndarray], limit: int = 20) -> dict[str, Any]:
    """R̂ on every coordinate of ``draws`` (``name -> (chains, draws, *shape)``); coordinates
    are labelled by integer position (``u[1900]``, ``u[3,1]``). Returns ``rhat_max``, the
    number checked and ``rhat_flagged``: the ``limit`` worst labels above
    :data:`RHAT_TOLERANCE`, worst first, with the total count flagged."""
    worst: list[tuple[float, str]] = []
    checked, flagged, top = 0, 0, 1.0
    for name, values in draws.items():
        values = np.asarray(values)
        if (
            values.ndim < 2
            or values.shape[1] < RHAT_MIN_DRAWS
            or not np.issubdtype(values.dtype, np.floating)
        ):
            continue
        shape = values.shape[2:]
        flat = values.reshape(values.shape[0], values.shape[1], -1)
        for start in range(0, flat.shape[-1], RHAT_CHUNK):
            r = split_rhat(flat[..., start : start + RHAT_CHUNK])
            ok = np.isfinite(r)
            checked += int(ok.sum())
            if ok.any():
                top = max(top, float(r[ok].max()))
            bad = np.flatnonzero(ok & (r > RHAT_TOLERANCE))
            flagged += bad.size
            for j in bad[np.argsort(-r[bad])][:limit]:
                index = np.unravel_index(start + j, shape) if shape else ()
                label = f"{name}[{','.join(str(int(i)) for i in index)}]" if shape else name
                worst.append((float(r[j]), label))
    worst = sorted(worst, reverse=True)[:limit]
    return {
        "rhat_checked": checked,
        "rhat_max": round(top, 4),
        "rhat_flagged_count": flagged,
        "rhat_flagged": {label: round(r, 3) for r, label in worst},
    }


DIRECTIONS = 2  # extreme directions of each end of the spectrum checked


def _directional_stein(
    positions: np.ndarray,
    gradients: np.ndarray,
    cov_diag: np.ndarray,
    unit: np.ndarray,
    names: Sequence[str],
    ess: ESS,
) -> list[dict[str, Any]]:
    """Stein's identity along combinations of the coordinates, under a diagonal metric.

    Per coordinate the identity checks ``E[θ_j ∂_j log p] = −1``, which draws with the
    right marginal *conditional* variances and no correlation also satisfy — exactly how a
    sampler with a diagonal whitening fails on a coupled posterior (a global coupled to 600
    group effects by an uncentred predictor: IASG's draws of it 0.55x too narrow, every
    per-coordinate ratio 1). The identity holds along any direction ``w``:
    ``E[(w·y)(w·r)] = −|w|²`` with ``y = θ/√p`` and ``r = √p ∇log p`` (``p`` the metric's
    diagonal). The directions that matter are those where the curvature in these units is
    far from 1: the extreme eigenvectors of the covariance of ``r`` (``≈ M²`` for draws
    without the correlations, ``M`` the curvature in ``y`` units, ``= M`` for correct draws).
    They are found on the first half of every chain and tested on the second, so the choice
    does not bias the test; tolerance as per coordinate, Bonferroni over the directions."""
    keep = np.nonzero(~unit)[0]
    chains, draws, _ = positions.shape
    if keep.size < 2 or draws < 40:
        return []
    root = np.sqrt(cov_diag[keep])
    y = positions[:, :, keep] / root
    r = gradients[:, :, keep] / root  # (A⁻¹∇log p)/√p = √p ∇log p for a diagonal A⁻¹
    half = draws // 2
    first = r[:, :half].reshape(-1, keep.size)
    values, vectors = np.linalg.eigh(np.cov(first, rowvar=False))
    count = min(DIRECTIONS, keep.size // 2)
    picks = list(range(count)) + list(range(keep.size - count, keep.size))
    y2 = y[:, half:] - y[:, half:].reshape(-1, keep.size).mean(axis=0)
    r2 = r[:, half:]
    z = float(norm.ppf(1.0 - FAMILY_WISE_RATE / (2.0 * len(picks))))
    out = []
    for i in picks:
        w = vectors[:, i]
        t = -(y2 @ w) * (r2 @ w)  # (chains, draws − half)
        ess_t = min(_ess(t, ess), float(t.size))
        ratio, se = float(t.mean()), float(t.std() / math.sqrt(ess_t))
        loadings = np.argsort(-np.abs(w))[:4]
        out.append(
            {
                "variance_ratio": round(ratio, 4),
                "se": round(se, 4),
                "curvature": round(float(np.sqrt(max(values[i], 0.0))), 4),
                "along": [names[keep[j]] for j in loadings],
                "flagged": bool(abs(ratio - 1.0) > STEIN_TOLERANCE + z * se),
            }
        )
    return out


def _stacked_check_stat(values: np.ndarray) -> np.ndarray | None:
    """``(chains, draws)`` object array of per-draw vectors (None in tuning), or PyMC's
    numeric stacking of them, as one ``(chains, draws, width)`` array of the draws every
    chain has (None when there are none)."""
    if values.dtype != object:
        # PyMC stacks equal-length arrays into a numeric (chains, draws, width) stat.
        if values.ndim != 3 or values.shape[1] == 0:
            return None
        stacked = np.asarray(values, dtype=np.float64)
        keep = np.all(np.isfinite(stacked), axis=(0, 2))
        stacked = stacked[:, keep]
        return stacked if stacked.shape[1] else None
    rows = []
    for chain in values:
        kept = [np.asarray(v, dtype=np.float64) for v in chain if isinstance(v, np.ndarray)]
        rows.append(kept)
    if not rows or min(len(r) for r in rows) == 0:
        return None
    length = min(len(r) for r in rows)
    return np.stack([np.stack(r[:length]) for r in rows])


def _split_check_stat(
    values: np.ndarray, marginal: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The ``sgmcmc_check`` stat as ``(positions, terms)`` of the checked coordinates and
    ``(positions, terms)`` of the ``marginal`` globals (its last ``2·marginal`` columns),
    each ``(chains, draws, k)``."""
    stacked = _stacked_check_stat(values)
    if stacked is None:
        return None
    main, last = (
        stacked[..., : stacked.shape[-1] - 2 * marginal],
        stacked[..., stacked.shape[-1] - 2 * marginal :],
    )
    k = main.shape[-1] // 2
    return main[..., :k], main[..., k:], last[..., :marginal], last[..., marginal:]


def run_checks(
    check: np.ndarray | None,
    entries: list[dict],
    *,
    ess: ESS,
    warn: bool = True,
    draws: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Run the checks on a finished run and warn about what failed; returns the report (the
    ``sgmcmc_diagnostics`` attrs entry, JSON-encoded by the caller). ``check``: the sampling
    draws' ``sgmcmc_check`` stat, ``(chains, draws)`` of per-draw arrays or a numeric
    ``(chains, draws, 2k)`` array (None when not recorded); ``entries`` are the SG steps'
    settings as they go into the attrs (one per step, each chain's tuned values under
    ``"chains"``); ``ess`` as for :func:`check_draws`; ``draws``: the posterior's draws of
    the variables the SG steps sample (``name -> (chains, draws, *shape)``), for
    :func:`check_chains_agree`."""
    report: dict[str, Any] = {}
    messages: list[str] = []
    entry = entries[0] if len(entries) == 1 else None
    chains = (entry or {}).get("chains", [])
    info = chains[0].get("check") if chains and isinstance(chains[0], dict) else None
    # 1. predicted stationary covariance per chain
    predicted = [c.get("predicted_sd_ratio") for c in chains if isinstance(c, dict)]
    predicted = [p for p in predicted if p]
    if predicted and info:
        worst: dict[str, float] = {}
        for p in predicted:
            for name, r in zip(info["names"], p, strict=False):
                if abs(r - 1.0) > abs(worst.get(name, 1.0) - 1.0):
                    worst[name] = r
        bad = {k: round(v, 3) for k, v in worst.items() if abs(v - 1.0) > PREDICTED_SD_TOLERANCE}
        report["predicted_sd_ratio_range"] = [
            float(min(min(p) for p in predicted)),
            float(max(max(p) for p in predicted)),
        ]
        report["predicted_flagged"] = bad
        if bad:
            messages.append(
                "the tuned step and noise predict posterior sds off by more than "
                f"{PREDICTED_SD_TOLERANCE:.0%} for {_shorten(bad)} (predicted sd ratio): "
                f"{_other_sampler(entry)}"
            )
    overdispersed = [
        c.get("fisher_ratio_max")
        for c in chains
        if isinstance(c, dict) and c.get("fisher_ratio_max")
    ]
    if overdispersed:
        report["fisher_ratio_max"] = float(max(overdispersed))
    # 2–3. Stein's identity and movement on the draws
    if check is not None and info is not None:
        marginal = info.get("marginal")
        split = _split_check_stat(check, len(marginal["names"]) if marginal else 0)
        if split is not None:
            positions, gradients, global_positions, global_terms = split
            passes = (
                float(entry.get("thin", 1))
                * float(entry.get("batch_size", 1))
                / float(max(entry.get("data_size", 1), 1))
            )
            cov_diag = np.mean([np.asarray(c["check"]["cov_diag"]) for c in chains], axis=0)
            stats = check_draws(
                positions,
                gradients,
                cov_diag,
                info["names"],
                passes,
                diagonal=info.get("metric") == "diagonal",
                temperature=float(entry.get("temperature", 1.0) or 1.0),
                ess=ess,
            )
            report.update(stats)
            for d in stats.get("directional_flagged", []):
                messages.append(
                    f"Stein's identity fails along a combination of {', '.join(d['along'])} "
                    f"(variance ratio {d['variance_ratio']:.2f}): correlations the diagonal "
                    "whitening does not see make the draws too narrow or too wide along it; "
                    "use preconditioner='full' if the dimension allows, or another sampler"
                )
            if stats.get("stein_flagged"):
                found = {
                    n: f"{_ratio_text(stats['stein_ratio'][n])}, mean off by "
                    f"{stats['mean_shift_sd'][n]:+.2f} sd"
                    for n in stats["stein_flagged"]
                }
                messages.append(
                    f"Stein's identity fails for {_shorten(found)}: the draws do not match "
                    f"the posterior there; {_other_sampler(entry)}"
                )
            if stats.get("stuck"):
                step = entry.get("step_size")
                messages.append(
                    f"the chains barely move along {_shorten(stats['stuck'])} (relaxation "
                    f"≥ {MAX_RELAXATION_PASSES:.0f} data passes; step_size={step}): use "
                    "step_size='auto', more draws, or a larger batch_size"
                )
            if marginal and global_positions.shape[-1]:
                report["marginal"] = check_marginal(
                    global_positions,
                    global_terms,
                    chains,
                    passes,
                    temperature=float(entry.get("temperature", 1.0) or 1.0),
                    ess=ess,
                )
                messages.extend(_marginal_messages(report["marginal"], entry))
    # 4. the chains agree, on every coordinate
    if draws:
        agree = check_chains_agree(draws)
        report.update(agree)
        if agree["rhat_flagged"]:
            found = {k: f"R̂ {v:.2f}" for k, v in agree["rhat_flagged"].items()}
            count = agree["rhat_flagged_count"]
            messages.append(
                f"the chains disagree on {_shorten(found)}"
                + (f" ({count} coordinates in all)" if count > len(found) else "")
                + f" (rank-normalised split R̂ above {RHAT_TOLERANCE}): a chain sits away "
                f"from the others there, or is still drifting; {_other_sampler(entry)}"
            )
    report["ok"] = not messages
    log = os.environ.get("PMSG_CHECK_LOG")
    if log:
        # One line per run, for measuring the false-alarm rate over a test session or a
        # benchmark (tests/conftest.py sets it; see docs/reliability.md).
        record = {
            "sampler": (entry or {}).get("sampler"),
            "ok": report["ok"],
            "messages": messages,
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        }
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
    if messages and warn:
        sampler = (entry or {}).get("sampler", "The SG sampler")
        warnings.warn(
            f"{sampler} self-check: " + "; ".join(messages) + ". (The numbers: "
            "idata.sample_stats.attrs['sgmcmc_diagnostics']; docs: reliability.)",
            SGMCMCCheckWarning,
            stacklevel=3,
        )
    return report


def check_marginal(
    positions: np.ndarray,
    terms: np.ndarray,
    chains: Sequence[dict],
    passes_per_draw: float,
    temperature: float = 1.0,
    *,
    ess: ESS,
) -> dict[str, Any]:
    r"""The globals' marginal: Stein's identity with the joint curvature, and movement along
    the direction of their largest marginal variance.

    ``terms`` are :math:`r_g\cdot\nabla\log p` at each draw, with :math:`r_g` the columns of
    the inverse of the joint curvature :math:`H` (globals and group effects; with
    ``local_vars`` the gradient is the joint density's at the draw of the locals). With
    :math:`M = H^{-1}` the identity's term for a global has mean 1 under the posterior,
    whatever its shape, and on a Gaussian posterior it is the draws' *marginal* variance over
    :math:`[H^{-1}]_{gg}` — where a diagonal metric, or q fitted at given globals, measures
    the conditional (:mod:`pymc_sgmcmc.tuning.marginal`). The tolerances are those of
    :func:`check_draws`. Movement: the draws projected on the leading eigenvector ``w`` of
    :math:`[H^{-1}]_{gg}` (the ridge the globals and the group effects move along), mean
    squared jump over :math:`2 w^\top [H^{-1}]_{gg} w`, as the movement check does per
    coordinate; the chain does not explore the marginal when its relaxation time along
    ``w`` exceeds :data:`MAX_RELAXATION_PASSES` data passes."""
    info = chains[0]["check"]["marginal"]
    names = info["names"]
    cov_diag = np.mean([np.asarray(c["check"]["marginal"]["cov_diag"]) for c in chains], axis=0)
    # The joint curvature is measured at one point; in a funnel (a non-centred scale) it may
    # be indefinite there, and a global's [H⁻¹]_gg ≤ 0 is no variance: not checked (its
    # Stein identity on the sampler's own metric still is), named in the attrs.
    positive = np.isfinite(cov_diag) & (cov_diag > 0)
    keep = np.flatnonzero(positive)
    out = check_draws(
        positions[..., keep],
        terms[..., keep],
        cov_diag[keep],
        [names[j] for j in keep],
        passes_per_draw,
        temperature=temperature,
        ess=ess,
    )
    if not positive.all():
        out["not_positive"] = [names[j] for j in np.flatnonzero(~positive)]
    direction = np.asarray(info["direction"], dtype=np.float64)
    variance = float(info["direction_variance"]) * float(temperature)
    if positions.shape[1] >= 20 and variance > 0:
        projected = positions @ direction  # (chains, draws)
        jumps = np.diff(projected, axis=1) ** 2 / (2.0 * variance)
        relax = passes_per_draw / np.maximum(jumps.mean(axis=1), 1e-300)
        out["ridge_relaxation_passes"] = float(relax.max())
        loadings = np.argsort(-np.abs(direction))[:3]
        out["ridge_along"] = [names[j] for j in loadings]
        out["ridge_stuck"] = bool(relax.max() > MAX_RELAXATION_PASSES)
    if positions.shape[1] >= 4:
        effective = {name: _ess(positions[..., j], ess) for j, name in enumerate(names)}
        out["global_ess"] = {name: round(v, 1) for name, v in effective.items()}
        out["few_effective_draws"] = [n for n, v in effective.items() if v < MIN_GLOBAL_ESS]
    draws = positions.reshape(-1, positions.shape[-1])
    if draws.shape[0] > 1:
        out["laplace_variance_ratio"] = {
            name: round(float(v / c), 4)
            for name, v, c, ok in zip(
                names, draws.var(axis=0, ddof=1), cov_diag, positive, strict=True
            )
            if ok
        }
    out["cg_iterations"] = info.get("cg_iterations")
    return out


def _marginal_messages(marginal: dict[str, Any], entry: dict) -> list[str]:
    """The warnings of :func:`check_marginal`, each naming what to try next."""
    messages = []
    locals_ = bool(entry.get("local_vars"))
    if locals_:
        fix = (
            "q(locals) is fitted at given globals, so the globals' draws miss their coupling "
            "with the locals: sample the locals (drop local_vars=), or check against NUTS"
        )
    else:
        fix = (
            "the draws follow the globals' conditional given the group effects, not their "
            "marginal: use ConstantSGD() or SGLD(), more draws, or a larger batch_size"
        )
    if marginal.get("stein_flagged"):
        found = {
            n: f"marginal {_ratio_text(marginal['stein_ratio'][n])}, mean off by "
            f"{marginal['mean_shift_sd'][n]:+.2f} sd"
            for n in marginal["stein_flagged"]
        }
        messages.append(f"the globals' marginal is off for {_shorten(found)}: {fix}")
    few = marginal.get("few_effective_draws") or []
    if few:
        ess = marginal["global_ess"]
        found = {n: f"ESS {ess[n]:.0f}" for n in few}
        messages.append(
            f"few effective draws of {_shorten(found)}: their means and sds are known only "
            f"to about ±3/√ESS of their sd (below {MIN_GLOBAL_ESS:.0f} draws the accuracy "
            "cannot be told); the chains relax slowly along them: run more draws, or sample "
            "a non-centred model centred (or the reverse)"
        )
    if marginal.get("ridge_stuck"):
        messages.append(
            f"the chains barely move along the ridge of {', '.join(marginal['ridge_along'])} "
            f"with the group effects (relaxation {marginal['ridge_relaxation_passes']:.0f} "
            f"data passes ≥ {MAX_RELAXATION_PASSES:.0f}): {fix}"
        )
    return messages


def _other_sampler(entry: dict | None) -> str:
    """What to try next when the draws do not match: a sampler whose defaults hold where
    this one's failed (docs/choosing.md), more draws, or larger batches."""
    sampler = (entry or {}).get("sampler")
    other = "SGLD()" if sampler in ("IASG", "ConstantSGD", "SGFS", "SGHMC") else "ConstantSGD()"
    return f"try {other}, more draws, or a larger batch_size"


def _ratio_text(ratio: float) -> str:
    """Stein's estimate of a variance ratio, in words. It is a mean of products that is 1 on
    the posterior; below 0 (seen on InstEval's scales) the draws' deviations follow the
    gradient instead of opposing it, and it is no longer a variance."""
    if ratio < 0:
        return (
            f"variance ratio below 0 (Stein's statistic {ratio:.2f}: the draws lie off the "
            "posterior)"
        )
    return f"variance ratio {ratio:.2f}"


def _shorten(items: Any, limit: int = 6) -> str:
    if isinstance(items, dict):
        parts = [f"{k} ({v})" for k, v in list(items.items())[:limit]]
        more = len(items) - limit
    else:
        parts = list(items)[:limit]
        more = len(items) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")
