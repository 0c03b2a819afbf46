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
draw, :meth:`~pymc_sgmcmc.step_methods.SGMCMCStep.draw_steps` — ``step()`` as a generator
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

import copy
import inspect
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pymc as pm
import pymc.sampling.mcmc as mcmc
from pymc.backends import init_traces
from pymc.initial_point import make_initial_point_fns_per_chain
from pymc.progress_bar import MCMCProgressBarManager
from pymc.sampling.parallel import Draw
from pymc.step_methods.compound import CompoundStep
from pymc.util import get_random_generator

from pymc_sgmcmc._chain_engine import _chain_groups, _Engine, _Lockstep
from pymc_sgmcmc._hooks import _DIVERGED, _STEPS
from pymc_sgmcmc._precision import in_float64_of_step
from pymc_sgmcmc._runtime import host_blas_threads
from pymc_sgmcmc.errors import DivergenceError, ModelNotSupportedError
from pymc_sgmcmc.step_methods import DrawRequest, SGMCMCStep, bind_steps

__all__ = ["sample"]

DEFAULT_CHUNKS = 20
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

    with host_blas_threads():  # the tuning's host linear algebra (see host_blas_threads)
        stopped, t_sampling = _run_chains(
            step, traces, points, rngs, draws, tune, cores, chunks, progressbar, callback
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
) -> tuple[dict[int, DivergenceError], float]:
    """Tune and sample every chain into ``traces``; the chains stopped by a divergence and
    the sampling time. ``step`` is left as after ``pm.sample(cores=1)``."""

    chains = len(traces)
    compiled = step._compile()
    # Draws run in the compiled loop after tuning (the first draw of a chain also tunes).
    looped = draws - (1 if tune == 0 else 0)
    length = max(1, math.ceil(looped / chunks))
    engine = _Engine(compiled, length, _chain_groups(chains, cores, compiled))
    runners = [_chain_copy(step) for _ in range(chains)]
    for runner, rng in zip(runners, rngs, strict=True):
        runner.set_rng(rng)
        runner.tune = bool(tune)
        if hasattr(runner, "reset_tuning"):
            runner.reset_tuning()
    lockstep = _Lockstep(runners, engine)

    progress = MCMCProgressBarManager(
        step_method=step, chains=chains, draws=draws, tune=tune, progressbar=progressbar
    )
    total = draws + tune
    last_stats: list[list[dict]] = [[{}] for _ in range(chains)]
    stopped: dict[int, DivergenceError] = {}

    def book(c: int, i: int, point: dict, stats: list[dict]) -> None:
        points[c] = point
        last_stats[c] = stats
        traces[c].record(point, stats, in_warmup=i < tune)
        if callback is not None:
            callback(trace=traces[c], draw=Draw(c, i == total - 1, i, i < tune, stats, point))
        progress.update(chain_idx=c, is_last=False, draw=i, stats=stats, tuning=i < tune)

    sizes = "+".join(str(len(g)) for g in engine.groups)
    _log.info(f"Vectorised sampling ({chains} chains vmapped, in groups of {sizes} chains)")
    t_start = time.time()
    try:
        with progress:
            try:
                # Tuning draws (and a chain's first draw: it tunes too) through each chain's
                # own step(), all chains' compiled draws batched.
                for i in range(tune if tune else 1):
                    if i == tune:  # tune=0: as pm.sample, before the first draw
                        for runner in runners:
                            runner.stop_tuning()
                    for c, (point, stats) in enumerate(lockstep.step(points)):
                        book(c, i, point, stats)
                if tune:
                    for runner in runners:
                        runner.stop_tuning()
                if looped:
                    _sample_frozen(engine, lockstep, runners, points, book, total - looped, total)
            except KeyboardInterrupt:
                pass  # as pm.sample: the draws so far are returned
            for c, runner in enumerate(runners):
                if runner._stopped is not None:
                    try:
                        runner.step(points[c])  # raises the chain's stop, as in pm.sample
                    except DivergenceError as error:
                        stopped[c] = error
                if not progress.combined_progress or c == chains - 1:
                    progress.update(
                        chain_idx=c,
                        is_last=True,
                        draw=len(traces[c]) - 1,
                        stats=last_stats[c],
                        tuning=False,
                    )
    finally:
        lockstep.close()
        engine.close()
        for trace in traces:
            trace.close()
    t_sampling = time.time() - t_start
    _adopt_last_chain(step, runners)
    return stopped, t_sampling


