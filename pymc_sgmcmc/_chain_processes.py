"""``pmsg.sample(chain_method="processes")``: each vmapped group of chains in a worker process of
its own, pinned to one CPU before JAX starts in it.

Why a process per group: XLA's CPU client sizes the thread pool it runs programs on from the
process's CPU affinity when JAX starts, and every computation of the process shares that
pool. In one process the groups of ``chain_method="vectorized"`` share it (a two-thread pool
spins on a small model's draws; a one-thread pool makes the groups take turns), so 4 chains
there cost more than 4 independent interpreters pinned to the CPUs. A worker pinned before its
JAX starts gets a one-thread pool of its own, as those interpreters do
(``benchmarks/RESULTS.md``).

How a worker starts: :mod:`subprocess` runs a fresh interpreter (``python -c``: fork and exec at
once, so nothing of this process's JAX threads is inherited), which pins itself to its CPU,
imports this module and serves jobs on its stdin (frames written on its stdout; what it prints
goes to stderr). The user's script is never run again (no ``if __name__ == "__main__":``
needed), and PyMC's own multiprocessing — how ``pm.sample`` runs NUTS — is not touched.

The workers stay up from call to call (until :func:`close_workers` or exit), one pool for
every step, and hold each step they were sent with its compiled functions until the step is
garbage collected here. The first call with a step sends it whole (model and data,
cloudpickled); later calls send only its state — the tuned values, records and chain state —
pickled with the model's objects, the step and its problem as references to the worker's own
(as :func:`~pymc_sgmcmc._chain_run._chain_copy` shares them between chains). Each worker runs :func:`~pymc_sgmcmc._chain_run.tune_and_sample` for its
group — the same code as in this process, so the same seed and ``cores`` give the same draws —
and sends each draw back in batches, with its warnings and log records; the parent books
them (traces, progress bar, callback) as they come. Ctrl-C is forwarded to the workers, which
stop and return their draws so far, as ``pm.sample`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytensor

from pymc_sgmcmc._chain_engine import _usable_cpus
from pymc_sgmcmc._chain_run import tune_and_sample
from pymc_sgmcmc._precision import float64_scope
from pymc_sgmcmc.errors import DivergenceError
from pymc_sgmcmc.step_methods import SGMCMCStep

__all__ = ["close_workers", "run_in_processes"]

_log = logging.getLogger("pymc")

# Kept in each process (never sent): the compiled functions, the model's problem and
# variables, PyMC's construction arguments and the chain's device.
_LOCAL = ("_compiled", "problem", "vars", "_BlockedStep__newargs", "_chain_device")
_FLUSH_SECONDS = 0.1  # a worker sends its booked draws at most this often (and at the end)
_CLOSE_SECONDS = 5.0

# The worker's first lines: pinned before anything imports JAX.
_BOOT = (
    "import os, sys\n"
    "cpu = int(sys.argv[1])\n"
    "if cpu >= 0 and hasattr(os, 'sched_setaffinity'):\n"
    "    os.sched_setaffinity(0, {cpu})\n"
    "from pymc_sgmcmc._chain_processes import serve\n"
    "serve()\n"
)


# -- frames on a pipe ----------------------------------------------------------------------------


def _write(stream: Any, obj: Any) -> None:
    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read(stream: Any) -> Any:
    """The next frame's object; None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


# -- a step's state, its model's objects by reference --------------------------------------------


def _references(step: SGMCMCStep, owner: Any) -> dict[int, Any]:
    """``id(obj) -> key`` of the objects every process holds its own of: ``owner`` (the step
    or chain copy whose state it is: its tuner's rule is a bound method of it), the problem,
    the model and its variables."""
    model = step.problem.model
    refs: dict[int, Any] = {id(owner): "step", id(step.problem): "problem", id(model): "model"}
    for name, var in model.named_vars.items():
        refs[id(var)] = ("named", name)
    for var in model.value_vars:
        refs[id(var)] = ("value", var.name)
    return refs


def _resolve(step: SGMCMCStep, key: Any) -> Any:
    model = step.problem.model
    if key == "step":
        return step
    if key == "problem":
        return step.problem
    if key == "model":
        return model
    kind, name = key
    if kind == "named":
        return model.named_vars[name]
    return {v.name: v for v in model.value_vars}[name]


