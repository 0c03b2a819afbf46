r"""Model checking at scale: pointwise log-likelihood on a subsample of rows, subsampled LOO.

``pm.compute_log_likelihood`` stores one number per row and posterior draw: 10⁶ rows ×
2 000 draws × 8 bytes = 16 GB, before ``az.loo`` makes its own copies. Two ways that fit:

- :func:`log_likelihood`: the pointwise log-likelihood on the rows you pick (a seeded simple
  random sample of them, or your own indices), computed a chunk of draws at a time, as an
  InferenceData ``log_likelihood`` group whose row coordinate keeps the original row numbers.
  Refuses, naming the size, when the result would exceed a memory budget.
- :func:`~pymc_sgmcmc.adapter.loo.loo_subsample`: the PSIS-LOO elpd of all N rows estimated from m of them with the
  difference estimator of Magnusson et al. (2020): the log density at the posterior mean
  for every row (one pass over the data) plus exact PSIS-LOO on the m sampled rows, with
  the subsampling standard error. Memory: N + m × draws numbers.

The pointwise terms are PyMC's own (the observed variables' elementwise ``logp``, as in
``pm.compute_log_likelihood``), with the row-aligned data containers found by
:func:`~pymc_sgmcmc.build_problem` replaced by the selected rows, compiled with JAX.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import xarray as xr
from pymc.logprob.basic import transformed_conditional_logp
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import graph_inputs

from pymc_sgmcmc.adapter.bridge import _replace_shared_scalars, _rows_to_batch_length, build_problem
from pymc_sgmcmc.adapter.bridge_jax import _jaxify
from pymc_sgmcmc.adapter.minibatch_models import _data_leaf_value, _full_data_model
from pymc_sgmcmc.adapter.precision import in_float64
from pymc_sgmcmc.adapter.results import (
    as_dataset,
    from_groups,
    get_group,
    is_result,
    set_group,
)

__all__ = ["log_likelihood"]

MEMORY_BUDGET = 2e9
"""Default ``memory_budget`` in bytes (2 GB) of :func:`log_likelihood` and :func:`~pymc_sgmcmc.adapter.loo.loo_subsample`."""

_CHUNK_BYTES = 64e6  # target size of one chunk's output when chunk_draws/chunk_rows are not given
SAMPLE_DIMS = ("chain", "draw")


# ---------------------------------------------------------------------------------------
# The pointwise log-likelihood graphs, on a placeholder for the selected rows
# ---------------------------------------------------------------------------------------


@dataclass
class _RowLikelihood:
    """The observed variables' elementwise logp as a JAX function of values and data rows."""

    model: pm.Model
    names: tuple[str, ...]  # observed variables
    trailing: tuple[tuple[int, ...], ...]  # each one's shape after the row axis
    input_names: tuple[str, ...]  # free variables the terms read (constrained values)
    input_dtypes: tuple[str, ...]
    data: tuple[np.ndarray, ...]  # the row-aligned arrays, all N rows
    data_size: int
    dtype: str
    _fn: Any = field(repr=False)
    _jit: dict = field(default_factory=dict, repr=False)

    @property
    def row_width(self) -> int:
        """Numbers per row and draw, summed over the variables (their trailing sizes)."""
        return sum(math.prod(t) for t in self.trailing)

    def _compiled(self, kind: str):
        if kind not in self._jit:
            import jax
            import jax.numpy as jnp

            fn = self._fn

            def terms(values, data):
                return tuple(fn(*values, *data))

            def totals(values, data):
                out = terms(values, data)
                return sum(jnp.reshape(t, (t.shape[0], -1)).sum(axis=1) for t in out)

            body = terms if kind.endswith("terms") else totals
            if kind.startswith("draws"):
                body = jax.vmap(body, in_axes=(0, None))
            self._jit[kind] = jax.jit(body)
        return self._jit[kind]

    def evaluate(self, kind: str, values: Sequence[np.ndarray], data: Sequence[np.ndarray]):
        """``kind``: ``"draws_terms"``, ``"draws_totals"`` (values have a leading draw axis)
        or ``"point_totals"`` (one parameter point)."""
        out = self._compiled(kind)(tuple(values), tuple(data))
        return out

    def check_rows(self, outputs: Sequence[np.ndarray], n_rows: int, leading: int) -> None:
        for name, out, trailing in zip(self.names, outputs, self.trailing, strict=True):
            if out.shape[leading:] != (n_rows, *trailing):
                raise ValueError(
                    f"The pointwise log-likelihood of {name!r} on {n_rows} selected rows has "
                    f"shape {out.shape[leading:]}, not {(n_rows, *trailing)}: it does not follow "
                    "the selected rows. Does its likelihood read a free variable with one entry "
                    "per row, or data that are not row-aligned? Use pm.compute_log_likelihood "
                    "for this model."
                )


