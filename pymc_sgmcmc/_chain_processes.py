"""``pmsg.sample(chain_method="processes")``: each vmapped group of chains in a worker process of
its own, pinned to one CPU before JAX starts in it.

Why a process per group: XLA's CPU client sizes the thread pool it runs programs on from the
process's CPU affinity when JAX starts, and every computation of the process shares that
pool. In one process the groups of ``chain_method="vectorized"`` share it (a two-thread pool
spins on a small model's draws; a one-thread pool makes the groups take turns), so 4 chains
there cost more than 4 independent interpreters pinned to the CPUs. A worker pinned before its
JAX starts gets a one-thread pool of its own, as those interpreters do
(``benchmarks/RESULTS.md``).

How a worker starts: :mod:`subprocess` runs a fresh interpreter (``python -P -c``: fork and exec
at once, so nothing of this process's JAX threads is inherited), which pins itself to its CPU
and runs :func:`pymc_sgmcmc._chain_worker.serve`: jobs read on its stdin, frames written on
its stdout (what it prints goes to stderr). The user's script is never run again (no ``if __name__ == "__main__":``
needed), and PyMC's own multiprocessing — how ``pm.sample`` runs NUTS — is not touched.

The workers stay up from call to call (until :func:`close_workers` or exit), one pool for
every step, and hold each step they were sent with its compiled functions until the step is
garbage collected here. The first call with a step sends it whole (model and data,
cloudpickled); later calls send only its state — the tuned values, records and chain state —
pickled with the model's objects, the step and its problem as references to the worker's own
(as :func:`~pymc_sgmcmc._chain_run._chain_copy` shares them between chains). Each worker runs :func:`~pymc_sgmcmc._chain_run.tune_and_sample` for its
group — the same code as in this process, so the same seed and ``cores`` give the same draws
(on small models; on large ones XLA on one thread may round differently) —
and sends each draw back in batches, with its warnings and log records; the parent books
them (traces, progress bar, callback) as they come. Ctrl-C is forwarded to the workers, which
stop and return their draws so far, as ``pm.sample`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import jax

from pymc_sgmcmc._chain_engine import _usable_cpus
from pymc_sgmcmc._chain_worker import dump_state, load_state, read_frame, write_frame
from pymc_sgmcmc.adapter.step import SGMCMCStep
from pymc_sgmcmc.errors import DivergenceError

__all__ = ["close_workers", "run_in_processes"]

_log = logging.getLogger("pymc")

_ONE_CALL = threading.Lock()
_IN_CALL = threading.local()  # this thread is inside run_in_processes (e.g. in a callback)
# JAX settings that change the draws, made in code (the workers start with JAX's defaults and
# the environment's JAX_* variables); jax_enable_x64 is the step's own, per call.
_JAX_SETTINGS = (
    "jax_default_prng_impl",
    "jax_default_matmul_precision",
    "jax_threefry_partitionable",
)
_CLOSE_SECONDS = 5.0

# The worker's first lines: pinned before anything imports JAX.
# On Linux a worker ends with its parent (killed, or crashed: a worker busy in a long job
# would otherwise compute on, orphaned, until the job ended); checked once after the request
# in case the parent had ended before it.
_BOOT = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)  # until serve() installs its handler\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    try:\n"
    "        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "    except (OSError, AttributeError):\n"
    "        pass\n"
    "    if os.getppid() != int(sys.argv[2]):\n"
    "        os._exit(0)\n"
    "cpu = int(sys.argv[1])\n"
    "if cpu >= 0 and hasattr(os, 'sched_setaffinity'):\n"
    "    os.sched_setaffinity(0, {cpu})\n"
    "from pymc_sgmcmc._chain_worker import serve\n"
    "serve()\n"
)


# -- the parent's side -------------------------------------------------------------------------


class _Worker:
    """One worker process pinned to ``cpu`` (-1: not pinned), and a thread reading its frames
    into the pool's queue as ``(worker, message)``; ``(worker, None)`` when it ends."""

    def __init__(self, cpu: int, inbox: queue.Queue, dtype: str) -> None:
        # This process's import path, this package first ('' is the current directory);
        # -P: the worker's own current directory is not put in front of it.
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        paths = [package_root, *(p or os.getcwd() for p in sys.path)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["JAX_PLATFORMS"] = "cpu"  # chain_method="processes" is refused on other backends
        flags = env.get("PYTENSOR_FLAGS", "")
        env["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, f"floatX={dtype}") if f)
        self.cpu = cpu
        self.steps: set[int] = set()  # the tokens of the steps it holds
        self.forget: set[int] = set()  # of those, the collected steps: dropped with the next job
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-c", _BOOT, str(cpu), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # the terminal's Ctrl-C reaches the parent only
        )
        self.reader = threading.Thread(
            target=self._read_into, args=(inbox,), daemon=True, name="pmsg-worker-reader"
        )
        self.reader.start()

    def _read_into(self, inbox: queue.Queue) -> None:
        while True:
            try:
                message = read_frame(self.process.stdout)
            except Exception as error:  # an unreadable frame: the stream is lost; report, end
                self.process.kill()
                reason = RuntimeError(f"unreadable message from a worker process: {error!r}")
                inbox.put((self, ("error", reason, 0)))
                message = None
            inbox.put((self, message))
            if message is None:
                return

    def send(self, message: Any) -> None:
        write_frame(self.process.stdin, message)

    def interrupt(self) -> None:
        if self.process.poll() is None:
            with _suppress_oserror():
                os.kill(self.process.pid, signal.SIGINT)

    def end_input(self, kill: bool) -> None:
        """Close its input (it ends when it has read all of it), or kill it."""
        if kill:
            with _suppress_oserror():
                self.process.kill()
        with _suppress_oserror():
            self.process.stdin.close()

    def wait(self, timeout: float) -> None:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, OSError | ValueError)


