"""Results as the host PyMC returns them: ``arviz.InferenceData`` with PyMC 5 (ArviZ 0.x),
``xarray.DataTree`` with PyMC 6 (ArviZ 1).

The package reads and edits ``pm.sample``'s result in a few ways only — which groups it has,
one group as an ``xarray.Dataset``, a group replaced or added, attrs set on groups — and
builds results of its own (:func:`from_groups`) of the same type, so that everything it
returns is what ``pm.sample`` returns on that PyMC. This module is where the two types differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import arviz as az
import xarray as xr

__all__ = [
    "ARVIZ_1",
    "as_dataset",
    "from_groups",
    "get_group",
    "group_names",
    "is_result",
    "set_attrs",
    "set_group",
]

ARVIZ_1 = int(az.__version__.split(".")[0]) >= 1


def is_result(value: Any) -> bool:
    """Whether ``value`` is a sampling result of the host (InferenceData / DataTree)."""
    if ARVIZ_1:
        return isinstance(value, xr.DataTree)
    return isinstance(value, az.InferenceData)


def as_dataset(value: Any) -> Any:
    """A group given as a DataTree node (``idata.posterior`` with ArviZ 1) as its Dataset;
    anything else unchanged."""
    if isinstance(value, xr.DataTree) and not value.children:
        return value.to_dataset()
    return value


def group_names(result: Any) -> list[str]:
    """The groups of ``result``, in order (``posterior``, ``sample_stats``, ...)."""
    if isinstance(result, xr.DataTree):
        return list(result.children)
    return list(result.groups())


def get_group(result: Any, name: str) -> xr.Dataset | None:
    """Group ``name`` of ``result`` as a Dataset (attrs included), None when absent."""
    if name not in group_names(result):
        return None
    if isinstance(result, xr.DataTree):
        return result[name].to_dataset()
    return result[name]


def set_group(result: Any, name: str, dataset: xr.Dataset) -> None:
    """Replace group ``name`` of ``result`` with ``dataset`` (added when absent), in place."""
    if isinstance(result, xr.DataTree):
        result[name] = dataset
    elif name in result.groups():
        # setattr, not result[name] = ...: ArviZ 0.x appends the name to groups() again.
        setattr(result, name, dataset)
    else:
        result.add_groups({name: dataset})


def set_attrs(result: Any, names: Iterable[str], attrs: Mapping[str, Any]) -> None:
    """Add ``attrs`` to each of the groups ``names`` that ``result`` has."""
    present = group_names(result)
    for name in names:
        if name in present:
            result[name].attrs.update(attrs)


def from_groups(groups: Mapping[str, xr.Dataset]) -> Any:
    """A result of the host's type made of ``groups`` (name → Dataset, in order)."""
    groups = {k: v for k, v in groups.items() if v is not None}
    if ARVIZ_1:
        return xr.DataTree.from_dict(dict(groups))
    return az.InferenceData(**groups)
