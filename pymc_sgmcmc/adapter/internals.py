"""Which PyMC this package supports, and the private PyMC names it uses.

Checked at import (:func:`check_versions`): an unsupported PyMC gets one clear error naming the
versions supported, not an ``AttributeError`` deep inside a run; the wrapped ``pm.sample``
internals are checked for their parameters when the hooks are installed
(:func:`pymc_sgmcmc.adapter.hooks.check_pymc_internals`).
"""

from __future__ import annotations

import sys

import pymc

__all__ = ["PRIVATE_NAMES", "SUPPORTED", "check_versions"]

# (lowest, first unsupported) PyMC release per stack: PyMC 6 on Python >= 3.12, PyMC 5.28 on
# Python 3.11 (PyMC 6 needs Python >= 3.12; kept through the 0.2 series). The lowest PyMC 6 is
# the first release: PyMC 6.0.0 with PyTensor 3.0.7 (what it resolves to) passed the development
# loop once (2026-11-27); CI tests the newest.
SUPPORTED = {"pymc6": ((6, 0), (7, 0)), "pymc5": ((5, 28), (6, 0))}


def _release(version: str) -> tuple[int, int]:
    parts = [p for p in version.split(".")[:2]]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def check_versions(version: str | None = None) -> None:
    """Refuse a PyMC outside :data:`SUPPORTED` with a message naming the supported ones."""
    version = version or pymc.__version__
    release = _release(version)
    if any(low <= release < high for low, high in SUPPORTED.values()):
        return
    (l6, h6), (l5, h5) = SUPPORTED["pymc6"], SUPPORTED["pymc5"]
    raise ImportError(
        f"pymc_sgmcmc supports PyMC {l6[0]}.{l6[1]} up to (not including) {h6[0]}.{h6[1]} on "
        f"Python >= 3.12, and PyMC {l5[0]}.{l5[1]} up to {h5[0]}.{h5[1]} on Python 3.11; this "
        f"environment has PyMC {version} (Python {sys.version_info[0]}.{sys.version_info[1]}). "
        "Install a supported PyMC (pip install 'pymc>=6,<7' on Python >= 3.12), or a "
        "pymc_sgmcmc release that supports yours."
    )


# Every private (or unexported) PyMC / PyTensor name the adapter uses: where, and why no
# public one serves. Each was checked against the releases in CHECKED; tests/test_structure.py
# resolves every path on the installed PyMC. PyMC's public extension points — step methods
# (BlockedStep, stats_dtypes_shapes, sampling_state, setup_chain), callbacks and trace
# backends — are used where they serve: they cover a step's draws and stats, but not what
# pm.sample does around them (which steps it chose, how it runs chains, what it returns).
CHECKED = (
    "PyMC 5.28.5 / PyTensor 2.38.3, PyMC 6.0.0 / PyTensor 3.0.7 and PyMC 6.4.0 / PyTensor 3.3.8"
)
PRIVATE_NAMES: dict[str, str] = {
    # -- pm.sample's internals, wrapped by adapter.hooks --------------------------------------
    "pymc.sampling.mcmc.assign_step_methods": (
        "hooks: which of the steps are ours, known before sampling (no hook exposes the "
        "steps pm.sample settled on); steps built outside `with model:` are bound here"
    ),
    "pymc.sampling.mcmc.instantiate_steppers": (
        "hooks: a NUTS-only keyword given with our step gets an error naming what plays its "
        "part (PyMC's own names a step_kwargs key the user never wrote)"
    ),
    "pymc.sampling.mcmc._sample_return": (
        "hooks: the step's settings, self-check and q's parameters added to pm.sample's "
        "result; a chain stopped by a divergence raised with the result (no public hook "
        "post-processes the result)"
    ),
    "pymc.sampling.mcmc._sample": (
        "hooks: the chain being sampled, a Ctrl-C seen (PyMC swallows it), a diverged chain "
        "stopped with its draws kept"
    ),
    "pymc.sampling.mcmc._mp_sample": (
        "hooks: our chains run in this process, not in PyMC's worker processes (forking "
        "after JAX started deadlocks; see adapter.chains_in_process)"
    ),
    "pymc.sampling.mcmc._sample_many": "chains_in_process: PyMC's sequential chain loop",
    "pymc.sampling.parallel._run_process": (
        "hooks: the chain index in a PyMC worker process (devices='chains')"
    ),
    "pymc.sampling.parallel._Process": "hooks: its 10th argument is the chain",
    "pymc.step_methods.STEP_METHODS": (
        "hooks: our steps listed with PyMC's (step_kwargs by name); the only registry there is"
    ),
    # -- what pmsg.sample reuses so that it returns what pm.sample returns --------------------
    "pymc.sampling.parallel.Draw": "sampling: the callback's draw record, as pm.sample's",
    "pymc.backends.init_traces": "sampling: the traces pm.sample records into",
    "pymc.initial_point.make_initial_point_fns_per_chain": (
        "sampling: the same initial points as pm.sample for a seed"
    ),
    "pymc.progress_bar.MCMCProgressBarManager": "sampling: pm.sample's progress bar",
    # -- reading a model -----------------------------------------------------------------------
    "pymc.logprob.basic.transformed_conditional_logp": (
        "model_checking: per-row log-likelihood terms of the observed variables"
    ),
    "pymc.data.MinibatchOp": "minibatch_models: pm.Minibatch models read on the full data",
    "pymc.data.MinibatchIndexRV": "minibatch_models: as above",
    "pymc.variational.minibatch_rv.MinibatchRandomVariable": (
        "minibatch_models: total_size= observed variables"
    ),
    "pymc.distributions.distribution.PartialObservedRV": (
        "data_checks: imputation (refused by name)"
    ),
    "pymc.model.core.Model._coords": (
        "minibatch_models: the full-data copy of a pm.Minibatch model keeps the coords"
    ),
    "pymc.model.core.Model._dim_lengths": "minibatch_models: as above",
    # -- PyTensor's JAX backend ------------------------------------------------------------------
    "pytensor.link.jax.dispatch.jax_funcify": (
        "bridge_jax: PyTensor graphs compiled to JAX functions we vmap and differentiate "
        "(PyMC's get_jaxified_graph returns no per-row structure)"
    ),
    "pymc.sampling.jax": (
        "precision: an import hook applies PyTensor's jax_enable_x64 when PyMC's JAX "
        "samplers are imported after ours put the user's setting back"
    ),
}
