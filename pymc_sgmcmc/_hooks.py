"""Put the SG samplers' settings and tuned values into ``pm.sample``'s InferenceData.

PyMC's ``pm.sample`` writes ``sampling_time``, ``tuning_steps`` etc. into the ``posterior`` and
``sample_stats`` attrs but has no hook for a step method's own metadata. Two functions of
``pymc.sampling.mcmc`` are wrapped (both are looked up as module globals by ``pm.sample``):

``assign_step_methods``
    remembers which of the steps the user passed are ours (in a context variable);
``_sample_return``
    adds, when there were any, to ``posterior.attrs`` and ``sample_stats.attrs``:

    - ``sgmcmc_samplers``: the class names, e.g. ``"IASG"``;
    - ``sgmcmc_settings``: a JSON list, one entry per SG step, with its settings and, when the
      chains ran in this process, ``"chains"`` — the tuned values of each chain (step size or
      preconditioner, window, ...). With ``cores > 1`` the chains are tuned inside worker
      processes, which do not send their step objects back; the per-draw ``step_size`` stat
      then carries the tuned rate.

The wrappers change nothing else and return PyMC's own results.
"""

from __future__ import annotations

import contextvars
import functools
import json
from typing import Any

import numpy as np

__all__ = ["install", "sgmcmc_attrs"]

_STEPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pmsg_steps", default=None)
_INSTALLED = False


def _ours(steps: Any) -> list:
    from pymc.step_methods.compound import CompoundStep

    from pymc_sgmcmc.step_methods import SGMCMCStep

    out: list = []
    for s in steps if isinstance(steps, list | tuple) else [steps]:
        if isinstance(s, CompoundStep):
            out.extend(_ours(list(s.methods)))
        elif isinstance(s, SGMCMCStep):
            out.append(s)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return str(value)


def sgmcmc_attrs(steps: list) -> dict[str, str]:
    """The attrs entries for the SG ``steps`` of one ``pm.sample`` call (JSON-encoded)."""
    entries = []
    for step in steps:
        entry = step.settings()
        chains = [c for c in step.chain_settings if c]
        entry = {**entry, "chains": chains} if chains else entry
        entry["tuned_in"] = "this process" if chains else "worker processes (see sample_stats)"
        entries.append(entry)
        step.chain_settings = []
    return {
        "sgmcmc_samplers": ",".join(type(s).__name__ for s in steps),
        "sgmcmc_settings": json.dumps(entries, default=_jsonable),
    }


def install() -> None:
    """Wrap ``assign_step_methods`` and ``_sample_return`` of ``pymc.sampling.mcmc`` once."""
    global _INSTALLED
    if _INSTALLED:
        return
    import pymc.sampling.mcmc as mcmc

    assign_original = mcmc.assign_step_methods
    return_original = mcmc._sample_return

    @functools.wraps(assign_original)
    def assign_step_methods(*args: Any, **kwargs: Any) -> Any:
        result = assign_original(*args, **kwargs)
        provided = result[0] if isinstance(result, tuple) else []
        _STEPS.set(_ours(list(provided)) or None)
        return result

    @functools.wraps(return_original)
    def _sample_return(*args: Any, **kwargs: Any) -> Any:
        steps = _STEPS.get()
        _STEPS.set(None)
        result = return_original(*args, **kwargs)
        if steps and hasattr(result, "groups"):
            attrs = sgmcmc_attrs(steps)
            for group in ("posterior", "sample_stats"):
                if group in result.groups():
                    result[group].attrs.update(attrs)
        return result

    mcmc.assign_step_methods = assign_step_methods
    mcmc._sample_return = _sample_return
    _INSTALLED = True
