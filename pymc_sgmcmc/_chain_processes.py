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

The workers belong to the step object: they stay up while it lives (closed when it is
collected, or at exit) and keep its compiled functions. The first call sends each worker the
step (model and data, cloudpickled); later calls send only its state — the tuned values,
records and chain state — pickled with the model's objects, the step and its problem as
references to the worker's own (as :func:`~pymc_sgmcmc._chain_run._chain_copy` shares them
between chains). Each worker runs :func:`~pymc_sgmcmc._chain_run.tune_and_sample` for its
group — the same code as in this process, so the same seed and ``cores`` give the same draws —
and sends each draw back in batches, with its warnings and log records; the parent books
them (traces, progress bar, callback) as they come. Ctrl-C is forwarded to the workers, which
stop and return their draws so far, as ``pm.sample`` does.
"""

from __future__ import annotations

import io
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
from collections.abc import Callable
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
    into the pool's queue as ``(index, message)``; ``(index, None)`` when it ends."""

    def __init__(self, index: int, cpu: int, inbox: queue.Queue) -> None:
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        paths = [package_root, *(p for p in sys.path if p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        flags = env.get("PYTENSOR_FLAGS", "")
        env["PYTENSOR_FLAGS"] = ",".join(
            f for f in (flags, f"floatX={pytensor.config.floatX}") if f
        )
        self.cpu = cpu
        self.has_step = False
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(cpu)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # the terminal's Ctrl-C reaches the parent only
        )
        self.reader = threading.Thread(
            target=self._read_into, args=(index, inbox), daemon=True, name="pmsg-worker-reader"
        )
        self.reader.start()

    def _read_into(self, index: int, inbox: queue.Queue) -> None:
        while True:
            try:
                message = _read(self.process.stdout)
            except Exception as error:  # an unpicklable frame: report it, end
                message = ("error", RuntimeError(f"unreadable message from a worker: {error!r}"))
                inbox.put((index, message))
                message = None
            inbox.put((index, message))
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
    """The worker processes of one step object, worker ``g`` pinned to the ``g``-th CPU this
    process may use (round robin)."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.workers: list[_Worker] = []
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux: not pinned
            self.cpus = [-1] * _usable_cpus()

    def ensure(self, n: int) -> list[_Worker]:
        while len(self.workers) < n:
            g = len(self.workers)
            self.workers.append(_Worker(g, self.cpus[g % len(self.cpus)], self.inbox))
        return self.workers[:n]

    def close(self, wait: float = _CLOSE_SECONDS) -> None:
        workers, self.workers = self.workers, []
        for worker in workers:
            worker.close(wait)


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool_for(step: SGMCMCStep) -> _Pool:
    pool = _POOLS.get(step)
    if pool is None:
        pool = _POOLS[step] = _Pool()
        weakref.finalize(step, pool.close, 1.0)
    return pool


def close_workers(step: SGMCMCStep | None = None) -> None:
    """End the worker processes of ``step`` (of every step when None); the next
    ``chain_method="processes"`` call starts them again."""
    steps = list(_POOLS) if step is None else [step]
    for s in steps:
        pool = _POOLS.pop(s, None)
        if pool is not None:
            pool.close()


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
    pool = _pool_for(step)
    workers = pool.ensure(len(groups))
    full: bytes | None = None
    state = dump_state(step, step)
    for g, (worker, chains) in enumerate(zip(workers, groups, strict=True)):
        if not worker.has_step and full is None:
            full = cloudpickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        job = {
            "step": None if worker.has_step else full,
            "state": state if worker.has_step else None,
            "points": [points[c] for c in chains],
            "rngs": [rngs[c] for c in chains],
            "draws": draws,
            "tune": tune,
            "chunks": chunks,
            "last": g == len(groups) - 1,
        }
        try:
            worker.send(("run", job))
        except (BrokenPipeError, OSError) as error:
            close_workers(step)
            raise RuntimeError(
                f"The worker process for chains {chains} is gone (exit code "
                f"{worker.process.poll()}); its output went to stderr. The next call starts "
                "new workers."
            ) from error
        worker.has_step = True

    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    pending = set(range(len(groups)))
    interrupted = False
    registry: dict = {}
    while pending:
        try:
            try:
                g, message = pool.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if message is None:  # the worker ended without finishing its job
                pending.discard(g)
                code = workers[g].process.wait()
                errors[g] = RuntimeError(
                    f"The worker process for chains {groups[g]} ended (exit code {code}) before "
                    "it finished; its output went to stderr."
                )
                continue
            kind = message[0]
            if kind == "draws":
                for c, i, point, stats in message[1]:
                    book(groups[g][c], i, point, stats)
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
                errors[g] = message[1]
                pending.discard(g)
                for other in pending:  # as in this process: the others stop there too
                    workers[other].interrupt()
        except KeyboardInterrupt:
            if interrupted:  # a second Ctrl-C: do not wait for the workers
                close_workers(step)
                raise
            interrupted = True
            for other in pending:
                workers[other].interrupt()
    if any(w.process.poll() is not None for w in workers):
        close_workers(step)
    if errors:
        raise errors[min(errors)]
    return _gathered(step, groups, results)


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
    """The worker's frames to the parent: booked draws batched, warnings and log records."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.draws: list = []
        self.sent = time.monotonic()

    def send(self, message: Any) -> None:
        with self.lock:
            _write(self.stream, message)

    def book(self, c: int, i: int, point: dict, stats: list[dict]) -> None:
        self.draws.append((c, i, point, stats))
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
    root = logging.getLogger()
    root.addHandler(_LogForwarder(outbox))
    root.setLevel(logging.INFO)
    step: SGMCMCStep | None = None
    while True:
        try:
            message = _read(inbox)
            if message is None:
                return
            _, job = message
            if job["step"] is not None:
                step = pickle.loads(job["step"])
            elif job["state"] is not None:
                step.__dict__.update(load_state(job["state"], step))
            outbox.send(_run_job(step, job, outbox))
        except KeyboardInterrupt:  # a Ctrl-C forwarded between jobs
            continue


def _run_job(step: SGMCMCStep, job: dict, outbox: _Outbox) -> tuple:
    """The job's group of chains, tuned and sampled: ``("done", result)`` or ``("error", e)``."""
    try:
        with warnings.catch_warnings(), float64_scope(step.problem.dtype):
            warnings.simplefilter("always")  # the parent's filters decide
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
            outbox.flush()
            result = {
                "stopped": stopped,
                "settings": [r.chain_settings for r in runners],
                "last": dump_state(step, runners[-1]) if job["last"] else None,
            }
        return ("done", result)
    except BaseException as error:  # noqa: BLE001 -- sent to the parent, raised there
        outbox.flush()
        error.add_note("In the worker process:\n" + "".join(traceback.format_exception(error)))
        try:
            pickle.loads(cloudpickle.dumps(error))
        except Exception:
            error = RuntimeError("".join(traceback.format_exception(error)))
        return ("error", error)
