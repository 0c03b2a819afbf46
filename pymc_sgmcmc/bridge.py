"""PyMC model → minibatch problem: the one module that knows PyMC/PyTensor internals.

The bridge splits a model's log-density (in the unconstrained space of PyMC's value
variables, Jacobians included) into

* ``logprior(position, fixed)`` – every term that is *not* minibatched: the log-prior of all
  free variables, potentials, and observed variables whose data are not row-aligned;
* ``loglik_rows(position, fixed, batch)`` – a ``(B,)`` vector of per-row log-likelihoods of
  every observed variable whose data share the leading data axis of length ``N``.

so that ``logprior + sum(loglik_rows over all rows)`` equals ``model.logp()``.  Each data
container on the data axis (observed values, ``pm.Data``, plain arrays such as a design
matrix) is replaced by a batch placeholder, and the graphs are compiled through PyTensor's JAX
backend.  JAX itself is only touched on first use (:meth:`MinibatchProblem.jax_functions`),
so building a problem in a parent process never starts JAX's thread pools before PyMC forks
its workers. A model written for minibatch ADVI (``pm.Minibatch`` slices, ``total_size=``) is
first read as its full-data equivalent (:func:`_full_data_model`).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pymc.distributions.dist_math import CheckParameterValue
from pytensor.compile.mode import JAX
from pytensor.compile.ops import ViewOp
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import ancestors, graph_inputs, toposort
from pytensor.raise_op import Assert
from pytensor.scalar.basic import Cast as ScalarCast
from pytensor.tensor.basic import Alloc, ARange, get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.shape import Shape_i, SpecifyShape
from pytensor.tensor.type_other import NoneTypeT

from pymc_sgmcmc._precision import import_pytensor_jax
from pymc_sgmcmc.errors import DataShapeError, ModelNotSupportedError, non_finite_rows

__all__ = ["ROW_INDEX", "MinibatchProblem", "VarInfo", "build_problem"]

ROW_INDEX = "__row_index__"  # name of the data array of original row indices (row-aligned locals)


@dataclass(frozen=True)
class VarInfo:
    """Name, shape and dtype of one value variable inside the raveled position vector."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=int))


