r"""Several hosts: JAX's multi-process runtime, each host holding only its own rows.

A data set too large for one machine lives as row shards on several hosts' disks. Every host
runs the same script, one process per host, started by the cluster's launcher (SLURM,
Kubernetes, ``mpirun`` or plain environment variables); the script starts JAX's runtime with
:func:`initialize` (or ``jax.distributed.initialize(...)``) before anything else uses JAX,
builds the model on a placeholder (its first rows, as for out-of-core data) and gives the
sampler its own rows as a :class:`RowShard`::

    import numpy as np, pymc as pm, pymc_sgmcmc as pmsg

    pmsg.distributed.initialize()  # SLURM / mpirun / Kubernetes / JAX_* environment variables
    start, X, y = my_rows()  # this host's rows start..start+len(X)-1 of the whole data set
    with pm.Model():
        X_data = pm.Data("X", X[:1000])
        beta = pm.Normal("beta", 0, 1, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=X_data @ beta, observed=pm.Data("y_obs", y[:1000]))
        step = pmsg.IASG(data=pmsg.RowShard({"X": X, "y_obs": y}, start=start))
        idata = pm.sample(step=step, random_seed=1)  # the same call on every host

What happens. Building the step gathers every process's ``(start, rows)`` and checks that
the shards partition ``0..N−1`` exactly (:func:`check_partition`: a row held twice or by
nobody is refused, naming the processes), so ``N`` — which scales the likelihood — is the
sum over hosts. Shards may differ systematically (one year, one region, one outcome per
host): a shard-by-shard minibatch then has less noise than a uniform one, and the tuning
measures that noise shard by shard (:func:`pymc_sgmcmc.sharding.sharded_gradient_noise`).
Each host lays out only its own rows on its own devices (shuffled once within
the shard for the ``"blocks"`` scheme); one global device mesh spans the hosts. Every
iteration each device draws ``B/k`` rows of its own piece and the gradient
``Σ_d (N_d / B_d) Σ_{i ∈ S_d} ∇ log p(x_i | θ)`` — unbiased for the full-data gradient
whatever the shard sizes — is summed across hosts by one all-reduce of ``D`` numbers
(:mod:`pymc_sgmcmc.sharding`). The tuning's blocks of rows (per-example gradient noise,
curvature, the mode search) are uniform over all ``N`` rows: each row slot picks a shard
with probability ``N_d / N`` and a row of it, and the chosen rows are summed across devices
(:func:`pymc_sgmcmc.sharding.sharded_uniform_rows`). Everything else — the kernel, the
positions, the random numbers — is replicated: every process computes the same draws, and
``pm.sample`` returns the same InferenceData on every process (write it from process 0,
:func:`is_main_process`).

Failure. When a process dies, the survivors' next all-reduce fails (JAX's CPU collectives
report the closed connection); the sampler then raises :class:`LostProcessError` naming the
processes the coordination service no longer sees, and JAX's runtime ends the process when
its heartbeat timeout (``heartbeat_timeout_seconds``, 100 s by default) confirms the loss —
no process hangs.

A single process can hold several shards too (``data=[RowShard(...), RowShard(...)]``,
one JAX device per shard): the layout of a multi-host run, simulated on one host, with the
same draws for the same seed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pymc_sgmcmc.errors import DataShapeError

__all__ = [
    "DataLayoutError",
    "LostProcessError",
    "RowShard",
    "ShardLayout",
    "check_partition",
    "initialize",
    "is_main_process",
    "local_environment",
    "process_count",
    "process_index",
]


class DataLayoutError(DataShapeError):
    """The hosts' row shards do not partition the rows ``0..N−1`` exactly."""


class LostProcessError(RuntimeError):
    """A collective operation failed because another process of the run stopped."""


@dataclasses.dataclass(frozen=True)
class RowShard:
    """The rows ``start`` to ``start + n − 1`` of the whole data set, as this process holds them.

    ``arrays`` maps each row-aligned container of the likelihood (as for ``data=``) to this
    shard's rows: NumPy arrays or memory-maps (read into memory once, on this host only).
    """

    arrays: Mapping[str, Any]
    start: int

    def __post_init__(self) -> None:
        if not isinstance(self.arrays, Mapping) or not self.arrays:
            raise DataShapeError(
                "RowShard(arrays, start) needs a mapping of container names to this shard's "
                f"rows, got {type(self.arrays).__name__}."
            )
        if isinstance(self.start, bool) or int(self.start) != self.start or self.start < 0:
            raise DataShapeError(
                f"RowShard start must be the shard's first row number (an integer >= 0), got "
                f"{self.start!r}."
            )
        lengths = {name: _rows(name, a) for name, a in self.arrays.items()}
        if len(set(lengths.values())) != 1:
            raise DataShapeError(
                f"The arrays of a RowShard must have the same number of rows; got {lengths}."
            )
        if next(iter(lengths.values())) == 0:
            raise DataShapeError(f"The RowShard starting at row {self.start} has no rows.")

    @property
    def n_rows(self) -> int:
        return _rows("", next(iter(self.arrays.values())))


