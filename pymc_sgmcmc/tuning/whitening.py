r"""The affine whitening every sampler is tuned in: :math:`\theta = c + L z` with
:math:`L L^\top = A^{-1}`, ``A`` the measured curvature (Hessian of the potential ``U``).

Why. Natural units give condition numbers of 10⁴–10¹² (an intercept next to a predictor in
dollars), and directions that only the prior informs have gradient noise zero. A rate computed
in θ — from the gradient noise ``C`` alone, as Mandt et al.'s theorems do under the Fisher
identity ``A = N C`` — is then wrong by as much. In ``z`` the posterior is close to
:math:`\mathcal N(0, I)` whatever the units: every rate below is computed there, and a
rescaled or shifted predictor leaves ``z`` unchanged (up to the estimation noise of ``A``).

``A`` is kept as an eigendecomposition :math:`A = V \operatorname{diag}(w) V^\top` (dense, up to
:data:`DENSE_MAX_DIM` = 500 dimensions) or as its diagonal (the fallback above it, where a ``D × D``
matrix would not fit or cost ``O(D^3)`` per retune; correlations between coordinates are then
not whitened, and a strongly coupled direction relaxes more slowly). :math:`L = V
\operatorname{diag}(w^{-1/2})`, so the coordinates of ``z`` are ``A``'s eigendirections: a
direction of the posterior that only the prior informs is one coordinate of ``z``.

The eigenvalues are taken in absolute value and floored at ``FLOOR·max(w)`` (Hessians measured
away from a mode can be indefinite; the saddle-free Newton choice of |w| keeps the metric
positive).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DENSE_MAX_DIM", "FLOOR", "Whitening", "psd_sqrt", "resolve_preconditioner"]

DENSE_MAX_DIM = 500
"""Up to this many dimensions the whitening is dense (a ``D × D`` curvature: 2 MB, and an
``O(D³)`` eigendecomposition of ~15 ms per retune at 500); above it, diagonal."""


def resolve_preconditioner(preconditioner: str | None, dim: int) -> str | None:
    """``"auto"`` as ``"full"`` up to :data:`DENSE_MAX_DIM` dimensions, else ``"diagonal"``;
    ``"full"`` above it refused (the tuning measures the curvature and the noise as diagonals
    there: it would be a diagonal whitening under a dense name); anything else as given."""
    if preconditioner == "auto":
        return "full" if dim <= DENSE_MAX_DIM else "diagonal"
    if preconditioner == "full" and dim > DENSE_MAX_DIM:
        raise ValueError(
            f"preconditioner='full' needs the {dim}x{dim} curvature and gradient-noise "
            f"matrices, measured up to {DENSE_MAX_DIM} dimensions only; above it use "
            "preconditioner='diagonal' (or 'auto', which chooses it)."
        )
    return preconditioner


FLOOR = 1e-14
"""Relative floor of the curvature's eigenvalues: natural-units posteriors reach condition
numbers of 10¹², float64 resolves eigenvalues down to ~10⁻¹⁶ of the largest."""


def psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric PSD matrix (negative eigenvalues clipped to 0), or
    the elementwise square root of a ``(D,)`` diagonal."""
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim == 1:
        return np.sqrt(np.maximum(matrix, 0.0))
    w, v = np.linalg.eigh(0.5 * (matrix + matrix.T))
    return (v * np.sqrt(np.maximum(w, 0.0))) @ v.T


@dataclass(frozen=True)
class Whitening:
    """``θ = center + L z`` with ``L Lᵀ = A⁻¹``; ``A`` dense (eigenvalues ``w``, vectors ``V``)
    or diagonal (``vectors`` is None)."""

    eigenvalues: np.ndarray
    vectors: np.ndarray | None

    @classmethod
    def from_curvature(cls, curvature: np.ndarray, floor: float = FLOOR) -> Whitening:
        """From a measured Hessian of the potential: ``(D, D)`` (dense) or ``(D,)`` (its
        diagonal)."""
        curvature = np.asarray(curvature, dtype=np.float64)
        if curvature.ndim == 1:
            w, v = np.abs(curvature), None
        else:
            w, v = np.linalg.eigh(0.5 * (curvature + curvature.T))
            w = np.abs(w)
        if not np.all(np.isfinite(w)):
            raise FloatingPointError("the measured curvature has non-finite entries")
        top = max(float(w.max(initial=0.0)), 1e-300)
        return cls(np.maximum(w, floor * top), v)

    @classmethod
    def identity(cls, dim: int, dense: bool = True) -> Whitening:
        return cls(np.ones(dim), np.eye(dim) if dense else None)

    @property
    def dense(self) -> bool:
        return self.vectors is not None

    @property
    def dim(self) -> int:
        return int(self.eigenvalues.shape[0])

    @property
    def condition_number(self) -> float:
        return float(self.eigenvalues.max() / self.eigenvalues.min())

    def precision(self) -> np.ndarray:
        """``A`` (``(D, D)`` or ``(D,)``)."""
        if self.vectors is None:
            return self.eigenvalues.copy()
        return (self.vectors * self.eigenvalues) @ self.vectors.T

    def covariance(self) -> np.ndarray:
        """``A⁻¹`` — the Laplace covariance at the measured curvature."""
        if self.vectors is None:
            return 1.0 / self.eigenvalues
        return (self.vectors / self.eigenvalues) @ self.vectors.T

    def factor(self) -> np.ndarray:
        """``L`` with ``L Lᵀ = A⁻¹``: ``θ − c = L z``."""
        if self.vectors is None:
            return 1.0 / np.sqrt(self.eigenvalues)
        return self.vectors / np.sqrt(self.eigenvalues)

    def to_whitened(self, matrix: np.ndarray) -> np.ndarray:
        """A covariance of gradients (θ units) in ``z``: ``Lᵀ M L``. A ``(D,)`` diagonal ``M``
        with a dense whitening is taken as ``diag(M)``."""
        matrix = np.asarray(matrix, dtype=np.float64)
        if self.vectors is None:
            root = 1.0 / np.sqrt(self.eigenvalues)
            if matrix.ndim == 2:  # a dense covariance in a diagonal whitening stays dense
                out = root[:, None] * matrix * root[None, :]
                return 0.5 * (out + out.T)
            return matrix / self.eigenvalues
        if matrix.ndim == 1:
            matrix = np.diag(matrix)
        lt = self.factor()
        out = lt.T @ matrix @ lt
        return 0.5 * (out + out.T)

    def position_noise_factor(self, whitened_cov: np.ndarray) -> np.ndarray:
        """``R`` with ``R Rᵀ = L Q Lᵀ``: the θ-space factor of Gaussian noise whose covariance
        is ``Q`` in ``z`` (``(D, D)``, or ``(D,)`` with a diagonal whitening)."""
        root = psd_sqrt(whitened_cov)
        if self.vectors is None:
            scale = 1.0 / np.sqrt(self.eigenvalues)
            return scale[:, None] * root if root.ndim == 2 else scale * root
        return self.factor() @ root

    def metric_from_whitened(self, whitened_cov: np.ndarray) -> np.ndarray:
        """``L Q Lᵀ`` (θ units) of a ``z`` covariance ``Q``."""
        q = np.asarray(whitened_cov, dtype=np.float64)
        if self.vectors is None:
            scale = 1.0 / np.sqrt(self.eigenvalues)
            if q.ndim == 2:
                return scale[:, None] * q * scale[None, :]
            return q / self.eigenvalues
        lt = self.factor()
        if q.ndim == 1:
            return (lt * q) @ lt.T
        out = lt @ q @ lt.T
        return 0.5 * (out + out.T)