class _Pool:
    """The worker processes, worker ``g`` pinned to the ``g``-th CPU this process may use
    (round robin). One pool serves every step: a worker holds each step it was sent (by
    token) until the step is collected here."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype  # PyTensor's floatX in the workers: the first step's model's
        self.inbox: queue.Queue = queue.Queue()
        self.workers: list[_Worker] = []
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux: not pinned
            self.cpus = [-1] * _usable_cpus()

    def ensure(self, n: int) -> list[_Worker]:
        """The first ``n`` workers, started (again, if one has ended) where needed."""
        for g in range(n):
            if g == len(self.workers):
                self.workers.append(None)
            worker = self.workers[g]
            if worker is None or worker.process.poll() is not None:
                self.workers[g] = _Worker(self.cpus[g % len(self.cpus)], self.inbox, self.dtype)
        return self.workers[:n]

    def close(self, wait: float = _CLOSE_SECONDS, kill: bool = False) -> None:
        """End every worker: at the end of its input (idle ones end at once), or killed."""
        workers, self.workers = [w for w in self.workers if w is not None], []
        for worker in workers:
            worker.end_input(kill)
        deadline = time.monotonic() + wait
        for worker in workers:
            worker.wait(max(0.0, deadline - time.monotonic()))


_POOL: _Pool | None = None
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step -> its token
_NEXT_TOKEN = itertools.count()
_FORGOTTEN: list[int] = []  # tokens of collected steps, for the workers to drop


def _token(step: SGMCMCStep) -> int:
    token = _TOKENS.get(step)
    if token is None:
        token = _TOKENS[step] = next(_NEXT_TOKEN)
        # Not sent from the finalizer (it may run inside another send): with the next job.
        weakref.finalize(step, _FORGOTTEN.append, token)
    return token


def close_workers(kill: bool = False) -> None:
    """End the worker processes of ``pmsg.sample(..., chain_method="processes")`` (they hold
    each step's compiled functions and data); the next such call starts them again. They
    also end at exit. ``kill``: at once, even in the middle of a job."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.close(kill=kill)


atexit.register(close_workers)


def workers_running() -> bool:
    """Whether worker processes are up (a call with ``chain_method="processes"`` started
    them): a new call then pays no start-up."""
    pool = _POOL
    return pool is not None and any(
        w is not None and w.process.poll() is None for w in pool.workers
    )


@contextlib.contextmanager
def _in_call() -> Iterator[None]:
    _IN_CALL.active = True
    try:
        yield
    finally:
        _IN_CALL.active = False


def run_in_processes(
    step: SGMCMCStep,
    *,
    groups: list[list[int]],
    points: list[dict],
    rngs: list,
    draws: int,
    tune: int,
    chunks: int,
    book: Callable[[int, int, dict, list[dict]], None],
) -> tuple[dict[int, DivergenceError], list[Any]]:
    """:func:`~pymc_sgmcmc._chain_run.tune_and_sample` with group ``g`` of the chains in worker
    process ``g``; the same returns, the chains' steps as their states (for
    :func:`~pymc_sgmcmc._chain_run._adopt_last_chain`: every chain's settings records, the
    last chain's whole state)."""
    if getattr(_IN_CALL, "active", False):
        raise RuntimeError(
            'pmsg.sample(chain_method="processes") was called from inside another such call '
            '(e.g. from its callback); use chain_method="vectorized" for the inner one.'
        )
    with _ONE_CALL, _in_call():  # one call at a time: the workers' frames share one inbox
        global _POOL
        if _POOL is None:
            _POOL = _Pool(step.problem.dtype)
        pool, token = _POOL, _token(step)
        workers = pool.ensure(len(groups))
        forgotten = set()
        while _FORGOTTEN:  # pop: a finalizer may append meanwhile
            forgotten.add(_FORGOTTEN.pop())
        for worker in pool.workers:
            worker.forget |= forgotten & worker.steps
        try:
            _send_jobs(step, token, workers, groups, points, rngs, draws, tune, chunks)
            results, errors = _collect(pool, workers, groups, book)
        except BaseException:  # Ctrl-C while sending, a send failing, an error in book (a
            close_workers(kill=True)  # callback): no worker may go on with this call's job
            raise
        for g in errors:  # its step may not have loaded: sent whole next time
            workers[g].steps.discard(token)
    if errors:  # the first failing draw's lowest group's
        raise min(errors.items(), key=lambda item: (item[1][0], item[0]))[1][1]
    return _gathered(step, groups, results)


def _send_jobs(
    step: SGMCMCStep,
    token: int,
    workers: list[_Worker],
    groups: list[list[int]],
    points: list[dict],
    rngs: list,
    draws: int,
    tune: int,
    chunks: int,
) -> None:
    """Worker ``g`` is sent group ``g``'s job: the step whole if it does not hold it, else the
    step's state; JAX's settings that change draws; the caller's warning filters."""
    full: bytes | None = None
    state = dump_state(step, step)
    settings = {name: getattr(jax.config, name) for name in _JAX_SETTINGS}
    for g, (worker, chains) in enumerate(zip(workers, groups, strict=True)):
        known = token in worker.steps
        if not known and full is None:
            full = cloudpickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        job = {
            "token": token,
            "forget": sorted(worker.forget),
            "step": None if known else full,
            "state": state if known else None,
            "points": [points[c] for c in chains],
            "rngs": [rngs[c] for c in chains],
            "draws": draws,
            "tune": tune,
            "chunks": chunks,
            "last": g == len(groups) - 1,
            "filters": list(warnings.filters),
            "jax": settings,
        }
        try:
            worker.send(("run", job))
        except (BrokenPipeError, OSError) as error:
            raise RuntimeError(
                f"The worker process for chains {chains} is gone (exit code "
                f"{worker.process.poll()}); its output went to stderr. The next call starts "
                "new workers."
            ) from error
        worker.steps -= worker.forget
        worker.forget = set()
        worker.steps.add(token)


def _collect(
    pool: _Pool, workers: list[_Worker], groups: list[list[int]], book: Callable
) -> tuple[dict[int, dict], dict[int, tuple[int, BaseException]]]:
    """The workers' messages until each has finished its job: draws booked, warnings and log
    records re-emitted here; each worker's result or error.

    Ctrl-C (or a KeyboardInterrupt raised by ``book``, i.e. by a callback) stops the run as in
    one process: the workers are told to stop (again every second, until they have) and
    return; of the draws they send meanwhile those up to the last draw booked at the Ctrl-C
    are booked (the chains end near the same draw, as in one process where they move
    together), but for the group whose draw raised in ``book`` — none after it, so that no
    chain has a gap. A second Ctrl-C raises at once.
    While this runs in the main thread, Ctrl-C only sets a flag: a draw is never half
    booked.

    After an error in draw ``d`` of a group the others are stopped as soon as they are past
    draw ``d`` — not before: one of them may fail in the same or an earlier draw, and the
    error raised is then, as in one process where the chains move in lockstep, that of the
    first failing draw's lowest chain."""
    results: dict[int, dict] = {}
    errors: dict[int, tuple[int, BaseException]] = {}
    booked = [-1] * len(groups)  # the last draw each group booked
    pending = set(range(len(groups)))
    stopped: dict[int, float] = {}  # group -> when it was last told to stop
    failed_at: float = float("inf")
    index = {id(w): g for g, w in enumerate(workers)}
    ctrl_c = _CtrlC()
    cut: set[int] = set()
    limit: int | None = None  # after a Ctrl-C: the last draw any chain had booked

    def stop(groups_: set[int], again_after: float | None = None) -> None:
        now = time.monotonic()
        for h in groups_:
            if h not in stopped or (again_after is not None and now - stopped[h] > again_after):
                stopped[h] = now
                workers[h].interrupt()

    def stop_those_past(again_after: float | None = None) -> None:
        """Stop the groups past the first failing draw, or past the last draw booked at a
        Ctrl-C: the others run on to it (so that the chains end near the same draw)."""
        end = min(failed_at, float("inf") if limit is None else limit)
        stop({h for h in pending if booked[h] >= end}, again_after)

    def fail(g: int, draw: int, error: BaseException) -> None:
        nonlocal failed_at
        errors[g] = (draw, error)
        pending.discard(g)
        failed_at = min(failed_at, draw)
        stop_those_past()

    with ctrl_c:
        while pending:
            if ctrl_c.pressed:
                if limit is None:
                    limit = max(booked)
                stop_those_past(again_after=1.0)
            try:
                sender, message = pool.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            g = index.get(id(sender))
            if g is None or g not in pending:  # an earlier call's worker, or finished
                continue
            if message is None:  # the worker ended without finishing its job
                code = workers[g].process.wait()
                reason = RuntimeError(
                    f"The worker process for chains {groups[g]} ended (exit code {code}) "
                    "before it finished; its output went to stderr."
                )
                fail(g, booked[g] + 1, reason)
                continue
            kind = message[0]
            if kind == "draws" and g not in cut:
                for c, i, point, stats in message[1]:
                    if ctrl_c.pressed and limit is None:
                        limit = max(booked)
                    if limit is not None and i > limit:
                        continue
                    try:
                        book(groups[g][c], i, point, stats)
                    except KeyboardInterrupt:  # from a callback: as a Ctrl-C, after this draw
                        if ctrl_c.forced:  # the second Ctrl-C, raised inside the callback
                            raise
                        ctrl_c.press()
                        limit = i if limit is None else min(limit, i)
                        cut.add(g)  # none of the group's later draws: no chain with a gap
                        break
                    booked[g] = max(booked[g], i)
                stop_those_past()
            elif kind == "warning":
                text, category, filename, lineno = message[1:]
                warnings.warn_explicit(text, category, filename, lineno)
            elif kind == "log":
                record = message[1]
                logger = logging.getLogger(record.name)
                if logger.isEnabledFor(record.levelno):
                    logger.handle(record)
            elif kind == "done":
                results[g] = message[1]
                pending.discard(g)
            elif kind == "error":
                fail(g, message[2], message[1])
    return results, errors


class _CtrlC:
    """While entered in the main thread with Python's own Ctrl-C handler in place, Ctrl-C sets
    ``pressed`` instead of raising; a second one raises KeyboardInterrupt (``forced``). A
    SIGINT handler of the caller's (or SIGINT ignored) is left alone; in another thread only
    :meth:`press` sets it."""

    def __init__(self) -> None:
        self.pressed = self.forced = False
        self.previous: Any = None

    def press(self) -> None:
        self.pressed = True

    def _handler(self, signum: int, frame: Any) -> None:
        if self.pressed:
            self.forced = True
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> _CtrlC:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _gathered(
    step: SGMCMCStep, groups: list[list[int]], results: dict[int, dict]
) -> tuple[dict[int, DivergenceError], list[Any]]:
    stopped: dict[int, DivergenceError] = {}
    runners: list[Any] = []
    for g, chains in enumerate(groups):
        result = results[g]
        for c, error in result["stopped"].items():
            stopped[chains[c]] = error
        runners.extend(types.SimpleNamespace(chain_settings=s) for s in result["settings"])
    last = results[len(groups) - 1]["last"]
    if last is not None:
        runners[-1] = types.SimpleNamespace(**load_state(last, step))
    return stopped, runners
