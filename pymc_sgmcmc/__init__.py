"""Stochastic-gradient MCMC for PyMC, compiled with JAX.

Inside a model block::

    import pymc as pm
    import pymc_sgmcmc as pmsg

    with model:
        idata = pm.sample(step=pmsg.SGLD(batch_size=256), random_seed=1)
"""

from __future__ import annotations

import pymc as pm

from pymc_sgmcmc import distributed, schedules
from pymc_sgmcmc._chain_processes import close_workers
from pymc_sgmcmc._hooks import install as _install_hooks
from pymc_sgmcmc._precision import float64_scope
from pymc_sgmcmc.bridge import MinibatchProblem, build_problem
from pymc_sgmcmc.compare import compare, plot_compare
from pymc_sgmcmc.constant_sgd import ConstantSGD
from pymc_sgmcmc.distributed import RowShard
from pymc_sgmcmc.errors import DataShapeError, DivergenceError, ModelNotSupportedError
from pymc_sgmcmc.iasg import IASG
from pymc_sgmcmc.loo import ElpdDifference, LooSubsample, loo_subsample
from pymc_sgmcmc.model_checking import log_likelihood
from pymc_sgmcmc.recording import DrawWriter, read_draws
from pymc_sgmcmc.registry import SAMPLERS
from pymc_sgmcmc.sampling import sample
from pymc_sgmcmc.sgfs import SGFS
from pymc_sgmcmc.sghmc import SGHMC
from pymc_sgmcmc.sgld import SGLD
from pymc_sgmcmc.step_methods import SGMCMCStep
from pymc_sgmcmc.variance_reduced import SAGALD, SVRGLD

__version__ = "0.1.0"

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

# Listed with PyMC's step methods (so step_kwargs by name and tooling see them); their
# competence is INCOMPATIBLE, so pm.sample never assigns them unless the user names them.
for _spec in SAMPLERS:
    if _spec.cls not in pm.STEP_METHODS:
        pm.STEP_METHODS.append(_spec.cls)
_install_hooks()