def _rows(name: str, array: Any) -> int:
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) < 1:
        raise DataShapeError(
            f"RowShard arrays must have rows along the first axis; {name!r} is "
            f"{type(array).__name__}."
        )
    return int(shape[0])


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where the rows are: shard ``i`` is the rows ``starts[i]`` to ``starts[i] + sizes[i] − 1``,
    held by process ``owners[i]`` (sorted by ``starts``)."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    owners: tuple[int, ...]

    @property
    def total(self) -> int:
        return int(sum(self.sizes))

    def held_by(self, process: int) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == process]


def check_partition(
    starts: Sequence[int], sizes: Sequence[int], owners: Sequence[int]
) -> ShardLayout:
    """The layout of shards that partition the rows 0 to N − 1 exactly, sorted by first row; else a
    :class:`DataLayoutError` naming the processes whose rows overlap or the rows nobody holds."""
    order = sorted(range(len(starts)), key=lambda i: (int(starts[i]), int(owners[i])))
    starts = [int(starts[i]) for i in order]
    sizes = [int(sizes[i]) for i in order]
    owners = [int(owners[i]) for i in order]
    problems = []
    expected = 0
    for i, (start, size, owner) in enumerate(zip(starts, sizes, owners, strict=True)):
        stop = start + size
        if start > expected:
            problems.append(f"rows {expected}..{start - 1} are held by no process")
        elif start < expected:
            prev = owners[i - 1]
            problems.append(
                f"rows {start}..{min(stop, expected) - 1} are held twice (process {prev} and "
                f"process {owner})"
            )
        expected = max(expected, stop)
    if problems:
        shards = ", ".join(
            f"process {o}: rows {s}..{s + n - 1}"
            for s, n, o in zip(starts, sizes, owners, strict=True)
        )
        raise DataLayoutError(
            "The row shards do not partition the data set's rows 0..N-1 exactly: "
            + "; ".join(problems)
            + f" ({shards}). Give each process RowShard(arrays, start=...) with its own rows, "
            "so that together they hold every row once."
        )
    return ShardLayout(tuple(starts), tuple(sizes), tuple(owners))


def process_count() -> int:
    """The number of processes of the run (1 unless ``jax.distributed`` is initialised)."""
    import jax

    return int(jax.process_count()) if jax.distributed.is_initialized() else 1


def process_index() -> int:
    """This process's index (0 unless ``jax.distributed`` is initialised)."""
    import jax

    return int(jax.process_index()) if jax.distributed.is_initialized() else 0


def is_main_process() -> bool:
    """Whether this process should write the results (process 0; always in one process)."""
    return process_index() == 0


def initialize(**kwargs: Any) -> bool:
    """Start JAX's multi-process runtime if the launcher set one up; return whether this is a
    run of several processes. Call it before anything else uses JAX.

    With keyword arguments: ``jax.distributed.initialize(**kwargs)``. Without, from the
    environment:

    * ``JAX_NUM_PROCESSES``, ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0) and
      ``JAX_PROCESS_ID`` — or, in a Kubernetes Indexed Job, ``JOB_COMPLETION_INDEX`` — which
      any launcher can set; ``JAX_HEARTBEAT_TIMEOUT`` (seconds) optionally;
    * else a SLURM job step of several tasks (``srun``) or an Open MPI run of several ranks
      (``mpirun``): JAX's own detection (``jax.distributed.initialize()``);
    * else nothing: one process, and the same script runs unchanged on a laptop (a single
      ``RowShard`` starting at row 0 is then the whole data set).
    """
    import jax

    if jax.distributed.is_initialized():
        return process_count() > 1
    env = os.environ
    if not kwargs and "JAX_NUM_PROCESSES" in env:
        process_id = env.get("JAX_PROCESS_ID", env.get("JOB_COMPLETION_INDEX"))
        if process_id is None or "JAX_COORDINATOR_ADDRESS" not in env:
            raise RuntimeError(
                "JAX_NUM_PROCESSES is set, so every process needs JAX_COORDINATOR_ADDRESS "
                "(host:port of process 0) and JAX_PROCESS_ID (or a Kubernetes Indexed Job's "
                "JOB_COMPLETION_INDEX) too."
            )
        kwargs = {
            "coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
            "num_processes": int(env["JAX_NUM_PROCESSES"]),
            "process_id": int(process_id),
        }
        if "JAX_HEARTBEAT_TIMEOUT" in env:
            kwargs["heartbeat_timeout_seconds"] = int(env["JAX_HEARTBEAT_TIMEOUT"])
    launched = int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env
    launched = launched or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if not kwargs and not launched:
        return False
    jax.distributed.initialize(**kwargs)
    return process_count() > 1


