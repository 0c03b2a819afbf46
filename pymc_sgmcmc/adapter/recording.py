"""Write draws to disk as ``pm.sample`` makes them, and read back what was written.

``pm.sample(..., callback=pmsg.DrawWriter("run.draws"))`` appends every draw of every chain
to a directory, one file per chain, flushed every ``flush_every`` draws: a run that is killed
(out of time, out of memory, ``kill -9``) loses at most the draws since the last flush.
:func:`read_draws` turns the directory into InferenceData at any time — during the run,
after a crash, or after a normal end.

Why not PyMC's ``ZarrTrace``: in PyMC 5.x it needs zarr 2, while nutpie (the fastest NUTS
here, which the comparisons use) needs zarr 3; and it pickles each step method's sampling
state into the store. The format here has no dependency: ``meta.json`` (variable names,
shapes, stats) and ``chain-<c>.bin``, fixed-size float64 records of
``[draw index, tuning flag, values..., stats...]`` — a partially written last record is
ignored on reading. Works with ``cores > 1`` (PyMC calls the callback in the main process).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import arviz as az
import numpy as np
import pymc as pm

from pymc_sgmcmc.adapter.results import ARVIZ_1

__all__ = ["DrawWriter", "read_draws"]

DEFAULT_STATS = ("diverging", "step_size", "minibatch_loss", "grad_norm", "data_passes")


class DrawWriter:
    """A ``pm.sample`` callback that appends each draw to ``path`` (a directory).

    Parameters
    ----------
    path
        Directory to create (it must not hold an earlier run unless ``overwrite=True``).
    model
        The model being sampled (default: the one on the context stack).
    flush_every
        Draws buffered per chain before they are written and flushed to the OS (default 1).
    fsync
        Also ``os.fsync`` on each flush (survives a machine crash, not only a killed process).
    stats
        Scalar sample stats to keep (those the sampler does not emit are skipped).
    overwrite
        Replace an existing directory's chain files.

    Examples
    --------
    >>> with model:  # doctest: +SKIP
    ...     idata = pm.sample(step=pmsg.IASG(), callback=pmsg.DrawWriter("run.draws"))
    >>> pmsg.read_draws("run.draws")  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model: pm.Model | None = None,
        flush_every: int = 1,
        fsync: bool = False,
        stats: tuple[str, ...] = DEFAULT_STATS,
        overwrite: bool = False,
    ) -> None:
        model = pm.modelcontext(model)
        self.path = Path(path)
        if int(flush_every) != flush_every or flush_every < 1:
            raise ValueError(f"flush_every must be a positive integer, got {flush_every!r}.")
        self.flush_every = int(flush_every)
        self.fsync = bool(fsync)
        if self.path.exists() and any(self.path.glob("chain-*.bin")) and not overwrite:
            raise FileExistsError(
                f"{str(self.path)!r} already holds draws; choose another path or pass "
                "overwrite=True."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        for old in self.path.glob("chain-*.bin"):
            old.unlink()
        outputs = [v for v in model.unobserved_value_vars if not v.name.endswith("__")]
        self._names = [v.name for v in outputs]
        self._fn = model.compile_fn(outputs, inputs=model.value_vars, on_unused_input="ignore")
        point = model.initial_point()
        shapes = [np.shape(v) for v in self._fn(point)]
        self._shapes = shapes
        self._stats = list(stats)
        self._files: dict[int, Any] = {}
        self._buffers: dict[int, list[np.ndarray]] = {}
        meta = {
            "format": "pymc_sgmcmc.draws/1",
            "variables": [
                {"name": n, "shape": list(s)} for n, s in zip(self._names, shapes, strict=True)
            ],
            "stats": self._stats,
            "coords": {k: np.asarray(v).tolist() for k, v in model.coords.items() if v is not None},
            "dims": {k: list(v) for k, v in model.named_vars_to_dims.items()},
        }
        (self.path / "meta.json").write_text(json.dumps(meta, default=str))

    def __call__(self, trace: Any, draw: Any) -> None:
        values = self._fn(draw.point)
        stats: dict[str, Any] = {}
        for sampler_stats in draw.stats:
            stats.update(sampler_stats)
        record = [float(draw.draw_idx), float(bool(draw.tuning))]
        for v in values:
            record.extend(np.asarray(v, dtype=np.float64).ravel().tolist())
        for name in self._stats:
            value = stats.get(name, np.nan)
            try:
                record.append(float(value))
            except (TypeError, ValueError):
                record.append(np.nan)
        chain = int(draw.chain)
        buffer = self._buffers.setdefault(chain, [])
        buffer.append(np.asarray(record, dtype=np.float64))
        if len(buffer) >= self.flush_every or draw.is_last:
            self._flush(chain)

    def _flush(self, chain: int) -> None:
        buffer = self._buffers.get(chain)
        if not buffer:
            return
        f = self._files.get(chain)
        if f is None:
            f = self._files[chain] = open(self.path / f"chain-{chain}.bin", "ab")  # noqa: SIM115
        f.write(np.concatenate(buffer).tobytes())
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        buffer.clear()

    def close(self) -> None:
        """Write what is buffered and close the files (also done when collected)."""
        for chain in list(self._buffers):
            self._flush(chain)
        for f in self._files.values():
            f.close()
        self._files = {}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def read_draws(path: str | os.PathLike, *, include_tune: bool = False) -> Any:
    """InferenceData of the draws a :class:`DrawWriter` wrote to ``path`` so far.

    Chains are cut to the length of the shortest (after dropping tuning draws unless
    ``include_tune``); a partially written last record is ignored. A chain whose file holds
    no complete draw (yet) is left out with a warning naming it, and the ``chain``
    coordinate keeps the other chains' numbers. The ``posterior`` holds
    the model's free variables (constrained) and deterministics, ``sample_stats`` the kept
    stats (``diverging`` as bool), and both record the draw indices as ``draw`` coordinates.
    """
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    variables = meta["variables"]
    sizes = [int(np.prod(v["shape"], dtype=int)) for v in variables]
    width = 2 + sum(sizes) + len(meta["stats"])
    chains, numbers, empty = [], [], []
    for file in sorted(path.glob("chain-*.bin"), key=lambda p: int(p.stem.split("-")[1])):
        raw = np.fromfile(file, dtype=np.float64)
        records = raw[: raw.size // width * width].reshape(-1, width)
        if not include_tune:
            records = records[records[:, 1] == 0]
        if len(records):
            chains.append(records)
            numbers.append(int(file.stem.split("-")[1]))
        else:
            empty.append(file.name)
    if not chains:
        raise ValueError(
            f"{str(path)!r} holds no complete draws yet"
            + (f" ({', '.join(empty)} hold none after tuning)." if empty else ".")
            + (" Pass include_tune=True to read the tuning draws." if empty else "")
        )
    if empty:
        warnings.warn(
            f"read_draws({str(path)!r}): {', '.join(empty)} "
            f"{'holds' if len(empty) == 1 else 'hold'} no complete "
            f"{'draws' if include_tune else 'draws after tuning'} and "
            f"{'is' if len(empty) == 1 else 'are'} left out; returning chains "
            f"{', '.join(map(str, numbers))}.",
            UserWarning,
            stacklevel=2,
        )
    length = min(len(c) for c in chains)
    data = np.stack([c[:length] for c in chains])  # (chain, draw, width)
    posterior: dict[str, np.ndarray] = {}
    start = 2
    for v, size in zip(variables, sizes, strict=True):
        posterior[v["name"]] = data[:, :, start : start + size].reshape(
            data.shape[0], length, *v["shape"]
        )
        start += size
    stats = {}
    for name in meta["stats"]:
        column = data[:, :, start]
        start += 1
        if np.all(np.isnan(column)):
            continue
        stats[name] = column.astype(bool) if name == "diverging" else column
    coords = {k: v for k, v in meta["coords"].items()}
    dims = {k: v for k, v in meta["dims"].items() if k in posterior}
    draw_index = data[0, :, 0].astype(int)
    coords["draw"] = draw_index
    coords["chain"] = numbers
    groups = {"posterior": posterior, "sample_stats": stats}
    if ARVIZ_1:
        return az.from_dict(groups, coords=coords, dims=dims)
    return az.from_dict(**groups, coords=coords, dims=dims)
