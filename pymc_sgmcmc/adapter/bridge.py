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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import ancestors, graph_inputs
from pytensor.tensor.basic import Alloc, get_underlying_scalar_constant_value
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.shape import SpecifyShape

from pymc_sgmcmc.adapter.bridge_jax import _JAX_LOCK, _build_jax_functions
from pymc_sgmcmc.adapter.data_checks import (
    NotRowSeparable,
    _check_imputation,
    _misaligned,
    _probe_rows,
    check_finite_rows,
)
from pymc_sgmcmc.adapter.minibatch_models import _data_leaf_value, _full_data_model, _uncast
from pymc_sgmcmc.errors import DataShapeError, ModelNotSupportedError
from pymc_sgmcmc.minibatch import FULL_BATCH_MAX_ROWS

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
    # The likelihood is not a sum over rows and is read whole (a dummy row; see
    # build_problem): the number of rows it reads, else 0.
    whole_likelihood_rows: int = 0

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

    def labels(self, names: Sequence[str] | None = None) -> list[str]:
        """One label per raveled coordinate of the value variables ``names`` (default: the
        sampled ones, in order), as ArviZ labels the user's variables: the model's name and
        coordinates (``beta[age]``, ``Sigma[a, 10]``), the transform for an unconstrained
        value (``log(sigma)``)."""
        model = self.model
        infos = {v.name: v for v in (*self.var_infos, *self.fixed_infos)}
        value_vars = {v.name: v for v in model.value_vars}
        out = []
        for name in names if names is not None else [v.name for v in self.var_infos]:
            info = infos[name]
            value = value_vars.get(name)
            rv = model.values_to_rvs.get(value) if value is not None else None
            base = rv.name if rv is not None else name
            dims = tuple(model.named_vars_to_dims.get(base) or ())
            coords = []
            for axis, size in enumerate(info.shape):
                dim = dims[axis] if axis < len(dims) else None
                labels = dict(model.coords).get(dim) if dim is not None else None
                if labels is not None and len(labels) == size:
                    coords.append([str(c) for c in labels])
                else:
                    coords.append([str(i) for i in range(size)])
            transform = model.rvs_to_transforms.get(rv) if rv is not None else None
            wrap = getattr(transform, "name", None) if name != base else None
            for index in np.ndindex(*info.shape):
                where = ", ".join(c[i] for c, i in zip(coords, index, strict=True))
                label = f"{base}[{where}]" if index else base
                out.append(f"{wrap}({label})" if wrap else label)
        return out

    def rv_name(self, value_name: str) -> str:
        """The model's name of a value variable (``sigma`` for ``sigma_log__``)."""
        value = {v.name: v for v in self.model.value_vars}.get(value_name)
        rv = self.model.values_to_rvs.get(value) if value is not None else None
        return rv.name if rv is not None else value_name

    @property
    def fixed_in_rows(self) -> tuple[str, ...]:
        """The variables this problem does not sample (other step methods do, in a compound
        step, or they are local variables) that the per-row log-likelihood terms read."""
        fixed = self._inputs[len(self.var_infos) :]
        read = set(ancestors([self._rows_graph], blockers=fixed))
        return tuple(
            info.name for info, var in zip(self.fixed_infos, fixed, strict=True) if var in read
        )

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


# ---------------------------------------------------------------------------------------
# Graph analysis
# ---------------------------------------------------------------------------------------


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


def build_problem(
    model: pm.Model | None = None,
    vars: Sequence[Any] | None = None,
    *,
    local_vars: Sequence[Any] | None = None,
    minibatch_data: Sequence[Any] | None = None,
    batch_size: int | None = None,
) -> MinibatchProblem:
    """Turn ``model`` into a :class:`MinibatchProblem` (see :func:`_row_problem`).

    A likelihood that is not a sum over rows — a time series' recursion (``pm.AR``, a GARCH
    written with ``scan``), a Gaussian process (an ``MvNormal`` over the rows), a
    ``pm.Potential`` or ``CustomDist`` that sums — cannot be minibatched. Where every row is
    read in every iteration anyway (``batch_size`` of at least N, or by default up to
    :data:`~pymc_sgmcmc.minibatch.FULL_BATCH_MAX_ROWS` rows) the whole likelihood is then one
    term (:func:`_whole_likelihood_problem`), and the samplers run their exact full-batch
    chain on it, as NUTS would; otherwise one error names the observed variable and what to do,
    before anything compiles.
    """
    try:
        return _row_problem(
            model,
            vars,
            local_vars=local_vars,
            minibatch_data=minibatch_data,
            batch_size=batch_size,
        )
    except NotRowSeparable as error:
        return _whole_likelihood_problem(
            pm.modelcontext(model), vars, local_vars, minibatch_data, batch_size, error
        )


WHOLE_LIKELIHOOD = "__whole_likelihood__"  # the one data "row" of a whole-likelihood problem


