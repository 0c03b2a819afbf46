r"""Observed data that stay on disk: NumPy memory-maps, zarr, dask or h5py arrays.

The model is written as usual on a *placeholder* — the first rows of the data, in
``pm.Data`` containers (PyMC evaluates the model's log-density on the data it holds, e.g. to
check the initial point; with a memory-map there it would read the whole file) — and the
sampler is given the full arrays::

    X = np.load("X.npy", mmap_mode="r")  # 10⁷ × 20, 1.6 GB on disk
    y = np.load("y.npy", mmap_mode="r")
    with pm.Model():
        X_data = pm.Data("X", X[:1000])
        beta = pm.Normal("beta", 0, 1, shape=20)
        pm.Bernoulli("y", logit_p=X_data @ beta, observed=pm.Data("y_obs", y[:1000]))
        idata = pm.sample(step=pmsg.IASG(data={"X": X, "y_obs": y}))

``data`` maps each row-aligned container (or observed variable) of the likelihood to its
full array; all must have the same number of rows ``N``, which then scales the likelihood.

Sampling scheme. Exactly the in-memory ``"blocks"`` scheme (:mod:`pymc_sgmcmc.minibatch`):
each minibatch is ``B/s`` sub-blocks of ``s`` consecutive rows starting at offsets drawn
uniformly from ``0..N−1`` (wrapping around the end), fresh for every iteration — no buffer
is reused, so the minibatch gradient is unbiased and its noise covariance is the in-memory
one, ``(N²/B)·C·(N−s)/(N−1)``, **provided the rows are stored in random order**. The
in-memory path shuffles the rows once; a file cannot be shuffled in place, so a file sorted
by time, group or label makes neighbouring rows alike and the sub-blocks' noise larger than
the estimate the tuning uses (store it shuffled, or use ``minibatch="random"``: ``s = 1``,
exact but one read per row). Tuning estimates use ``max(B, 1024)`` rows drawn uniformly.

Reading. The host reads each chunk of iterations' rows (about ``CHUNK_ROWS`` rows) while the
device runs the previous chunk (JAX dispatches asynchronously), and hands the chunk to one
compiled scan. A NumPy memory-map (as made by ``np.load(mmap_mode="r")`` or ``np.memmap``,
not a slice of one) is read with ``os.preadv`` into a fresh buffer when a run of rows spans
``RUN_MIN_BYTES`` or more (``s`` is at most ``N/20 000`` rows, so large ``N`` gives long runs);
shorter runs are gathered through the mapping in one NumPy call and the mapping's pages are
then dropped from the process (``madvise(MADV_DONTNEED)``; they stay in the OS's page cache).
Either way the file never accumulates in the process's resident memory. Any other array is
read by slicing (``a[i:j]``; zarr and dask arrays should be chunked along rows). Peak memory
is the model plus a few chunks, whatever ``N`` (``benchmarks/out_of_core.py`` measures it).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from pymc_sgmcmc.errors import DataShapeError

__all__ = ["CHUNK_ROWS", "RowSource", "as_row_source", "is_in_memory", "with_data"]

CHUNK_ROWS = 1 << 15  # rows read per compiled chunk of a streamed draw
RUN_MIN_BYTES = 1 << 16  # runs of rows shorter than this are gathered in one NumPy call


def is_in_memory(array: Any) -> bool:
    """A plain in-memory NumPy array (not a memory-map, zarr, dask or h5py array)."""
    return isinstance(array, np.ndarray) and not isinstance(array, np.memmap)


class RowSource:
    """Reads runs of consecutive rows (wrapping around the end) of one row-aligned array."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self.shape = tuple(int(d) for d in array.shape)
        self.dtype = np.dtype(array.dtype)
        self.n = self.shape[0]
        self._row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=int))

    def row_numbers(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The row numbers :meth:`read` returns, in its order: ``(start + 0..length−1) mod N``."""
        rows = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)
        return rows.reshape(-1) % self.n

    def _gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        return np.asarray(self.array[self.row_numbers(starts, length)])

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``(len(starts) * length, *shape[1:])``: rows ``(start + 0..length−1) mod N``."""
        if isinstance(self.array, np.ndarray) and length * self._row_bytes < RUN_MIN_BYTES:
            # Short runs: one vectorised gather beats a Python loop of slices.
            return self._gather(starts, length)
        out = np.empty((len(starts) * length, *self.shape[1:]), dtype=self.dtype)
        for k, start in enumerate(np.asarray(starts, dtype=np.int64)):
            self._read_into(out[k * length : (k + 1) * length], int(start), length)
        return out

    def _read_into(self, out: np.ndarray, start: int, length: int) -> None:
        first = min(length, self.n - start)
        out[:first] = np.asarray(self.array[start : start + first])
        if first < length:
            out[first:] = np.asarray(self.array[: length - first])

    def close(self) -> None:
        pass


class FileRowSource(RowSource):
    """A C-ordered NumPy memory-map read with ``os.preadv`` (no pages mapped in)."""

    def __init__(self, array: np.memmap) -> None:
        super().__init__(array)
        self._mmap = array.base
        self._offset = int(array.offset)
        self._fd = os.open(os.fspath(array.filename), os.O_RDONLY)

    def _gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        # Runs shorter than a few pages: gather through the mapping, then drop the pages
        # from this process (they stay in the OS's page cache) so they never pile up in its
        # resident memory.
        out = super()._gather(starts, length)
        if hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)
        return out

    def _read_into(self, out: np.ndarray, start: int, length: int) -> None:
        first = min(length, self.n - start)
        view = memoryview(out.reshape(-1).view(np.uint8))
        self._pread(view[: first * self._row_bytes], start)
        if first < length:
            self._pread(view[first * self._row_bytes :], 0)

    def _pread(self, view: memoryview, row: int) -> None:
        offset = self._offset + row * self._row_bytes
        while len(view):
            got = os.preadv(self._fd, [view], offset)
            if got <= 0:
                raise OSError(f"short read from {self.array.filename!r} at byte {offset}")
            view, offset = view[got:], offset + got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a file row source is opened in the process that samples")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def as_row_source(array: Any) -> RowSource:
    """The reader for ``array``: ``preadv`` for a whole C-ordered memory-map, else slicing."""
    if (
        isinstance(array, np.memmap)
        and isinstance(array.base, mmap.mmap)
        and array.flags.c_contiguous
        and getattr(array, "filename", None)
        and hasattr(os, "preadv")
    ):
        return FileRowSource(array)
    return RowSource(array)


