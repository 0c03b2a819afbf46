"""The samplers, in one place: what each is made of and what it can do.

A sampler is its step class plus one :class:`SamplerSpec` line here. The package registers
the classes with PyMC from this list (``pm.STEP_METHODS``); the tests, the correctness
benchmark and the docs' tables read it; ``tests/test_registry.py`` fails when a sampler listed
here has no docs page, no row in the docs' tables or no entry in the API page.

>>> from pymc_sgmcmc.registry import SAMPLERS, spec
>>> spec("SGHMC").kernel, spec("SAGALD").estimator, spec("SAGALD").local_vars
('sgd', 'saga', False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pymc_sgmcmc.adapter.step import SGMCMCStep
from pymc_sgmcmc.constant_sgd import ConstantSGD
from pymc_sgmcmc.iasg import IASG
from pymc_sgmcmc.sgfs import SGFS
from pymc_sgmcmc.sghmc import SGHMC
from pymc_sgmcmc.sgld import SGLD
from pymc_sgmcmc.variance_reduced import SAGALD, SVRGLD

__all__ = ["SAMPLERS", "TOLERANCES", "SamplerSpec", "spec"]

# The correctness table's allowance per tolerance family (benchmarks/posteriordb.py,
# docs/choosing.md): |Δmean| in posterior sds and |sd ratio − 1|, before the Monte Carlo error.
TOLERANCES = {"constant_sgd": (0.10, 0.10), "langevin": (0.15, 0.15)}


@dataclass(frozen=True)
class SamplerSpec:
    """One sampler: its step class, its discretisation (``kernel``: SGD with momentum and
    injected noise, :mod:`pymc_sgmcmc.kernels.sgd`, or Langevin,
    :mod:`pymc_sgmcmc.kernels.sgld`), its gradient estimator (a plain minibatch, or SAGA's
    table / SVRG's anchor as control variates), its tolerance family in the correctness table,
    and its docs page (``docs/samplers/<page>.md``). What it can do is read from the class:
    ``local_vars`` (variational local variables) and ``streams`` (out-of-core ``data=``)."""

    cls: type[SGMCMCStep]
    kernel: Literal["sgd", "langevin"]
    estimator: Literal["minibatch", "saga", "svrg"]
    tolerance: Literal["constant_sgd", "langevin"]
    page: str

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def local_vars(self) -> bool:
        return bool(self.cls._supports_locals)

    @property
    def streams(self) -> bool:
        return bool(self.cls._streams)


SAMPLERS: tuple[SamplerSpec, ...] = (
    SamplerSpec(IASG, "sgd", "minibatch", "constant_sgd", "iasg"),
    SamplerSpec(ConstantSGD, "sgd", "minibatch", "constant_sgd", "constant_sgd"),
    SamplerSpec(SGFS, "sgd", "minibatch", "constant_sgd", "sgfs"),
    SamplerSpec(SGHMC, "sgd", "minibatch", "langevin", "sghmc"),
    SamplerSpec(SGLD, "langevin", "minibatch", "langevin", "sgld"),
    SamplerSpec(SAGALD, "langevin", "saga", "langevin", "sagald"),
    SamplerSpec(SVRGLD, "langevin", "svrg", "langevin", "svrgld"),
)


def spec(name: str) -> SamplerSpec:
    """The spec of the sampler called ``name`` (its class's name, e.g. ``"IASG"``)."""
    for entry in SAMPLERS:
        if entry.name == name:
            return entry
    raise KeyError(f"No sampler {name!r}; the samplers are {[s.name for s in SAMPLERS]}.")