def _sample_frozen(
    engine: _Engine,
    lockstep: _Lockstep,
    runners: list[SGMCMCStep],
    points: list[dict],
    book: Callable,
    first: int,
    total: int,
) -> None:
    """Draws ``first..total-1`` of every chain in compiled chunks, each chain's parameters
    frozen as they are after tuning; each chain's ``draw_steps`` then books the chunk's draws."""
    frozen = [_draw_params(r) for r in runners]
    dtype = runners[0].problem.dtype
    carries = {}
    for g, chains in enumerate(engine.groups):
        requests = [
            DrawRequest(
                *runners[c].chain_state,
                runners[c]._last_fixed,
                {**frozen[c], "ref_loss": np.asarray(runners[c]._ref_loss, dtype=dtype)},
                runners[c]._draw_index,
            )
            for c in chains
        ]
        carries[g] = engine.stack_chains(
            requests, halted=[runners[c]._stopped is not None for c in chains]
        )
    i = first
    while i < total and not all(r._stopped is not None for r in runners):
        n = min(engine.length, total - i)
        live = {g: carry for g, carry in carries.items() if not np.all(carry.halted)}
        for g, (carry, record) in engine.run_groups(live, n).items():
            carries[g] = carry
            for j, c in enumerate(engine.groups[g]):
                runner = runners[c]
                if runner._stopped is not None:
                    continue
                final = engine.take(carry.states, j)
                key = engine.take(carry.keys, j)
                for k in range(n):
                    state = _DrawnState(final, record["position"][k, j], record["iteration"][k, j])
                    result = (
                        key,
                        state,
                        record["emitted"][k, j],
                        {name: value[k, j] for name, value in record["stats"].items()},
                    )
                    expected = {**frozen[c], "ref_loss": record["ref_loss"][k, j]}
                    point, stats = lockstep.replay(c, points[c], result, expected)
                    book(c, i + k, point, stats)
                    if runner._stopped is not None:
                        break
                if runner._stopped is None:
                    runner.chain_state = (key, final)
        i += n


def _draw_params(runner: SGMCMCStep) -> dict[str, Any]:
    """The parameters the chain's next compiled draw takes, without the reference loss (the
    compiled loop carries it from draw to draw)."""
    iteration = int(runner.chain_state[1].iteration)
    if hasattr(runner, "_draw_params"):
        params = dict(runner._draw_params(iteration))
    else:
        params = dict(runner._params(iteration))
    params.pop("ref_loss", None)
    return params


class _DrawnState:
    """What a chain's ``step()`` reads of a draw's new kernel state when it books a draw of
    the compiled loop (``position`` and ``iteration``, for its stats): the state after that
    draw, of which the loop kept those two fields; other fields are the chunk's last."""

    def __init__(self, final: Any, position: Any, iteration: Any) -> None:
        self._final = final
        self.position = position
        self.iteration = iteration

    def __getattr__(self, name: str) -> Any:
        # Not for _final itself or special names: unpickling looks them up before _final is
        # set, which recursed (a chain stopped by a divergence keeps such a state).
        if name == "_final" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._final, name)


# -- per-chain copies of the step --------------------------------------------------------------

# Shared by all chains: the compiled functions (never recompiled), the model's problem and
# variables, the construction arguments (for unpickling only) and the generator (replaced by
# set_rng). Everything else — the tuning state — is copied.
_SHARED = ("_compiled", "problem", "vars", "rng", "_BlockedStep__newargs")


def _chain_copy(step: SGMCMCStep) -> SGMCMCStep:
    """A copy of ``step`` for one chain: its own tuning containers (noise estimates, tuned
    values, records), the compiled functions and the model shared. (``copy.copy`` would go
    through ``__getstate__``, which drops the compiled functions.)"""
    clone = object.__new__(type(step))
    model = step.problem.model
    # The step itself maps to the clone: its tuner's rule is a bound method of the step, and a
    # deep copy of it would otherwise bind a second, hidden copy of the step, whose attributes
    # the rule would set while the clone's stayed as they were (SGHMC's friction did).
    memo: dict[int, Any] = {id(model): model, id(step.problem): step.problem, id(step): clone}
    for var in (*model.named_vars.values(), *model.value_vars):
        memo[id(var)] = var
    for name, value in vars(step).items():
        if name == "chain_state":
            value = None  # a previous run's (set_rng resets it anyway)
        clone.__dict__[name] = value if name in _SHARED else copy.deepcopy(value, memo)
    return clone


def _adopt_last_chain(step: SGMCMCStep, runners: list[SGMCMCStep]) -> None:
    """Leave ``step`` as ``pm.sample(cores=1)`` leaves it: holding the last chain's tuned
    values and state, and every chain's settings record."""
    records = [r.chain_settings[-1] for r in runners if r.chain_settings]
    step.__dict__.update(vars(runners[-1]))
    step.chain_settings = records


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
    """PyMC's own ``_sample_return`` (as wrapped by :mod:`pymc_sgmcmc._hooks`): the same
    chain selection, InferenceData, convergence checks, attrs and DivergenceError as
    ``pm.sample``."""
    _STEPS.set([step])
    _DIVERGED.set(sorted(stopped.items()) or None)
    accepted = inspect.signature(mcmc._sample_return).parameters
    defaults = {"run": None, "return_inferencedata": True, "keep_warning_stat": False}
    kwargs = {k: v for k, v in {**defaults, **kwargs}.items() if k in accepted}
    try:
        return mcmc._sample_return(**kwargs)
    finally:
        _STEPS.set(None)
        _DIVERGED.set(None)