class _StatePickler(cloudpickle.Pickler):
    def __init__(self, file: Any, refs: dict[int, Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._refs = refs

    def persistent_id(self, obj: Any) -> Any:
        return self._refs.get(id(obj))


class _StateUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, step: SGMCMCStep) -> None:
        super().__init__(file)
        self._step = step

    def persistent_load(self, pid: Any) -> Any:
        return _resolve(self._step, pid)


def dump_state(step: SGMCMCStep, owner: Any) -> bytes:
    """``owner``'s attributes but the local ones, the shared objects as references."""
    state = {k: v for k, v in vars(owner).items() if k not in _LOCAL}
    buffer = io.BytesIO()
    _StatePickler(buffer, _references(step, owner)).dump(state)
    return buffer.getvalue()


def load_state(data: bytes, step: SGMCMCStep) -> dict[str, Any]:
    """What :func:`dump_state` wrote, the references resolved to ``step``'s own objects."""
    return _StateUnpickler(io.BytesIO(data), step).load()


# -- the parent's side -------------------------------------------------------------------------


class _Worker:
    """One worker process pinned to ``cpu`` (-1: not pinned), and a thread reading its frames
    into the pool's queue as ``(worker, message)``; ``(worker, None)`` when it ends."""

    def __init__(self, cpu: int, inbox: queue.Queue) -> None:
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        paths = [package_root, *(p for p in sys.path if p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        flags = env.get("PYTENSOR_FLAGS", "")
        env["PYTENSOR_FLAGS"] = ",".join(
            f for f in (flags, f"floatX={pytensor.config.floatX}") if f
        )
        self.cpu = cpu
        self.steps: set[int] = set()  # the tokens of the steps it holds
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(cpu)],
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
                message = _read(self.process.stdout)
            except Exception as error:  # an unpicklable frame: report it, end
                message = ("error", RuntimeError(f"unreadable message from a worker: {error!r}"))
                inbox.put((self, message))
                message = None
            inbox.put((self, message))
            if message is None:
                return

    def send(self, message: Any) -> None:
        _write(self.process.stdin, message)

    def interrupt(self) -> None:
        if self.process.poll() is None:
            with _suppress_oserror():
                os.kill(self.process.pid, signal.SIGINT)

    def close(self, wait: float) -> None:
        with _suppress_oserror():
            self.process.stdin.close()  # the worker ends at the end of its input
        try:
            self.process.wait(timeout=wait)
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

    def __init__(self) -> None:
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
                self.workers[g] = _Worker(self.cpus[g % len(self.cpus)], self.inbox)
        return self.workers[:n]

    def close(self, wait: float = _CLOSE_SECONDS) -> None:
        workers, self.workers = self.workers, []
        for worker in workers:
            worker.close(wait)


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


def close_workers() -> None:
    """End the worker processes of ``pmsg.sample(..., chain_method="processes")`` (they hold
    each step's compiled functions and data); the next such call starts them again. They
    also end at exit."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


atexit.register(close_workers)


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
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
    pool, token = _POOL, _token(step)
    workers = pool.ensure(len(groups))
    forgotten, _FORGOTTEN[:] = list(_FORGOTTEN), []
    full: bytes | None = None
    state = dump_state(step, step)
    for g, (worker, chains) in enumerate(zip(workers, groups, strict=True)):
        known = token in worker.steps
        if not known and full is None:
            full = cloudpickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        job = {
            "token": token,
            "forget": [t for t in forgotten if t in worker.steps],
            "step": None if known else full,
            "state": state if known else None,
            "points": [points[c] for c in chains],
            "rngs": [rngs[c] for c in chains],
            "draws": draws,
            "tune": tune,
            "chunks": chunks,
            "last": g == len(groups) - 1,
            "filters": list(warnings.filters),
        }
        try:
            worker.send(("run", job))
        except (BrokenPipeError, OSError) as error:
            close_workers()
            raise RuntimeError(
                f"The worker process for chains {chains} is gone (exit code "
                f"{worker.process.poll()}); its output went to stderr. The next call starts "
                "new workers."
            ) from error
        worker.steps.difference_update(job["forget"])
        worker.steps.add(token)
    for worker in pool.workers[len(groups) :]:  # the workers this call does not use: later
        _FORGOTTEN.extend(t for t in forgotten if t in worker.steps)

    try:
        results, errors = _collect(pool, workers, groups, book)
    except BaseException:  # a second Ctrl-C, or raised by book (a callback) or a warning filter
        close_workers()
        raise
    for g in errors:  # its step may not have loaded: sent whole next time
        workers[g].steps.discard(token)
    if errors:  # the first failing draw's lowest group's
        raise min(errors.items(), key=lambda item: (item[1][0], item[0]))[1][1]
    return _gathered(step, groups, results)


def _collect(
    pool: _Pool, workers: list[_Worker], groups: list[list[int]], book: Callable
) -> tuple[dict[int, dict], dict[int, tuple[int, BaseException]]]:
    """The workers' messages until each has finished its job: draws booked, warnings and log
    records re-emitted here; each worker's result or error. A Ctrl-C is forwarded to the
    workers still running (they return their draws so far); a second one raises.

    After an error in draw ``d`` of a group the others are stopped as soon as they are past
    draw ``d`` — not before: one of them may fail in the same or an earlier draw, and the
    error raised is then, as in one process where the chains move in lockstep, that of the
    first failing draw's lowest chain."""
    results: dict[int, dict] = {}
    errors: dict[int, tuple[int, BaseException]] = {}
    booked = [-1] * len(groups)  # the last draw each group booked
    stopped: set[int] = set()
    failed_at: float = float("inf")

    def stop_those_past_the_failure() -> None:
        for h in pending - stopped:
            if booked[h] >= failed_at:
                stopped.add(h)
                workers[h].interrupt()

    pending = set(range(len(groups)))
    index = {id(w): g for g, w in enumerate(workers)}
    interrupted = False
    registry: dict = {}
    while pending:
        try:
            try:
                sender, message = pool.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            g = index.get(id(sender))
            if g is None:  # from a worker of an earlier call that has ended since
                continue
            if message is None:  # the worker ended without finishing its job
                pending.discard(g)
                code = workers[g].process.wait()
                errors[g] = (
                    booked[g] + 1,
                    RuntimeError(
                        f"The worker process for chains {groups[g]} ended (exit code {code}) "
                        "before it finished; its output went to stderr."
                    ),
                )
                failed_at = min(failed_at, booked[g] + 1)
                stop_those_past_the_failure()
                continue
            kind = message[0]
            if kind == "draws":
                for c, i, point, stats in message[1]:
                    book(groups[g][c], i, point, stats)
                    booked[g] = max(booked[g], i)
                stop_those_past_the_failure()
            elif kind == "warning":
                text, category, filename, lineno = message[1:]
                warnings.warn_explicit(text, category, filename, lineno, registry=registry)
            elif kind == "log":
                record = message[1]
                logger = logging.getLogger(record.name)
                if logger.isEnabledFor(record.levelno):
                    logger.handle(record)
            elif kind == "done":
                results[g] = message[1]
                pending.discard(g)
            elif kind == "error":
                error, draw = message[1:]
                errors[g] = (draw, error)
                pending.discard(g)
                failed_at = min(failed_at, draw)
                stop_those_past_the_failure()
        except KeyboardInterrupt:
            if interrupted:  # a second Ctrl-C: do not wait for the workers
                raise
            interrupted = True
            for other in pending - stopped:
                stopped.add(other)
                workers[other].interrupt()
    return results, errors


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


# -- the worker's side ---------------------------------------------------------------------------


class _Outbox:
    """The worker's frames to the parent: booked draws batched, warnings and log records.

    A Ctrl-C forwarded by the parent raises KeyboardInterrupt in the worker's main thread;
    while that thread writes a frame (or is :meth:`shielded`) it is held back and raised
    after, so that no frame is cut short."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.draws: list = []
        self.sent = time.monotonic()
        self.last_draw = -1  # the last draw booked in this job
        self.holding = 0  # the main thread is writing or shielded
        self.held = False  # a Ctrl-C came meanwhile

    def on_sigint(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.held = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def shielded(self, release: bool = True) -> Iterator[None]:
        main = threading.current_thread() is threading.main_thread()
        self.holding += main
        try:
            yield
        finally:
            self.holding -= main
            if main and not self.holding and self.held and release:
                self.held = False
                raise KeyboardInterrupt

    def send(self, message: Any) -> None:
        with self.shielded(), self.lock:
            _write(self.stream, message)

    def book(self, c: int, i: int, point: dict, stats: list[dict]) -> None:
        self.draws.append((c, i, point, stats))
        self.last_draw = max(self.last_draw, i)
        if time.monotonic() - self.sent >= _FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.draws:
            draws, self.draws = self.draws, []
            self.send(("draws", draws))
        self.sent = time.monotonic()

    def warning(self, message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        self.flush()
        self.send(("warning", str(message), category, filename, lineno))


class _LogForwarder(logging.Handler):
    def __init__(self, outbox: _Outbox) -> None:
        super().__init__(logging.INFO)
        self.outbox = outbox

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None
        record.exc_info = record.exc_text = None
        self.outbox.send(("log", record))


def serve() -> None:
    """A worker's loop: run each job sent on stdin, until stdin ends."""
    inbox = os.fdopen(os.dup(0), "rb")
    outbox = _Outbox(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)  # what the worker prints goes to stderr, not into the frames
    sys.stdout = sys.stderr
    # A Ctrl-C forwarded by the parent raises KeyboardInterrupt here even when the parent was
    # started with SIGINT ignored (a shell's background job), which its children inherit.
    signal.signal(signal.SIGINT, outbox.on_sigint)
    root = logging.getLogger()
    root.addHandler(_LogForwarder(outbox))
    root.setLevel(logging.INFO)
    held: dict[int, SGMCMCStep] = {}  # token -> step
    while True:
        try:
            message = _read(inbox)
        except KeyboardInterrupt:  # a Ctrl-C forwarded while idle: nothing to stop
            continue
        if message is None:
            return
        outbox.held, outbox.last_draw = False, -1
        result = _run_job(held, message[1], outbox)
        with outbox.shielded(release=False):
            outbox.send(result)
            outbox.held = False  # the job is over: a Ctrl-C for it is spent


def _run_job(held: dict, job: dict, outbox: _Outbox) -> tuple:
    """The job's group of chains, tuned and sampled: ``("done", result)`` or ``("error", e)``.
    ``held`` maps tokens to the steps the worker was sent."""
    try:
        for token in job["forget"]:
            held.pop(token, None)
        if job["step"] is not None:
            held[job["token"]] = pickle.loads(job["step"])
        step = held[job["token"]]
        if job["state"] is not None:
            step.__dict__.update(load_state(job["state"], step))
        with warnings.catch_warnings(), float64_scope(step.problem.dtype):
            # The caller's filters, but "error": raised there, when the warning arrives.
            warnings.filters[:] = [
                ("always", *f[1:]) if f[0] == "error" else f for f in job["filters"]
            ]
            getattr(warnings, "_filters_mutated", lambda: None)()  # (CPython's cache)
            warnings.showwarning = outbox.warning
            points = job["points"]
            stopped, runners = tune_and_sample(
                step,
                points,
                job["rngs"],
                job["draws"],
                job["tune"],
                [list(range(len(points)))],
                job["chunks"],
                outbox.book,
            )
        with outbox.shielded(release=False):
            outbox.flush()
            result = {
                "stopped": stopped,
                "settings": [r.chain_settings for r in runners],
                "last": dump_state(step, runners[-1]) if job["last"] else None,
            }
        return ("done", result)
    except BaseException as error:  # noqa: BLE001 -- sent to the parent, raised there
        with outbox.shielded(release=False):
            outbox.flush()
            error.add_note("In the worker process:\n" + "".join(traceback.format_exception(error)))
            try:
                pickle.loads(cloudpickle.dumps(error))
            except Exception:
                error = RuntimeError("".join(traceback.format_exception(error)))
        return ("error", error, outbox.last_draw + 1)