def with_data(problem: Any, data: Mapping[str, Any]) -> Any:
    """``problem`` with its row-aligned data replaced by the full arrays in ``data``.

    Keys are the names the problem knows its data by (``problem.data_names``: a ``pm.Data``
    container's name, or an observed variable's name for observed values given directly).
    """
    names = list(problem.data_names)
    # An observed variable's data are known by its name; when they are a pm.Data container,
    # its name is accepted too.
    aliases = {name: {name} for name in names}
    model = problem.model
    for name in names:
        rv = model.named_vars.get(name)
        value = model.rvs_to_values.get(rv) if rv in model.observed_RVs else None
        if value is not None and getattr(value, "name", None):
            aliases[name].add(value.name)
    given = {}
    for key, array in data.items():
        for name in names:
            if key in aliases[name]:
                given[name] = array
    unknown = sorted(k for k in data if not any(k in a for a in aliases.values()))
    missing = [n for n in names if n not in given]
    data = given
    if unknown or missing:
        raise DataShapeError(
            f"data= must give the full array of every row-aligned container of the minibatched "
            f"likelihood, {[' or '.join(sorted(aliases[n])) for n in names]}; got "
            f"{sorted(set(data) | set(unknown))}"
            + (f" (not row-aligned data of this model: {unknown})" if unknown else "")
            + (f" (missing: {missing})" if missing else "")
            + ". Put each in a pm.Data container holding its first rows and pass "
            "data={name: full_array, ...}."
        )
    arrays = []
    lengths = {}
    for name, placeholder in zip(names, problem.data, strict=True):
        array = data[name]
        if not hasattr(array, "shape") or not hasattr(array, "dtype") or len(array.shape) < 1:
            raise DataShapeError(
                f"data[{name!r}] must be an array with rows along the first axis (NumPy, "
                f"memory-map, zarr, dask or h5py), got {type(array).__name__}."
            )
        if tuple(array.shape[1:]) != tuple(placeholder.shape[1:]):
            raise DataShapeError(
                f"data[{name!r}] has rows of shape {tuple(array.shape[1:])} but the model's "
                f"placeholder {name!r} has rows of shape {tuple(placeholder.shape[1:])}."
            )
        if np.dtype(array.dtype).kind != np.dtype(placeholder.dtype).kind:
            raise DataShapeError(
                f"data[{name!r}] has dtype {array.dtype} but the model's placeholder has "
                f"{placeholder.dtype}; give the placeholder the rows of the same array."
            )
        lengths[name] = int(array.shape[0])
        arrays.append(array)
    if len(set(lengths.values())) != 1:
        raise DataShapeError(
            f"The arrays given as data= must have the same number of rows; got {lengths}."
        )
    return dataclasses.replace(problem, data=tuple(arrays), data_size=next(iter(lengths.values())))
