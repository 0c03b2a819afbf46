"""Exceptions raised by pymc_sgmcmc; each message names the variable at fault and the fix."""

from __future__ import annotations

from pymc.exceptions import SamplingError

__all__ = ["DataShapeError", "DivergenceError", "ModelNotSupportedError"]


class ModelNotSupportedError(ValueError):
    """The model cannot be sampled by a stochastic-gradient method as it stands."""


class DataShapeError(ValueError):
    """Data containers or ``batch_size`` are inconsistent with the data axis."""


class DivergenceError(SamplingError):
    """A chain produced a non-finite position, loss or gradient.

    Raised by ``pm.sample`` when a chain diverged after tuning: the chain was stopped there and
    the draws sampled before it — of every chain — are in its ``idata`` (the diverged draw is
    flagged ``diverging=True`` in ``sample_stats``). Raised at once when a tuning draw still
    diverged after its step was halved several times.

    Attributes
    ----------
    idata
        What ``pm.sample`` would have returned for the draws before the divergence (``None``
        when raised by a step method directly).
    chains
        ``[(chain, draw), ...]`` of the diverged chains, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        draw: int | None = None,
        stopped_chain: bool = False,
        idata: object = None,
        chains: list | None = None,
    ) -> None:
        super().__init__(message)
        self.draw = draw
        self.stopped_chain = stopped_chain
        self.idata = idata
        self.chains = chains or []

    def __reduce__(self):  # keep the attributes across PyMC's worker processes
        return (
            _rebuild_divergence,
            (self.args[0] if self.args else "", self.draw, self.stopped_chain),
        )


def _rebuild_divergence(message: str, draw: int | None, stopped_chain: bool) -> DivergenceError:
    return DivergenceError(message, draw=draw, stopped_chain=stopped_chain)
