"""Models written for minibatch ADVI (``pm.Minibatch`` slices, ``total_size=``), read as their
full-data equivalent for the bridge (:func:`_full_data_model`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

import numpy as np
import pymc as pm
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.traversal import ancestors, toposort
from pytensor.scalar.basic import Cast as ScalarCast
from pytensor.tensor.basic import get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.type_other import NoneTypeT

from pymc_sgmcmc.errors import ModelNotSupportedError


def _data_leaf_value(var: Variable) -> np.ndarray | None:
    """The numeric value of a graph leaf that holds data, or None for anything else."""
    if isinstance(var, SharedVariable):
        if isinstance(var.type, RandomType):
            return None
        return np.asarray(var.get_value(borrow=True))
    if isinstance(var, Constant):
        return np.asarray(var.data)
    return None


def _optional_op_types(*paths: str) -> tuple[type, ...]:
    """The PyMC classes at ``module:name`` paths that this PyMC version has."""
    found = []
    for path in paths:
        module, name = path.split(":")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _minibatch_op_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """PyMC's ``pm.Minibatch`` op, its ``minibatch_index`` draw, and ``total_size``'s op."""
    return (
        _optional_op_types("pymc.data:MinibatchOp"),
        _optional_op_types("pymc.data:MinibatchIndexRV"),
        _optional_op_types("pymc.variational.minibatch_rv:MinibatchRandomVariable"),
    )


def _minibatch_slices(graphs: list[Variable]) -> list[Any]:
    """The ``pm.Minibatch`` nodes among the ancestors of ``graphs``."""
    minibatch_ops = _minibatch_op_types()[0]
    if not minibatch_ops:
        return []
    nodes = dict.fromkeys(a.owner for a in ancestors(graphs) if a.owner is not None)
    return [n for n in nodes if isinstance(n.op, minibatch_ops)]


def _total_size(rv: Variable, rescaled_ops: tuple[type, ...]) -> list[int | None] | None:
    """The ``total_size`` of an observed variable, one entry (or None) per axis; None without."""
    if not rescaled_ops or rv.owner is None or not isinstance(rv.owner.op, rescaled_ops):
        return None
    sizes: list[int | None] = []
    for size in rv.owner.inputs[1:]:
        if isinstance(size.type, NoneTypeT):
            sizes.append(None)
            continue
        try:
            sizes.append(int(get_underlying_scalar_constant_value(size)))
        except NotScalarConstantError as err:
            raise ModelNotSupportedError(
                f"Observed variable {rv.name!r} has a symbolic total_size= (not a number), so "
                "the samplers cannot check it against the number of data rows N. Pass "
                "total_size=N as an integer (len of the full data), or drop it."
            ) from err
    return sizes


def _uncast(var: Variable) -> Variable:
    """``var`` without a dtype cast on top: observed values given as a pm.Data container of
    another dtype (an integer container under a Bernoulli) arrive wrapped in a Cast."""
    owner = var.owner
    if (
        owner is not None
        and isinstance(owner.op, Elemwise)
        and isinstance(owner.op.scalar_op, ScalarCast)
    ):
        return owner.inputs[0]
    return var


def _numeric_shape(var: Variable) -> tuple[int, ...]:
    """The shape of a data graph (a container, a constant, or a cast of one)."""
    var = _uncast(var)
    value = _data_leaf_value(var)
    if value is not None:
        return tuple(int(s) for s in np.shape(value))
    return tuple(int(s) for s in var.shape.eval())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by the caller that points at the user's code (the
    first frame outside this package), however many of its functions lie in between."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pymc_sgmcmc/
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _full_data_model(model: pm.Model) -> pm.Model:
    """``model`` with ``pm.Minibatch`` slices read as the full data and ``total_size`` dropped.

    A model written for minibatch ADVI reads its rows through ``pm.Minibatch(X, y,
    batch_size=B)`` — a ``MinibatchOp`` node (drawing B row indices with a ``minibatch_index``
    random variable) whose outputs are B random rows of its inputs — and rescales the
    likelihood with ``total_size=N``, which wraps the observed variable in a
    ``MinibatchRandomVariable`` whose log-likelihood is multiplied by ``N/B``. The
    stochastic-gradient samplers draw their own minibatches from the full data and rescale by
    ``N/B`` themselves, so the model they sample is the full-data one: every ``MinibatchOp``
    output replaced by the array it slices (its ``pm.Data`` container or constant), and every
    ``MinibatchRandomVariable`` by the variable it rescales. That is what is returned: a new
    ``pm.Model`` holding the same free variables, value variables, potentials, deterministics
    and data containers as ``model`` (the same objects, so ``vars``, the initial point and the
    draws' names are the user's), whose observed variables are rebuilt on the full data. The
    model itself is returned when it has neither.

    Rules: ``total_size`` must equal the full data's length along each axis it is given for
    (``N`` rows), else the model is refused (the samplers cannot weight the likelihood as
    another number of rows); ``pm.Minibatch`` without ``total_size`` is sampled on the full
    data with a warning (ADVI weighted it as B rows); a Deterministic reading minibatch rows
    warns (PyMC records it on a random minibatch); free variables, potentials and observed
    variables whose covariates but not their data read minibatch rows are refused, as is a
    bare ``minibatch_index`` draw.
    """
    minibatch_ops, index_ops, rescaled_ops = _minibatch_op_types()
    watched = minibatch_ops + index_ops + rescaled_ops
    if not watched:
        return model
    observed = list(model.observed_RVs)
    values = [model.rvs_to_values[rv] for rv in observed]
    every = [*model.free_RVs, *observed, *values, *model.potentials, *model.deterministics]
    nodes = list(dict.fromkeys(a.owner for a in ancestors(every) if a.owner is not None))
    if not any(isinstance(n.op, watched) for n in nodes):
        return model

    fix = (
        "The stochastic-gradient samplers read a model written for minibatch ADVI as its "
        "full-data equivalent (they draw their own minibatches and rescale the likelihood by "
        "N/B themselves), which is only defined when pm.Minibatch slices the rows of observed "
        "data and of the covariates of their likelihood."
    )
    # A minibatch_index draw outside pm.Minibatch (inside, it is hidden in the op's graph).
    bare = [n for n in nodes if index_ops and isinstance(n.op, index_ops)]
    if bare:
        raise ModelNotSupportedError(
            "The model draws minibatch row indices itself (a minibatch_index random variable "
            f"outside pm.Minibatch). {fix} Pass the full arrays (pm.Data or NumPy) instead and "
            "set the minibatch size with the sampler's batch_size= (pmsg.SGLD(batch_size=...))."
        )
    for kind, var, why in [
        *[
            (
                "Free variable",
                rv,
                "its distribution (or shape) follows the random rows of each minibatch, as a "
                "per-row latent of a minibatch ADVI model does. Define it over the full data "
                "(one entry per row of the full arrays) and pass it as local_vars= if it is a "
                "per-row latent",
            )
            for rv in model.free_RVs
        ],
        *[
            (
                "Potential",
                p,
                "a log-density term over a random minibatch has no full-data equivalent "
                "(total_size does not rescale potentials). Write it on the full arrays",
            )
            for p in model.potentials
        ],
    ]:
        slices = _minibatch_slices([var])
        if slices:
            raise ModelNotSupportedError(
                f"{kind} {var.name!r} reads data through pm.Minibatch "
                f"({_describe_minibatch(slices)}): {why}. {fix}"
            )

    batch_sizes: dict[str, int | None] = {}
    for rv, value in zip(observed, values, strict=True):
        value_slices = _minibatch_slices([value])
        covariate_slices = [n for n in _minibatch_slices([rv]) if n not in value_slices]
        if covariate_slices and not value_slices:
            raise ModelNotSupportedError(
                f"Observed variable {rv.name!r} reads covariates through pm.Minibatch "
                f"({_describe_minibatch(covariate_slices)}) but not its observed data, so the "
                f"rows of its data and of its covariates do not line up. {fix} Slice them "
                "together, pm.Minibatch(X, y, batch_size=...) with observed=the y slice — or "
                "pass the full arrays and the sampler's batch_size=."
            )
        if value_slices:
            out = value_slices[0].outputs[0]
            batch_sizes[rv.name] = out.type.shape[0] if out.type.ndim else None
        else:
            batch_sizes[rv.name] = None

    # Rebuild every graph downstream of a pm.Minibatch slice or a total_size rescaling.
    replaced: dict[Variable, Variable] = {}
    for node in toposort([*observed, *values]):
        inputs = [replaced.get(i, i) for i in node.inputs]
        if minibatch_ops and isinstance(node.op, minibatch_ops):
            # Outputs: the sliced inputs, then the index draw's generator update.
            for out, full in zip(node.outputs[:-1], inputs[:-1], strict=True):
                replaced[out] = full
            continue
        if rescaled_ops and isinstance(node.op, rescaled_ops):
            replaced[node.outputs[0]] = inputs[0]
            continue
        if all(new is old for new, old in zip(inputs, node.inputs, strict=True)):
            continue
        new_node = node.clone_with_new_inputs(inputs, strict=False)
        for old, new in zip(node.outputs, new_node.outputs, strict=True):
            new.name = old.name
            replaced[old] = new

    for rv, value in zip(observed, values, strict=True):
        sizes = _total_size(rv, rescaled_ops)
        full_value = replaced.get(value, value)
        if sizes is None and batch_sizes[rv.name] is None:
            continue
        shape = _numeric_shape(full_value)
        for axis, (size, length) in enumerate(zip(sizes or [], shape, strict=False)):
            if size is None or size == length:
                continue
            given = sizes[0] if len(sizes) == 1 else sizes
            where = (
                f"N={length} rows"
                if axis == 0
                else f"length {length} along axis {axis} (where total_size gives {size})"
            )
            raise ModelNotSupportedError(
                f"Observed variable {rv.name!r} has total_size={given!r}, but the full data "
                f"{'that pm.Minibatch slices ' if batch_sizes[rv.name] else ''}have {where}. "
                f"total_size rescales the likelihood as if the data had {size} rows; the "
                "stochastic-gradient samplers draw their minibatches from the full data and "
                "rescale by N/B themselves, so they sample the full-data posterior and can "
                f"only read total_size = N. Pass total_size={length} (len of the full data) or "
                "drop total_size=; to fit a larger data set, pass all of its rows as the data."
            )
        if batch_sizes[rv.name] is not None and (sizes is None or sizes[0] is None):
            n_rows = shape[0] if shape else 1
            warnings.warn(
                f"Observed variable {rv.name!r} reads its rows through pm.Minibatch "
                f"(batch_size={batch_sizes[rv.name]}) without total_size=: the "
                "stochastic-gradient samplers sample it on the full data (all "
                f"N={n_rows} rows), the posterior of the model written with the full arrays. "
                "PyMC's ADVI fit of this model without total_size weighted its likelihood as "
                f"{batch_sizes[rv.name]} rows instead of {n_rows}, so its posterior is wider "
                f"than this one. Pass total_size={n_rows} to pm.Normal(..., observed=...) to "
                "make both fit the full-data model.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
    for det in model.deterministics:
        slices = _minibatch_slices([det])
        if slices:
            warnings.warn(
                f"Deterministic {det.name!r} reads data through pm.Minibatch "
                f"({_describe_minibatch(slices)}): PyMC computes the Deterministics of the "
                "model itself at every draw, so its recorded values are those of a random "
                "minibatch of rows, not of the full data. Define it on the full arrays to "
                "record it for every row.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )

    full = pm.Model(check_bounds=model.check_bounds, model=None)
    full._coords = dict(model._coords)
    full._dim_lengths = dict(model._dim_lengths)
    dims = model.named_vars_to_dims
    for data in model.data_vars:
        full.data_vars.append(data)
        full.add_named_variable(data, dims=dims.get(data.name))
    for rv in model.free_RVs:
        full.free_RVs.append(rv)
        full.create_value_var(
            rv,
            transform=model.rvs_to_transforms.get(rv),
            default_transform=None,
            value_var=model.rvs_to_values[rv],
        )
        full.add_named_variable(rv, dims=dims.get(rv.name))
        full.set_initval(rv, model.rvs_to_initial_values.get(rv))
    for rv, value in zip(observed, values, strict=True):
        new_rv = replaced.get(rv, rv)
        new_rv.name = rv.name
        full.observed_RVs.append(new_rv)
        full.create_value_var(
            new_rv, transform=None, default_transform=None, value_var=replaced.get(value, value)
        )
        full.add_named_variable(new_rv, dims=dims.get(rv.name))
    for kind in ("potentials", "deterministics"):
        for var in getattr(model, kind):
            getattr(full, kind).append(var)
            full.add_named_variable(var, dims=dims.get(var.name))
    return full


def _describe_minibatch(nodes: list[Any]) -> str:
    parts = []
    for node in nodes:
        if not hasattr(node.op, "inner_outputs"):  # the minibatch_index draw inside the op
            continue
        names = [
            repr(inp.name) if inp.name else f"an array of shape {np.shape(_data_leaf_value(inp))}"
            for inp in node.inputs
            if not isinstance(inp.type, RandomType)
        ]
        batch = node.outputs[0].type.shape[0] if node.outputs[0].type.ndim else None
        parts.append(f"rows of {', '.join(names)}" + (f" with batch_size={batch}" if batch else ""))
    return "; ".join(parts) or "a minibatch_index draw"