def _row_likelihood(model: pm.Model, var_names: Sequence[str] | None) -> _RowLikelihood:
    # The data axis, its length N and its row-aligned containers are the bridge's, so the
    # rows here are the rows the samplers minibatch; a model written for minibatch ADVI
    # (pm.Minibatch, total_size) is read as its full-data equivalent, as the samplers read
    # it. vars=[]: nothing sampled, so discrete free variables (sampled by another step) are
    # not refused.
    model = _full_data_model(model)
    problem = build_problem(model, vars=[])
    data_size = problem.data_size
    on_axis = list(problem.minibatched_observed)
    if var_names is None:
        names = on_axis
    else:
        if isinstance(var_names, str):
            var_names = [var_names]
        observed = [rv.name for rv in model.observed_RVs]
        names = []
        for name in var_names:
            if name in problem.full_observed:
                raise ValueError(
                    f"var_names contains {name!r}, an observed variable whose data are not on "
                    f"the data axis (the {data_size} rows of {on_axis}): it has no rows to "
                    "select. Its log-likelihood is small; compute it with "
                    f"pm.compute_log_likelihood(idata, var_names=[{name!r}])."
                )
            if name not in on_axis:
                close = difflib.get_close_matches(str(name), observed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"var_names contains {name!r}, which is not an observed variable of the "
                    f"model{hint}. Observed variables on the data axis: {on_axis}."
                )
            names.append(name)
    rvs = [model[name] for name in names]

    # Constrained values (what the posterior holds), as pm.compute_log_likelihood uses after
    # remove_value_transforms; no Jacobian, no transforms.
    values = {rv: rv.type(name=rv.name) for rv in model.free_RVs}
    rvs_to_values = {**values, **{rv: model.rvs_to_values[rv] for rv in model.observed_RVs}}
    terms = transformed_conditional_logp(
        rvs, rvs_to_values=rvs_to_values, rvs_to_transforms={}, jacobian=False
    )

    # The row-aligned containers: those the bridge replaces by its batch placeholders.
    row_arrays = {id(a) for a in problem.data}
    leaves = []
    for var in graph_inputs(terms):
        value = _data_leaf_value(var)
        if value is None or value.ndim == 0:
            continue
        if id(value) in row_arrays or value.shape[0] == data_size:
            leaves.append(var)
    placeholders = [
        pt.tensor(
            name=f"rows_{i}",
            dtype=leaf.dtype,
            shape=(None, *_data_leaf_value(leaf).shape[1:]),
        )
        for i, leaf in enumerate(leaves)
    ]
    terms = clone_replace(
        terms, replace=dict(zip(leaves, placeholders, strict=True)), rebuild_strict=False
    )
    terms = _replace_shared_scalars(list(terms))
    terms = [_rows_to_batch_length(t, data_size, placeholders[0].shape[0]) for t in terms]

    used = set(graph_inputs(terms))
    inputs = [v for v in values.values() if v in used]
    # The logp keeps the value's batch dims and drops its core dims (an MvNormal's last).
    trailing = []
    for rv, term in zip(rvs, terms, strict=True):
        shape = np.shape(_data_leaf_value(model.rvs_to_values[rv]))
        trailing.append(tuple(int(s) for s in shape[1 : term.ndim]))

    dtype = str(pytensor.config.floatX)
    fn = _jaxify(inputs + placeholders, terms)
    return _RowLikelihood(
        model=model,
        names=tuple(names),
        trailing=tuple(trailing),
        input_names=tuple(v.name for v in inputs),
        input_dtypes=tuple(str(v.dtype) for v in inputs),
        data=tuple(np.asarray(_data_leaf_value(leaf)) for leaf in leaves),
        data_size=data_size,
        dtype=dtype,
        _fn=fn,
    )


