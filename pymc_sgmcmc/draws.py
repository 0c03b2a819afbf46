"""The compiled draw: one ``lax.scan`` over a draw's ``thin`` inner iterations, then its end
(variational EM's step, the loss, divergence, stats, the saved draw and the self-check's
terms) — in memory, streamed chunk by chunk from the host, or with every minibatch split over
devices.

A step describes its draw as a :class:`DrawPlan` (its inner iteration, hooks and sizes);
:func:`draw_functions` turns the plan into the functions
:meth:`pymc_sgmcmc.adapter.step.SGMCMCStep._compile` jits. Nothing here reads a step: what a
draw needs is in the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pymc_sgmcmc.kernels.preconditioning import apply_preconditioner
from pymc_sgmcmc.minibatch import (
    draw_minibatch,
    full_data_chunks,
    minibatch_indices,
    minibatch_row_ids,
    take_minibatch,
)
from pymc_sgmcmc.out_of_core import CHUNK_ROWS
from pymc_sgmcmc.variational import HybridState

__all__ = ["DrawPlan", "ShardedData", "draw_functions", "full_data_gradient", "streamed_draw"]

# A draw whose final minibatch loss exceeds the previous draw's by more than
# max(LOSS_JUMP_ABS, LOSS_JUMP_REL * |previous|) is diverging too: an unstable step grows the
# position geometrically and is caught here within a few iterations, long before it
# overflows — in time for a retry at a smaller step from a state still near the posterior.
# (The jump is ~10¹⁰ squared posterior sds; the minibatch loss of a stationary chain moves
# by about N/√B per-row sds.)
PREDRAWN_NORMALS_MAX = 2**20
"""A draw's standard normals (``thin × D`` of them) are drawn before its scan up to this
many, else each iteration draws its own. Before the scan, one PRNG call for the draw beats
one per iteration where a minibatch's gradient is cheap (small ``D``); at 20 000 group
effects a draw of 694 iterations pre-drew 111 MB, 0.51 s of generation against 0.27 s
iteration by iteration (the array no longer fits a cache), and the injection then read it
again."""
CHECK_CHUNK_ROWS = 8192
"""Rows a step of the self-check's exact gradient (``check_exact``) takes at a time."""
LOSS_JUMP_ABS = 1e10
LOSS_JUMP_REL = 1e4


@dataclass(frozen=True)
class ShardedData:
    """Rows split over devices (:mod:`pymc_sgmcmc.sharding`): the mesh, the devices' row
    counts, and the log-likelihood summed over a minibatch split over them."""

    mesh: Any
    shard_sizes: Any
    devices: list
    loglik: Callable  # (position, fixed, arrays, n_local, rows) -> (value, gradient)
    per_device: int  # rows each device draws per iteration


@dataclass(frozen=True)
class DrawPlan:
    """What a compiled draw is made of.

    ``iteration(normal, state, batch, row_ids, next_row_ids, fixed, params) -> (state, info,
    grad)`` is one inner iteration (``kernel_step`` is the bare kernel update the sharded
    draw calls with its own gradient); ``start_draw``, ``mix_normals``, ``draw_stats`` and
    ``emit`` are the step's traced hooks (``plain_mix_normals`` the one for streamed and
    sharded draws, which never run the exact MALA kernel); ``extra_normals`` more standard
    normals per iteration than dimensions (MALA's acceptance test).
    """

    fns: dict[str, Callable]
    n: int
    b: int
    thin: int
    scheme: str
    dim: int
    iteration: Callable
    kernel_step: Callable
    start_draw: Callable
    mix_normals: Callable
    plain_mix_normals: Callable
    extra_normals: int
    draw_stats: Callable
    emit: Callable
    hybrid: Any  # pymc_sgmcmc.variational.Hybrid or None
    exact: bool  # MALA on the full data: the check uses the kernel's exact gradient
    check_idx: Any
    local_idx: Any
    row_locals: bool  # local variables indexed by row: no self-check terms
    global_idx: Any  # the globals whose marginal the check tests (diagnostics), maybe empty


