"""What the tuning measures, compiled: the gradient noise and the curvature on a block of rows,
the spectral radius of the preconditioned Hessian, Hessian-vector products, and the Newton
search for the mode's value, gradient and Hessian.

:func:`measurement_functions` builds them (not yet jitted) for one model and data layout (in
memory, streamed, or sharded over devices); the steps' host-side tuning
(:mod:`pymc_sgmcmc.tuning.tuner`) consumes their results. With local variables
(:class:`pymc_sgmcmc.variational.Hybrid`) they measure the ELBO the globals are sampled from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pymc_sgmcmc.kernels.preconditioning import apply_preconditioner
from pymc_sgmcmc.minibatch import block_rows, draw_minibatch
from pymc_sgmcmc.sharding import sharded_gradient_noise, sharded_uniform_rows
from pymc_sgmcmc.tuning.averaging import (
    arrowhead_moments_along,
    chunked_gradient_noise,
    gradient_noise,
)

__all__ = ["measurement_functions"]

EXACT_DIAG_MAX_DIM = 64  # the curvature's diagonal exactly (one product per unit vector)
NOISE_REPEATS = 16  # ELBO gradients whose covariance is the noise estimate with local_vars
NOISE_CHUNK_WORK = 2**22  # per-example gradients are computed this many row x dims at a time
POWER_ITERATIONS = 20  # of the spectral radius


def measurement_functions(
    fns: dict[str, Callable],
    *,
    n: int,
    b: int,
    scheme: str,
    dtype: Any,
    hybrid: Any,
    streaming: bool,
    sharded: Any,
    noise_rows: int,
    search_rows: int,
) -> dict[str, Callable]:
    """``noise``, ``sharded_noise`` (jitted, or None), ``spectral_radius``,
    ``hessian_product``, ``initial_loss``, ``search_block``, ``search_value_grad`` and
    ``search_hessian`` for the model's functions ``fns`` and data of ``n`` rows drawn ``b`` at
    a time by ``scheme``: ``sharded`` (a :class:`pymc_sgmcmc.draws.ShardedData`) when the
    rows are split over devices, ``streaming`` when a block of rows is read on the host and
    passed in as the data. Tuning measures on ``noise_rows`` uniform rows; the search (and
    the noise) on ``search_rows`` (every row when it equals ``n`` in memory)."""
    logdensity = fns["logdensity"]
    in_memory = not streaming and sharded is None

    def tuning_rows(key_rows, data, rows=noise_rows):
        # In memory: uniform rows with replacement (the first N rows of either layout are
        # the data). Streamed: ``data`` is already such a block, read on the host. Sharded:
        # uniform over every device's rows, replicated (see sharded_uniform_rows).
        if streaming:
            return data
        if sharded is not None:
            uniform = sharded_uniform_rows(sharded.mesh, sharded.shard_sizes, rows)
            return uniform(key_rows, data[0], data[1])
        return draw_minibatch(key_rows, data, n, rows, "random")

    def search_block(key_rows, data):
        if in_memory and search_rows == n:
            return tuple(a[:n] for a in data)
        return tuning_rows(key_rows, data, search_rows)

    def search_value_grad(position, fixed, block):
        return jax.value_and_grad(lambda th: -logdensity(th, fixed, block))(position)

    def search_hessian(position, fixed, block, dense):
        grad_u = jax.grad(lambda th: -logdensity(th, fixed, block))
        dim = position.shape[0]
        if dense or dim <= EXACT_DIAG_MAX_DIM:
            eye = jnp.eye(dim, dtype=position.dtype)
            # Batches of Hessian-vector products whose intermediates stay near
            # NOISE_CHUNK_WORK row x dims (all of them at once on every row of a large
            # data set would not fit).
            per = max(1, NOISE_CHUNK_WORK // max(block[0].shape[0], 1))
            hess = jax.lax.map(
                lambda v: jax.jvp(grad_u, (position,), (v,))[1], eye, batch_size=min(per, dim)
            )
            hess = 0.5 * (hess + hess.T)
            return hess if dense else jnp.diag(hess)
        return scaled_hutchinson(
            lambda v: jax.jvp(grad_u, (position,), (v,))[1],
            jax.random.PRNGKey(0),
            dim,
            jnp.zeros(dim, dtype=position.dtype),
        )

    def tuning_logdensity(fixed, local_params, key):
        # What tuning measures: the sampler's log-density, or with local variables the
        # ELBO estimate at q's current parameters and one fixed set of draws ε (so that
        # its curvature is that of the density the globals are sampled from).
        if hybrid is None:
            return lambda th, batch: logdensity(th, fixed, batch)
        eps = hybrid.draw_eps(key, dtype)
        return lambda th, batch: hybrid.elbo(th, local_params, fixed, batch, eps)

    def curvature_product(grad_u, position, v):
        # Hessian-vector product of the potential. With local variables and float64: by
        # central differences of the ELBO gradient at fixed draws of the locals (error
        # ~1e-7 relative), which reuses the draw's gradient graph — forward-over-reverse
        # through q's associative scans took minutes to compile.
        if hybrid is None or position.dtype != jnp.float64:
            return jax.jvp(grad_u, (position,), (v,))[1]
        scale = jnp.maximum(jnp.max(jnp.abs(v)), 1e-300)
        delta = 1e-5 * (1.0 + jnp.max(jnp.abs(position))) / scale
        return (grad_u(position + delta * v) - grad_u(position - delta * v)) / (2 * delta)

    def noise(key, position, fixed, data, full, local_params, full_curvature=False):
        # Per-example gradients by vmap; unbiased sample (co)variance. With local
        # variables the estimator's own noise instead: the covariance of NOISE_REPEATS
        # ELBO gradients at fresh minibatches and draws of the locals, in per-datum units
        # (x B/N²) — per-example gradients at fixed locals miss both the minibatch noise
        # that reaches the globals through q(z | θ) and the Monte Carlo noise. Also the
        # diagonal Hessian of the potential on the same rows: exact (one Hessian-vector
        # product per unit vector) up to 64 dimensions, else Hutchinson's estimator
        # diag(H) ≈ mean_z z ⊙ Hz over 16 Rademacher probes.
        key_rows, key_probe = jax.random.split(key)
        # Every row once when there are few (the curvature of a group's effect then comes
        # from all of its rows), else a block of rows drawn uniformly.
        batch = search_block(key_rows, data)
        if hybrid is None:

            def rows_of(start, size):
                part = tuple(jax.lax.dynamic_slice_in_dim(a, start, size) for a in batch)
                return fns["per_example_grads"](position, fixed, part)

            c = chunked_gradient_noise(
                rows_of, batch[0].shape[0], position.shape[0], full, NOISE_CHUNK_WORK
            )
        else:

            def one_estimate(k):
                k_rows, k_eps = jax.random.split(k)
                rows = draw_minibatch(k_rows, data, n, b, scheme)
                eps = hybrid.draw_eps(k_eps, dtype)
                return jax.grad(hybrid.elbo)(position, local_params, fixed, rows, eps)

            keys = jax.random.split(jax.random.fold_in(key_rows, 7), NOISE_REPEATS)
            c = gradient_noise(jax.lax.map(one_estimate, keys), full=full) * (b / n**2)
        target = tuning_logdensity(fixed, local_params, key_probe)
        grad_u = jax.grad(lambda th: -target(th, batch))
        dim = position.shape[0]
        if full_curvature:
            # The whole Hessian, one Hessian-vector product per unit vector (symmetrised).
            eye = jnp.eye(dim, dtype=position.dtype)
            hess = jax.lax.map(lambda z: curvature_product(grad_u, position, z), eye)
            return c, 0.5 * (hess + hess.T)
        if dim <= EXACT_DIAG_MAX_DIM:
            probes = jnp.eye(dim, dtype=position.dtype)  # exact diagonal
            hvp = jax.lax.map(lambda z: curvature_product(grad_u, position, z), probes)
            return c, jnp.sum(probes * hvp, axis=0)
        fisher_guess = jnp.abs(jnp.diag(c) if c.ndim == 2 else c) * n
        return c, scaled_hutchinson(
            lambda v: curvature_product(grad_u, position, v), key_probe, dim, fisher_guess
        )

    def structured_noise(key, position, fixed, data, probes, id_probes, local_idx, pairs):
        # The per-datum gradients' second moment with the model's nested structure
        # (pymc_sgmcmc.tuning.structure): a row touches the globals and one group's locals,
        # so Σ gᵢgᵢᵀ is a block arrowhead — its globals' block (G, G), each group's cross
        # terms (J, k, G) and block (J, k, k) — on the rows the noise is measured on, from
        # each row's derivatives along the structure's probes (forward mode, O(rows) each:
        # no per-row gradients of D entries). Uncentred: the mean's rank-one term ḡḡᵀ is
        # dense, and in the whitened coordinates (a posterior z-score per coordinate, the
        # full gradient O(1)) it adds O(1/B) to a coordinate's noise, against a budget of
        # O(h).
        key_rows, _ = jax.random.split(key)
        batch = search_block(key_rows, data)
        loglik_rows = fns["loglik_rows"]

        def along(start, size, tangents):
            part = tuple(jax.lax.dynamic_slice_in_dim(a, start, size) for a in batch)

            def one(t):
                return jax.jvp(lambda th: loglik_rows(th, fixed, part), (position,), (t,))[1]

            return jax.vmap(one)(tangents)

        return arrowhead_moments_along(
            along, batch[0].shape[0], probes, id_probes, local_idx, pairs, NOISE_CHUNK_WORK
        )

    def block_potential_grad(key, fixed, data, local_params, rows):
        # The gradient of the potential on the ``rows`` rows that ``key`` draws (and, with
        # local variables, its draws of them), and the key left for the caller.
        key_rows, key_v = jax.random.split(key)
        batch = tuning_rows(key_rows, data, rows)
        target = tuning_logdensity(fixed, local_params, jax.random.fold_in(key_v, 1))
        return jax.grad(lambda th: -target(th, batch)), key_v

    def spectral_radius(key, position, fixed, data, precond, local_params):
        # Largest |eigenvalue| of P·H (H the potential's Hessian on a block of rows) by 20
        # power iterations of Hessian-vector products. SGD is stable iff it is < 2.
        grad_u, key_v = block_potential_grad(key, fixed, data, local_params, noise_rows)

        def power(v, _):
            w = apply_preconditioner(precond, curvature_product(grad_u, position, v))
            norm = jnp.linalg.norm(w)
            return w / jnp.maximum(norm, 1e-300), norm

        v0 = jax.random.normal(key_v, position.shape, dtype=position.dtype)
        _, norms = jax.lax.scan(power, v0 / jnp.linalg.norm(v0), None, length=POWER_ITERATIONS)
        return norms[-1]

    def hessian_product(key, position, fixed, data, local_params, v, rows):
        # H v, H the potential's Hessian on the ``rows`` rows that ``key`` draws (the same
        # rows and draws of the locals at every call with the same key).
        grad_u, _ = block_potential_grad(key, fixed, data, local_params, rows)
        return curvature_product(grad_u, position, v)

    def initial_loss(key, position, fixed, data):
        return -logdensity(position, fixed, tuning_rows(key, data))

    return {
        "noise": noise,
        "structured_noise": structured_noise,
        "sharded_noise": _sharded_noise(fns, b, scheme, sharded, noise_rows)
        if sharded is not None and hybrid is None
        else None,
        "spectral_radius": spectral_radius,
        "hessian_product": hessian_product,
        "initial_loss": initial_loss,
        "search_block": search_block,
        "search_value_grad": search_value_grad,
        "search_hessian": search_hessian,
    }


def scaled_hutchinson(hvp: Callable, key: Any, dim: int, guess: Any) -> Any:
    """diag(H) by Hutchinson's estimator in the coordinates a first estimate d scales: probes
    v = z / √d (z Rademacher), H_jj ≈ √d_j · mean z_j (Hv)_j — unbiased for any d > 0, with
    error Σ_k H_jk / √(d_j d_k) z_j z_k relative to H_jj: the couplings in units of the
    curvature, not of the coordinates. In natural units (a global coupled to 600 group
    effects by a predictor in its own units) plain Hutchinson's error on a group effect's
    diagonal was 5x the diagonal itself, the step then capped 10x too small by the apparent
    stiffness. d: the larger of ``guess`` (the Fisher diagonal N·C_jj) and a plain 16-probe
    estimate (both only scale the probes)."""
    key_plain, key_scaled = jax.random.split(key)
    z = jax.random.rademacher(key_plain, (16, dim), dtype=guess.dtype)
    plain = jnp.mean(z * jax.lax.map(hvp, z), axis=0)
    d = jnp.maximum(guess, jnp.abs(plain))
    d = jnp.maximum(d, 1e-12 * jnp.maximum(jnp.max(d), 1e-300))
    root = jnp.sqrt(d)
    z = jax.random.rademacher(key_scaled, (16, dim), dtype=guess.dtype)
    hvp_z = jax.lax.map(lambda zi: hvp(zi / root), z)
    return root * jnp.mean(z * hvp_z, axis=0)


def _sharded_noise(fns, b, scheme, sharded, noise_rows) -> Callable:
    """The estimator's own noise with rows over devices, a stratified sample's (see
    :func:`pymc_sgmcmc.sharding.sharded_gradient_noise`): (N_d²/B_d)·f_d·C_d added over the
    pieces, each C_d from the piece's own rows. Jitted here (``full`` static)."""
    k = len(sharded.devices)
    piece_block = block_rows(int(sharded.shard_sizes.min()), b // k) if scheme == "blocks" else 1

    def sharded_noise(key, position, fixed, data, full):
        measure = sharded_gradient_noise(
            fns["per_example_grads"],
            sharded.mesh,
            sharded.shard_sizes,
            b // k,
            piece_block,
            max(1024, noise_rows // k),
            full,
            NOISE_CHUNK_WORK,
        )
        return measure(key, position, fixed, data[0], data[1])

    return jax.jit(sharded_noise, static_argnames="full")
