"""The bridge's JAX side: PyTensor graphs compiled through PyTensor's JAX backend into the
problem's functions (``logprior``, ``loglik_rows``, ``logdensity``, per-example gradients,
``log_jacobian``), with the few ops that backend lacks registered here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from pymc.distributions.dist_math import CheckParameterValue
from pytensor.compile.mode import JAX
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.raise_op import Assert
from pytensor.tensor.basic import ARange
from pytensor.tensor.shape import Shape_i

from pymc_sgmcmc.adapter.precision import import_pytensor_jax

if TYPE_CHECKING:
    from pymc_sgmcmc.adapter.bridge import MinibatchProblem
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