def draw_functions(plan: DrawPlan, sharded: ShardedData | None) -> dict[str, Callable]:
    """The draw's functions, not yet jitted: ``draw(key, state, data, fixed, params) -> (key,
    state, emitted, stats)`` (in memory, or sharded when ``sharded`` is given),
    ``draw_chunk`` and ``finish`` (a streamed draw: iterations over host-read chunks, then its
    end) and ``full_grad`` (the log-likelihood's gradient over every row)."""
    finish = _finish(plan)
    out = {
        "draw": _draw_sharded(plan, sharded, finish) if sharded else _draw(plan, finish),
        "draw_chunk": _draw_chunk(plan),
        "finish": _finish_streamed(plan, finish),
        "full_grad": _full_grad(plan),
    }
    return out


def _finish(plan: DrawPlan) -> Callable:
    fns, thin, hybrid = plan.fns, plan.thin, plan.hybrid

    def finish(
        state,
        position_sum,
        grad_sum,
        loss_fn,
        grad_norms,
        step_size,
        fixed,
        params,
        emit_key,
        acceptance=None,
    ):
        """The end of a draw: variational EM's step, the loss, divergence, stats and the
        saved draw (the step's ``emit``)."""
        if "hyper_step" in params:
            # Variational EM: one Robbins–Monro step per draw with the draw's mean
            # gradient; the hyperparameters stay fixed within the draw, so the sampled
            # coordinates see the prior their step size and noise were tuned for.
            # Point-estimated coordinates ascend the density without their transform's
            # Jacobian (see ConstantSGD's hyper_vars). Its gradient along a hyper variable
            # depends on that variable only, which is fixed within the draw: once here.
            jac = jax.grad(fns["log_jacobian"])(state.position, fixed)
            ascent = grad_sum / thin - params["hyper_mask"] * jac
            position = state.position + params["hyper_step"] * ascent
            state = state._replace(position=position)
        # The log-density value only once per draw: at the final position, on the last
        # minibatch (evaluating it every iteration cost up to 85% more than the gradient).
        loss = loss_fn(state.position)
        # Divergence: a non-finite gradient at some inner iteration (a non-finite
        # position shows up in the next iteration's gradient), the final position or loss.
        grad_ok = jnp.isfinite(grad_norms)
        finite = jnp.all(jnp.isfinite(state.position)) & jnp.isfinite(loss) & jnp.all(grad_ok)
        ref = params["ref_loss"]
        limit = jnp.maximum(LOSS_JUMP_ABS, LOSS_JUMP_REL * jnp.abs(ref))
        exploded = jnp.isfinite(ref) & (loss - ref > limit)
        stats = {
            "step_size": step_size,
            "minibatch_loss": loss,
            "grad_norm": jnp.mean(grad_norms),
            "diverging": ~finite | exploded,
            "first_nonfinite": jnp.where(jnp.all(grad_ok), thin, jnp.argmin(grad_ok)),
            "acceptance_rate": jnp.nan if acceptance is None else jnp.mean(acceptance),
        }
        stats.update(plan.draw_stats(state, fixed, params))
        emitted = plan.emit(state, position_sum / thin, emit_key, fixed)
        if hybrid is not None:
            # Each saved draw of the globals is paired with a draw of the locals from q.
            params_q = state.local["params"]
            local_draw = hybrid.draw_locals(emitted, params_q, fixed, emit_key)
            emitted = jnp.concatenate([emitted, local_draw.astype(emitted.dtype)])
        return state, emitted, stats

    return finish


