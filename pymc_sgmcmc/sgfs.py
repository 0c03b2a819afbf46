r"""Stochastic gradient Fisher scoring (Ahn et al. 2012), as analysed by Mandt et al. (2017, §5.2).

.. math::

    \theta \leftarrow \theta - H\,(\hat g(\theta) + e), \qquad e \sim \mathcal N(0, EE^\top),

i.e. :math:`\theta \leftarrow \theta - H \hat g + \xi` with :math:`\xi \sim \mathcal N(0, H
EE^\top H)`: Mandt's eq. 26 with the injected noise written in gradient units. ``H`` is the
KL-optimal preconditioner for the total gradient noise :math:`M = N^2 C/B + EE^\top`
(Theorem 5, Corollary 6) and the injected noise follows Mandt's stability rule for a largest
step ``h_max``. Notation (N-scale potential, per-datum noise ``C``) as on the samplers page
of the documentation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.constant_sgd import ConstantSGD
from pymc_sgmcmc.kernels.preconditioning import ArrowheadInjection, is_operator
from pymc_sgmcmc.tuning.rates import Rates

__all__ = ["SGFS", "sgfs_noise_floor"]

ATTRS_MAX_ENTRIES = 4096  # as for the preconditioner: larger injected covariances are summarised


def sgfs_noise_floor(
    noise: np.ndarray,
    data_size: int,
    batch_size: int,
    h_max: float,
    temperature: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    r"""Mandt's SGFS stability rule: raise the per-datum noise so that ``H_kk ≤ h_max``.

    The diagonal SGFS preconditioner (Corollary 6) is
    :math:`H_{kk} = 2T / (N^2 C_{kk}/B + EE^\top_{kk})` (``T`` the temperature). Injecting the
    least noise that keeps it at most ``h_max`` gives

    .. math::

        EE^\top_{kk} = \max\big(0,\; 2T/h_{max} - N^2 C_{kk}/B\big),

    which is Mandt's :math:`EE^\top_{kk} = 2/(h_{max} N) - BB^\top_{kk}` in this package's
    N-scale notation. In per-datum units (the noise the KL-optimal rules divide by) it floors
    the diagonal: :math:`C''_{kk} = \max(C_{kk},\, 2BT/(N^2 h_{max}))`, and the increase
    :math:`C''_{kk} - C_{kk}` is injected as gradient noise of N-scale variance
    :math:`(N^2/B)(C''_{kk} - C_{kk}) = EE^\top_{kk}`.

    Parameters
    ----------
    noise
        Per-datum gradient noise ``C``: ``(D,)`` diagonal or ``(D, D)``.
    data_size, batch_size
        ``N`` and ``B``.
    h_max
        Largest diagonal entry of ``H`` (positive).
    temperature
        ``T``: the tempered rate is ``T·H``, so the floor scales with ``T``.

    Returns
    -------
    (raised, increase)
        ``C''`` shaped like ``noise`` and the ``(D,)`` diagonal increase ``C'' − C``.

    Examples
    --------
    >>> raised, increase = sgfs_noise_floor(np.array([1.0, 1e-6]), 1000, 10, 1e-4)
    >>> increase  # floor 2B/(N² h_max) = 0.2
    array([0.      , 0.199999])
    """
    if not (h_max > 0 and math.isfinite(h_max)):
        raise ValueError(f"h_max must be a positive finite number, got {h_max!r}.")
    noise = np.asarray(noise, dtype=np.float64)
    floor = 2.0 * batch_size * temperature / (data_size**2 * h_max)
    diag = np.diag(noise) if noise.ndim == 2 else noise
    increase = np.maximum(floor - diag, 0.0)
    raised = noise + np.diag(increase) if noise.ndim == 2 else noise + increase
    return raised, increase


class SGFS(ConstantSGD):
    r"""Stochastic gradient Fisher scoring (Ahn et al. 2012; Mandt et al. 2017, §5.2).

    .. math::

        \theta \leftarrow \theta - H\,(\hat g(\theta) + e), \qquad
        e \sim \mathcal N(0, EE^\top)

    so the injected step noise :math:`He` has covariance :math:`H EE^\top H` (Mandt's eq. 26).

    **KL-optimal preconditioner and its batch-size scaling.** The minibatch gradient
    :math:`\hat g` averages ``B`` per-datum gradients and multiplies by ``N``, so its noise
    covariance is :math:`(N^2/B)\,C`; the injected :math:`e` is added after the average and is
    not divided by ``B``. The total N-scale gradient noise is :math:`M = N^2 C/B + EE^\top`.
    Near the mode the iterates are an Ornstein–Uhlenbeck process (one iteration per unit of
    time), :math:`d\theta = -H A_U \theta\,dt + H M^{1/2} dW`, whose stationary covariance
    solves :math:`H A_U \Sigma + \Sigma A_U H = H M H`. Putting :math:`\Sigma = A_U^{-1}`
    (the Laplace posterior) makes the left side :math:`2H`, so it is the solution exactly when
    :math:`H M = 2I`:

    .. math::

        H^* = 2\,(N^2 C/B + EE^\top)^{-1},

    which is also the KL minimiser (Theorem 5; Mandt's S = 1, L-scale form
    :math:`(2/N)(BB^\top + EE^\top)^{-1}` with :math:`P = H/N` and :math:`EE^\top_N = N^2
    EE^\top_L`). The posterior needs :math:`A_U = N A` with :math:`A = C` (the Fisher identity
    near the mode of a well-specified model), which is why the step is "Fisher scoring".
    With :math:`E = 0`, :math:`H^* = (2B/N^2)\,C^{-1}` — constant SGD's Theorem 2 rate,
    proportional to ``B``: a batch twice as large halves the gradient noise, so the step can
    double for the same stationary spread. Injected noise makes the rate less dependent on
    ``B``: where :math:`EE^\top \gg N^2 C/B`, :math:`H^* \approx 2 (EE^\top)^{-1}` whatever
    ``B``. ``"diagonal"`` uses :math:`H_{kk} = 2/(N^2 C_{kk}/B + EE^\top_{kk})` (Corollary 6);
    its stationary covariance is the Lyapunov solution above, narrower than the posterior when
    the posterior is correlated.

    **Stability rule** (Mandt, after Corollary 6). With ``h_max`` set, noise is injected where
    the gradient variance is small, so that :math:`H_{kk} \le h_{max}`:
    :math:`EE^\top_{kk} = \max(0,\, 2/h_{max} - N^2 C_{kk}/B)`
    (:func:`~pymc_sgmcmc.sgfs.sgfs_noise_floor`; times the temperature). For ``"diagonal"`` this makes
    :math:`H_{kk} = \min(h_{max}, 2B/(N^2 C_{kk}))` exactly. For ``"full"`` the rule floors the
    diagonal of ``M``, and :math:`H_{kk} = 2/(M_{kk}(1 - R_k^2))` with :math:`R_k^2` the squared
    multiple correlation of coordinate ``k`` with the others in ``M``: ``H_kk = h_max`` for a
    direction uncorrelated with the rest, at most :math:`h_{max}/(1-R_k^2)` in general.

    **How it is tuned** (as :class:`~pymc_sgmcmc.ConstantSGD`, which this subclasses). During
    ``tune`` the per-datum noise ``C`` is estimated online at the chain's position (per-example
    gradients, running mean over doubling windows) after a short search for the mode. In this
    package's notation :math:`P = H` and the kernel adds the injected noise to the gradient:
    raising ``C`` to :math:`C'' = C + (B/N^2)\operatorname{diag}(EE^\top)` and applying the
    KL-optimal rule to ``C''`` gives :math:`H = (2B/N^2) C''^{-1} = 2(N^2 C/B + EE^\top)^{-1}`,
    and the increase is injected. Two other increases of ``C`` are injected the same way:
    where the data do not inform a direction, ``C_kk`` is lifted to the curvature ``h_kk/N``
    (:func:`pymc_sgmcmc.tuning.lift_noise`), and if the spectral radius of ``H·A_U`` exceeds 1,
    ``H`` is scaled down by ``s`` and :math:`(1/s - 1)(N^2/B)\,C''` is injected — SGFS's own
    device of trading step size for injected noise, which leaves the stationary covariance
    unchanged. All of these only lower ``H``. ``H`` and ``EE`` are frozen after tuning; the
    tuned values are in ``step.precond_value`` and, per chain, in the ``sgmcmc_settings`` attrs
    (``"preconditioner_value"``; ``"injected_noise_value"``: the N-scale covariance of ``e``).

    Parameters
    ----------
    preconditioner
        ``"auto"`` (default: ``"full"`` up to 500 dimensions, else ``"diagonal"``),
        ``"full"`` (Theorem 5: the stationary distribution is the Gaussian posterior) or
        ``"diagonal"`` (Corollary 6).
    h_max
        Largest step :math:`H_{kk}` (in units of the unconstrained parameters per unit of
        N-scale gradient), or ``None`` (default: no extra noise).
    search_draws
        Tuning draws spent reaching the mode before ``C`` is averaged (default 5).
    **kwargs
        See :class:`~pymc_sgmcmc.ConstantSGD` and :class:`~pymc_sgmcmc.SGMCMCStep`
        (``batch_size``, ``temperature``, ``thin``, ``minibatch``, ``hyper_vars``, ...). There
        is no ``step_size`` (H is always tuned) and no ``momentum``.

    References
    ----------
    .. [1] Ahn, S., Korattikara, A., Welling, M. (2012). Bayesian posterior sampling via
       stochastic gradient Fisher scoring. ICML.
    .. [2] Mandt, S., Hoffman, M. D., Blei, D. M. (2017). Stochastic Gradient Descent as
       Approximate Bayesian Inference. JMLR 18(134), §5.2, Theorem 5, Corollary 6.
    """

    name = "sgfs"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        preconditioner: str = "auto",
        h_max: float | None = None,
        **kwargs: Any,
    ) -> None:
        for name, allowed in (("momentum", None), ("step_size", "auto")):
            if name in kwargs:
                if kwargs[name] != allowed:
                    raise TypeError(
                        f"SGFS has no {name} (got {name}={kwargs[name]!r}): its preconditioner "
                        "H is tuned from the gradient noise; bound it with h_max."
                    )
                del kwargs[name]
        if preconditioner not in ("auto", "full", "diagonal"):
            raise ValueError(
                f"SGFS preconditioner must be 'auto', 'full' or 'diagonal', got {preconditioner!r}."
            )
        if h_max is not None:
            if isinstance(h_max, bool) or not isinstance(h_max, int | float | np.number):
                raise ValueError(f"h_max must be None or a positive number, got {h_max!r}.")
            if not (h_max > 0 and math.isfinite(h_max)):
                raise ValueError(f"h_max must be None or a positive number, got {h_max!r}.")
            h_max = float(h_max)
        self.h_max: float | None = h_max
        super().__init__(vars, preconditioner=preconditioner, **kwargs)

    @classmethod
    def _valid_kwargs(cls) -> set[str]:
        return super()._valid_kwargs() - {"momentum", "step_size"}

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        # Constant SGD's rule (all the noise the minibatch gives, the rest injected), with the
        # step bounded so that every H_kk = h (A⁻¹)_kk ≤ h_max.
        if self.h_max is not None and whitening is not None:
            if getattr(whitening, "structured", False):
                diag = whitening.covariance_diagonal()
            else:
                cov = whitening.covariance()
                diag = np.diag(cov) if cov.ndim == 2 else cov
            cap = min(cap, self.h_max / max(float(diag.max()), 1e-300))
        return super()._rates(noise_z, cap, whitening)

    def injected_noise(self) -> np.ndarray:
        r"""The tuned N-scale covariance of the injected noise in gradient units,
        :math:`EE^\top = H^{-1} R R^\top H^{-1}` (the step adds :math:`H e = R\xi`):
        ``(D,)`` (its diagonal, for ``"diagonal"`` and a structured whitening) or ``(D, D)``."""
        tuned = self.tuned
        if isinstance(self.inject_value, ArrowheadInjection) and tuned is not None:
            # R = P K^½ diag(w) (the exact injection): P⁻¹R = K^½ diag(w)
            factor = self.inject_value
            return factor.root.gram_diagonal(np.asarray(factor.weights, dtype=np.float64) ** 2)
        if is_operator(self.inject_value) and tuned is not None:
            # P = C⁻ᵀ diag(q) C⁻¹ and R = C⁻ᵀ diag(r): P⁻¹R = C diag(r/q), so EEᵀ is
            # C diag(r²/q²) Cᵀ
            precond, factor = tuned.preconditioner, self.inject_value
            ratio = np.asarray(factor.weights) / np.maximum(np.asarray(precond.weights), 1e-300)
            return factor.chol.gram_diagonal(ratio**2)
        scale = np.asarray(self.inject_value, dtype=np.float64)
        if tuned is None:
            return scale @ scale.T if scale.ndim == 2 else scale**2
        precond = np.asarray(tuned.preconditioner, dtype=np.float64)
        if precond.ndim == 2 or scale.ndim == 2:
            full = precond if precond.ndim == 2 else np.diag(precond)
            root = np.linalg.solve(full, scale if scale.ndim == 2 else np.diag(scale))
            return root @ root.T
        return (scale / precond) ** 2

    def settings(self) -> dict[str, Any]:
        injected = self.injected_noise()
        if injected.size <= ATTRS_MAX_ENTRIES:
            summary: dict[str, Any] = {"injected_noise_value": injected.tolist()}
        else:
            diag = np.diag(injected) if injected.ndim == 2 else injected
            summary = {
                "injected_noise_diagonal_min": float(diag.min()),
                "injected_noise_diagonal_mean": float(diag.mean()),
                "injected_noise_diagonal_max": float(diag.max()),
            }
        return {
            **super().settings(),
            "step_size_rule": "sgfs_kl_optimal",
            "h_max": self.h_max,
            **summary,
        }
