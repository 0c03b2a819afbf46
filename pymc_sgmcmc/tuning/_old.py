r"""Online estimates that tune the samplers: gradient-noise covariance and step sizes.

Gradient noise. With per-example gradients :math:`g_n = \nabla \log p(x_n \mid \theta)`
of a minibatch, the unbiased sample covariance estimates the per-datum covariance
:math:`C = \mathrm{Cov}_n[g_n]` (the notation of the documentation's samplers page).
Estimates taken at successive draws are averaged with weight :math:`\kappa_t = 1/t` (a running
mean), which Mandt et al. (2017, §4.1, eq. 21) use to smooth the noisy per-minibatch estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FULL_MAX_DIM",
    "PreconditionerKind",
    "NoiseEstimate",
    "lift_noise",
    "gradient_noise",
    "inverse_noise",
    "iasg_preconditioner",
    "iasg_window",
    "lanczos_extremes",
    "kl_optimal_preconditioner",
    "kl_optimal_scalar_step",
    "sgld_step_size",
    "curvature_preconditioner",
    "preconditioned_sgld_step_size",
]

PreconditionerKind = Literal["scalar", "diagonal", "full"]
FULL_MAX_DIM = 500
"""Above this many dimensions the automatic preconditioner is diagonal, not full: a dense
``D × D`` noise estimate needs ``O(D²)`` memory and an ``O(D³)`` inverse per tuning draw,
and its ``B``-row estimates are rank-deficient when ``D`` approaches ``B``."""


def gradient_noise(per_example_grads: jax.Array, full: bool = False) -> jax.Array:
    """Unbiased sample (co)variance of per-example gradients ``(B, D)``: ``(D,)`` or ``(D, D)``."""
    centred = per_example_grads - per_example_grads.mean(axis=0)
    denom = max(per_example_grads.shape[0] - 1, 1)
    if full:
        return centred.T @ centred / denom
    return jnp.sum(centred * centred, axis=0) / denom


@dataclass
class NoiseEstimate:
    """Running mean of gradient-noise estimates over doubling windows, on the host.

    Within a window the weight is ``κ_t = 1/t`` (Mandt et al. 2017, eq. 21). The early draws of
    tuning are taken far from the mode, where the gradient noise is larger, so the mean is
    restarted after 1, 2, 4, 8, … updates (as Stan restarts its adaptation windows). The
    estimate in force (``value``) pools the last completed window with the current one, so
    that it does not jump back to a single noisy estimate when a window starts — in
    variational EM such a jump perturbed the sampled spread and sent the hyperparameter
    astray. At the end of tuning it averages the last ``~3/4`` of the tuning draws at most.
    """

    count: int = 0
    window: int = 1
    current: np.ndarray | None = field(default=None)
    previous: np.ndarray | None = field(default=None)
    previous_count: int = 0

    @property
    def value(self) -> np.ndarray | None:
        if self.current is None:
            return self.previous
        if self.previous is None:
            return self.current
        total = self.count + self.previous_count
        return (self.count * self.current + self.previous_count * self.previous) / total

    def update(self, estimate: np.ndarray) -> np.ndarray:
        estimate = np.asarray(estimate, dtype=np.float64)
        if self.count >= self.window:
            self.previous, self.previous_count = self.current, self.count
            self.current, self.count, self.window = None, 0, 2 * self.window
        self.count += 1
        if self.current is None:
            self.current = estimate.copy()
        else:
            self.current = self.current + (estimate - self.current) / self.count
        return self.value

    def reset(self) -> None:
        self.count, self.window, self.current = 0, 1, None
        self.previous, self.previous_count = None, 0


def kl_optimal_scalar_step(noise_trace: float, dim: int, data_size: int, batch_size: int) -> float:
    r"""Theorem 1 of Mandt et al. (2017) in this package's N-scale notation.

    :math:`P^* = 2 B D / (N^2 \operatorname{Tr} C)` — the scalar rate of
    :math:`\theta \leftarrow \theta - P \hat g` that minimises KL(stationary ‖ posterior).
    """
    return float(2.0 * batch_size * dim / (data_size**2 * max(noise_trace, 1e-300)))


def sgld_step_size(
    noise_diag: np.ndarray,
    data_size: int,
    batch_size: int,
    rmsprop: bool,
    target_bias: float,
    curvature: np.ndarray | None = None,
) -> float:
    r"""The largest constant SGLD step whose stationary variance inflation is ``target_bias``.

    For a Gaussian target with per-coordinate curvature :math:`a_k = N C_{kk}` (the Fisher
    identity, exact for well-specified models near the mode) and minibatch-gradient noise
    variance :math:`s_k^2 = N^2 C_{kk} / B`, one SGLD step
    :math:`\theta' = \theta - \tfrac{\epsilon}{2}(a\theta + s\xi_1) + \sqrt{\epsilon}\,\xi_2`
    has stationary variance :math:`(1 + \epsilon s^2/4) / (a (1 - \epsilon a / 4))`, i.e. a
    relative inflation of about :math:`\epsilon (s^2 + a)/4` (Mandt et al. 2017, §5.1).
    Setting that to ``target_bias`` in the worst coordinate gives
    :math:`\epsilon = 4\delta / \max_k (N^2 C_{kk}/B + N C_{kk})`. With the RMSprop
    preconditioner :math:`G_k \approx 1/s_k` the inflation is :math:`\epsilon s_k / 4`, so
    :math:`\epsilon = 4\delta / \max_k s_k`. When the diagonal Hessian of the potential
    ``curvature`` is given it replaces the Fisher proxy :math:`N C_{kk}` for :math:`a_k`
    (it also covers directions that only the prior informs).
    """
    noise_diag = np.maximum(np.asarray(noise_diag, dtype=np.float64), 1e-300)
    a = data_size * noise_diag if curvature is None else np.abs(np.asarray(curvature))
    s2 = data_size**2 * noise_diag / batch_size + a
    if rmsprop:
        return float(4.0 * target_bias / np.sqrt(s2).max())
    return float(4.0 * target_bias / s2.max())


def curvature_preconditioner(curvature: np.ndarray, floor: float = 1e-8) -> np.ndarray:
    """``G = Â⁻¹`` from a Hessian estimate ``Â`` of the potential: ``(D,)`` diagonal or
    ``(D, D)``; eigenvalues (or diagonal entries) are taken in absolute value and floored at
    ``floor`` times the largest, so that ``G`` is SPD even where the estimate is not."""
    curvature = np.asarray(curvature, dtype=np.float64)
    if curvature.ndim == 1:
        a = np.abs(curvature)
        return 1.0 / np.maximum(a, floor * max(float(a.max()), 1e-300))
    w, v = np.linalg.eigh(0.5 * (curvature + curvature.T))
    w = np.abs(w)
    w = np.maximum(w, floor * max(float(w.max()), 1e-300))
    return (v / w) @ v.T


def preconditioned_sgld_step_size(
    noise: np.ndarray,
    curvature: np.ndarray,
    preconditioner: np.ndarray,
    data_size: int,
    batch_size: int,
    target_bias: float,
) -> float:
    r"""The largest constant step of SGLD preconditioned by a fixed ``G`` whose stationary
    variance inflation is ``target_bias``.

    In the coordinates :math:`\phi = G^{-1/2}\theta` the step is plain SGLD with curvature
    :math:`G^{1/2} A G^{1/2}` and gradient-noise covariance :math:`G^{1/2} M G^{1/2}`
    (:math:`M = N^2 C / B`), so :func:`sgld_step_size`'s rule becomes
    :math:`\epsilon = 4\delta / \lambda_{\max}\big(G^{1/2}(M + A)G^{1/2}\big)`. With
    :math:`G \approx A^{-1}` the curvature part is about 1 in every direction, so the step is
    limited only by the noise — not by the stiffest coordinate as in plain SGLD, whose slowest
    direction then relaxes in ``κ/ε`` iterations.
    """
    c = np.asarray(noise, dtype=np.float64)
    a = np.asarray(curvature, dtype=np.float64)
    g = np.asarray(preconditioner, dtype=np.float64)
    m = data_size**2 * c / batch_size
    if c.ndim == 1 and a.ndim == 1 and g.ndim == 1:
        return float(4.0 * target_bias / np.max(g * (np.maximum(m, 0.0) + np.abs(a))))
    dim = max(x.shape[0] for x in (c, a, g))
    as_matrix = [x if x.ndim == 2 else np.diag(x) for x in (m, a, g)]
    m_full, a_full, g_full = (np.broadcast_to(x, (dim, dim)) for x in as_matrix)
    w, v = np.linalg.eigh(0.5 * (g_full + g_full.T))
    root = (v * np.sqrt(np.maximum(w, 0.0))) @ v.T
    total = root @ (m_full + a_full) @ root
    return float(
        4.0 * target_bias / max(float(np.linalg.eigvalsh(0.5 * (total + total.T)).max()), 1e-300)
    )


def inverse_noise(noise: np.ndarray, jitter: float = 1e-8) -> np.ndarray:
    """``C⁻¹`` for a ``(D,)`` diagonal or ``(D, D)`` estimate, with a relative ridge.

    The ridge ``jitter · mean(diag C)`` keeps directions the data do not inform (zero
    gradient variance, e.g. a coefficient of an all-zero feature) from getting an infinite
    step; there the prior sets the curvature and a finite step is what we want.
    """
    noise = np.asarray(noise, dtype=np.float64)
    diag = np.diag(noise) if noise.ndim == 2 else noise
    ridge = jitter * max(float(np.mean(diag)), 1e-300)
    if noise.ndim == 1:
        return 1.0 / (noise + ridge)
    sym = 0.5 * (noise + noise.T) + ridge * np.eye(noise.shape[0])
    return np.linalg.inv(sym)


def lift_noise(
    noise: np.ndarray, curvature: np.ndarray, data_size: int
) -> tuple[np.ndarray, np.ndarray]:
    r"""Raise ``C``'s diagonal to the Fisher-identity level ``h/N``; return it and the lift.

    The KL-optimal and IASG rates divide by ``C`` and assume :math:`A = C` (per datum).
    Along a direction the data barely inform — the weight of a pixel that is always 0, the
    softmax's redundant direction — :math:`C_{kk} \approx 0` while the prior still curves
    the potential (:math:`h_{kk}`, the diagonal Hessian of ``U``): the rate would be
    unbounded, and with no gradient noise constant SGD would collapse the posterior there
    to a point. Using :math:`C'_{kk} = h_{kk}/N` where :math:`C_{kk} < h_{kk}/(2N)` restores
    :math:`A = C'`
    there, and *injecting* Gaussian noise with the missing variance
    :math:`(N^2/B)(C'_{kk} - C_{kk})` makes the chain behave as if its gradient noise were
    ``C'`` — Mandt et al.'s SGFS rule of adding noise where the gradient variance is small
    (§5.2). Where :math:`C \approx A` already, the lift is zero up to estimation noise.

    Returns ``(C', lift)`` with ``lift`` the ``(D,)`` diagonal increase.
    """
    noise = np.asarray(noise, dtype=np.float64)
    floor = np.abs(np.asarray(curvature, dtype=np.float64)) / data_size
    diag = np.diag(noise) if noise.ndim == 2 else noise
    # Only where the noise is clearly below the curvature (less than half of it), so that
    # estimation noise in h does not perturb directions where C ≈ A already.
    lift = np.where(diag < 0.5 * floor, floor - diag, 0.0)
    lifted = noise + np.diag(lift) if noise.ndim == 2 else noise + lift
    return lifted, lift


def kl_optimal_preconditioner(
    noise: np.ndarray,
    kind: PreconditionerKind,
    data_size: int,
    batch_size: int,
) -> np.ndarray:
    r"""Mandt et al. (2017) KL-optimal constant-SGD preconditioner, N-scale notation.

    For :math:`\theta \leftarrow \theta - P \hat g` with gradient noise
    :math:`(N^2/B)\,C`:

    * ``"scalar"`` (Theorem 1): :math:`P^* = 2 B D / (N^2 \operatorname{Tr} C)`;
    * ``"diagonal"`` (Corollary 3): :math:`P^*_{kk} = 2 B / (N^2 C_{kk})`;
    * ``"full"`` (Theorem 2): :math:`P^* = (2B/N^2)\, C^{-1}`, for which the stationary
      covariance is :math:`A_U^{-1}` exactly when :math:`A = C` (Corollary 4).

    Mandt's rates are for the per-datum average loss (:math:`\epsilon` with
    :math:`\theta \leftarrow \theta - \epsilon \nabla \hat L`, :math:`L = U/N`);
    :math:`P = \epsilon / N` maps them here. ``noise`` is ``C`` as ``(D,)`` (diagonal only)
    or ``(D, D)`` (see :func:`lift_noise` for directions without gradient noise).
    Returns ``()``, ``(D,)`` or ``(D, D)``.
    """
    noise = np.asarray(noise, dtype=np.float64)
    scale = 2.0 * batch_size / data_size**2
    diag = np.diag(noise) if noise.ndim == 2 else noise
    if kind == "scalar":
        return np.asarray(
            kl_optimal_scalar_step(float(diag.sum()), diag.size, data_size, batch_size)
        )
    if kind == "diagonal":
        return scale * inverse_noise(diag)
    if kind == "full":
        if noise.ndim != 2:
            raise ValueError("the full preconditioner needs a (D, D) noise covariance")
        return scale * inverse_noise(noise)
    raise ValueError(f"preconditioner must be 'scalar', 'diagonal' or 'full', got {kind!r}.")


def iasg_preconditioner(
    noise: np.ndarray,
    kind: PreconditionerKind,
    data_size: int,
    learning_rate: float,
) -> np.ndarray:
    r"""IASG's preconditioner :math:`P = (\epsilon / N)\, \hat C^{-1}` (Mandt et al. 2017, §6).

    With :math:`A = C` the preconditioned per-datum Hessian is the identity, so the
    step-size window :math:`B/(N\lambda_{min}) \ll \epsilon < 2/\lambda_{max}` of §6.2 holds
    for :math:`\epsilon \approx 0.5` whatever the scaling of the parameters. ``"scalar"`` uses
    :math:`\epsilon D / (N \operatorname{Tr} C)`.
    """
    noise = np.asarray(noise, dtype=np.float64)
    diag = np.diag(noise) if noise.ndim == 2 else noise
    if kind == "scalar":
        return np.asarray(learning_rate * diag.size / (data_size * max(diag.sum(), 1e-300)))
    if kind == "diagonal":
        return learning_rate / data_size * inverse_noise(diag)
    return learning_rate / data_size * inverse_noise(noise)


def iasg_window(target: float, learning_rate: float) -> int:
    r"""IASG window ``T`` whose mean has the variance of ``target`` independent iterates' worth.

    Along a direction where the preconditioned Hessian is ε (A = C), the iterates are AR(1)
    with :math:`\rho = 1 - \epsilon` and long-run variance :math:`1/(Bc)` per iterate. The mean
    of ``T`` consecutive ones has variance

    .. math::

        \frac{1}{BcT}\Big[1 - \frac{2\rho(1-\rho^T)}{T(1-\rho)(1+\rho)}\Big]
        \approx \frac{1}{BcT}\Big(1 - \frac{1}{\epsilon T}\Big),

    smaller than :math:`1/(BcT)` because a finite window does not see the correlations that
    reach outside it (measured: marginal variances 8–14% too small with ε·T = 10). The
    returned ``T`` is the smallest window for which that variance is at most
    :math:`1/(Bc\,\mathrm{target})` — with ``target = N/B`` the posterior variance
    :math:`1/(Nc)` — i.e. about ``target − 1/ε``.
    """
    rho = 1.0 - learning_rate
    t = np.arange(1, int(np.ceil(target)) + 1, dtype=np.float64)
    deficit = 2.0 * rho * (1.0 - rho**t) / (t * (1.0 - rho) * (1.0 + rho))
    effective = t / np.maximum(1.0 - deficit, 1e-12)
    reached = np.nonzero(effective >= target)[0]
    return int(t[reached[0]]) if reached.size else int(np.ceil(target))


def lanczos_extremes(
    matvec: Callable[[np.ndarray], np.ndarray],
    dim: int,
    steps: int = 80,
    seed: int = 0,
) -> tuple[float, float]:
    """Smallest and largest eigenvalue of a symmetric ``dim × dim`` operator given by its
    products, by ``min(steps, dim)`` Lanczos steps with full reorthogonalisation.

    The extreme Ritz values lie inside the spectrum and converge to its ends much faster than
    power iteration does (which, on a spread spectrum, understated a relaxation time several
    fold in 20 iterations). So the first value is an estimate of the smallest eigenvalue from
    above, the second of the largest from below; with ``steps ≥ dim``, or when the Krylov space
    closes early (few distinct eigenvalues), they are exact up to rounding."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=dim)
    basis = [v / np.linalg.norm(v)]
    alphas: list[float] = []
    betas: list[float] = []
    for _ in range(min(steps, dim)):
        w = np.asarray(matvec(basis[-1]), dtype=np.float64)
        alphas.append(float(basis[-1] @ w))
        q = np.array(basis)
        for _ in range(2):  # twice is enough (Kahan–Parlett)
            w = w - q.T @ (q @ w)
        beta = float(np.linalg.norm(w))
        scale = max(abs(a) for a in alphas) + (betas[-1] if betas else 0.0)
        if not np.isfinite(beta) or beta <= 1e-10 * max(scale, 1e-300):
            break  # an invariant subspace: the Ritz values are eigenvalues
        betas.append(beta)
        basis.append(w / beta)
    k = len(alphas)
    tri = np.diag(alphas) + np.diag(betas[: k - 1], 1) + np.diag(betas[: k - 1], -1)
    ritz = np.linalg.eigvalsh(tri)
    return float(ritz[0]), float(ritz[-1])