def _check_terms(plan: DrawPlan) -> Callable:
    fns, hybrid, dim = plan.fns, plan.hybrid, plan.dim
    n, b, scheme = plan.n, plan.b, plan.scheme
    check_idx, local_idx, global_idx = plan.check_idx, plan.local_idx, plan.global_idx
    loglik_rows = fns["loglik_rows"]
    prior_grad = jax.grad(fns["logprior"])

    def batch_grad(position, fixed, batch):
        return jax.grad(lambda th: jnp.sum(loglik_rows(th, fixed, batch)))(position)

    full_grad = full_data_gradient(loglik_rows, n, min(n, max(b, CHECK_CHUNK_ROWS)))

    def marginal_terms(theta, grad, params):
        """``[θ_g, r_g · ∇log p]`` for the globals, ``r_g`` the columns of the joint
        curvature's inverse (``check_rows``, :mod:`pymc_sgmcmc.tuning.marginal`); empty
        without globals."""
        if global_idx.shape[0] == 0:
            return jnp.zeros((0,), dtype=theta.dtype)
        return jnp.concatenate([theta[global_idx], params["check_rows"].T @ grad])

    def check_terms(state, emitted, fixed, data, params, key):
        """``[θ_k, (A⁻¹∇log p(θ))_k]`` at the saved draw for the checked coordinates
        (:mod:`pymc_sgmcmc.diagnostics`), then ``[θ_g, r_g·∇log p]`` for the globals: the
        exact gradient for MALA; else a minibatch estimate with an SVRG control variate at
        the centre (whose full-data gradient ``check_grad`` was taken once after tuning), or
        with local variables the joint density's gradient at the draw of the locals."""
        theta = emitted[:dim]
        if plan.exact:
            grad = state.grad
        elif hybrid is not None:
            # The joint density's gradient at (θ, z) for the globals and, with M = I, for
            # the checked locals: Stein's identity in θ alone holds for any draws whose
            # θ | z is right, so the locals' coordinates are what can see a wrong q; the
            # globals' marginal terms take the joint gradient in (θ, z).
            width = 2 * (check_idx.shape[0] + local_idx.shape[0] + global_idx.shape[0])
            if plan.row_locals:
                return jnp.full((width,), jnp.nan, dtype=theta.dtype)
            z = emitted[dim:]
            batch = draw_minibatch(key, data, n, b, scheme)

            def joint(th, zz):
                with_z = hybrid.layout.insert(fixed, zz)
                rows = jnp.sum(loglik_rows(th, with_z, batch))
                return fns["logprior"](th, with_z) + (n / b) * rows

            grad, grad_z = jax.grad(joint, argnums=(0, 1))(theta, z)
            u = apply_preconditioner(params["check_cov"], grad)
            both = jnp.concatenate([grad, grad_z])
            return jnp.concatenate(
                [
                    theta[check_idx],
                    z[local_idx],
                    u[check_idx],
                    grad_z[local_idx],
                    marginal_terms(theta, both, params),
                ]
            )
        else:

            def estimated(_):
                batch = draw_minibatch(key, data, n, b, scheme)
                centre = params["check_centre"]
                diff = batch_grad(theta, fixed, batch) - batch_grad(centre, fixed, batch)
                return prior_grad(theta, fixed) + (n / b) * diff + params["check_grad"]

            def whole(_):
                return prior_grad(theta, fixed) + full_grad(theta, fixed, data)

            # Group effects (check_exact): a minibatch holds a group's rows once in many
            # draws, and Stein's statistic on a gradient that is mostly the centre's, with
            # a rare spike of N/B times the rows', is heavy-tailed (20 000 groups, B = 512:
            # variance ratios 0.12-0.23 on groups whose draws were right). The exact
            # gradient costs one pass per saved draw, in large chunks.
            grad = jax.lax.cond(params["check_exact"] > 0, whole, estimated, None)
        u = apply_preconditioner(params["check_cov"], grad)
        return jnp.concatenate(
            [theta[check_idx], u[check_idx], marginal_terms(theta, grad, params)]
        )

    return check_terms


def full_data_logdensity(fns: dict[str, Callable], n: int, b: int) -> Callable:
    """``logdensity(position, fixed, data)``: the log prior plus the log-likelihood summed
    over all ``n`` rows of the laid-out ``data`` in a scan over chunks of ``b`` rows (what the
    self-check's joint curvature differentiates twice)."""
    loglik_rows, logprior = fns["loglik_rows"], fns["logprior"]

    def logdensity(position, fixed, data):
        starts, masks = full_data_chunks(n, b)

        def chunk(total, xs):
            start, mask = xs
            rows = tuple(jax.lax.dynamic_slice_in_dim(a, start, b, axis=0) for a in data)
            return total + jnp.sum(mask * loglik_rows(position, fixed, rows)), None

        total, _ = jax.lax.scan(chunk, jnp.zeros((), position.dtype), (starts, masks))
        return logprior(position, fixed) + total

    return logdensity


def _full_grad(plan: DrawPlan) -> Callable:
    return full_data_gradient(plan.fns["loglik_rows"], plan.n, plan.b)


def full_data_gradient(loglik_rows: Callable, n: int, b: int) -> Callable:
    """``full_grad(position, fixed, data)``: the log-likelihood's gradient summed over all
    ``n`` rows of the laid-out ``data``, in a scan over chunks of ``b`` rows (the tuning's
    check gradient; SVRG-LD's anchor)."""

    def full_grad(position, fixed, data):
        # Σ_n ∇log p(x_n | θ) over every row once, in chunks of B laid-out rows.
        starts, masks = full_data_chunks(n, b)

        def chunk(total, xs):
            start, mask = xs
            rows = tuple(jax.lax.dynamic_slice_in_dim(a, start, b, axis=0) for a in data)
            g = jax.grad(lambda th: jnp.sum(mask * loglik_rows(th, fixed, rows)))(position)
            return total + g, None

        total, _ = jax.lax.scan(chunk, jnp.zeros_like(position), (starts, masks))
        return total

    return full_grad


