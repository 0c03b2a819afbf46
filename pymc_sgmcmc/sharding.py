r"""Data-parallel minibatch gradients over several JAX devices (``devices=`` of the samplers).

With ``k`` devices, the rows are split into ``k`` pieces (:func:`pymc_sgmcmc.minibatch.
layout_shards`), one per device, as one global array sharded along a ``"data"`` mesh axis.
Each iteration, every device draws ``B/k`` rows of its piece and computes their
log-likelihood gradient; ``jax.lax.psum`` adds them up inside a :func:`jax.shard_map`, and
the prior's gradient is added once. The estimator

.. math:: \nabla \log p(\theta) + \sum_d \frac{N_d}{B/k} \sum_{i \in S_d} \nabla \log p(x_i \mid \theta)

is unbiased for the full-data gradient. Its noise is a stratified sample's,
``Σ_d (N_d²/B_d)·f_d·C_d`` (:func:`sharded_gradient_noise`), which the tuning measures piece by
piece: less than a uniform minibatch's when the pieces differ. Everything else — the kernel,
the draw's scan — is the single-device code.

Testing on one machine: ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before
JAX starts) makes the CPU look like four devices.

Several hosts (:mod:`pymc_sgmcmc.distributed`): each process gives the sampler only its own
rows as a :class:`~pymc_sgmcmc.distributed.RowShard` (:func:`shard_rows` lays them out on its
own devices of one global mesh); or every process holds the whole data set and passes
``devices="all"`` (:func:`shard_data` places on each device only its own rows). Either way
every process runs the same ``pm.sample`` call with the same ``random_seed`` and computes the
same draws (``tests/test_distributed.py`` runs both with two processes on the CPU).

Tuning's curvature reads blocks of rows drawn uniformly from all ``N`` rows
(:func:`sharded_uniform_rows`), replicated on every device; its gradient noise is measured on
each device's own piece (:func:`sharded_gradient_noise`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.distributed import process_count, process_index
from pymc_sgmcmc.minibatch import (
    SHUFFLE_SEED,
    MinibatchScheme,
    layout_shards,
    local_batch,
    stack_pieces,
    take_minibatch,
)
from pymc_sgmcmc.tuning.averaging import chunked_gradient_noise

__all__ = [
    "resolve_devices",
    "shard_data",
    "shard_rows",
    "sharded_gradient_noise",
    "sharded_loglik",
    "sharded_uniform_rows",
]

AXIS = "data"


def resolve_devices(spec: int | str | None) -> list | None:
    """The devices for ``devices=spec`` (None: JAX's default device only)."""
    import jax

    if spec is None:
        return None
    available = jax.devices()
    if spec == "all":
        return list(available)
    if spec > len(available):
        raise ValueError(
            f"devices={spec} but JAX sees {len(available)} device(s) ({available[0].platform}). "
            "On a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=<k> before JAX "
            "starts to split it into k devices."
        )
    return list(available[:spec])


def shard_data(
    arrays: Sequence[np.ndarray], batch_size: int, scheme: MinibatchScheme, devices: list
) -> tuple[tuple[Any, ...], Any, np.ndarray, Any]:
    """``(data, n_local, sizes, mesh)``: the rows as global arrays sharded over ``devices``
    (leading axis of length ``k``), each device's row count as a sharded ``(k,)`` array and on
    the host, and the mesh."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(devices), (AXIS,))
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    stacked, sizes = layout_shards(arrays, batch_size, scheme, len(devices))

    def place(host: np.ndarray) -> Any:
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    data = tuple(place(a) for a in stacked)
    n_local = place(sizes.astype(np.int32))
    return data, n_local, sizes, mesh


def shard_rows(
    local: Sequence[np.ndarray],
    layout: Any,
    batch_size: int,
    scheme: MinibatchScheme,
) -> tuple[tuple[Any, ...], Any, np.ndarray, Any]:
    """:func:`shard_data` for rows held as shards, as ``layout`` (a
    :class:`~pymc_sgmcmc.distributed.ShardLayout`) places them; ``local`` is this process's
    shards' rows, concatenated in row order. One device per shard in one process, or each
    process's shard split over its own devices. Each piece is shuffled once with a
    permutation seeded by its first row number (``"blocks"``), so the layout is the same
    however the pieces are spread over processes."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    multi = process_count() > 1
    if multi:
        per = len(jax.local_devices())
        # Mesh order: the processes in the order of their rows, each with its own devices.
        by_process = {}
        for device in jax.devices():
            by_process.setdefault(device.process_index, []).append(device)
        devices = [d for owner in layout.owners for d in by_process[owner]]
    else:
        per = 1  # one device per shard (the step checked that there are enough)
        devices = list(jax.devices()[: len(layout.sizes)])
    k = len(devices)
    local_b = local_batch(batch_size, k)
    # Pieces: shard i split into `per` contiguous parts (one per device of its process).
    starts, sizes = [], []
    for start, size in zip(layout.starts, layout.sizes, strict=True):
        bounds = start + np.linspace(0, size, per + 1).astype(np.int64)
        starts.extend(bounds[:-1].tolist())
        sizes.extend(np.diff(bounds).tolist())
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    if sizes_arr.min() < local_b:
        raise ValueError(
            f"The smallest piece of the data on one device has {int(sizes_arr.min())} rows, "
            f"fewer than the local batch of {local_b} rows (batch_size / {k} devices); use a "
            "smaller batch_size."
        )
    extra = local_b - 1 if scheme == "blocks" else 0
    length = int(sizes_arr.max()) + extra
    mine = (
        [i for i in range(k) if layout.owners[i // per] == process_index()]
        if multi
        else list(range(k))
    )
    offset = layout.starts[layout.held_by(process_index())[0]] if multi else 0
    mesh = Mesh(np.asarray(devices), (AXIS,))
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    data = []
    for a in local:
        pieces = []
        for i in mine:
            piece = np.asarray(a[starts[i] - offset : starts[i] - offset + sizes[i]])
            if scheme == "blocks":
                piece = piece[
                    np.random.default_rng([SHUFFLE_SEED, starts[i]]).permutation(len(piece))
                ]
            pieces.append(piece)
        stacked = stack_pieces(pieces, length, extra)
        if multi:
            global_shape = (k, *stacked.shape[1:])
            data.append(jax.make_array_from_process_local_data(sharding, stacked, global_shape))
        else:
            data.append(jax.device_put(stacked, sharding))
    n_local = jax.make_array_from_callback(
        (k,), sharding, lambda index: sizes_arr.astype(np.int32)[index]
    )
    return tuple(data), n_local, sizes_arr, mesh


def sharded_uniform_rows(mesh: Any, sizes: np.ndarray, rows: int) -> Callable:
    """``f(key, data, n_local) -> block``: ``rows`` rows drawn uniformly with replacement
    from all ``N = Σ N_d`` rows of the sharded data, replicated on every device.

    Each row slot picks a piece ``d`` with probability ``N_d / N`` (the same draw on every
    device) and each device a uniform row of its own piece; a device keeps the slots it owns
    and one all-reduce sums them. So the tuning's blocks are uniform over the whole data set
    whatever the pieces' sizes or order (a piece sorted by time or group is no problem), and
    cost ``rows`` rows of communication, not a piece."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    logits = np.log(np.asarray(sizes, dtype=np.float64) / float(np.sum(sizes)))

    def local(key, data, n_local):
        d = jax.lax.axis_index(AXIS)
        key_pick, key_rows = jax.random.split(key)
        owner = jax.random.categorical(key_pick, jnp.asarray(logits), shape=(rows,))
        idx = jax.random.randint(jax.random.fold_in(key_rows, d), (rows,), 0, n_local[0])
        mine = owner == d
        out = []
        for a in data:
            cand = jnp.take(a[0], idx, axis=0)
            keep = mine.reshape((rows,) + (1,) * (cand.ndim - 1))
            kind = cand.dtype
            if kind == jnp.bool_:
                cand = cand.astype(jnp.int8)
            picked = jax.lax.psum(jnp.where(keep, cand, jnp.zeros_like(cand)), AXIS)
            out.append(picked.astype(kind))
        return tuple(out)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())


def sharded_gradient_noise(
    per_example_grads: Callable,
    mesh: Any,
    sizes: np.ndarray,
    local_batch: int,
    block: int,
    rows: int,
    full: bool,
    chunk_work: int,
) -> Callable:
    """``f(key, position, fixed, data, n_local) -> S``: the covariance of the sharded
    minibatch-gradient estimator itself, ``S = Σ_d (N_d² / B_d) · f_d · C_d`` (``C_d`` the
    per-row gradient covariance within piece ``d``, ``f_d`` the scheme's factor for blocks of
    ``block`` rows of it), replicated on every device.

    A minibatch drawn piece by piece is a stratified sample: it has none of the spread between
    the pieces' mean gradients that a uniform minibatch has. When the pieces differ
    systematically (rows split by an outcome, a date or a group) that spread is much of the
    per-row noise, and tuning to a uniform minibatch's noise would take the estimator to be
    noisier than it is — a sampler that counts on it then comes out too narrow. Each device
    estimates ``C_d`` from ``rows`` rows of its own piece drawn uniformly with replacement; one
    all-reduce adds the weighted terms."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    sizes = np.asarray(sizes, dtype=np.float64)
    factors = np.where(sizes > 1, (sizes - block) / np.maximum(sizes - 1, 1), 1.0)
    weights = sizes**2 / local_batch * factors

    def local(key, position, fixed, data, n_local):
        d = jax.lax.axis_index(AXIS)
        idx = jax.random.randint(jax.random.fold_in(key, d), (rows,), 0, n_local[0])
        block_rows_ = tuple(jnp.take(a[0], idx, axis=0) for a in data)

        # The position is replicated; a gradient with respect to a replicated value is summed
        # over the devices (its transpose is a psum). Each device's rows' gradients must be
        # its own, so the position is cast to a device-varying value first.
        here = jax.lax.pcast(position, AXIS, to="varying")

        def rows_of(start, size):
            part = tuple(jax.lax.dynamic_slice_in_dim(a, start, size) for a in block_rows_)
            return per_example_grads(here, fixed, part)

        c = chunked_gradient_noise(rows_of, rows, position.shape[0], full, chunk_work)
        weight = jnp.asarray(weights, dtype=c.dtype)[d]
        return jax.lax.psum(weight * c, AXIS)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS), P(AXIS)), out_specs=P()
    )


def sharded_loglik(
    loglik_rows: Callable, mesh: Any, data_size_min: int, local_batch: int, scheme: MinibatchScheme
) -> Callable:
    """``f(position, fixed, data, n_local, rows) -> (value, grad)`` of
    ``Σ_d (N_d / B_d) Σ_{i ∈ S_d} log p(x_i | θ)``, ``rows`` the ``(k, ...)`` minibatch
    indices (one row of :func:`pymc_sgmcmc.minibatch.minibatch_indices` per device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def local(position, fixed, data, n_local, rows):
        pieces = tuple(a[0] for a in data)
        batch = take_minibatch(rows[0], pieces, data_size_min, local_batch, scheme)
        scale = n_local[0].astype(position.dtype) / local_batch

        def part(th):
            return scale * jnp.sum(loglik_rows(th, fixed, batch))

        # The position enters every device unchanged, so under shard_map's replication
        # typing the gradient with respect to it is already summed over devices (the
        # transpose of the implicit broadcast is a psum); only the value needs one.
        value, grad = jax.value_and_grad(part)(position)
        return jax.lax.psum(value, AXIS), grad

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(), P()),
    )
