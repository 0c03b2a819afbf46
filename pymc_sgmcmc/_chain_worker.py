"""The worker process of ``pmsg.sample(chain_method="processes")``
(:mod:`pymc_sgmcmc._chain_processes` starts it): its loop (:func:`serve`), which runs
:func:`~pymc_sgmcmc._chain_run.tune_and_sample` for each job and sends the draws, warnings,
log records and the result back; and what both sides share — the frames on the pipes and a
step's state pickled with its model's objects by reference (:func:`dump_state`,
:func:`load_state`).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
import warnings
from typing import Any

import cloudpickle
import jax

from pymc_sgmcmc._chain_run import tune_and_sample
from pymc_sgmcmc._precision import float64_scope
from pymc_sgmcmc.adapter.step import SGMCMCStep

__all__ = ["dump_state", "load_state", "read_frame", "serve", "write_frame"]

# Kept in each process (never sent): the compiled functions, the model's problem and
# variables, PyMC's construction arguments and the chain's device.
_LOCAL = ("_compiled", "problem", "vars", "_BlockedStep__newargs", "_chain_device")
_FLUSH_SECONDS = 0.1  # a worker sends its booked draws at most this often (and at the end)


# -- frames on a pipe ----------------------------------------------------------------------------


def write_frame(stream: Any, obj: Any) -> None:
    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read_frame(stream: Any) -> Any:
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


# -- the worker's loop -------------------------------------------------------------------------


class _Outbox:
    """The worker's frames to the parent: booked draws batched, warnings and log records.

    A Ctrl-C forwarded by the parent raises KeyboardInterrupt in the worker's main thread only
    while a job's sampling is ``armed``, and only once per job (the parent repeats it until
    the job returns); never while that thread writes a frame — it is then held and raised
    right after — so no frame is cut short, and never between jobs."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.draws: list = []
        self.sent = time.monotonic()
        self.last_draw = -1  # the last draw booked in this job
        self.armed = False  # a Ctrl-C may raise (once)
        self.writing = 0  # the main thread is writing a frame
        self.held = False  # a Ctrl-C came while it was

    def on_sigint(self, signum: int, frame: Any) -> None:
        if not self.armed:
            return
        if self.writing:
            self.held = True
            return
        self.armed = False
        raise KeyboardInterrupt

    def start_job(self) -> None:
        self.draws, self.last_draw, self.held = [], -1, False
        self.sent = time.monotonic()
        self.armed = True

    def end_job(self) -> None:
        self.armed = self.held = False

    def send(self, message: Any) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.writing += main
        try:
            with self.lock:
                write_frame(self.stream, message)
        finally:
            self.writing -= main
        if main and self.held and self.armed and not self.writing:
            self.held = self.armed = False
            raise KeyboardInterrupt

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
    # The parent's forwarded Ctrl-C (SIGINT ignored until here, see _BOOT).
    signal.signal(signal.SIGINT, outbox.on_sigint)
    # Every log record goes to the parent, which prints it or not: the handlers the imports
    # installed here (PyMC's on "pymc") would print it a second time.
    for logger in [logging.getLogger(), *logging.root.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.propagate = True
    root = logging.getLogger()
    root.addHandler(_LogForwarder(outbox))
    root.setLevel(logging.INFO)
    held: dict[int, SGMCMCStep] = {}  # token -> step
    while True:
        message = read_frame(inbox)
        if message is None:
            return
        result = _run_job(held, message[1], outbox)
        outbox.send(result)


def _run_job(held: dict, job: dict, outbox: _Outbox) -> tuple:
    """The job's group of chains, tuned and sampled: ``("done", result)`` or
    ``("error", error, draw)``. ``held`` maps tokens to the steps the worker was sent."""
    outbox.start_job()
    try:
        for token in job["forget"]:
            held.pop(token, None)
        for name, value in job["jax"].items():
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)
        if job["step"] is not None:
            held[job["token"]] = pickle.loads(job["step"])
        step = held[job["token"]]
        if job["state"] is not None:
            step.__dict__.update(load_state(job["state"], step))
        with warnings.catch_warnings(), float64_scope(step.problem.dtype):
            warnings.filters[:] = job["filters"]  # the caller's ("error" raises here, as there)
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
        outbox.end_job()
        outbox.flush()
        result = {
            "stopped": stopped,
            "settings": [r.chain_settings for r in runners],
            "last": dump_state(step, runners[-1]) if job["last"] else None,
        }
        return ("done", result)
    except BaseException as error:  # noqa: BLE001 -- sent to the parent, raised there
        outbox.end_job()
        outbox.flush()
        error.add_note("In the worker process:\n" + "".join(traceback.format_exception(error)))
        try:
            pickle.loads(cloudpickle.dumps(error))
        except Exception:
            error = RuntimeError("".join(traceback.format_exception(error)))
        return ("error", error, outbox.last_draw + 1)