def _draw(plan: DrawPlan, finish: Callable) -> Callable:
    n, b, thin, scheme = plan.n, plan.b, plan.thin, plan.scheme
    iteration, hybrid, logdensity = plan.iteration, plan.hybrid, plan.fns["logdensity"]
    check_terms = _check_terms(plan)

    def draw(key, state, data, fixed, params):
        # All of a draw's randomness in two vectorised calls before the scan: per-iteration
        # PRNG calls cost more than a small minibatch's gradient on CPU.
        key, key_rows, key_noise = jax.random.split(key, 3)
        indices = minibatch_indices(key_rows, n, b, scheme, (thin,))
        position = state.position
        width = position.shape[0] + plan.extra_normals
        predrawn = thin * width <= PREDRAWN_NORMALS_MAX
        if predrawn:
            normals = jax.random.normal(key_noise, (thin, width), dtype=position.dtype)
            normals = plan.mix_normals(normals, params)
        else:
            normals = jnp.arange(thin)  # each iteration draws its own, from its number
            key_iterations = jax.random.fold_in(key_noise, 4)

        def normal_of(drawn):
            if predrawn:
                return drawn
            own = jax.random.normal(
                jax.random.fold_in(key_iterations, drawn), (1, width), dtype=position.dtype
            )
            return plan.mix_normals(own, params)[0]

        # Row ids (in 0..N−1) of every iteration's minibatch and of the one after it.
        row_ids = jax.vmap(lambda r: minibatch_row_ids(r, n, b, scheme))(indices)
        next_row_ids = jnp.roll(row_ids, -1, axis=0)
        state = plan.start_draw(state, row_ids[0])
        if hybrid is not None:
            local = {
                **state.local,
                "key": jax.random.fold_in(key_noise, 2),
                "elbo_sum": jnp.zeros_like(state.local["elbo_sum"]),
            }
            state = HybridState(state.kernel, local)

        def body(carry, xs):
            state, position_sum, grad_sum = carry
            rows, drawn, ids, next_ids = xs
            batch = take_minibatch(rows, data, n, b, scheme)
            state, info, grad = iteration(
                normal_of(drawn), state, batch, ids, next_ids, fixed, params
            )
            return (state, position_sum + state.position, grad_sum + grad), info

        zeros = jnp.zeros_like(state.position)
        (state, position_sum, grad_sum), infos = jax.lax.scan(
            body,
            (state, zeros, zeros),
            (indices, normals, row_ids, next_row_ids),
        )
        last_batch = take_minibatch(indices[-1], data, n, b, scheme)
        state, emitted, stats = finish(
            state,
            position_sum,
            grad_sum,
            lambda position: -logdensity(position, fixed, last_batch),
            infos.grad_norm,
            infos.step_size[-1],
            fixed,
            params,
            jax.random.fold_in(key_noise, 1),
            getattr(infos, "acceptance", None),
        )
        stats["check_terms"] = check_terms(
            state, emitted, fixed, data, params, jax.random.fold_in(key_noise, 3)
        )
        return key, state, emitted, stats

    return draw


def _draw_chunk(plan: DrawPlan) -> Callable:
    iteration, b = plan.iteration, plan.b

    def draw_chunk(key, state, sums, batches, fixed, params):
        # A streamed draw's iterations over one chunk of host-read minibatches
        # (``batches``: arrays of shape (iterations, B, ...)).
        iters = batches[0].shape[0]
        position = state.position
        normals = jax.random.normal(key, (iters, *position.shape), dtype=position.dtype)
        normals = plan.plain_mix_normals(normals, params)
        ids = jnp.zeros(b, dtype=jnp.int32)  # row ids: only SAGA-LD uses them

        def body(carry, xs):
            state, position_sum, grad_sum = carry
            batch, normal = xs
            state, info, grad = iteration(normal, state, batch, ids, ids, fixed, params)
            return (state, position_sum + state.position, grad_sum + grad), (
                info.step_size,
                info.grad_norm,
            )

        (state, position_sum, grad_sum), (steps, norms) = jax.lax.scan(
            body, (state, *sums), (batches, normals)
        )
        return state, (position_sum, grad_sum), steps[-1], norms

    return draw_chunk