def local_environment(process_id: int, num_processes: int, port: int) -> dict[str, str]:
    """The variables :func:`initialize` reads, for process ``process_id`` of ``num_processes``
    on this one machine (the coordinator on ``127.0.0.1:port``): to try a cluster script
    locally, start it once per process with ``env={**os.environ, **local_environment(...)}``."""
    return {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
    }


def as_shards(data: Any) -> list[RowShard] | None:
    """``data=`` as a list of row shards, or None when it is a plain mapping of arrays."""
    if isinstance(data, RowShard):
        return [data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(s, RowShard) for s in data):
        return list(data)
    if isinstance(data, (list, tuple)):
        raise DataShapeError(
            "data= as a list must be RowShard(arrays, start=...) values, one per shard; got "
            f"{[type(s).__name__ for s in data]}."
        )
    return None


def gather_layout(shards: Sequence[RowShard]) -> ShardLayout:
    """Every process's shards, checked to partition ``0..N−1`` (one all-gather across
    processes; in one process, the shards given)."""
    count = process_count()
    if count == 1:
        return check_partition(
            [s.start for s in shards], [s.n_rows for s in shards], [0] * len(shards)
        )
    if len(shards) != 1:
        raise DataShapeError(
            f"With {count} processes each process gives its own rows as one RowShard; process "
            f"{process_index()} gave {len(shards)} (concatenate them, or start one process per "
            "shard)."
        )
    from jax.experimental import multihost_utils

    mine = np.asarray([shards[0].start, shards[0].n_rows, process_index()], dtype=np.int64)
    table = np.asarray(multihost_utils.process_allgather(mine)).reshape(count, 3)
    return check_partition(table[:, 0], table[:, 1], table[:, 2])


def lost_processes(wait_seconds: float | None = None) -> list[int] | None:
    """The processes the coordination service no longer sees as alive, or None when it cannot
    tell (no runtime, or no answer within ``wait_seconds``; JAX answers once its heartbeat
    timeout has confirmed the loss)."""
    import jax

    if not jax.distributed.is_initialized():
        return None
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    count = process_count()
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            result["live"] = client.get_live_nodes(list(range(count)))
        except Exception as err:  # the coordinator itself is gone
            result["error"] = err

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(wait_seconds)
    if "live" in result:
        return sorted(set(range(count)) - set(result["live"]))
    if "error" in result and process_index() != 0:
        return [0]  # the coordination service runs in process 0
    return None


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a cross-process collective that failed because a peer stopped."""
    if process_count() == 1:
        return False
    text = str(err)
    return any(
        marker in text
        for marker in (
            "Gloo",
            "Connection closed by peer",
            "Connection reset by peer",
            "heartbeat",
            "coordination service",
            "DEADLINE_EXCEEDED",
            "UNAVAILABLE",
        )
    )


def lost_process_error(err: BaseException) -> LostProcessError:
    """The error a survivor raises: names this process and, if the coordination service can
    tell, the lost ones (a line is also written to stderr at once, since JAX's runtime may
    end the process before the exception reaches the user)."""
    me, count = process_index(), process_count()
    head = f"pymc_sgmcmc: process {me} of {count}: a collective with the other processes failed"
    print(f"{head} ({str(err).splitlines()[0][:300]}); asking which stopped...", file=sys.stderr)
    sys.stderr.flush()
    # Two processes: the other one. More: ask the coordination service (which answers once
    # its heartbeat timeout has confirmed the loss).
    lost = [1 - me] if count == 2 else lost_processes()
    if lost:
        names = ", ".join(f"process {p}" for p in lost)
        which = f"lost {names}"
    else:
        which = "the coordination service could not say which process stopped"
    message = (
        f"{head}: {which}. Sampling cannot go on without every shard of the data; restart "
        "the run on every host."
    )
    print(message, file=sys.stderr)
    sys.stderr.flush()
    return LostProcessError(message)
