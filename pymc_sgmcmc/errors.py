"""Exceptions raised by pymc_sgmcmc; each message names the variable at fault and the fix."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DataShapeError", "DivergenceError", "ModelNotSupportedError", "NoDrawsError"]


class ModelNotSupportedError(ValueError):
    """The model cannot be sampled by a stochastic-gradient method as it stands."""


class DataShapeError(ValueError):
    """Data containers or ``batch_size`` are inconsistent with the data axis."""


class NoDrawsError(ValueError):
    """A run stopped (Ctrl-C) before any chain got past tuning, with the tuning draws
    discarded: there is nothing to return."""


def non_finite_rows(
    name: str, shape: tuple, rows: np.ndarray, values: Any, data_size: int, *, streamed: bool
) -> DataShapeError:
    """The error for NaN or inf in minibatched data: ``rows`` are the bad rows' numbers
    (all of them in memory; those in the chunk just read when ``streamed``)."""
    where = (
        f"at row {int(rows[0])} (found in a chunk read while sampling; the array has "
        f"{data_size} rows)"
        if streamed
        else f"in {rows.size} of {data_size} rows, the first at row {int(rows[0])}"
    )
    array = name.strip("'\"") if name.strip("'\"").isidentifier() else "data"
    finite = f"np.isfinite({array})" + (".all(axis=1)" if len(shape) == 2 else "")
    if len(shape) > 2:
        finite = f"np.isfinite({array}).reshape(len({array}), -1).all(axis=1)"
    how = (
        "write a copy without them (or with them completed) and pass that as data="
        if streamed
        else f"drop those rows before building the model — mask = {finite}, then keep "
        f"[mask] of every row-aligned array ({array}[mask] and the others: predictors, group "
        "indices) — or complete them (impute)"
    )
    return DataShapeError(
        f"The data in {name} ({'x'.join(map(str, shape))}) have non-finite values (NaN or "
        f"inf) {where}: {np.asarray(values).tolist()!r}. Missing values are not supported in "
        f"minibatched data: {how}."
    )


class DivergenceError(RuntimeError):
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