def _finish_streamed(plan: DrawPlan, finish: Callable) -> Callable:
    logdensity = plan.fns["logdensity"]

    def finish_streamed(state, position_sum, grad_sum, last_batch, *rest):
        # rest: grad_norms, step_size, fixed, params, emit_key
        return finish(
            state,
            position_sum,
            grad_sum,
            lambda position: -logdensity(position, rest[-3], last_batch),
            *rest,
        )

    return finish_streamed


def _draw_sharded(plan: DrawPlan, sharded: ShardedData, finish: Callable) -> Callable:
    thin, kernel_step, fns = plan.thin, plan.kernel_step, plan.fns
    k, per_device, shard_loglik = len(sharded.devices), sharded.per_device, sharded.loglik
    prior_grad = jax.grad(fns["logprior"])

    def draw_sharded(key, state, data, fixed, params):
        # The single-device draw with each iteration's minibatch split over devices.
        arrays, n_local = data
        key, key_rows, key_noise = jax.random.split(key, 3)
        limit = n_local[None, :, None]
        indices = jax.random.randint(key_rows, (thin, k, per_device), 0, limit)
        position = state.position
        normals = jax.random.normal(key_noise, (thin, *position.shape), position.dtype)
        normals = plan.plain_mix_normals(normals, params)

        def body(carry, xs):
            state, position_sum, grad_sum = carry
            rows, normal = xs
            _, lik_grad = shard_loglik(state.position, fixed, arrays, n_local, rows)
            grad = prior_grad(state.position, fixed) + lik_grad
            state, info = kernel_step(normal, state, lambda _: grad, params)
            return (state, position_sum + state.position, grad_sum + grad), info

        zeros = jnp.zeros_like(position)
        (state, position_sum, grad_sum), infos = jax.lax.scan(
            body, (state, zeros, zeros), (indices, normals)
        )

        def loss_fn(position):
            lik, _ = shard_loglik(position, fixed, arrays, n_local, indices[-1])
            return -(fns["logprior"](position, fixed) + lik)

        state, emitted, stats = finish(
            state,
            position_sum,
            grad_sum,
            loss_fn,
            infos.grad_norm,
            infos.step_size[-1],
            fixed,
            params,
            jax.random.fold_in(key_noise, 1),
        )
        return key, state, emitted, stats

    return draw_sharded


def streamed_draw(
    compiled: dict[str, Any],
    key: Any,
    state: Any,
    fixed: tuple,
    params: dict[str, Any],
    thin: int,
    b: int,
    block: int,
    read_rows: Callable,
    rng: np.random.Generator,
    n: int,
    dtype: Any,
) -> tuple:
    """One draw on data read from the host (out of core): ``(key, state, emitted, stats)``
    as the in-memory draw returns them. Its ``thin`` iterations run as compiled
    ``draw_chunk`` calls over chunks of about ``CHUNK_ROWS`` rows, each chunk's minibatches
    read by ``read_rows(starts, block)`` (blocks of ``block`` consecutive rows at the starts
    ``rng`` draws), then ``finish``."""
    per_batch = b // block
    chunk = max(1, min(thin, CHUNK_ROWS // b))
    key, key_draw = jax.random.split(key)
    zeros = np.zeros(state.position.shape, dtype=dtype)
    sums = (zeros, zeros)
    norms, step_size, batches = [], None, None
    for c, first in enumerate(range(0, thin, chunk)):
        iters = min(chunk, thin - first)
        starts = rng.integers(0, n, iters * per_batch)
        arrays = read_rows(starts, block)
        batches = tuple(a.reshape(iters, b, *a.shape[1:]) for a in arrays)
        state, sums, step_size, chunk_norms = compiled["draw_chunk"](
            jax.random.fold_in(key_draw, c), state, sums, batches, fixed, params
        )
        norms.append(chunk_norms)
    last_batch = tuple(a[-1] for a in batches)
    grad_norms = norms[0] if len(norms) == 1 else jnp.concatenate(norms)
    state, emitted, stats = compiled["finish"](
        state,
        sums[0],
        sums[1],
        last_batch,
        grad_norms,
        step_size,
        fixed,
        params,
        jax.random.fold_in(key_draw, 2**31 - 1),
    )
    return key, state, emitted, stats
