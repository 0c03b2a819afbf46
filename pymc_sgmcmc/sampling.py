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
and their results are sent back. Everything else — tuning, divergence handling, the stats,
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
import os
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import pymc as pm
import pymc.sampling.mcmc as mcmc
from pymc.backends import init_traces
from pymc.initial_point import make_initial_point_fns_per_chain
from pymc.progress_bar import MCMCProgressBarManager
from pymc.sampling.parallel import Draw
from pymc.step_methods.compound import CompoundStep
from pymc.util import get_random_generator

from pymc_sgmcmc._hooks import _DIVERGED, _STEPS
from pymc_sgmcmc._precision import callers_x64, in_float64_of_step
from pymc_sgmcmc._runtime import host_blas_threads
from pymc_sgmcmc.errors import DivergenceError, ModelNotSupportedError
from pymc_sgmcmc.step_methods import DrawRequest, SGMCMCStep, bind_steps

__all__ = ["sample"]

DEFAULT_CHUNKS = 20
_LOOP_KEY = "pmsg_sample_loop"  # the vmapped loop, cached in the step's compiled functions
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
    per-chain noise estimates one chain after another, the draw one vmapped call per group);
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
    frozen as they are after tuning; each chain's ``step()`` then books the chunk's draws."""
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


# -- the vmapped compiled draw ---------------------------------------------------------------


class _Carry(NamedTuple):
    """A group's chains between draws, stacked over the group's chains."""

    keys: Any
    states: Any
    ref_loss: Any  # each chain's last minibatch loss: the next draw's divergence reference
    halted: Any  # chains stopped by a divergence (frozen at their last finite state)
    params: dict[str, Any]
    fixed: tuple


def _vmapped_loop(compiled: dict[str, Any]) -> Callable:
    """``loop(carry, data, n, length) -> (carry, record)``: ``n`` draws (traced, at most the
    static ``length``) of the step's compiled draw vmapped over a group of chains, and each
    draw's ``record`` (emitted draw, position, iteration, reference loss, stats) in buffers
    of ``length``. Cached with the step's compiled functions: later calls with the same step
    do not compile it again.

    The chains of a group run in lockstep, so their iteration counters are equal (but for a
    halted chain, whose state is never booked again): the counter is passed unbatched. A
    ``lax.cond`` on it — SVRG-LD's anchor refresh every ``anchor_every`` iterations — then
    stays a branch; with a batched predicate vmap turns it into a select that evaluates both
    branches, i.e. a full-data gradient at every iteration of every chain."""
    cached = compiled.get(_LOOP_KEY)
    if cached is not None:
        return cached
    import jax
    import jax.numpy as jnp

    def is_axis(x):
        return x is None

    def shared_iteration(states, halted):
        """``states`` with the iteration counter unbatched (that of the first live chain)
        and the vmap axes of the state: 0 for every leaf but the counter."""
        leaves, treedef = jax.tree.flatten(states)
        counter = states.iteration
        shared = [leaf is counter for leaf in leaves]
        if any(shared):
            k = shared.index(True)
            leaves[k] = leaves[k][jnp.argmin(halted)]
        axes = treedef.unflatten([None if flag else 0 for flag in shared])
        return treedef.unflatten(leaves), axes

    def one_chain(draw, axes):
        """A group of one chain: the draw itself on the chain's slices (vmap over one chain
        compiles a different program, measured 10-50% slower)."""

        def on_leaves(fn, tree, tree_axes):
            return jax.tree.map(
                lambda a, x: x if a is None else fn(x), tree_axes, tree, is_leaf=is_axis
            )

        def run(keys, states, data, fixed, params):
            def squeeze(tree, tree_axes=None):
                if tree_axes is None:
                    return jax.tree.map(lambda x: x[0], tree)
                return on_leaves(lambda x: x[0], tree, tree_axes)

            key, state, emitted, stats = draw(
                keys[0], squeeze(states, axes), data, squeeze(fixed), squeeze(params)
            )
            state = on_leaves(lambda x: x[None], state, axes)
            return key[None], state, emitted[None], jax.tree.map(lambda x: x[None], stats)

        return run

    def advance(carry, data, axes):
        if carry.keys.shape[0] == 1:
            vdraw = one_chain(compiled["draw"], axes)
        else:
            vdraw = jax.vmap(
                compiled["draw"], in_axes=(0, axes, None, 0, 0), out_axes=(0, axes, 0, 0)
            )
        params = {**carry.params, "ref_loss": carry.ref_loss}
        keys, states, emitted, stats = vdraw(carry.keys, carry.states, data, carry.fixed, params)
        # A chain that diverged (now or before) keeps its last finite state and key.
        halt = carry.halted | stats["diverging"]

        def pick(axis, new, old):
            if axis is None:
                return new
            return jnp.where(halt.reshape(halt.shape + (1,) * (new.ndim - 1)), old, new)

        record = {
            "emitted": emitted,
            "position": states.position,
            "iteration": jnp.broadcast_to(states.iteration, halt.shape),
            "ref_loss": carry.ref_loss,
            "stats": stats,
        }
        carry = carry._replace(
            keys=pick(0, keys, carry.keys),
            states=jax.tree.map(pick, axes, states, carry.states, is_leaf=is_axis),
            ref_loss=jnp.where(halt, carry.ref_loss, stats["minibatch_loss"]),
            halted=halt,
        )
        return carry, record

    def loop(carry, data, n, length):
        states, axes = shared_iteration(carry.states, carry.halted)
        carry = carry._replace(states=states)
        shapes = jax.eval_shape(lambda c: advance(c, data, axes)[1], carry)
        buffers = jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), shapes)

        def body(k, value):
            carry, buffers = value
            carry, record = advance(carry, data, axes)
            buffers = jax.tree.map(lambda b, r: b.at[k].set(r), buffers, record)
            return carry, buffers

        carry, buffers = jax.lax.fori_loop(0, n, body, (carry, buffers))
        chains = carry.halted.shape
        states = jax.tree.map(
            lambda axis, leaf: jnp.broadcast_to(leaf, chains) if axis is None else leaf,
            axes,
            carry.states,
            is_leaf=is_axis,
        )
        return carry._replace(states=states), buffers

    compiled[_LOOP_KEY] = jax.jit(loop, static_argnames="length")
    return compiled[_LOOP_KEY]


_HOST_LEAF_BYTES = 1 << 20


def _on_host(x: Any, chains: int = 1) -> bool:
    """Whether a state leaf (one chain's, or ``chains`` chains' stacked) is stacked and split
    on the host: an eager JAX op on a small array costs ~0.1 ms of dispatch (a tuning draw of
    4 chains did hundreds), NumPy's ~1 µs; large leaves (SAGA-LD's gradient table) stay on
    the device rather than being copied to the host and back."""
    return getattr(x, "nbytes", 0) <= _HOST_LEAF_BYTES * chains


class _Engine:
    """The chains' draws on the device, in groups: each group of chains is one
    :func:`_vmapped_loop` call of up to ``length`` draws (one compilation serves every chunk
    and, with a count of 1, the tuning draws); several groups run side by side in threads.

    Why groups: on XLA's CPU backend a vmapped iteration costs about the chains' sum (measured
    at B = 256, D = 20: 4 chains ≈ 3.4× one), since the per-iteration work is arithmetic and
    memory traffic that batching does not share, and one computation runs on one core. JAX
    releases the GIL while it computes, so one thread per group uses one core each — what
    ``pm.sample(cores=...)`` gets from processes, without copying the data or compiling in
    each process.

    Why not several XLA CPU devices (``jax_num_cpu_devices=2``): tried, measured slower. One
    ``jax.shard_map`` of the loop over the chains (each device its own chains, the data
    replicated, no collectives) cost 2.62x (SGLD) / 2.84x (IASG) one chain, and one group per
    device in threads 2.55x / 3.08x, against 1.86x / 2.14x and 1.71x / 2.01x for these
    threads on one device in the same processes (4 chains, N = 1e5, D = 20, B = 256, paired
    medians of 7). A hand-written logistic loop did scale over two devices (1.26x), so it
    depends on the program; one chain alone already keeps both of XLA's pool threads busy."""

    def __init__(self, compiled: dict[str, Any], length: int, groups: list[list[int]]) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self.data = compiled["data"]
        self.groups = groups
        self.length = length
        self._loop = _vmapped_loop(compiled)
        self._compiled_shapes: set[str] = compiled.setdefault(_LOOP_KEY + "_shapes", set())
        self.pool = (
            ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="pmsg-group")
            if len(groups) > 1
            else None
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def run_groups(self, carries: dict[int, _Carry], n: int) -> dict[int, tuple[_Carry, dict]]:
        """``n`` draws of each group in ``carries``: ``{group: (carry, record)}``, the
        records on the host."""
        jax = self.jax
        scope = callers_x64()  # this thread's float64 setting, for the pool's threads

        def run(item):
            g, carry = item
            with scope():
                carry, record = self._loop(carry, self.data, n, length=self.length)
            return g, (carry, jax.device_get(record))

        items = list(carries.items())
        if self.pool is None or len(items) == 1:
            return dict(map(run, items))
        # A new shape compiles at its first call: once, before the threads would each do it.
        results = {}
        for item in items:
            signature = str((self.length, jax.tree.map(np.shape, item[1])))
            if signature not in self._compiled_shapes:
                self._compiled_shapes.add(signature)
                results.update([run(item)])
        results.update(self.pool.map(run, [item for item in items if item[0] not in results]))
        return results

    def stack(self, trees: Sequence[Any]) -> Any:
        """The chains' trees stacked leaf by leaf: small leaves on the host (NumPy), large ones
        (SAGA-LD's gradient table) on the device."""
        jnp = self.jnp

        def leaf(*xs):
            if all(_on_host(x) for x in xs):
                return np.stack([np.asarray(x) for x in xs])
            return jnp.stack([jnp.asarray(x) for x in xs])

        return self.jax.tree.map(leaf, *trees)

    def stack_chains(self, requests: list[DrawRequest], halted: list[bool]) -> _Carry:
        """A group's carry from its chains' draw requests (``params`` with ``ref_loss``)."""
        live = {
            int(r.state.iteration) for r, stop in zip(requests, halted, strict=True) if not stop
        }
        if len(live) > 1:  # the loop shares the counter (see _vmapped_loop)
            raise RuntimeError(f"pmsg.sample: chains out of step (iterations {sorted(live)}).")
        return _Carry(
            keys=self.stack([r.key for r in requests]),
            states=self.stack([r.state for r in requests]),
            ref_loss=np.stack([np.asarray(r.params["ref_loss"]) for r in requests]),
            halted=np.asarray(halted, dtype=bool),
            params={
                k: np.stack([np.asarray(r.params[k]) for r in requests])
                for k in requests[0].params
                if k != "ref_loss"
            },
            fixed=self.stack([tuple(r.fixed) for r in requests]),
        )

    def take(self, tree: Any, j: int) -> Any:
        """Chain ``j``'s slice of a stacked tree: small leaves as views of one host copy."""

        def leaf(x):
            return np.asarray(x)[j] if _on_host(x, chains=max(1, np.shape(x)[0])) else x[j]

        return self.jax.tree.map(leaf, tree)

    def draw_together(self, requests: dict[int, DrawRequest]) -> dict[int, tuple]:
        """One vmapped draw for the chains in ``requests`` (what their ``draw_steps`` asked
        for), one call per group that has any; the slots of a group's other chains repeat one
        of its requests and are discarded."""
        carries = {}
        for g, chains in enumerate(self.groups):
            asked = [c for c in chains if c in requests]
            if asked:
                order = [requests.get(c, requests[asked[0]]) for c in chains]
                carries[g] = self.stack_chains(order, halted=[False] * len(order))
        results = {}
        for g, (carry, record) in self.run_groups(carries, 1).items():
            for j, c in enumerate(self.groups[g]):
                if c in requests:
                    results[c] = (
                        self.take(carry.keys, j),
                        self.take(carry.states, j),
                        record["emitted"][0, j],
                        {name: value[0, j] for name, value in record["stats"].items()},
                    )
        return results


