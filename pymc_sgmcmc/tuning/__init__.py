"""Tuning: estimates of the curvature and the gradient noise, the whitening they define, and
the step sizes and injected noise of every sampler, computed in whitened coordinates.

- :mod:`~pymc_sgmcmc.tuning.whitening`: ``θ = c + L z`` with ``L Lᵀ = A⁻¹``;
- :mod:`~pymc_sgmcmc.tuning.rates`: each sampler's step and injected noise in ``z``;
- :mod:`~pymc_sgmcmc.tuning.tuner`: the one interface both drivers call,
  ``init / update / final``.
"""

from pymc_sgmcmc.tuning._old import *  # noqa: F403  (transitional)
from pymc_sgmcmc.tuning._old import __all__ as _old_all
from pymc_sgmcmc.tuning.rates import (
    Rates,
    effective_window,
    iasg_rule,
    iasg_window,
    langevin_rule,
    noise_budget,
)
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, Whitening

__all__ = [
    *_old_all,
    "DENSE_MAX_DIM",
    "Rates",
    "Whitening",
    "effective_window",
    "iasg_rule",
    "iasg_window",
    "langevin_rule",
    "noise_budget",
]