@dataclass
class MinibatchProblem:
    """A PyMC model split into a full-batch part and a per-row, minibatchable part.

    Attributes
    ----------
    var_infos
        The sampled value variables, in the order they are raveled into ``position``.
    fixed_infos
        Value variables that other step methods sample; they enter as ``fixed`` arrays.
    data
        Row-aligned data arrays (leading axis of length ``data_size``), in ``data_names`` order.
    data_size
        ``N``, the number of rows.
    minibatched_observed, full_observed
        Names of the observed variables whose likelihood is minibatched / evaluated in full.
    local_names
        Value variables given a variational distribution (``local_vars``); they are among
        ``fixed_infos`` and enter the graphs like fixed values.
    row_local_names
        The locals whose leading axis is the data axis: the row graph reads them row by row,
        gathered from their ``fixed`` value at the minibatch's original row indices, which
        then travel as the last data array (``data_names[-1] == ROW_INDEX``).
    """

    model: pm.Model
    var_infos: tuple[VarInfo, ...]
    fixed_infos: tuple[VarInfo, ...]
    data_names: tuple[str, ...]
    data: tuple[np.ndarray, ...]
    data_size: int
    minibatched_observed: tuple[str, ...]
    full_observed: tuple[str, ...]
    dtype: str
    _inputs: list[Variable] = field(repr=False)
    _batch_inputs: list[Variable] = field(repr=False)
    _logprior_graph: Variable = field(repr=False)
    _rows_graph: Variable = field(repr=False)
    _jacobian_graph: Variable | None = field(default=None, repr=False)
    _jax_cache: dict = field(default_factory=dict, repr=False, compare=False)
    local_names: tuple[str, ...] = ()
    row_local_names: tuple[str, ...] = ()

    # -- raveling -------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        """Length of the raveled position vector."""
        return sum(v.size for v in self.var_infos)

    def ravel(self, point: dict[str, np.ndarray]) -> np.ndarray:
        """Concatenate the sampled value variables of ``point`` into one float vector."""
        if not self.var_infos:
            return np.zeros(0, dtype=self.dtype)
        return np.concatenate(
            [np.asarray(point[v.name], dtype=self.dtype).reshape(-1) for v in self.var_infos]
        )

    def unravel(self, position: np.ndarray) -> dict[str, np.ndarray]:
        """Inverse of :meth:`ravel`, casting each variable back to its own dtype."""
        out, start = {}, 0
        for v in self.var_infos:
            out[v.name] = (
                np.asarray(position[start : start + v.size]).reshape(v.shape).astype(v.dtype)
            )
            start += v.size
        return out

    def fixed_values(self, point: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """Values of the variables this problem does not sample, taken from ``point``."""
        return tuple(np.asarray(point[v.name], dtype=v.dtype) for v in self.fixed_infos)

    # -- JAX ------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # Compiled JAX callables are rebuilt lazily wherever the problem is unpickled
        # (a spawned or forkserver worker), never shipped across processes.
        state = self.__dict__.copy()
        state["_jax_cache"] = {}
        return state

    def jax_functions(self) -> dict[str, Callable]:
        """JAX callables built from the PyTensor graphs (on first call; cached).

        Returns a dict with

        ``logprior(position, fixed) -> ()``, ``loglik_rows(position, fixed, batch) -> (B,)``,
        ``log_jacobian(position, fixed) -> ()`` (the transforms' log-Jacobian alone),
        ``logdensity_and_grad(position, fixed, batch) -> ((), (D,))`` — the unbiased minibatch
        estimate ``logprior + (N/B) Σ_rows loglik`` and its gradient — and
        ``per_example_grads(position, fixed, batch) -> (B, D)`` (``jax.vmap`` over rows of the
        gradient of one row's log-likelihood).
        """
        if self._jax_cache:
            return self._jax_cache
        with _JAX_LOCK:
            if not self._jax_cache:
                self._jax_cache.update(_build_jax_functions(self))
        return self._jax_cache


_JAX_LOCK = threading.Lock()


def _register_jax_passthroughs() -> None:
    """Make PyMC's parameter checks JAX-traceable (as ``pymc.sampling.jax`` does).

    ``pymc.sampling.jax`` is not imported on purpose: importing it rewrites ``XLA_FLAGS`` to
    force 100 host devices, which would change the device layout of the user's process.
    """
    jax_funcify = import_pytensor_jax().jax_funcify

    def passthrough(op: Any, **kwargs: Any) -> Callable:
        def assert_fn(value: Any, *inps: Any) -> Any:
            return value

        return assert_fn

    jax_funcify.register(Assert)(passthrough)
    jax_funcify.register(CheckParameterValue)(passthrough)
    jax_funcify.register(ARange)(_jax_funcify_arange)


def _jax_funcify_arange(op: Any, node: Any, **kwargs: Any) -> Callable:
    """PyTensor's JAX ``arange`` with its bounds cast to the output dtype first.

    A Categorical's logp indexes rows with ``arange(0, n_rows, 1)`` whose constant bounds are
    int8; under NumPy 2's promotion rules PyTensor's dispatch computes ``n_rows - int8(0)`` in
    int8 and overflows once a minibatch has 128 rows or more.
    """
    constant_args = []
    for arg in node.inputs:
        if arg.owner and isinstance(arg.owner.op, Shape_i):
            constant_args.append(None)
        elif isinstance(arg, Constant):
            constant_args.append(int(arg.value))
        else:
            raise NotImplementedError("arange bounds must be constants or shapes under JAX")

    def arange(start: Any, stop: Any, step: Any) -> Any:
        args = [
            int(a) if c is None else c
            for a, c in zip((start, stop, step), constant_args, strict=True)
        ]
        return jnp.arange(*args, dtype=op.dtype)

    return arange


def _jaxify(inputs: list[Variable], outputs: list[Variable]) -> Callable:
    jax_funcify = import_pytensor_jax().jax_funcify
    _register_jax_passthroughs()
    fgraph = FunctionGraph(inputs=inputs, outputs=outputs, clone=True)
    JAX.optimizer.rewrite(fgraph)
    return jax_funcify(fgraph)


def _build_jax_functions(problem: MinibatchProblem) -> dict[str, Callable]:
    n_sampled = len(problem.var_infos)
    logprior_raw = _jaxify(problem._inputs, [problem._logprior_graph])
    jacobian_raw = (
        _jaxify(problem._inputs, [problem._jacobian_graph])
        if problem._jacobian_graph is not None
        else None
    )
    rows_raw = _jaxify(problem._inputs + problem._batch_inputs, [problem._rows_graph])
    infos = problem.var_infos
    fixed_dtypes = [v.dtype for v in problem.fixed_infos]

    def unravel(position: jax.Array) -> list[jax.Array]:
        out, start = [], 0
        for v in infos:
            out.append(position[start : start + v.size].reshape(v.shape).astype(v.dtype))
            start += v.size
        return out

    def values(position: jax.Array, fixed: Sequence[jax.Array]) -> list[jax.Array]:
        fixed = [jnp.asarray(f, dtype=d) for f, d in zip(fixed, fixed_dtypes, strict=True)]
        return unravel(position) + list(fixed)

    del n_sampled

    def logprior(position: jax.Array, fixed: Sequence[jax.Array] = ()) -> jax.Array:
        return logprior_raw(*values(position, fixed))[0]

    fixed_names = [v.name for v in problem.fixed_infos]
    row_slots = [fixed_names.index(name) for name in problem.row_local_names]

    def loglik_rows(
        position: jax.Array, fixed: Sequence[jax.Array], batch: Sequence[jax.Array]
    ) -> jax.Array:
        if row_slots:
            # Row-aligned locals: their rows at the minibatch's original row indices.
            rows_index = batch[-1]
            batch = tuple(batch[:-1]) + tuple(
                jnp.take(jnp.asarray(fixed[slot]), rows_index, axis=0) for slot in row_slots
            )
        rows = rows_raw(*values(position, fixed), *batch)[0]
        return jnp.broadcast_to(rows, (batch[0].shape[0],)) if batch else rows

    data_size = problem.data_size

    def logdensity(position: jax.Array, fixed: Sequence[jax.Array], batch: Sequence[jax.Array]):
        batch_size = batch[0].shape[0]
        scale = data_size / batch_size
        return logprior(position, fixed) + scale * jnp.sum(loglik_rows(position, fixed, batch))

    def one_row_loglik(position, fixed, row):
        return loglik_rows(position, fixed, tuple(r[None] for r in row))[0]

    per_example = jax.vmap(jax.grad(one_row_loglik), in_axes=(None, None, 0))

    def log_jacobian(position: jax.Array, fixed: Sequence[jax.Array] = ()) -> jax.Array:
        if jacobian_raw is None:
            return jnp.zeros((), dtype=position.dtype)
        return jacobian_raw(*values(position, fixed))[0]

    return {
        "log_jacobian": log_jacobian,
        "logprior": logprior,
        "loglik_rows": loglik_rows,
        "logdensity": logdensity,
        "logdensity_and_grad": jax.value_and_grad(logdensity),
        "per_example_grads": per_example,
    }


# ---------------------------------------------------------------------------------------
# Graph analysis
# ---------------------------------------------------------------------------------------


def _data_leaf_value(var: Variable) -> np.ndarray | None:
    """The numeric value of a graph leaf that holds data, or None for anything else."""
    if isinstance(var, SharedVariable):
        if isinstance(var.type, RandomType):
            return None
        return np.asarray(var.get_value(borrow=True))
    if isinstance(var, Constant):
        return np.asarray(var.data)
    return None


def _leaf_label(model: pm.Model, var: Variable, observed_owner: dict[Variable, str]) -> str:
    if var in observed_owner:
        return f"observed data of {observed_owner[var]!r}"
    if getattr(var, "name", None):
        return repr(var.name)
    return f"a constant array of shape {np.shape(_data_leaf_value(var))}"


def _replace_shared_scalars(graphs: list[Variable]) -> list[Variable]:
    """Freeze the remaining shared variables (dim lengths, unsliced pm.Data) as constants."""
    shared = [
        v
        for v in graph_inputs(graphs)
        if isinstance(v, SharedVariable) and not isinstance(v.type, RandomType)
    ]
    replacements = {v: pt.constant(v.get_value(borrow=True), dtype=v.dtype) for v in shared}
    return clone_replace(graphs, replace=replacements) if replacements else graphs


def _rows_to_batch_length(graph: Variable, data_size: int, batch_length: Variable) -> Variable:
    """Turn shapes fixed to ``N`` rows into the batch length.

    PyMC broadcasts every log-probability to its variable's shape (an ``Alloc`` whose leading
    length is ``N``, from ``shape=``/``dims=``) and may assert that shape (``SpecifyShape``).
    Both are rewritten so the graph follows the number of rows it is given.
    """
    replacements: dict[Variable, Variable] = {}
    for var in ancestors([graph]):
        node = var.owner
        if node is None:
            continue
        if isinstance(node.op, SpecifyShape):
            replacements[var] = node.inputs[0]
        elif isinstance(node.op, Alloc) and len(node.inputs) > 1:
            try:
                lead = int(get_underlying_scalar_constant_value(node.inputs[1]))
            except NotScalarConstantError:
                continue
            if lead == data_size:
                replacements[var] = pt.alloc(node.inputs[0], batch_length, *node.inputs[2:])
    if not replacements:
        return graph
    return clone_replace([graph], replace=replacements, rebuild_strict=False)[0]


def _free_names(model: pm.Model) -> list[str]:
    return [rv.name for rv in model.free_RVs]


def _user_vars_to_value_vars(
    model: pm.Model, vars: Sequence[Any] | None, arg: str = "vars"
) -> list[Variable]:
    """The value variables of ``vars`` (free RVs, their value variables, or names of either)."""
    if vars is None:
        return list(model.value_vars)
    value_by_name = {v.name: v for v in model.value_vars}
    out = []
    for v in vars:
        if isinstance(v, str):
            if v in value_by_name:  # a value variable's name, e.g. "sigma_log__"
                out.append(value_by_name[v])
                continue
            named = model.named_vars.get(v)
        elif isinstance(v, Variable):
            named = v
        else:
            named = None
        if named is not None and named in model.value_vars:
            out.append(named)
            continue
        if named is not None and named in model.free_RVs:
            out.append(model.rvs_to_values[named])
            continue
        raise ValueError(_not_a_free_variable(model, v, named, arg))
    return out


def _not_a_free_variable(model: pm.Model, item: Any, named: Variable | None, arg: str) -> str:
    """Why ``item`` of the argument ``arg`` is not a free variable, and what to pass instead."""
    free = _free_names(model)
    label = repr(item) if isinstance(item, str) else repr(getattr(item, "name", None) or item)
    if named is not None and named in model.observed_RVs:
        what = (
            "an observed variable: its data are what the sampler minibatches, they are not sampled"
        )
    elif named is not None and named in model.deterministics:
        what = (
            "a Deterministic, computed from the free variables on every draw: pass the free "
            "variables it depends on instead"
        )
    elif named is not None and named in model.data_vars:
        what = "a data container (pm.Data), not a random variable"
    elif named is not None and named in model.potentials:
        what = "a Potential, a log-density term, not a random variable"
    elif isinstance(item, str):
        close = difflib.get_close_matches(item, free + list(model.named_vars), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = f"not the name of any variable of the model{hint}"
    elif isinstance(item, Variable):
        what = "not a variable of this model (was it created in another model?)"
    else:
        what = f"of type {type(item).__name__}, neither a random variable nor a name"
    return (
        f"`{arg}` contains {label}, which is {what}. Only free random variables can be sampled: "
        f"pass free variables (or their names) from {free}."
    )


# ---------------------------------------------------------------------------------------
# Models written for minibatch ADVI (pm.Minibatch / total_size); imputed missing data
# ---------------------------------------------------------------------------------------


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
    package = os.path.dirname(os.path.abspath(__file__))
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
            f"The observed data of {name!r} have missing values (NaN or masked entries), so PyMC "
            f"split {name!r} into the observed variable {obs.name!r} and the free variable "
            f"{unobs.name!r} that imputes the missing entries. The stochastic-gradient samplers "
            "cannot minibatch such a split likelihood: its observed rows no longer line up with "
            "the rows of the other data (covariates, group indices). Drop the rows with missing "
            "values before building the model (keep = ~np.isnan(data); observed=data[keep], and "
            "index every row-aligned covariate with [keep] too), or sample this model with "
            "pm.sample() (NUTS), which imputes them."
        )


def build_problem(
    model: pm.Model | None = None,
    vars: Sequence[Any] | None = None,
    *,
    local_vars: Sequence[Any] | None = None,
    minibatch_data: Sequence[Any] | None = None,
    batch_size: int | None = None,
) -> MinibatchProblem:
    """Split a PyMC model into a full-batch log-prior and per-row log-likelihoods.

    Parameters
    ----------
    model
        The PyMC model (default: the model on the context stack).
    vars
        Free variables to sample (default: all but ``local_vars``). The other value variables
        become ``fixed`` inputs so that the gradient is the correct conditional one inside a
        compound step.
    local_vars
        Free variables that get a variational distribution (:mod:`pymc_sgmcmc.variational`):
        they become ``fixed`` inputs, and those whose leading axis is the data axis are read
        row by row in the minibatched likelihood.
    minibatch_data
        Explicit override for what is minibatched: ``pm.Data`` containers, observed random
        variables, or their names. All must share the same leading length ``N``; every other
        data array is used in full. By default the data axis is the leading axis of the
        largest observed variable, and every observed variable and data container with that
        leading length is minibatched.
    batch_size
        Validated against ``N`` when given.

    A model written for minibatch ADVI — rows read through ``pm.Minibatch(X, y,
    batch_size=...)``, the likelihood rescaled with ``total_size=len(y)`` — is sampled as the
    same model written with the full arrays (see :func:`_full_data_model`): the samplers draw
    their own minibatches from all ``N`` rows and rescale by ``N/B`` themselves. The
    ``batch_size`` given to ``pm.Minibatch`` is not theirs: the step's ``batch_size=`` sets it
    (default: the step's own default, see ``default_batch_size``). ``total_size`` must equal
    ``N``; without ``total_size`` the model is sampled on the full data with a warning.

    Raises
    ------
    ModelNotSupportedError
        Discrete free variables, no observed data to minibatch, ``total_size=`` other than the
        number of data rows, ``pm.Minibatch`` slices read by free variables, potentials or
        only by an observed variable's covariates, or observed data with missing values
        (PyMC's imputation).
    DataShapeError
        Data containers whose leading axes disagree, or ``batch_size`` outside ``1..N``.
    ValueError
        ``vars`` or ``minibatch_data`` naming something that is not a free variable / data.
    """
    model = pm.modelcontext(model)
    sampled = _user_vars_to_value_vars(model, vars)
    local_values = (
        list(dict.fromkeys(_user_vars_to_value_vars(model, local_vars, "local_vars")))
        if local_vars
        else []
    )
    if local_values:
        both = [v.name for v in sampled if v in local_values]
        if vars is None:
            sampled = [v for v in sampled if v not in local_values]
        elif both:
            raise ValueError(
                f"{both} are in both vars and local_vars. A free variable is either sampled "
                "(vars) or given a variational distribution (local_vars): name it in one."
            )
        if not sampled:
            raise ModelNotSupportedError(
                "local_vars covers every free variable, so no global variable is left for the "
                "stochastic-gradient sampler. Leave the globals (hyperparameters, scales, "
                "fixed effects) out of local_vars, or fit the whole model by variational "
                "inference (pm.fit)."
            )
    # A model written for minibatch ADVI is read as its full-data equivalent; the free
    # variables and their value variables are the user's objects in both.
    user_model, model = model, _full_data_model(model)
    _check_imputation(model)

    for value_var in sampled + local_values:
        rv = model.values_to_rvs[value_var]
        if rv.dtype.startswith(("int", "uint", "bool")) or value_var.dtype.startswith(
            ("int", "uint", "bool")
        ):
            raise ModelNotSupportedError(
                f"Free variable {rv.name!r} is discrete ({rv.dtype}); stochastic-gradient "
                "samplers need a continuous, differentiable log-density. Marginalise it out, "
                "or sample it with a PyMC step method and give the SG sampler only the "
                f"continuous variables: step=[pmsg.SGLD(vars=[...]), pm.Metropolis([{rv.name}])]."
            )
    fixed = [v for v in model.value_vars if v not in sampled]

    if not model.observed_RVs:
        raise ModelNotSupportedError(
            "The model has no observed variables, so there is no data to minibatch. "
            "Stochastic-gradient MCMC only pays off for likelihoods over many rows: pass the "
            "data as `observed=` of a likelihood, or sample this model with pm.sample() (NUTS)."
        )

    observed_value = {rv: model.rvs_to_values[rv] for rv in model.observed_RVs}
    observed_owner = {val: rv.name for rv, val in observed_value.items()}

    def leading(var: Variable) -> int | None:
        var = _uncast(var)  # a cast container's rows are the container's
        value = _data_leaf_value(var)
        if value is None or value.ndim == 0:
            return None
        return int(value.shape[0])

    # --- which observed variables and containers are minibatched --------------------------
    forced_leaves: list[Variable] | None = None
    if minibatch_data is not None:
        forced_leaves = []
        mb_choices = [d.name for d in model.data_vars] + [rv.name for rv in model.observed_RVs]
        for item in minibatch_data:
            if isinstance(item, str):
                if item not in model.named_vars:
                    close = difflib.get_close_matches(item, mb_choices, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ValueError(
                        f"minibatch_data names {item!r}, which is not a variable of the "
                        f"model{hint}. Pass pm.Data containers or observed variables (or their "
                        f"names) from {mb_choices}."
                    )
                item = model.named_vars[item]
            label = getattr(item, "name", None) or item
            if model is not user_model and item in user_model.observed_RVs:
                item = model.named_vars[item.name]  # rebuilt on the full data
            if item in observed_value:
                item = observed_value[item]
            if _data_leaf_value(item) is None:
                raise ValueError(
                    f"minibatch_data entry {label!r} is neither a data container (pm.Data) nor "
                    "an observed variable, so it has no rows to minibatch. Pass pm.Data "
                    f"containers or observed variables (or their names) from {mb_choices}."
                )
            forced_leaves.append(item)
        sizes = {_leaf_label(model, v, observed_owner): leading(v) for v in forced_leaves}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise DataShapeError(
                "The data containers passed as minibatch_data must share one leading (row) "
                f"axis, but their leading lengths are {sizes}. Reshape them so that rows come "
                "first and every container has the same number of rows."
            )
        data_size = int(next(iter(sizes.values())))
        mb_rvs = [rv for rv, val in observed_value.items() if val in forced_leaves]
        if not mb_rvs:
            # Containers given without their observed variable: every likelihood that depends
            # on them is minibatched.
            mb_rvs = [
                rv
                for rv in model.observed_RVs
                if set(graph_inputs([model.logp(vars=[rv], sum=False)[0]])) & set(forced_leaves)
            ]
    else:
        obs_rows = {
            rv: (leading(val) if leading(val) is not None else 0)
            for rv, val in observed_value.items()
        }
        data_size = max(obs_rows.values())
        if data_size <= 1:
            raise ModelNotSupportedError(
                "No observed variable has more than one row of data, so there is nothing to "
                "minibatch. Pass the data with rows along the first axis as `observed=`, or "
                "use pm.sample() (NUTS) for this model."
            )
        mb_rvs = [rv for rv in model.observed_RVs if obs_rows[rv] == data_size]

    full_rvs = [rv for rv in model.observed_RVs if rv not in mb_rvs]

    if batch_size is not None and not (1 <= int(batch_size) <= data_size):
        raise DataShapeError(
            f"batch_size={batch_size} must be between 1 and the number of data rows N={data_size} "
            f"(minibatched observed variables: {[rv.name for rv in mb_rvs]}). "
            f"Choose batch_size <= {data_size}."
        )

    # --- graphs ---------------------------------------------------------------------------
    mb_names = [rv.name for rv in mb_rvs]
    row_terms = []
    for rv in mb_rvs:
        try:
            term = model.logp(vars=[rv], sum=False)[0]
        except (ValueError, AssertionError) as err:
            raise _misaligned(model, mb_names, data_size, err) from err
        if term.ndim == 0:
            raise DataShapeError(
                f"Observed variable {rv.name!r} has a scalar log-likelihood, so it cannot be "
                "split into rows. Leave it out of minibatch_data (it will be used in full)."
            )
        if term.ndim > 1:
            term = term.sum(axis=tuple(range(1, term.ndim)))
        row_terms.append(term)
    rows_graph = row_terms[0]
    for term in row_terms[1:]:
        rows_graph = rows_graph + term

    prior_vars = list(model.free_RVs) + full_rvs + list(model.potentials)
    logprior_graph = model.logp(vars=prior_vars, sum=True)
    # The transforms' log-Jacobian alone: point estimates (variational EM's hyperparameters)
    # maximise the density of the variable itself, not of its unconstrained image.
    jacobian_graph = model.logp(vars=list(model.free_RVs), jacobian=True, sum=True) - model.logp(
        vars=list(model.free_RVs), jacobian=False, sum=True
    )

    if forced_leaves is not None:
        leaves = list(forced_leaves)
    else:
        leaves = [
            v
            for v in graph_inputs([rows_graph])
            if _data_leaf_value(v) is not None and leading(v) == data_size
        ]
    ip = model.initial_point()
    row_inputs = set(graph_inputs([rows_graph]))
    row_locals = [
        v
        for v in local_values
        if v in row_inputs and np.ndim(ip[v.name]) >= 1 and np.shape(ip[v.name])[0] == data_size
    ]
    placeholders = []
    replacements = {}
    data_names = []
    data_arrays = []
    for i, leaf in enumerate(leaves):
        value = _data_leaf_value(leaf)
        assert value is not None
        ph = pt.tensor(name=f"batch_{i}", dtype=leaf.dtype, shape=(None, *value.shape[1:]))
        placeholders.append(ph)
        replacements[leaf] = ph
        data_names.append(observed_owner.get(leaf) or leaf.name or f"data_{i}")
        data_arrays.append(value)
        check_finite_rows(
            repr(data_names[-1])
            if observed_owner.get(leaf) or leaf.name
            else f"an unnamed array in the likelihood of {', '.join(mb_names)}",
            value,
            data_size,
        )

    local_placeholders = []
    for i, local in enumerate(row_locals):
        shape = np.shape(ip[local.name])
        ph = pt.tensor(name=f"local_rows_{i}", dtype=local.dtype, shape=(None, *shape[1:]))
        local_placeholders.append(ph)
        replacements[local] = ph
    full_rows_graph = rows_graph
    try:
        rows_graph = clone_replace([rows_graph], replace=replacements, rebuild_strict=False)[0]
        rows_graph, logprior_graph, jacobian_graph = _replace_shared_scalars(
            [rows_graph, logprior_graph, jacobian_graph]
        )
        rows_graph = _rows_to_batch_length(rows_graph, data_size, placeholders[0].shape[0])
    except (ValueError, AssertionError) as err:
        raise _misaligned(model, mb_names, data_size, err) from err

    local_rows = [np.asarray(ip[v.name]) for v in row_locals]
    _probe_rows(
        model,
        sampled,
        fixed,
        placeholders + local_placeholders,
        data_arrays + local_rows,
        rows_graph,
        ip,
        mb_names,
        data_size,
        full_rows_graph if row_locals else None,
    )
    if row_locals:
        data_names.append(ROW_INDEX)
        index_dtype = np.int32 if data_size < 2**31 else np.int64
        data_arrays.append(np.arange(data_size, dtype=index_dtype))
    infos = tuple(VarInfo(v.name, tuple(np.shape(ip[v.name])), str(v.dtype)) for v in sampled)
    fixed_infos = tuple(VarInfo(v.name, tuple(np.shape(ip[v.name])), str(v.dtype)) for v in fixed)
    problem = MinibatchProblem(
        model=user_model,
        var_infos=infos,
        fixed_infos=fixed_infos,
        data_names=tuple(data_names),
        data=tuple(data_arrays),
        data_size=data_size,
        minibatched_observed=tuple(mb_names),
        full_observed=tuple(rv.name for rv in full_rvs),
        dtype=str(pytensor.config.floatX),
        _inputs=list(sampled) + list(fixed),
        _batch_inputs=placeholders + local_placeholders,
        _logprior_graph=logprior_graph,
        _rows_graph=rows_graph,
        _jacobian_graph=jacobian_graph,
        local_names=tuple(v.name for v in local_values),
        row_local_names=tuple(v.name for v in row_locals),
    )
    return problem


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
    full_rows_graph: Variable | None = None,
) -> None:
    """Evaluate the row graph on a 2-row batch (NumPy, no JAX) to catch misaligned data.

    With row-aligned local variables (``full_rows_graph``, the row graph before any slicing)
    the sliced rows must also equal the first rows of the full graph: a local that the
    likelihood reads other than row by row would otherwise be sliced silently.

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
    args += [a[:probe_rows] for a in data_arrays]
    try:
        out = np.asarray(fn(*args))
    except (ValueError, IndexError, AssertionError) as err:
        raise _misaligned(model, mb_names, data_size, err) from err
    if out.shape != (probe_rows,):
        raise _misaligned(
            model,
            mb_names,
            data_size,
            f"a {probe_rows}-row minibatch gave log-likelihood rows of shape {out.shape}",
        )
    if full_rows_graph is not None:
        full_fn = pytensor.function(
            [*sampled, *fixed], full_rows_graph, mode="FAST_COMPILE", on_unused_input="ignore"
        )
        full = np.asarray(full_fn(*[initial_point[v.name] for v in (*sampled, *fixed)]))
        if not np.allclose(out, full[:probe_rows], rtol=1e-6, atol=1e-8):
            raise ModelNotSupportedError(
                "A local variable whose leading axis is the data axis is read by the "
                "likelihood other than row by row (the minibatch's rows do not reproduce the "
                "full data's), so it cannot be minibatched with the data. Make the local's "
                "leading axis differ from the data's, or index it with a row-aligned integer "
                "array (pm.Data) in the likelihood."
            )


def _misaligned(
    model: pm.Model, mb_names: list[str], data_size: int, problem: object
) -> DataShapeError:
    """The error for row-misaligned data, listing every data container's leading length."""
    if isinstance(problem, BaseException):
        problem = f"{type(problem).__name__}: {str(problem).splitlines()[0]}"
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
