"""The bridge's checks of the data before anything compiles: non-finite rows, imputed
observed values, and variables whose leading axis does not line up with the data's rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pymc as pm
import pytensor
from pytensor.compile.ops import ViewOp
from pytensor.graph.basic import Variable

from pymc_sgmcmc.adapter.minibatch_models import _data_leaf_value, _optional_op_types
from pymc_sgmcmc.errors import DataShapeError, ModelNotSupportedError, non_finite_rows


def _imputations(model: pm.Model) -> list[tuple[str, Variable, Variable]]:
    """``(name, observed part, imputed free part)`` of every observed variable with missing data.

    Given ``observed=`` data with NaNs (or a masked array), PyMC registers the observed entries
    as an observed variable ``{name}_observed``, the missing ones as a free variable
    ``{name}_unobserved``, and records the split in the model as the Deterministic ``{name}``
    that writes both back into one array (``set_subtensor`` into an empty array, one mask
    each). That Deterministic is what is detected, not the names; the general case (a
    ``PartialObservedRV`` node, which makes both parts) is detected from the op as well.
    """
    observed, free = set(model.observed_RVs), set(model.free_RVs)
    found: list[tuple[str, Variable, Variable]] = []
    for det in model.deterministics:
        var = det
        while var.owner is not None and isinstance(var.owner.op, ViewOp):
            var = var.owner.inputs[0]
        written = []
        while var.owner is not None and getattr(var.owner.op, "set_instead_of_inc", False):
            written.append(var.owner.inputs[1])
            var = var.owner.inputs[0]
        obs = [w for w in written if w in observed]
        unobs = [w for w in written if w in free]
        if obs and unobs:
            found.append((det.name, obs[0], unobs[0]))
    partial_ops = _optional_op_types("pymc.distributions.distribution:PartialObservedRV")
    seen = {o for _, o, _ in found}
    for rv in model.observed_RVs:
        if rv not in seen and partial_ops and isinstance(rv.owner.op, partial_ops):
            unobs = [o for o in rv.owner.outputs if o in free]
            name = rv.name.removesuffix("_observed") if rv.name else rv.name
            found.append((name, rv, unobs[0] if unobs else rv))
    return found


def _check_imputation(model: pm.Model) -> None:
    for name, obs, unobs in _imputations(model):
        raise ModelNotSupportedError(
            f"The observed data of {name!r} have missing values (NaN or masked entries): drop "
            "those rows before building the model — keep = ~np.isnan(data), then "
            "observed=data[keep] and [keep] of every row-aligned array (predictors, group "
            "indices) — or sample this model with pm.sample() (NUTS), which imputes them. "
            f"(PyMC split {name!r} into the observed {obs.name!r} and the free variable "
            f"{unobs.name!r} that imputes the missing entries, and the stochastic-gradient "
            "samplers cannot minibatch that split likelihood: its rows no longer line up with "
            "the other data's. A NaN in a pm.Data predictor is the same case: PyMC's advice to "
            "pass it as observed leads here.)"
        )


def check_finite_rows(name: str, value: Any, data_size: int) -> None:
    """Refuse a minibatched container with non-numeric or non-finite values, naming it and
    its first bad row (NUTS reports these as a model it cannot evaluate at the start; here
    they would only surface as a divergence)."""
    array = np.asarray(value)
    shape = "x".join(map(str, array.shape))
    if array.dtype.kind not in "biuf":
        raise DataShapeError(
            f"The data in {name} ({shape}, dtype {array.dtype}) are not numeric: the "
            "stochastic-gradient samplers need numbers in every minibatched container. "
            "Encode categories as integer codes (e.g. pandas.factorize) and convert the "
            "column with .astype(float) or .astype(int)."
        )
    if array.dtype.kind != "f" or np.all(np.isfinite(array)):
        return
    bad = ~np.isfinite(array.reshape(array.shape[0], -1)).all(axis=1)
    rows = np.flatnonzero(bad)
    raise non_finite_rows(name, array.shape, rows, array[rows[0]], data_size, streamed=False)


class NotRowSeparable(DataShapeError):
    """The minibatched likelihood is not a sum of one term per row (``names``: its observed
    variables). :func:`pymc_sgmcmc.adapter.bridge.build_problem` then reads the whole
    likelihood as one term where every row is read anyway, else raises this."""

    def __init__(self, message: str, names: list[str], data_size: int) -> None:
        super().__init__(message)
        self.names = names
        self.data_size = data_size


def _probe_rows(
    model: pm.Model,
    sampled: list[Variable],
    fixed: list[Variable],
    placeholders: list[Variable],
    data_arrays: list[np.ndarray],
    rows_graph: Variable,
    initial_point: dict[str, np.ndarray],
    mb_names: list[str],
    data_size: int,
    full_rows_graph: Variable,
    row_locals: bool,
) -> None:
    """Evaluate the row graph on 2-row batches (NumPy, no JAX) to catch misaligned data and
    likelihoods that are not a sum over rows.

    The rows of a batch must reproduce the full graph's terms for those rows
    (``full_rows_graph``, before any slicing): at the first rows, and in the middle of the
    data. A likelihood that links rows — a time series' recursion (``pm.AR``, a GARCH written
    with ``scan``), a covariance across rows (a Gaussian process) — computes other terms
    from a slice, or none of the right shape. With row-aligned local variables
    (``row_locals``) the same comparison catches a local that the likelihood reads other than
    row by row.

    A container the likelihood reads whose row count disagrees with ``N`` (say ``X`` with one
    row more than ``y``) is not sliced, so the batch's rows would broadcast against all of it;
    that surfaces here as a shape error, reported with every container's leading length.
    """
    probe_rows = min(2, data_size)
    fn = pytensor.function(
        [*sampled, *fixed, *placeholders],
        rows_graph,
        mode="FAST_COMPILE",
        on_unused_input="ignore",
    )
    args = [initial_point[v.name] for v in (*sampled, *fixed)]
    starts = sorted({0, max(0, data_size // 2 - 1)})
    outs = []
    for start in starts:
        try:
            out = np.asarray(fn(*args, *[a[start : start + probe_rows] for a in data_arrays]))
        except (ValueError, IndexError, AssertionError) as err:
            raise NotRowSeparable(
                str(_misaligned(model, mb_names, data_size, err)), mb_names, data_size
            ) from err
        if out.shape != (probe_rows,):
            raise NotRowSeparable(
                str(
                    _misaligned(
                        model,
                        mb_names,
                        data_size,
                        f"a {probe_rows}-row minibatch gave log-likelihood rows of shape "
                        f"{out.shape}",
                    )
                ),
                mb_names,
                data_size,
            )
        outs.append(out)
    full_fn = pytensor.function(
        [*sampled, *fixed], full_rows_graph, mode="FAST_COMPILE", on_unused_input="ignore"
    )
    try:
        full = np.asarray(full_fn(*args))
    except (ValueError, IndexError, AssertionError) as err:
        raise NotRowSeparable(
            str(_misaligned(model, mb_names, data_size, err)), mb_names, data_size
        ) from err
    same = full.shape == (data_size,) and all(
        np.allclose(out, full[start : start + probe_rows], rtol=1e-6, atol=1e-8, equal_nan=True)
        for start, out in zip(starts, outs, strict=True)
    )
    if same:
        return
    if row_locals:
        raise ModelNotSupportedError(
            "A local variable whose leading axis is the data axis is read by the "
            "likelihood other than row by row (the minibatch's rows do not reproduce the "
            "full data's), so it cannot be minibatched with the data. Make the local's "
            "leading axis differ from the data's, or index it with a row-aligned integer "
            "array (pm.Data) in the likelihood."
        )
    raise NotRowSeparable(
        f"The likelihood of {mb_names} is not a sum over rows: the log-density of rows "
        f"{starts[-1]}-{starts[-1] + probe_rows - 1} computed from those rows alone differs "
        "from their terms in the whole likelihood (it links rows: a time series' recursion, a "
        "covariance across rows, a sum over the data).",
        mb_names,
        data_size,
    )


def _misaligned(
    model: pm.Model, mb_names: list[str], data_size: int, problem: object
) -> DataShapeError:
    """The error for row-misaligned data: an observed column of shape (N, 1) by name (with
    its fix), else every data container's leading length."""
    if isinstance(problem, BaseException):
        problem = f"{type(problem).__name__}: {str(problem).splitlines()[0]}"
    for rv in model.observed_RVs:
        value = _data_leaf_value(model.rvs_to_values[rv])
        if (
            value is not None
            and value.ndim >= 2
            and value.shape[0] == data_size
            and all(size == 1 for size in value.shape[1:])
        ):
            return DataShapeError(
                f"Observed variable {rv.name!r} has data of shape {value.shape}: one value per "
                f"row, as a column. Its distribution's parameters have one value per row, shape "
                f"({data_size},), and broadcast against ({data_size}, 1) to {data_size} x "
                f"{data_size}. Pass the values as a vector: observed=y.ravel() (shape "
                f"({data_size},)). ({problem})"
            )
    lengths = {}
    for v in model.data_vars:
        value = _data_leaf_value(v)
        if value is not None and value.ndim >= 1:
            lengths[v.name] = int(value.shape[0])
    return DataShapeError(
        f"The data of the minibatched likelihood ({mb_names}) are not row-aligned: the "
        f"observed data have N={data_size} rows, and the data containers have leading "
        f"lengths {lengths} ({problem}). Give every row-aligned container (X, y, group "
        "indices...) the same number of rows, or name the containers to minibatch with "
        "minibatch_data=[...]."
    )
