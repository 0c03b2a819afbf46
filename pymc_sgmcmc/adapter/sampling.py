"""``pmsg.sample``: the step methods' kernels with chains vectorised by ``jax.vmap``.

``pm.sample(step=pmsg.IASG())`` runs one chain after another (or one per process), one
compiled draw per Python call. :func:`sample` runs all chains at once: every draw of every
chain is one call of the step's own compiled draw under ``jax.vmap``, and after tuning all
sampling draws run in a compiled loop, in chunks so that a progress bar moves. It returns
what ``pm.sample(step=...)`` returns — the same InferenceData groups, variables, stats and
attrs — and for the same ``random_seed`` the same initial points and PRNG keys.

How a draw is shared between the host and the device
----------------------------------------------------
Tuning happens on the host, per chain, between draws (noise estimates, step sizes,
preconditioners, retries of a diverged draw at a halved step). Each chain gets its own copy of
the step object (sharing the compiled functions, never recompiling) and runs the step's own
draw, :meth:`~pymc_sgmcmc.adapter.step.SGMCMCStep.draw_steps` — ``step()`` as a generator
that yields each compiled draw it needs: the draws all chains ask for run as one vmapped call
and their results are sent back (the chains' host parts side by side in threads). Everything else — tuning, divergence handling, the stats,
the tuned settings — is the step method's own code, not a copy of it. After tuning the
parameters of the compiled draw are frozen, so the sampling draws need no host round-trip: a
compiled loop runs a whole chunk of vmapped draws, freezing a chain that diverges at its last
finite state. Each chain's ``draw_steps`` then books the chunk's draws as if it had run them
itself (it is sent the loop's results), which also checks that the frozen parameters are
those the step asks for.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pymc as pm
import pymc.sampling.mcmc as mcmc
from pymc.backends import init_traces
from pymc.initial_point import make_initial_point_fns_per_chain
from pymc.progress_bar import MCMCProgressBarManager
from pymc.sampling.parallel import Draw
from pymc.step_methods.compound import CompoundStep
from pymc.util import get_random_generator

from pymc_sgmcmc._chain_engine import _chain_groups
from pymc_sgmcmc._chain_processes import run_in_processes, workers_running
from pymc_sgmcmc._chain_run import _adopt_last_chain, tune_and_sample
from pymc_sgmcmc.adapter.context import DIVERGED, STEPS
from pymc_sgmcmc.adapter.precision import float64_scope, in_float64_of_step
from pymc_sgmcmc.adapter.step import SGMCMCStep, bind_steps
from pymc_sgmcmc.errors import DivergenceError, ModelNotSupportedError

__all__ = ["CHAIN_METHODS", "sample"]

DEFAULT_CHUNKS = 20
CHAIN_METHODS = ("auto", "vectorized", "processes")
# chain_method="auto": worker processes when the run is long enough to repay their start-up.
# Measured (RESULTS.md, benchmarks/vectorised.py, N = 10^5, D = 20, 4 chains in 2 groups):
# in processes the chains take 0.90-0.92x four independent single-CPU chains, in threads
# 1.22-1.35x, so processes save about a quarter of a run; their first call costs 4-5 s more
# (fresh interpreters importing PyMC and JAX, compiling the step). They pay from runs of
# about 15 s; a run's length is estimated from its data passes at about 1e-9 s per row and
# dimension (a pass of IASG at N = 10^5, D = 20 took 2.2 ms; at 10^6, 10 ms).
AUTO_PROCESSES_SECONDS = 15.0
SECONDS_PER_ROW_DIMENSION = 1e-9
_log = logging.getLogger("pymc")


@in_float64_of_step
def sample(
    step: SGMCMCStep,
    draws: int = 1000,
    tune: int = 1000,
    chains: int = 4,
    *,
    random_seed: Any = None,
    model: pm.Model | None = None,
    progressbar: bool | str = True,
    initvals: Any = None,
    discard_tuned_samples: bool = True,
    compute_convergence_checks: bool = True,
    callback: Callable | None = None,
    idata_kwargs: dict[str, Any] | None = None,
    cores: int | None = None,
    chunks: int = DEFAULT_CHUNKS,
    chain_method: str = "auto",
) -> Any:
    """Sample all chains of one SG step method at once, vectorised with ``jax.vmap``.

    A drop-in for ``pm.sample(step=step, draws=..., tune=..., chains=...)`` when ``step``
    samples every free variable: the same kernels, tuning and divergence handling, the chains
    batched into one compiled computation instead of run one by one (or one per process).

    Parameters
    ----------
    step
        A step method of this package (``pmsg.SGLD(...)``, ``pmsg.IASG(...)``, ...) covering
        every free variable of the model. A compound step (some variables sampled by PyMC's
        steps) needs ``pm.sample``.
    draws, tune, chains
        As for ``pm.sample``: saved draws and tuning draws per chain, number of chains.
    random_seed
        As for ``pm.sample``; the same seed gives the same initial points and PRNG keys as
        ``pm.sample(step=..., random_seed=...)`` (see Notes).
    model
        Default: the model on the context stack. It must be the step's model; a step built
        outside any ``with model:`` (``pmsg.IASG()`` at top level) is bound to this one.
    progressbar
        ``True``/``False`` or one of PyMC's progress-bar modes (``"combined"``, ``"split"``,
        ...). Tuning draws move it every draw; the sampling draws between chunks.
    initvals
        Initial values, as for ``pm.sample`` (one dict, or one per chain).
    discard_tuned_samples
        ``False`` keeps the tuning draws in ``warmup_posterior`` / ``warmup_sample_stats``.
    compute_convergence_checks
        Run PyMC's convergence checks (r-hat, ESS) and log their warnings.
    callback
        Called as ``callback(trace=..., draw=...)`` after every draw of every chain, as by
        ``pm.sample`` (e.g. ``pmsg.DrawWriter(path)``); after tuning, once per chunk for its
        draws.
    idata_kwargs
        Passed to ``pm.to_inference_data``.
    cores
        On a CPU, the chains are split into ``min(chains, cores)`` groups of vmapped chains
        that run side by side in threads, one core each (default: ``min(4, CPUs)``, counting
        the CPUs this process may use — ``pm.sample``'s default counts half of them, taking
        every other one for a hyperthread). On a GPU/TPU the default is one group: all chains
        in one batch.
    chunks
        The sampling draws after tuning run as this many compiled chunks (default 20): more
        chunks move the progress bar (and a callback) more often, at a host round-trip each.
    chain_method
        Where the groups of vmapped chains run. ``"auto"`` (default): in worker processes
        when there are several groups on a CPU and the run is estimated to take more than
        :data:`AUTO_PROCESSES_SECONDS` (from its data passes), or the workers are already up;
        else in threads. ``"vectorized"``: in this process, side by side in threads. ``"processes"`` (CPU only): each group in a worker process of
        its own, pinned to one CPU — faster for several chains of a small or medium model,
        where the groups in one process contend for XLA's one thread pool (measured in
        ``benchmarks/vectorised.py``). The workers start with the first call (a fresh
        interpreter each: seconds) and stay for later calls, holding each step's compiled
        functions and data until the step is garbage collected;
        :func:`pymc_sgmcmc.close_workers` ends them, as does the interpreter's exit. The same
        seed and ``cores`` give the same draws with either method on small models (bit for
        bit in the tests). On larger ones a worker's XLA, on one thread, may sum a large array
        in another order (1e-11 relative at N = 10⁶), and where the tuning's host-side
        decisions follow such numbers the chains then part: different draws of the same
        posterior (radon, D = 390: both methods within the reference's sds). On that large
        model the two methods took the same time (IASG, 4 chains).

    Returns
    -------
    arviz.InferenceData
        The groups of ``pm.sample(step=step)``: ``posterior`` (free variables on their
        constrained scale and deterministics, with the model's coords/dims),
        ``sample_stats`` (``step_size``, ``data_passes``, ``minibatch_loss``, ``grad_norm``,
        ``diverging`` and the sampler's own, e.g. ``hyper_*``, ``elbo``), ``observed_data``,
        ``constant_data``, with ``discard_tuned_samples=False`` the warmup groups and with
        ``local_vars`` the ``variational`` group; attrs ``sampling_time``, ``tuning_steps``,
        ``sgmcmc_samplers`` and ``sgmcmc_settings`` (each chain's tuned settings under
        ``"chains"``). Built by PyMC's own code for ``pm.sample``'s result.

    Raises
    ------
    DivergenceError
        A chain diverged after tuning: it was stopped at its last finite state (the other
        chains ran on), and the draws before it are in the error's ``idata``, the diverged
        draw flagged ``diverging`` — as ``pm.sample(cores=1)`` does. Raised at once if a
        tuning draw still diverges after its step was halved several times.
    ModelNotSupportedError
        The step does not sample every free variable (a compound step needs ``pm.sample``),
        or reads out-of-core ``data=``, or has ``devices=`` (use ``pm.sample``).
    TypeError, ValueError
        Not one step method of this package; the step built for another model; ``draws``,
        ``tune``, ``chains``, ``cores`` or ``chunks`` out of range.

    Notes
    -----
    **Equal seeds.** Per-chain generators, initial points and the step's PRNG keys are derived
    exactly as ``pm.sample`` derives them (``random_seed`` is spawned into one generator per
    chain; each draws the initial-point seed, then the step's key), so both paths start every
    chain at the same point with the same key, and every draw uses the same minibatches and
    the same injected noise. The arithmetic need not be bitwise the same: XLA compiles the
    vmapped draw into a different program (batched products, fused differently), whose
    floating-point results may differ in the last bits. Measured (float64, XLA:CPU,
    ``tests/test_sampling.py``): SGLD, IASG, ConstantSGD, SGFS and SAGA-LD give bit for bit
    the draws and tuned settings of ``pm.sample`` (some stats differ by ~1e-16 relative),
    SVRG-LD's draws differ by ~1e-16 relative; the tests assert 1e-9. The chains are not
    chaotic, so rounding differences stay at rounding level, but host-side decisions taken
    from these numbers (a tuning draw judged diverging, which halves its step) could in
    principle go the other way on a knife edge, and the chains then differ from there on. The
    same seed and ``cores`` give bit for bit the same draws with ``pmsg.sample`` again;
    another ``cores`` groups the chains differently and may round differently.

    **Cost.** The tuning draws take one host round-trip each (all chains together: the
    per-chain noise estimates side by side in threads, the draw one vmapped call per group);
    the sampling draws one per chunk. On a CPU a vmapped draw costs about the sum of
    its chains' (the work of an iteration is arithmetic that batching does not share), so
    the chains are split into ``cores`` groups run side by side in threads. See
    ``benchmarks/vectorised.py``.

    Examples
    --------
    >>> with model:  # doctest: +SKIP
    ...     idata = pmsg.sample(step=pmsg.IASG(batch_size=500), chains=4, random_seed=1)
    """

    model = pm.modelcontext(model)
    step = bind_steps(step, model)  # a step built outside `with model:` (UnboundStep)
    _check_arguments(step, model, draws, tune, chains, chunks, random_seed)
    if cores is not None and (
        isinstance(cores, bool) or not isinstance(cores, int | np.integer) or cores < 1
    ):
        raise ValueError(f"cores must be a positive integer or None, got {cores!r}.")
    if chain_method not in CHAIN_METHODS:
        raise ValueError(
            f"chain_method must be one of {CHAIN_METHODS}, got {chain_method!r}: "
            '"vectorized" runs the chains in this process, "processes" in worker processes.'
        )
    chain_method = resolve_chain_method(chain_method, step, chains, draws, tune, cores)
    if chain_method == "processes" and os.name != "posix":
        raise ValueError(
            'chain_method="processes" needs a POSIX system (its workers are pinned to CPUs and '
            'stopped with SIGINT); use chain_method="vectorized".'
        )
    if chain_method == "processes" and jax.default_backend() != "cpu":
        raise ValueError(
            'chain_method="processes" pins each group of chains to one CPU; on a '
            f"{jax.default_backend()} all chains run in one batch: use chain_method="
            '"vectorized".'
        )
    draws, tune, chains, chunks = int(draws), int(tune), int(chains), int(chunks)

    # As pm.sample: one generator per chain; each first seeds the initial point, then
    # (set_rng) is the step's generator, which draws the chain's PRNG key.
    rngs = get_random_generator(random_seed).spawn(chains)
    seeds = [rng.integers(2**30) for rng in rngs]
    ipfns = make_initial_point_fns_per_chain(
        model=model, overrides=initvals, jitter_rvs=set(), chains=chains
    )
    points = [ipfn(seed) for ipfn, seed in zip(ipfns, seeds, strict=True)]
    _, traces = init_traces(
        backend=None,
        chains=chains,
        expected_length=draws + tune,
        step=step,
        initial_point=points[0],
        model=model,
        tune=tune,
    )

    # In a function of its own: the chains' copies and device state are gone when the result
    # is built (a traceback kept until exit would otherwise hold JAX arrays past JAX's own
    # teardown: seen as a segfault at exit after Ctrl-C during tuning).

    stopped, t_sampling = _run_chains(
        step,
        traces,
        points,
        rngs,
        draws,
        tune,
        cores,
        chunks,
        progressbar,
        callback,
        chain_method,
    )
    return _sample_return(
        step,
        stopped,
        traces=traces,
        tune=tune,
        t_sampling=t_sampling,
        discard_tuned_samples=discard_tuned_samples,
        compute_convergence_checks=compute_convergence_checks,
        idata_kwargs=idata_kwargs or {},
        model=model,
    )


def resolve_chain_method(
    method: str, step: SGMCMCStep, chains: int, draws: int, tune: int, cores: int | None
) -> str:
    """``"auto"`` made concrete (see :data:`AUTO_PROCESSES_SECONDS`); other methods as given."""
    if method != "auto":
        return method
    if os.name != "posix" or jax.default_backend() != "cpu":
        return "vectorized"
    if len(_chain_groups(int(chains), cores, on_cpu=True)) < 2:
        return "vectorized"
    if workers_running():
        return "processes"
    problem = step.problem
    passes = int(chains) * (int(draws) + int(tune)) * step.thin * step.batch_size
    seconds = passes * max(problem.dim, 1) * SECONDS_PER_ROW_DIMENSION
    return "processes" if seconds >= AUTO_PROCESSES_SECONDS else "vectorized"


def sample_side_by_side(kwargs: dict[str, Any]) -> bool:
    """``pm.sample(step=..., cores=k)``'s chains side by side (the engine of :func:`sample`,
    ``chain_method="auto"``), when its step is one of ours that samples every free variable
    in memory on one device; False (nothing done) otherwise, for PyMC's sequential loop.
    ``kwargs`` are those PyMC passes to its ``_mp_sample`` (``draws`` includes ``tune``)."""
    step, model = kwargs["step"], kwargs.get("model")
    chains, cores, tune = int(kwargs["chains"]), int(kwargs.get("cores") or 1), int(kwargs["tune"])
    if not isinstance(step, SGMCMCStep) or chains < 2 or cores < 2 or model is None:
        return False
    covered = {v.name for v in step.vars}
    if any(v.name not in covered for v in model.value_vars):
        return False
    if step.streaming or step.devices not in (None, 1):
        return False
    draws = int(kwargs["draws"]) - tune
    method = resolve_chain_method("auto", step, chains, draws, tune, cores)
    with float64_scope(step.problem.dtype):  # as pmsg.sample (pm.sample runs outside one)
        stopped, _ = _run_chains(
            step,
            list(kwargs["traces"]),
            [dict(point) for point in kwargs["start"]],
            list(kwargs["rngs"]),
            draws,
            tune,
            cores,
            DEFAULT_CHUNKS,
            kwargs.get("progressbar", True),
            kwargs.get("callback"),
            method,
        )
    if stopped:
        DIVERGED.set(sorted(stopped.items()))
    return True


def _run_chains(
    step: SGMCMCStep,
    traces: list,
    points: list[dict],
    rngs: list,
    draws: int,
    tune: int,
    cores: int | None,
    chunks: int,
    progressbar: bool | str,
    callback: Callable | None,
    chain_method: str,
) -> tuple[dict[int, DivergenceError], float]:
    """Tune and sample every chain into ``traces``; the chains stopped by a divergence and
    the sampling time. ``step`` is left as after ``pm.sample(cores=1)``."""

    chains = len(traces)
    progress = MCMCProgressBarManager(
        step_method=step, chains=chains, draws=draws, tune=tune, progressbar=progressbar
    )
    total = draws + tune
    last_stats: list[list[dict]] = [[{}] for _ in range(chains)]
    booked = [0] * chains

    def book(c: int, i: int, point: dict, stats: list[dict]) -> None:
        points[c] = point
        last_stats[c] = stats
        booked[c] += 1
        traces[c].record(point, stats, in_warmup=i < tune)
        if callback is not None:
            callback(trace=traces[c], draw=Draw(c, i == total - 1, i, i < tune, stats, point))
        progress.update(chain_idx=c, is_last=False, draw=i, stats=stats, tuning=i < tune)

    if chain_method == "processes":
        groups = _chain_groups(chains, cores, on_cpu=True)
        run = functools.partial(run_in_processes, step, groups=groups)
        where = f"in {len(groups)} worker processes, one CPU each"
    else:
        compiled = step._compile()
        groups = _chain_groups(chains, cores, compiled["jax"].default_backend() == "cpu")
        run = functools.partial(tune_and_sample, step, groups=groups)
        where = "in threads"
    sizes = "+".join(str(len(g)) for g in groups)
    _log.info(f"Vectorised sampling ({chains} chains vmapped, in groups of {sizes} chains {where})")
    t_start = time.time()
    try:
        with progress:
            stopped, runners = run(
                points=points, rngs=rngs, draws=draws, tune=tune, chunks=chunks, book=book
            )
            for c in range(chains):
                if not progress.combined_progress or c == chains - 1:
                    progress.update(
                        chain_idx=c,
                        is_last=True,
                        draw=booked[c] - 1,
                        stats=last_stats[c],
                        tuning=False,
                    )
    finally:
        for trace in traces:
            trace.close()
    t_sampling = time.time() - t_start
    _adopt_last_chain(step, runners)
    return stopped, t_sampling


# -- checks and the result -----------------------------------------------------------------------


def _check_arguments(
    step: Any, model: pm.Model, draws: Any, tune: Any, chains: Any, chunks: Any, random_seed: Any
) -> None:

    if isinstance(step, list | tuple | CompoundStep) or not isinstance(step, SGMCMCStep):
        raise TypeError(
            "pmsg.sample takes one step method of pymc_sgmcmc (e.g. step=pmsg.SGLD()), got "
            f"{type(step).__name__}. A compound step (SG steps with PyMC's own) runs with "
            "pm.sample(step=[...])."
        )
    for name, value, low in (("draws", draws, 1), ("tune", tune, 0), ("chains", chains, 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    if isinstance(chunks, bool) or not isinstance(chunks, int | np.integer) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}.")
    if random_seed == -1:
        raise ValueError("random_seed=-1 is not allowed (as in pm.sample); pass None for no seed.")
    if step.problem.model is not model:
        raise ValueError(
            "The step was built for another model than the one being sampled: create the step "
            "inside the same `with model:` block (or pass model= the step's model)."
        )
    covered = {v.name for v in step.vars}
    missing = [v.name for v in model.value_vars if v.name not in covered]
    if missing:
        raise ModelNotSupportedError(
            f"{type(step).__name__} samples {sorted(covered)} but not {missing}; pmsg.sample "
            "vectorises one step over all free variables. Give the step every variable "
            "(vars=None), or sample the others with PyMC's steps in a compound step through "
            f"pm.sample(step=[{type(step).__name__}(vars=[...]), pm.Metropolis(vars=[...])])."
        )
    if step.streaming:
        raise ModelNotSupportedError(
            "pmsg.sample needs the data in device memory; the step reads out-of-core data= "
            "arrays from disk chunk by chunk, which runs one chain at a time: use "
            "pm.sample(step=...), or load the arrays into memory."
        )
    if step.devices not in (None, 1):
        raise ModelNotSupportedError(
            f"pmsg.sample runs every chain on one device; devices={step.devices!r} (data-parallel "
            "minibatches or one device per chain) runs through pm.sample(step=..., cores=...). "
            "Drop devices= to vectorise the chains."
        )
    if isinstance(random_seed, tuple | list):
        warnings.warn(
            "A list or tuple of random_seed does not give each chain's seed (as in pm.sample); "
            "use a single seed.",
            UserWarning,
            stacklevel=3,
        )


def _sample_return(step: SGMCMCStep, stopped: dict[int, DivergenceError], **kwargs: Any) -> Any:
    """PyMC's own ``_sample_return`` (as wrapped by :mod:`pymc_sgmcmc.adapter.hooks`): the same
    chain selection, InferenceData, convergence checks, attrs and DivergenceError as
    ``pm.sample``."""
    STEPS.set([step])
    DIVERGED.set(sorted(stopped.items()) or None)
    accepted = inspect.signature(mcmc._sample_return).parameters
    defaults = {"run": None, "return_inferencedata": True, "keep_warning_stat": False}
    kwargs = {k: v for k, v in {**defaults, **kwargs}.items() if k in accepted}
    try:
        return mcmc._sample_return(**kwargs)
    finally:
        STEPS.set(None)
        DIVERGED.set(None)