# ---------------------------------------------------------------------------------------
# Rows, draws, chunks
# ---------------------------------------------------------------------------------------


def _select_rows(rows: Any, data_size: int, random_seed: Any) -> np.ndarray:
    """Sorted original row numbers: all, a seeded simple random sample, or the given ones."""
    if rows is None:
        return np.arange(data_size)
    if isinstance(rows, int | np.integer) and not isinstance(rows, bool):
        m = int(rows)
        if m < 1:
            raise ValueError(f"rows={m}: the number of rows to sample must be at least 1.")
        if m >= data_size:
            return np.arange(data_size)
        rng = np.random.default_rng(random_seed)
        return np.sort(rng.choice(data_size, size=m, replace=False))
    index = np.asarray(rows)
    if index.dtype == bool:
        if index.shape != (data_size,):
            raise ValueError(
                f"rows is a boolean mask of shape {index.shape}; it must have one entry per "
                f"row, shape ({data_size},)."
            )
        return np.flatnonzero(index)
    if index.ndim != 1 or index.size == 0 or index.dtype.kind not in "iu":
        raise ValueError(
            "rows must be None (all rows), an int (that many rows, a simple random sample "
            "without replacement), or a non-empty 1-D array of integer row indices; got "
            f"{type(rows).__name__} of shape {index.shape} and dtype {index.dtype}."
        )
    if index.min() < 0 or index.max() >= data_size:
        raise ValueError(
            f"rows holds indices outside 0..{data_size - 1} (min {index.min()}, max "
            f"{index.max()}); the data have N={data_size} rows."
        )
    if np.unique(index).size != index.size:
        raise ValueError("rows holds repeated indices; give each row at most once.")
    return index.astype(np.int64)