# -- each chain's own draw, batched --------------------------------------------------------


class _Lockstep:
    """Every chain's draw (:meth:`SGMCMCStep.draw_steps`, the host's part of ``step()``) driven
    side by side: the compiled draws the chains ask for are run together, one vmapped call per
    group (:meth:`_Engine.draw_together`), and each result is sent back to its chain. A chain
    whose tuning draw diverged asks again (its retry at a halved step) and is batched with
    the others still asking, or alone.

    ``replay`` books a draw the compiled loop ran already: the chain's ``draw_steps`` is sent
    that result, after a check that the chain asked for the parameters the loop used."""

    def __init__(self, runners: list[SGMCMCStep], engine: _Engine) -> None:
        self.runners = runners
        self.engine = engine

    def step(self, points: list[dict]) -> list[tuple[dict, list[dict]]]:
        steps = {c: runner.draw_steps(points[c]) for c, runner in enumerate(self.runners)}
        done: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        asking: dict[int, DrawRequest] = {}

        def advance(c: int, result: Any = None, first: bool = False) -> None:
            try:
                asking[c] = next(steps[c]) if first else steps[c].send(result)
            except StopIteration as finished:
                done[c] = finished.value
            except Exception as error:  # raised below in chain order, as pm.sample meets it
                errors[c] = error

        for c in steps:
            advance(c, first=True)
        while asking:
            requests, asking = asking, {}
            results = self.engine.draw_together(requests)
            for c in requests:
                advance(c, results[c])
        if errors:
            raise errors[min(errors)]
        return [done[c] for c in range(len(self.runners))]

    def replay(self, c: int, point: dict, result: tuple, expected: dict) -> Any:
        steps = self.runners[c].draw_steps(point)
        request = next(steps)
        _check_frozen(self.runners[c], request.params, expected)
        try:
            steps.send(result)
        except StopIteration as finished:
            return finished.value
        raise RuntimeError(  # a retry: only tuning draws are retried
            f"{type(self.runners[c]).__name__} asked to redo a draw of the compiled loop."
        )


