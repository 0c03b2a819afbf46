"""Exceptions raised by pymc_sgmcmc; each message names the variable at fault and the fix."""

from __future__ import annotations

from pymc.exceptions import SamplingError

__all__ = ["DataShapeError", "DivergenceError", "ModelNotSupportedError"]


class ModelNotSupportedError(ValueError):
    """The model cannot be sampled by a stochastic-gradient method as it stands."""


class DataShapeError(ValueError):
    """Data containers or ``batch_size`` are inconsistent with the data axis."""


class DivergenceError(SamplingError):
    """A chain produced a non-finite position, loss or gradient."""