def _whole_likelihood_problem(
    model: pm.Model,
    vars: Sequence[Any] | None,
    local_vars: Sequence[Any] | None,
    minibatch_data: Sequence[Any] | None,
    batch_size: int | None,
    error: NotRowSeparable,
) -> MinibatchProblem:
    """``model`` with its whole likelihood in the log-prior and one dummy row: the problem of a
    likelihood that is not a sum over rows, where every row is read in every iteration anyway
    (see :func:`build_problem`); else ``error``, with what to do."""
    n = int(error.data_size)
    names = ", ".join(repr(name) for name in error.names)
    every_row = batch_size is not None and int(batch_size) >= n
    if (
        local_vars
        or minibatch_data is not None
        or not (every_row or (batch_size is None and n <= FULL_BATCH_MAX_ROWS))
    ):
        raise DataShapeError(
            f"{error} The stochastic-gradient samplers need a likelihood that is a sum of one "
            f"term per row, which the likelihood of {names} is not; with N = {n} rows its "
            "minibatches would be wrong. What to do: pass batch_size=N (every row in every "
            "iteration: an exact Metropolis-adjusted Langevin chain, no faster than NUTS), "
            "name the row-aligned containers with minibatch_data=[...] if only some data are "
            "rows (the others are then read in full), or sample the model with pm.sample() "
            "(NUTS)." + (" local_vars needs a likelihood over rows." if local_vars else "")
        ) from error
    model = _full_data_model(model)
    sampled = _user_vars_to_value_vars(model, vars)
    fixed = [v for v in model.value_vars if v not in sampled]
    observed = list(dict.fromkeys(model.observed_RVs))
    free = list(model.free_RVs)
    logprior_graph = model.logp(vars=free + observed + list(model.potentials), sum=True)
    jacobian_graph = model.logp(vars=free, jacobian=True, sum=True) - model.logp(
        vars=free, jacobian=False, sum=True
    )
    ip = model.initial_point()
    try:
        value = pytensor.function(
            [*sampled, *fixed], logprior_graph, mode="FAST_COMPILE", on_unused_input="ignore"
        )(*[ip[v.name] for v in (*sampled, *fixed)])
    except (ValueError, IndexError, AssertionError) as err:
        raise error from err  # not even the whole likelihood evaluates: the data's shapes
    if not np.isfinite(value):
        raise error
    dtype = str(pytensor.config.floatX)
    placeholder = pt.tensor(name="batch_0", dtype=dtype, shape=(None,))
    rows_graph = placeholder * np.asarray(0.0, dtype=dtype)  # one term per "row": zero
    rows_graph, logprior_graph, jacobian_graph = _replace_shared_scalars(
        [rows_graph, logprior_graph, jacobian_graph]
    )
    return MinibatchProblem(
        model=model,
        var_infos=tuple(
            VarInfo(v.name, tuple(np.shape(ip[v.name])), str(v.dtype)) for v in sampled
        ),
        fixed_infos=tuple(
            VarInfo(v.name, tuple(np.shape(ip[v.name])), str(v.dtype)) for v in fixed
        ),
        data_names=(WHOLE_LIKELIHOOD,),
        data=(np.zeros(1, dtype=dtype),),
        data_size=1,
        minibatched_observed=(),
        full_observed=tuple(rv.name for rv in observed),
        dtype=dtype,
        _inputs=list(sampled) + list(fixed),
        _batch_inputs=[placeholder],
        _logprior_graph=logprior_graph,
        _rows_graph=rows_graph,
        _jacobian_graph=jacobian_graph,
        whole_likelihood_rows=n,
    )


def _row_problem(
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
    # Each observed variable once: PyMC 5.28's sample_posterior_predictive(...,
    # extend_inferencedata=True) leaves it twice in model.observed_RVs.
    observed_rvs = list(dict.fromkeys(model.observed_RVs))

    if not observed_rvs and model.potentials:
        raise NotRowSeparable(
            "The model's likelihood is a pm.Potential, not observed data with rows.",
            [pot.name or "a potential" for pot in model.potentials],
            0,
        )
    if not observed_rvs:
        raise ModelNotSupportedError(
            "The model has no observed variables, so there is no data to minibatch. "
            "Stochastic-gradient MCMC only pays off for likelihoods over many rows: pass the "
            "data as `observed=` of a likelihood, or sample this model with pm.sample() (NUTS)."
        )

    observed_value = {rv: model.rvs_to_values[rv] for rv in observed_rvs}
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
        mb_choices = [d.name for d in model.data_vars] + [rv.name for rv in observed_rvs]
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
                for rv in observed_rvs
                if set(graph_inputs([model.logp(vars=[rv], sum=False)[0]])) & set(forced_leaves)
            ]
    else:
        obs_rows = {
            rv: (leading(val) if leading(val) is not None else 0)
            for rv, val in observed_value.items()
        }
        data_size = max(obs_rows.values())
        if data_size <= 1:
            raise NotRowSeparable(
                "No observed variable has more than one row of data.",
                [rv.name for rv in observed_rvs],
                data_size,
            )
        mb_rvs = [rv for rv in observed_rvs if obs_rows[rv] == data_size]

    full_rvs = [rv for rv in observed_rvs if rv not in mb_rvs]

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
            raise NotRowSeparable(
                str(_misaligned(model, mb_names, data_size, err)), mb_names, data_size
            ) from err
        if term.ndim == 0:
            raise NotRowSeparable(
                f"Observed variable {rv.name!r} has a scalar log-likelihood (an MvNormal over "
                "the rows, a CustomDist that sums), so it cannot be split into rows.",
                [rv.name],
                data_size,
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
        raise NotRowSeparable(
            str(_misaligned(model, mb_names, data_size, err)), mb_names, data_size
        ) from err

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
        full_rows_graph,
        bool(row_locals),
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
