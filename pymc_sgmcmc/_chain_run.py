"""One run of a group of chains of :func:`pymc_sgmcmc.sample`: every chain's own copy of the
step, tuned draw by draw in lockstep (:class:`~pymc_sgmcmc._chain_engine._Lockstep`), then
sampled in compiled chunks with its parameters frozen (:func:`tune_and_sample`). The same code
runs in the calling process (``chain_method="vectorized"``) and in each worker process of
``chain_method="processes"`` (:mod:`pymc_sgmcmc._chain_processes`); what is done with each draw
(traces, progress, callback, or a message to the parent) is the caller's ``book``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pymc_sgmcmc._chain_engine import _Engine, _Lockstep
from pymc_sgmcmc._runtime import host_blas_threads
from pymc_sgmcmc.adapter.step import DrawRequest, SGMCMCStep
from pymc_sgmcmc.errors import DivergenceError

__all__ = ["tune_and_sample"]


def tune_and_sample(
    step: SGMCMCStep,
    points: list[dict],
    rngs: list,
    draws: int,
    tune: int,
    groups: list[list[int]],
    chunks: int,
    book: Callable[[int, int, dict, list[dict]], None],
) -> tuple[dict[int, DivergenceError], list[SGMCMCStep]]:
    """Tune and sample the chains of ``points`` (chain ``c`` starts at ``points[c]`` with the
    generator ``rngs[c]``; ``groups`` are the vmapped groups, lists of indices into them),
    calling ``book(c, i, point, stats)`` for draw ``i`` of chain ``c`` as it is drawn.
    Returns the chains stopped by a divergence (their errors, as ``pm.sample`` raises them)
    and each chain's step. ``points`` ends holding each chain's last point. Ctrl-C ends the
    run early, as in ``pm.sample``: the draws booked so far stand."""

    with host_blas_threads():  # the tuning's host linear algebra (see host_blas_threads)
        return _tune_and_sample(step, points, rngs, draws, tune, groups, chunks, book)


def _tune_and_sample(
    step: SGMCMCStep,
    points: list[dict],
    rngs: list,
    draws: int,
    tune: int,
    groups: list[list[int]],
    chunks: int,
    book: Callable[[int, int, dict, list[dict]], None],
) -> tuple[dict[int, DivergenceError], list[SGMCMCStep]]:
    compiled = step._compile()
    # Draws run in the compiled loop after tuning (the first draw of a chain also tunes).
    looped = draws - (1 if tune == 0 else 0)
    length = max(1, math.ceil(looped / chunks))
    engine = _Engine(compiled, length, groups)
    runners = [_chain_copy(step) for _ in points]
    for runner, rng in zip(runners, rngs, strict=True):
        runner.set_rng(rng)
        runner.tune = bool(tune)
        if hasattr(runner, "reset_tuning"):
            runner.reset_tuning()
    lockstep = _Lockstep(runners, engine)
    total = draws + tune
    stopped: dict[int, DivergenceError] = {}

    def booked(c: int, i: int, point: dict, stats: list[dict]) -> None:
        points[c] = point
        book(c, i, point, stats)

    try:
        try:
            # Tuning draws (and a chain's first draw: it tunes too) through each chain's
            # own step(), all chains' compiled draws batched.
            for i in range(tune if tune else 1):
                if i == tune:  # tune=0: as pm.sample, before the first draw
                    for runner in runners:
                        runner.stop_tuning()
                for c, (point, stats) in enumerate(lockstep.step(points)):
                    booked(c, i, point, stats)
            if tune:
                for runner in runners:
                    runner.stop_tuning()
            if looped:
                _sample_frozen(engine, lockstep, runners, points, booked, total - looped, total)
        except KeyboardInterrupt:
            pass  # as pm.sample: the draws so far are returned
        for c, runner in enumerate(runners):
            if runner._stopped is not None:
                try:
                    runner.step(points[c])  # raises the chain's stop, as in pm.sample
                except DivergenceError as error:
                    stopped[c] = error
    finally:
        lockstep.close()
        engine.close()
    return stopped, runners


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
