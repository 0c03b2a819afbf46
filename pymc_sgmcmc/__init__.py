"""Stochastic-gradient MCMC for PyMC, compiled with JAX.

Inside a model block::

    import pymc as pm
    import pymc_sgmcmc as pmsg

    with model:
        idata = pm.sample(step=pmsg.SGLD(batch_size=256), random_seed=1)
"""

from __future__ import annotations

from importlib.metadata import version as _version

from pymc_sgmcmc import distributed, schedules
from pymc_sgmcmc._chain_processes import close_workers
from pymc_sgmcmc.adapter.bridge import MinibatchProblem, build_problem
from pymc_sgmcmc.adapter.compare import compare, plot_compare
from pymc_sgmcmc.adapter.hooks import install as _install_hooks
from pymc_sgmcmc.adapter.loo import ElpdDifference, LooSubsample, loo_subsample
from pymc_sgmcmc.adapter.model_checking import log_likelihood
from pymc_sgmcmc.adapter.precision import float64_scope
from pymc_sgmcmc.adapter.recording import DrawWriter, read_draws
from pymc_sgmcmc.adapter.sampling import sample
from pymc_sgmcmc.adapter.step import SGMCMCStep
from pymc_sgmcmc.constant_sgd import ConstantSGD
from pymc_sgmcmc.distributed import RowShard
from pymc_sgmcmc.errors import (
    DataShapeError,
    DivergenceError,
    ModelNotSupportedError,
    NoDrawsError,
)
from pymc_sgmcmc.iasg import IASG
from pymc_sgmcmc.registry import SAMPLERS
from pymc_sgmcmc.sgfs import SGFS
from pymc_sgmcmc.sghmc import SGHMC
from pymc_sgmcmc.sgld import SGLD
from pymc_sgmcmc.variance_reduced import SAGALD, SVRGLD

__version__ = _version("pymc-sgmcmc")

__all__ = [
    "IASG",
    "SAGALD",
    "SGFS",
    "SGHMC",
    "SGLD",
    "SVRGLD",
    "ConstantSGD",
    "DataShapeError",
    "DivergenceError",
    "DrawWriter",
    "ElpdDifference",
    "LooSubsample",
    "MinibatchProblem",
    "ModelNotSupportedError",
    "NoDrawsError",
    "RowShard",
    "SGMCMCStep",
    "build_problem",
    "compare",
    "distributed",
    "float64_scope",
    "log_likelihood",
    "loo_subsample",
    "plot_compare",
    "read_draws",
    "sample",
    "close_workers",
    "schedules",
]

_install_hooks([spec.cls for spec in SAMPLERS])
