"""Old spellings that still resolve: names that moved to other modules on 2026-11-26 (the
re-founding of issue 24), looked up by the old modules' ``__getattr__`` — so that
``pymc_sgmcmc.step_methods.SGLD`` and objects pickled with such paths keep working. The
public spellings (``pymc_sgmcmc.SGLD``, ``pmsg.loo_subsample``) never moved.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["moved_attribute"]

MOVED: dict[str, dict[str, str]] = {  # old module -> {name: the module it lives in now}
    "pymc_sgmcmc.step_methods": {
        "ConstantSGD": "pymc_sgmcmc.constant_sgd",
        "CONSTANT_SGD_STEP_CAP": "pymc_sgmcmc.constant_sgd",
        "IASG": "pymc_sgmcmc.iasg",
        "MAX_RELAXATION_CHECK_DIM": "pymc_sgmcmc.iasg",
        "SGLD": "pymc_sgmcmc.sgld",
        "_PreconditionedSGD": "pymc_sgmcmc.preconditioned_sgd",
        "DEFAULT_BATCH_SIZE": "pymc_sgmcmc.minibatch",
        "EXACT_DIAG_MAX_DIM": "pymc_sgmcmc.tuning.measurements",
        "NOISE_CHUNK_WORK": "pymc_sgmcmc.tuning.measurements",
        "NOISE_REPEATS": "pymc_sgmcmc.tuning.measurements",
        "LOSS_JUMP_ABS": "pymc_sgmcmc.draws",
        "LOSS_JUMP_REL": "pymc_sgmcmc.draws",
        "SEARCH_ITERATIONS": "pymc_sgmcmc._tuning_glue",
        "SEARCH_LOG_STEP": "pymc_sgmcmc._tuning_glue",
        "SEARCH_TRUST": "pymc_sgmcmc._tuning_glue",
        "ROW_POWER_ITERATIONS": "pymc_sgmcmc._tuning_glue",
    },
    "pymc_sgmcmc.model_checking": {
        "ElpdDifference": "pymc_sgmcmc.loo",
        "LooSubsample": "pymc_sgmcmc.loo",
        "loo_subsample": "pymc_sgmcmc.loo",
    },
}


def moved_attribute(module: str, name: str) -> Any:
    """``module.name`` for a name that moved (see ``MOVED``); AttributeError as usual else."""
    new = MOVED.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return getattr(importlib.import_module(new), name)
