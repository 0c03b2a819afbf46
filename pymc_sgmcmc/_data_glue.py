"""The steps' data placement: rows held as shards over devices or processes, one device per
chain, and the blocks of rows the tuning reads (in memory, or read from disk for out-of-core
``data=``).

A mixin of :class:`pymc_sgmcmc.adapter.step.SGMCMCStep` (it reads the step's problem and
compiled functions), kept apart so that the step's module holds the draw loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pymc_sgmcmc._runtime import current_chain
from pymc_sgmcmc.adapter.bridge import check_finite_rows
from pymc_sgmcmc.distributed import RowShard, gather_layout, process_count
from pymc_sgmcmc.errors import ModelNotSupportedError, non_finite_rows
from pymc_sgmcmc.out_of_core import with_data
from pymc_sgmcmc.sharding import resolve_devices

__all__ = ["DataGlue"]


class DataGlue:
    def _setup_shards(self, shards: list[RowShard], devices: Any) -> tuple[Any, Any]:
        """``data=RowShard(...)`` (or a list of them): this process's rows, with their place
        in the whole data set. Gathers every process's shards, checks that they partition
        ``0..N−1`` and the rows are finite, and returns ``(data, devices)`` for the rest of
        ``__init__``: one shard in one process is plain ``data=``; else ``(None, the devices
        spec)`` (every device of the mesh; see :func:`pymc_sgmcmc.sharding.shard_rows`)."""
        if devices not in (None, "all"):
            raise ValueError(
                f"data= as row shards puts each shard on its own devices; leave devices= unset "
                f"(got devices={devices!r})."
            )
        if not self._streams:
            raise ModelNotSupportedError(
                f"{type(self).__name__} keeps per-row state or takes full-data gradients; it "
                "runs on one device. Use SGLD, ConstantSGD, IASG or SGFS with row shards."
            )
        layout = gather_layout(shards)
        if len(layout.sizes) == 1:
            return dict(shards[0].arrays), devices  # the whole data set, in this process
        if process_count() == 1:
            import jax

            if len(jax.devices()) < len(layout.sizes):
                raise ValueError(
                    f"{len(layout.sizes)} row shards in one process need one JAX device each, "
                    f"but JAX sees {len(jax.devices())}. On a CPU, set XLA_FLAGS=--xla_force_"
                    f"host_platform_device_count={len(layout.sizes)} before JAX starts (or "
                    "concatenate the shards)."
                )
        names = list(shards[0].arrays)
        # This process's rows in row order; one shard (every multi-process run) stays as given,
        # e.g. a memory-map that shard_rows then reads piece by piece, without a whole copy.
        local = {
            name: np.asarray(shards[0].arrays[name])
            if len(shards) == 1
            else np.concatenate([np.asarray(s.arrays[name]) for s in shards], axis=0)
            for name in names
        }
        problem = with_data(self.problem, local)
        for name, array in zip(problem.data_names, problem.data, strict=True):
            check_finite_rows(repr(name), array, layout.total)
        self.problem = dataclasses.replace(problem, data_size=layout.total)
        self._shard_layout = layout
        return None, "all" if process_count() > 1 else len(layout.sizes)

    def _device_summary(self) -> Any:
        if self._chain_device is not None:
            return str(self._chain_device)
        compiled = self._compiled
        if compiled is None or self.devices in (None, 1):
            return None
        return int(len(resolve_devices(self.devices) or [])) or None

    def _place_chain(self, compiled: dict[str, Any]) -> None:
        """``devices="chains"``: move the data to device ``c mod k`` for chain ``c``; the
        compiled functions then run there (they follow their committed inputs)."""
        jax = compiled["jax"]
        available = jax.devices()
        chain = current_chain()
        device = available[(chain or 0) % len(available)]
        if device != self._chain_device:
            compiled["data"] = jax.device_put(compiled["data"], device)
            self._chain_device = device

    def _tuning_data(self, key: Any, rows: int | None = None) -> Any:
        """What the tuning functions read: the device data, or (streamed) a block of ``rows``
        (default ``max(B, 1024)``) rows drawn uniformly with replacement and read on the host."""
        compiled = self._compile()
        if not self.streaming:
            return compiled["data"]
        rng = np.random.default_rng(np.asarray(compiled["jax"].random.key_data(key)).tolist())
        count = self._noise_rows if rows is None else rows
        return self._read_rows(np.sort(rng.integers(0, self.problem.data_size, count)), 1)

    def _read_rows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, ...]:
        """Rows ``(start + 0..length−1) mod N`` of every streamed array, checked finite as
        they are read (the in-memory data are checked when the problem is built)."""
        compiled = self._compile()
        chunks = []
        for name, source, dtype in zip(
            self.problem.data_names, compiled["sources"], compiled["batch_dtypes"], strict=True
        ):
            rows = np.asarray(source.read(starts, length))
            if rows.dtype.kind == "f":
                finite = np.isfinite(rows.reshape(len(rows), -1)).all(axis=1)
                if not finite.all():
                    at = np.flatnonzero(~finite)
                    raise non_finite_rows(
                        f"data[{name!r}]",
                        source.shape,
                        source.row_numbers(starts, length)[at],
                        rows[at[0]],
                        source.n,
                        streamed=True,
                    )
            chunks.append(np.asarray(rows, dtype=dtype))
        return tuple(chunks)