def _format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def _check_budget(
    n_rows: int, n_draws: int, width: int, itemsize: int, budget: float, what: str
) -> None:
    size = n_rows * n_draws * width * itemsize
    if size <= budget:
        return
    per_row = f" × {width} values" if width != 1 else ""
    fits = max(1, int(budget // (n_draws * width * itemsize)))
    raise ValueError(
        f"The {what} on {n_rows:,} rows × {n_draws:,} draws{per_row} × {itemsize} bytes is "
        f"{_format_bytes(size)}, above memory_budget={_format_bytes(budget)}. Pass rows= to "
        f"compute it on a subsample (rows={min(fits, 10_000):_} is a seeded simple random sample "
        "of that many rows; an array selects rows by index), use pmsg.loo_subsample for LOO, "
        "or raise memory_budget= if it fits in memory."
    )


def _posterior(idata: Any) -> xr.Dataset:
    idata = as_dataset(idata)  # a posterior group given as a DataTree node
    if isinstance(idata, xr.Dataset):
        return idata
    posterior = get_group(idata, "posterior") if is_result(idata) else None
    if posterior is None:
        raise ValueError("idata has no posterior group: pass the result of a sampling run.")
    return posterior


def _stacked_draws(posterior: xr.Dataset, lik: _RowLikelihood) -> tuple[list[np.ndarray], int]:
    missing = [name for name in lik.input_names if name not in posterior]
    if missing:
        raise ValueError(
            f"The posterior has no draws of {missing}, which the likelihood of "
            f"{list(lik.names)} reads. Pass the InferenceData the model was sampled into."
        )
    for dim in SAMPLE_DIMS:
        if dim not in posterior.dims:
            raise ValueError(
                f"The posterior has no {dim!r} dimension (dims: {dict(posterior.sizes)})."
            )
    n_draws = posterior.sizes["chain"] * posterior.sizes["draw"]
    arrays = []
    for name, dtype in zip(lik.input_names, lik.input_dtypes, strict=True):
        da = posterior[name].transpose(*SAMPLE_DIMS, ...)
        arrays.append(np.asarray(da.values, dtype=dtype).reshape(n_draws, *da.shape[2:]))
    return arrays, n_draws


def _padded(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` with its first axis filled up to ``size`` by repeating its last entry (one
    compiled shape for every chunk)."""
    short = size - array.shape[0]
    if short <= 0:
        return array
    return np.concatenate([array, np.repeat(array[-1:], short, axis=0)])


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _auto_chunk(total: int, per_item_bytes: float, chunk: int | None, name: str) -> int:
    if chunk is None:
        return int(max(1, min(total, _CHUNK_BYTES // max(per_item_bytes, 1))))
    if int(chunk) < 1:
        raise ValueError(f"{name}={chunk} must be at least 1.")
    return int(min(chunk, total))


def _draw_chunks(lik, values, n_draws, data, kind, chunk_draws, per_draw_bytes):
    """Evaluate ``kind`` over all draws in chunks; yields ``(start, stop, outputs)``."""
    size = _auto_chunk(n_draws, per_draw_bytes, chunk_draws, "chunk_draws")
    for start, stop in _chunks(n_draws, size):
        chunk = [_padded(v[start:stop], size) for v in values]
        out = lik.evaluate(kind, chunk, data)
        yield start, stop, out


# ---------------------------------------------------------------------------------------
# log_likelihood
# ---------------------------------------------------------------------------------------


@in_float64
def log_likelihood(
    idata: Any,
    model: pm.Model | None = None,
    *,
    rows: int | Sequence[int] | np.ndarray | None = None,
    var_names: Sequence[str] | None = None,
    random_seed: int | None = 0,
    extend_inferencedata: bool = False,
    chunk_draws: int | None = None,
    memory_budget: float = MEMORY_BUDGET,
) -> Any:
    """Pointwise log-likelihood for every posterior draw, on all rows or on a subsample.

    The same numbers as ``pm.compute_log_likelihood`` (the observed variables' elementwise
    log-probability at each draw), on the selected rows only, computed ``chunk_draws`` draws
    at a time, so that memory is the result plus one chunk. The result takes
    ``rows × draws × values per row × 8 bytes``: 16 GB for 10⁶ rows and 2 000 draws. Above
    ``memory_budget`` it is refused with that size; pass ``rows=`` then.

    Parameters
    ----------
    idata
        InferenceData with a ``posterior`` group (``chain``, ``draw``) holding every free
        variable the likelihood reads.
    model
        The PyMC model (default: the model on the context stack).
    rows
        ``None``: all N rows (refused above ``memory_budget``). An int ``m``: a simple random
        sample of ``m`` rows without replacement, seeded by ``random_seed`` (the same rows on
        every call with the same N, so two models of the same data are checked on the same
        rows). An array: the row indices (or a boolean mask over the N rows). The rows are
        those of the data axis the samplers minibatch (:func:`~pymc_sgmcmc.build_problem`).
    var_names
        Observed variables on the data axis (default: all of them). Observed variables whose
        data are not on the data axis are refused: use ``pm.compute_log_likelihood``.
    random_seed
        Seed of the row sample when ``rows`` is an int.
    extend_inferencedata
        ``True``: add the ``log_likelihood`` group to ``idata`` and return it (PyMC's
        default; an existing group is an error). ``False`` (default, so that a subsample never
        silently stands in for the full data in ``idata``): return a new InferenceData with
        ``idata``'s posterior and the ``log_likelihood`` group.
    chunk_draws
        Draws evaluated per call (default: about 64 MB of output per chunk).
    memory_budget
        Largest result in bytes (default 2 GB).

    Returns
    -------
    arviz.InferenceData
        Its ``log_likelihood`` group has one variable per observed variable, with dims
        ``(chain, draw, row_dim, ...)`` named as ``pm.compute_log_likelihood`` names them
        (the model's dims, else ``{name}_dim_0``...). The row dimension's coordinate holds the
        model's coordinate values at the selected rows, or the original row numbers when the
        model has none; the non-index coordinate ``row_index`` (``{row_dim}_row_index`` when
        variables have different row dims) always holds the original row numbers. The group's
        attrs hold ``n_rows_total`` (N) and ``n_rows`` (the rows selected).

    Raises
    ------
    ValueError
        The result above ``memory_budget`` (the message names its size), bad ``rows``, or
        ``var_names`` that are not observed variables on the data axis.

    Notes
    -----
    ``az.loo`` on a subsample's log-likelihood estimates the elpd of those ``m`` rows, not of
    all N; :func:`~pymc_sgmcmc.adapter.loo.loo_subsample` scales it to N with a standard error for the subsampling.
    """
    model = pm.modelcontext(model)
    posterior = _posterior(idata)
    lik = _row_likelihood(model, var_names)
    row_index = _select_rows(rows, lik.data_size, random_seed)
    values, n_draws = _stacked_draws(posterior, lik)
    itemsize = np.dtype(lik.dtype).itemsize
    _check_budget(
        row_index.size, n_draws, lik.row_width, itemsize, memory_budget, "pointwise log-likelihood"
    )
    data = [d[row_index] for d in lik.data]
    m = row_index.size
    out = [np.empty((n_draws, m, *t), dtype=lik.dtype) for t in lik.trailing]
    checked = False
    for start, stop, chunk in _draw_chunks(
        lik, values, n_draws, data, "draws_terms", chunk_draws, m * lik.row_width * itemsize
    ):
        chunk = [np.asarray(c) for c in chunk]
        if not checked:
            lik.check_rows(chunk, m, leading=1)
            checked = True
        for target, c in zip(out, chunk, strict=True):
            target[start:stop] = c[: stop - start]

    dataset = _log_likelihood_dataset(model, posterior, lik, out, row_index)
    if extend_inferencedata:
        set_group(idata, "log_likelihood", dataset)
        return idata
    return from_groups({"posterior": posterior, "log_likelihood": dataset})


def _log_likelihood_dataset(
    model: pm.Model,
    posterior: xr.Dataset,
    lik: _RowLikelihood,
    arrays: list[np.ndarray],
    row_index: np.ndarray,
) -> xr.Dataset:
    n_chains, n_draws = posterior.sizes["chain"], posterior.sizes["draw"]
    model_dims = model.named_vars_to_dims
    coords = {"chain": posterior["chain"].values, "draw": posterior["draw"].values}
    variables = {}
    row_dims = []
    for name, array in zip(lik.names, arrays, strict=True):
        declared = list(model_dims.get(name) or ())
        dims = []
        for k in range(array.ndim - 1):
            dim = declared[k] if k < len(declared) and declared[k] is not None else None
            dims.append(dim or f"{name}_dim_{k}")
        for k, dim in enumerate(dims):
            if dim in coords:
                continue
            labels = model.coords.get(dim)
            if k == 0:
                coords[dim] = (
                    np.asarray(labels)[row_index] if labels is not None else row_index.copy()
                )
            else:
                coords[dim] = (
                    np.asarray(labels) if labels is not None else np.arange(array.shape[k + 1])
                )
        row_dims.append(dims[0])
        variables[name] = (
            ("chain", "draw", *dims),
            array.reshape(n_chains, n_draws, *array.shape[1:]),
        )
    distinct = list(dict.fromkeys(row_dims))
    for dim in distinct:
        label = "row_index" if len(distinct) == 1 else f"{dim}_row_index"
        coords[label] = (dim, row_index.copy())
    attrs = {
        "n_rows_total": int(lik.data_size),
        "n_rows": int(row_index.size),
        "created_by": "pymc_sgmcmc.log_likelihood",
    }
    return xr.Dataset(variables, coords=coords, attrs=attrs)