def _check_frozen(runner: SGMCMCStep, params: dict, expected: dict) -> None:
    """The compiled loop ran a chain's sampling draws with the parameters frozen at the end of
    tuning; the step must agree (else a subclass changes them after tuning, which the loop
    cannot follow)."""
    same = params.keys() == expected.keys() and all(
        np.array_equal(np.asarray(params[k]), np.asarray(expected[k]), equal_nan=True)
        for k in params
    )
    if not same:
        raise RuntimeError(
            f"{type(runner).__name__} changed the parameters of its compiled draw after tuning "
            f"(keys {sorted(params)}); pmsg.sample runs the sampling draws with them frozen and "
            "cannot sample this step. Use pm.sample(step=...)."
        )


def _usable_cpus() -> int:
    """The CPUs this process may run on. Not PyMC's ``_cpu_count()``, which counts half of
    them (it takes every other one for a hyperthread): on a 2-CPU machine that left one core
    idle, and 4 chains in one group cost 2.6-2.9x one chain against ~1.7-2.0x in two."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _chain_groups(chains: int, cores: int | None, compiled: dict[str, Any]) -> list[list[int]]:
    """Consecutive chains in ``min(chains, cores)`` groups whose sizes differ by one at most."""
    if cores is None:
        on_cpu = compiled["jax"].default_backend() == "cpu"
        cores = min(4, _usable_cpus()) if on_cpu else 1
    bounds = np.linspace(0, chains, min(chains, cores) + 1).round().astype(int)
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


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
