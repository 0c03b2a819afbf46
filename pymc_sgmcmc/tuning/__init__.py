"""Tuning: estimates of the curvature and the gradient noise, the whitening they define, and
the step sizes and injected noise of every sampler, computed in whitened coordinates
(see the documentation's page "How the samplers tune themselves").

- :mod:`~pymc_sgmcmc.tuning.whitening`: ``θ = c + L z`` with ``L Lᵀ = A⁻¹``;
- :mod:`~pymc_sgmcmc.tuning.rates`: each sampler's steps and injected noise in ``z``;
- :mod:`~pymc_sgmcmc.tuning.tuner`: the one interface both drivers call,
  ``init / update / final``;
- :mod:`~pymc_sgmcmc.tuning.adaptation`: MALA's step-size adaptation (full batch);
- :mod:`~pymc_sgmcmc.tuning.averaging`: running means of the measurements over windows.
"""

from pymc_sgmcmc.tuning.adaptation import StepSizeAdaptation
from pymc_sgmcmc.tuning.averaging import NoiseEstimate, WindowedMean, gradient_noise
from pymc_sgmcmc.tuning.rates import (
    Rates,
    effective_window,
    iasg_rule,
    iasg_window,
    langevin_rule,
    noise_budget,
    sgld_step_size,
)
from pymc_sgmcmc.tuning.spectrum import lanczos_extremes
from pymc_sgmcmc.tuning.tuner import Measurement, Tuned, Tuner
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, Whitening

__all__ = [
    "DENSE_MAX_DIM",
    "Measurement",
    "NoiseEstimate",
    "Rates",
    "StepSizeAdaptation",
    "Tuned",
    "Tuner",
    "Whitening",
    "WindowedMean",
    "effective_window",
    "gradient_noise",
    "iasg_rule",
    "iasg_window",
    "lanczos_extremes",
    "langevin_rule",
    "noise_budget",
    "sgld_step_size",
]
