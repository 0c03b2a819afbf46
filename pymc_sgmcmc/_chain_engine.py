"""The chains' engine behind :func:`pymc_sgmcmc.sample`: the compiled draw of a group of chains
under ``jax.vmap`` (one loop of up to ``length`` draws, one compilation), the groups run side
by side (:class:`_Engine`), and every chain's draw — the step's own
:meth:`~pymc_sgmcmc.adapter.step.SGMCMCStep.draw_steps` — driven in lockstep, the draws the
chains ask for run together (:class:`_Lockstep`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from pymc_sgmcmc._precision import callers_x64
from pymc_sgmcmc.adapter.step import DrawRequest, SGMCMCStep

_LOOP_KEY = "pmsg_sample_loop"  # the vmapped loop, cached in the step's compiled functions


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
                k: self.stack([r.params[k] for r in requests])
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

    The chains' host parts (the tuning's measurements and linear algebra, between their
    draws) run side by side in threads, one per chain: their compiled calls and NumPy's
    algebra release the GIL. One after another they made a tuning-heavy run 17% slower (radon,
    D = 390, 4 chains, 150 tuning + 50 draws: 21.2 s against 18.2 s).

    ``replay`` books a draw the compiled loop ran already: the chain's ``draw_steps`` is sent
    that result, after a check that the chain asked for the parameters the loop used."""

    def __init__(self, runners: list[SGMCMCStep], engine: _Engine) -> None:
        self.runners = runners
        self.engine = engine
        self.pool = (
            ThreadPoolExecutor(max_workers=len(runners), thread_name_prefix="pmsg-chain")
            if len(runners) > 1
            else None
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def step(self, points: list[dict]) -> list[tuple[dict, list[dict]]]:
        steps = {c: runner.draw_steps(points[c]) for c, runner in enumerate(self.runners)}
        done: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        asking: dict[int, DrawRequest] = {}

        scope = callers_x64()  # this thread's float64 setting, for the pool's threads

        def advance(c: int, result: Any = None, first: bool = False) -> None:
            with scope():
                try:
                    asking[c] = next(steps[c]) if first else steps[c].send(result)
                except StopIteration as finished:
                    done[c] = finished.value
                except Exception as error:  # raised below in chain order, as pm.sample meets it
                    errors[c] = error

        def advance_all(results: dict[int, Any] | None) -> None:
            chains = list(steps) if results is None else list(results)
            move = (
                (lambda c: advance(c, first=True))
                if results is None
                else (lambda c: advance(c, results[c]))
            )
            if self.pool is None or len(chains) == 1:
                for c in chains:
                    move(c)
            else:
                list(self.pool.map(move, chains))

        advance_all(None)
        while asking:
            requests, asking = asking, {}
            try:
                results = self.engine.draw_together(requests)
            except Exception as error:  # the draw's error is each asking chain's
                errors.update(dict.fromkeys(requests, error))
                continue
            advance_all({c: results[c] for c in requests})
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
    import jax

    def leaves_equal(k):
        a, b = jax.tree.leaves(params[k]), jax.tree.leaves(expected[k])
        return len(a) == len(b) and all(
            _equal(k, np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True)
        )

    same = params.keys() == expected.keys() and all(leaves_equal(k) for k in params)
    if not same:
        raise RuntimeError(
            f"{type(runner).__name__} changed the parameters of its compiled draw after tuning "
            f"(keys {sorted(params)}); pmsg.sample runs the sampling draws with them frozen and "
            "cannot sample this step. Use pm.sample(step=...)."
        )


def _equal(name: str, a: np.ndarray, b: np.ndarray) -> bool:
    """Frozen parameters are equal bit for bit; the divergence reference (the previous draw's
    minibatch loss) to rounding: XLA may compute the loop's carried copy of a draw's loss and
    the copy it records in separate fusions (seen with JAX 0.12: 1 ulp apart)."""
    if name == "ref_loss":
        return bool(np.allclose(a, b, rtol=1e-12, atol=0.0, equal_nan=True))
    return bool(np.array_equal(a, b, equal_nan=True))


def _usable_cpus() -> int:
    """The CPUs this process may run on. Not PyMC's ``_cpu_count()``, which counts half of
    them (it takes every other one for a hyperthread): on a 2-CPU machine that left one core
    idle, and 4 chains in one group cost 2.6-2.9x one chain against ~1.7-2.0x in two."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _chain_groups(chains: int, cores: int | None, on_cpu: bool) -> list[list[int]]:
    """Consecutive chains in ``min(chains, cores)`` groups whose sizes differ by one at most
    (default ``cores``: ``min(4, CPUs)`` on a CPU, one group on a GPU/TPU)."""
    if cores is None:
        cores = min(4, _usable_cpus()) if on_cpu else 1
    bounds = np.linspace(0, chains, min(chains, cores) + 1).round().astype(int)
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
