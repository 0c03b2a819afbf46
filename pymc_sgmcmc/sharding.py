r"""Data-parallel minibatch gradients over several JAX devices (``devices=`` of the samplers).

With ``k`` devices, the rows are split into ``k`` pieces (:func:`pymc_sgmcmc.minibatch.
layout_shards`), one per device, as one global array sharded along a ``"data"`` mesh axis.
Each iteration, every device draws ``B/k`` rows of its piece and computes their
log-likelihood gradient; ``jax.lax.psum`` adds them up inside a :func:`jax.shard_map`, and
the prior's gradient is added once. The estimator

.. math:: \nabla \log p(\theta) + \sum_d \frac{N_d}{B/k} \sum_{i \in S_d} \nabla \log p(x_i \mid \theta)

is unbiased for the full-data gradient. Everything else — the kernel, the noise estimates
for tuning (from the first device's rows, a uniform sample of the shuffled data), the
draw's scan — is the single-device code.

Testing on one machine: ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before
JAX starts) makes the CPU look like four devices. Many hosts: start every process with
``jax.distributed.initialize(...)`` before the model is sampled and pass ``devices="all"``;
each host must hold the data (it is placed with :func:`jax.make_array_from_callback`, so each
host materialises only its own devices' rows on them), and every process runs the same
``pm.sample`` call with the same ``random_seed`` and gets the same draws (write the results
from process 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.minibatch import MinibatchScheme, layout_shards, take_minibatch

__all__ = ["resolve_devices", "shard_data", "sharded_loglik"]

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
