"""What ``pm.sample`` does differently when one of its steps is ours: six PyMC internals
wrapped (:data:`PATCHED_INTERNALS`; why no public extension point serves is listed with each
in :mod:`pymc_sgmcmc.adapter.internals`).

PyMC's ``pm.sample`` writes ``sampling_time``, ``tuning_steps`` etc. into the ``posterior`` and
``sample_stats`` attrs but has no hook for a step method's own metadata. Five functions of
``pymc.sampling.mcmc`` (looked up as module globals by ``pm.sample``) and the worker entry
point of ``pymc.sampling.parallel`` are wrapped:

``assign_step_methods``
    remembers which of the steps the user passed are ours (in a context variable);
``_sample_return``
    adds, when there were any, to ``posterior.attrs`` and ``sample_stats.attrs``:

    - ``sgmcmc_samplers``: the class names, e.g. ``"IASG"``;
    - ``sgmcmc_settings``: a JSON list, one entry per SG step, with its settings and
      ``"chains"`` — the tuned values of each chain (step size or preconditioner, window, ...).
      Each step also emits its tuned settings as the ``sgmcmc_tuned`` stat (a JSON string on
      the chain's first draw after tuning, else empty; it carried them back from PyMC's
      worker processes when chains ran there); it is read here and dropped from
      ``sample_stats`` / ``warmup_sample_stats``;
    - ``sgmcmc_diagnostics``: the self-check's report (:mod:`pymc_sgmcmc.diagnostics`), from
      the ``sgmcmc_check`` stat, which is dropped too; a failed check warns.

``instantiate_steppers``
    turns a NUTS-only keyword (``target_accept``, ``nuts={...}``) passed with one of our
    steps into an error that says what plays its part here (PyMC's own message named a
    ``step_kwargs`` key the user never wrote).

``_mp_sample``
    runs the chains in this process, one after another, when the call's step is or contains
    one of ours (:mod:`pymc_sgmcmc.adapter.chains_in_process`); other calls are PyMC's own.

``pymc.sampling.parallel._run_process``
    records the chain a PyMC worker process samples (:mod:`pymc_sgmcmc._runtime`) before
    running it, for steps with ``devices="chains"``.

``_sample`` and ``_mp_sample``
    stop a chain whose step raised :class:`~pymc_sgmcmc.errors.DivergenceError` after
    tuning as PyMC stops chains on ``KeyboardInterrupt`` — the draws so far are kept, and the
    other chains of a sequential run go on (a parallel run stops them all, as any worker
    error does) — and remember it. ``_sample_return`` then raises the error with the
    result of the draws before the divergence as its ``idata`` attribute.

The wrappers change nothing else and return PyMC's own results.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import pymc
import pymc.sampling.mcmc as mcmc
import pymc.sampling.parallel as parallel
import xarray as xr
from pymc.step_methods import STEP_METHODS
from pymc.step_methods.compound import BlockedStep, CompoundStep

from pymc_sgmcmc._runtime import host_blas_threads, set_current_chain
from pymc_sgmcmc.adapter.chains_in_process import sample_in_this_process
from pymc_sgmcmc.adapter.context import DIVERGED, INTERRUPTED, STEPS
from pymc_sgmcmc.adapter.minibatch_models import _minibatch_slices
from pymc_sgmcmc.adapter.results import get_group, is_result, set_attrs, set_group
from pymc_sgmcmc.adapter.sampling import sample_side_by_side
from pymc_sgmcmc.adapter.stats import ess_mean
from pymc_sgmcmc.adapter.step import SGMCMCStep, _jsonable, bind_steps
from pymc_sgmcmc.diagnostics import run_checks
from pymc_sgmcmc.distributed import is_collective_failure, lost_process_error
from pymc_sgmcmc.errors import DivergenceError, ModelNotSupportedError, NoDrawsError

__all__ = ["install", "sgmcmc_attrs", "step_entries", "variational_group"]

_INSTALLED = False
_PROCESS_CHAIN_INDEX = 9  # PyMC's _Process arguments after self: name, ..., blas_cores, chain


def _run_process_with_chain(*args: Any) -> None:
    """PyMC's worker entry point (``pymc.sampling.parallel._run_process``), recording the
    chain (its 10th argument) first. A module-level function, so that ``spawn`` and
    ``forkserver`` workers find it by reference."""
    i = _PROCESS_CHAIN_INDEX
    chain = int(args[i]) if len(args) > i and isinstance(args[i], int | np.integer) else None
    set_current_chain(chain)
    parallel._Process(*args).run()


def _ours(steps: Any) -> list:
    out: list = []
    for s in steps if isinstance(steps, list | tuple) else [steps]:
        if isinstance(s, CompoundStep):
            out.extend(_ours(list(s.methods)))
        elif isinstance(s, SGMCMCStep):
            out.append(s)
    return out


def _refuse_pymc_steps_on_minibatches(model: Any, provided: list, result: Any) -> None:
    """A model written for minibatch ADVI (``pm.Minibatch``) is read by our steps as its
    full-data model; PyMC's own steps in the same call (a compound step, or variables our
    steps leave to PyMC) would evaluate the user's model, i.e. a random minibatch rescaled by
    ``total_size``, and accept or reject on that noise."""
    others = [type(s).__name__ for s in provided if not isinstance(s, SGMCMCStep)]
    selected = result[1] if isinstance(result, tuple) and len(result) > 1 else {}
    others += [getattr(cls, "__name__", str(cls)) for cls, v in dict(selected).items() if v]
    if not others or model is None:
        return
    graphs = [*model.observed_RVs, *model.potentials, *model.deterministics]
    if _minibatch_slices(graphs):
        raise ModelNotSupportedError(
            f"The model reads its data through pm.Minibatch, and PyMC's {', '.join(others)} "
            "would sample some variables on a random minibatch of it (its log-density "
            "changes at every evaluation). The stochastic-gradient steps read such a model as "
            "its full-data model; PyMC's steps cannot. Write the model on the full arrays "
            "(drop pm.Minibatch and total_size=: the SG step minibatches itself), or sample "
            "every variable with stochastic-gradient steps."
        )


def _refuse_a_run_stopped_in_tuning(kwargs: dict, interrupted: tuple | None) -> None:
    """Before PyMC's ``_sample_return``: a run stopped while every chain was still tuning,
    with ``discard_tuned_samples=True``, gets an error that says so (PyMC's own is "Not
    enough samples to build a trace"); with ``False`` the tuning draws come back as usual."""
    traces, tune = kwargs.get("traces"), int(kwargs.get("tune") or 0)
    if not kwargs.get("discard_tuned_samples", True) or not traces or tune == 0:
        return
    try:
        lengths = [len(trace) for trace in traces]
    except TypeError:  # a trace backend without len()
        return
    if max(lengths) > tune:
        return
    where = f" (chain {interrupted[0]} at draw {interrupted[1]})" if interrupted is not None else ""
    raise NoDrawsError(
        f"Sampling was interrupted{where} while every chain was still tuning ({max(lengths)} "
        f"of {tune} tuning draws at most): no chain got past tuning, so there are no draws to "
        "return. Pass discard_tuned_samples=False to get the tuning draws back, or let the "
        "tuning finish (tune= sets its length)."
    )


def _pop_stat(result: Any, name: str) -> dict[str, np.ndarray]:
    """The values of the stat ``name`` in ``warmup_sample_stats`` and ``sample_stats`` (by
    group), which is then dropped from them, with any dimension of its own."""
    found = {}
    for group in ("warmup_sample_stats", "sample_stats"):
        dataset = get_group(result, group)
        if dataset is None or name not in dataset:
            continue
        stat = dataset[name]
        found[group] = np.asarray(stat.values)
        extra = [d for d in stat.dims if d not in ("chain", "draw")]
        dataset = dataset.drop_vars(name)
        set_group(result, group, dataset.drop_dims([d for d in extra if d in dataset.dims]))
    return found


def _tuned_from_stats(values: dict[str, np.ndarray]) -> list[dict] | None:
    """Each chain's tuned settings from the ``sgmcmc_tuned`` stat's values (JSON on the
    chain's first draw after tuning)."""
    per_chain: list[dict] | None = None
    for group in ("warmup_sample_stats", "sample_stats"):
        if group not in values:
            continue
        array = values[group]
        array = array.reshape(array.shape[0], -1)  # (chain, draw[, 1]) → (chain, draw)
        if per_chain is None:
            per_chain = [{} for _ in range(array.shape[0])]
        for chain, row in enumerate(array):
            found = [str(v) for v in row if isinstance(v, str) and v]
            if found:
                per_chain[chain] = json.loads(found[-1])
    return per_chain if per_chain and all(per_chain) else None


def _check_values(values: dict[str, np.ndarray]) -> np.ndarray | None:
    """The sampling draws' ``sgmcmc_check`` stat as :func:`run_checks` reads it."""
    array = values.get("sample_stats")
    if array is None or not array.size or array.ndim < 2:
        return None
    return array if array.ndim == 3 else array.reshape(array.shape[0], -1)


def _checked_draws(result: Any, steps: list) -> dict[str, np.ndarray] | None:
    """The posterior's draws the chains-agree check reads (:func:`run_checks`): every variable
    when the SG steps sample all the model's free variables (deterministics of them included:
    ``u = tau * z`` is what users read), else only the variables they sample (another step
    method's are PyMC's convergence checks' business)."""
    posterior = get_group(result, "posterior")
    if posterior is None:
        return None
    model = steps[0].problem.model
    ours: set[str] = set()
    for step in steps:
        problem = step.problem
        ours.update(problem.rv_name(v.name) for v in problem.var_infos)
        if step.hybrid is not None:
            ours.update(problem.rv_name(name) for name in step.hybrid.layout.names)
    everything = {rv.name for rv in model.free_RVs} <= ours
    return {
        str(name): np.asarray(values.values)
        for name, values in posterior.data_vars.items()
        if (everything or name in ours) and values.dims[:2] == ("chain", "draw")
    }


def step_entries(steps: list, tuned_chains: list[dict] | None = None) -> list[dict]:
    """One settings entry per SG step of a ``pm.sample`` call, with each chain's tuned values
    under ``"chains"``: ``tuned_chains`` (from the stats, one dict per chain) for a single SG
    step, otherwise the records the step objects kept while sampling in this process."""
    entries = []
    for step in steps:
        entry = step.settings()
        entry.pop("variational", None)  # the last chain's; each chain's is under "chains"
        chains = tuned_chains if tuned_chains and len(steps) == 1 else None
        if chains is None:
            chains = [c for c in step.chain_settings if c]
        if chains:
            entry = {**entry, "chains": chains}
        entry["tuned_in"] = "sampled chains" if chains else "not recorded (see sample_stats)"
        entries.append(entry)
        step.chain_settings = []
    return entries


def sgmcmc_attrs(steps: list, entries: list[dict] | None = None) -> dict[str, str]:
    """The attrs entries for the SG ``steps`` of one ``pm.sample`` call (JSON-encoded);
    ``entries`` from :func:`step_entries` (computed here when not given). q's parameters
    (``"variational"``) are left out: they go to the ``variational`` group."""
    if entries is None:
        entries = step_entries(steps)
    slim = [
        {
            **entry,
            "chains": [
                {k: v for k, v in chain.items() if k != "variational"}
                for chain in entry.get("chains", [])
            ],
        }
        if "chains" in entry
        else entry
        for entry in entries
    ]
    return {
        "sgmcmc_samplers": ",".join(type(s).__name__ for s in steps),
        "sgmcmc_settings": json.dumps(slim, default=_jsonable),
    }


def variational_group(entries: list[dict], model: Any) -> Any:
    """The ``variational`` group: q's frozen parameters of every chain, as variables
    ``<local>_<parameter>`` with dims ``("chain", *the local's dims)``; None without locals
    (or when a chain's parameters were not recorded)."""
    for entry in entries:
        chains = entry.get("chains", [])
        if not chains or not all("variational" in c for c in chains):
            continue
        data_vars = {}
        coords: dict[str, Any] = {"chain": np.arange(len(chains))}
        values_to_rvs = {v.name: rv for v, rv in model.values_to_rvs.items()}
        for name in chains[0]["variational"]:
            rv = values_to_rvs.get(name)
            dims = model.named_vars_to_dims.get(rv.name) if rv is not None else None
            for param in chains[0]["variational"][name]:
                stacked = np.stack(
                    [np.asarray(c["variational"][name][param]) for c in chains], axis=0
                )
                var_dims = (
                    tuple(dims)
                    if dims is not None and len(dims) == stacked.ndim - 1
                    else tuple(f"{name}_dim_{i}" for i in range(stacked.ndim - 1))
                )
                for dim in var_dims:
                    if dim in model.coords and model.coords[dim] is not None:
                        coords[dim] = np.asarray(model.coords[dim])
                data_vars[f"{name}_{param}"] = (("chain", *var_dims), stacked)
        return xr.Dataset(data_vars, coords=coords)
    return None


# The PyMC internals wrapped by :func:`install`, with the parameters the wrappers read or pass
# on by name (``_Process``: the worker's ``chain`` is its 10th positional argument, read by
# :func:`_run_process_with_chain`). Checked at import: a PyMC whose internals changed shape
# fails loudly, naming what changed, instead of sampling with half-working wrappers.
PATCHED_INTERNALS: dict[str, tuple[str, ...]] = {
    "pymc.sampling.mcmc.assign_step_methods": ("model", "step", "methods"),
    "pymc.sampling.mcmc.instantiate_steppers": ("model", "steps", "step_kwargs"),
    "pymc.sampling.mcmc._sample_return": ("traces", "idata_kwargs", "model"),
    "pymc.sampling.mcmc._sample": ("chain", "draws", "step", "trace", "callback"),
    "pymc.sampling.mcmc._mp_sample": ("draws", "tune", "step", "chains", "traces", "model"),
    "pymc.sampling.parallel._run_process": ("args",),
}


def check_pymc_internals(modules: dict[str, Any] | None = None) -> None:
    """Refuse a PyMC whose wrapped internals (:data:`PATCHED_INTERNALS`) changed: each must
    exist and take the parameters the wrappers rely on. ``modules``: for tests, module
    objects by dotted name instead of the imported ones."""
    problems = []
    for path, needed in PATCHED_INTERNALS.items():
        module_name, name = path.rsplit(".", 1)
        module = (modules or {}).get(module_name) or importlib.import_module(module_name)
        fn = getattr(module, name, None)
        if fn is None:
            problems.append(f"{path} is gone")
            continue
        params = list(inspect.signature(fn).parameters)
        missing = [p for p in needed if p not in params]
        if missing:
            problems.append(f"{path} has no parameter(s) {missing} (it takes {params})")
    parallel = (modules or {}).get("pymc.sampling.parallel") or importlib.import_module(
        "pymc.sampling.parallel"
    )
    process = getattr(parallel, "_Process", None)
    params = list(inspect.signature(process.__init__).parameters)[1:] if process else []
    if len(params) <= _PROCESS_CHAIN_INDEX or params[_PROCESS_CHAIN_INDEX] != "chain":
        problems.append(
            f"pymc.sampling.parallel._Process's argument {_PROCESS_CHAIN_INDEX + 1} is not "
            f"'chain' (it takes {params})"
        )
    if not any(hasattr(BlockedStep, name) for name in ("setup_chain", "set_rng")):
        problems.append(
            "BlockedStep has neither setup_chain (PyMC 6) nor set_rng (PyMC 5), by which a "
            "step learns that a chain starts"
        )
    if problems:
        raise ImportError(
            f"pymc_sgmcmc wraps a few internals of PyMC's pm.sample, and in PyMC "
            f"{pymc.__version__} they changed: " + "; ".join(problems) + ". This release of "
            "pymc_sgmcmc was built against PyMC 5.28 and 6.x (see pyproject.toml); install a "
            "PyMC in that range or a pymc_sgmcmc that supports yours."
        )


def install(step_classes: Sequence[type] = ()) -> None:
    """List ``step_classes`` with PyMC's step methods and wrap PyMC's ``pm.sample`` internals
    (:data:`PATCHED_INTERNALS`) once, after checking that they still have the shape the
    wrappers expect (:func:`check_pymc_internals`).

    Listed in ``pm.STEP_METHODS`` so that ``step_kwargs`` by name and tooling see them; their
    competence is INCOMPATIBLE, so ``pm.sample`` never assigns them unless the user names
    them."""
    for cls in step_classes:
        if cls not in STEP_METHODS:
            STEP_METHODS.append(cls)
    global _INSTALLED
    if _INSTALLED:
        return
    check_pymc_internals()
    assign_original = mcmc.assign_step_methods
    return_original = mcmc._sample_return
    sample_original = mcmc._sample
    mp_sample_original = mcmc._mp_sample

    def stopped(error: BaseException) -> DivergenceError | None:
        for err in (error, error.__cause__):
            if isinstance(err, DivergenceError) and err.stopped_chain:
                return err
        return None

    def record(chain: Any, error: DivergenceError) -> None:
        diverged = DIVERGED.get()
        if diverged is None:
            diverged = []
            DIVERGED.set(diverged)
        diverged.append((chain, error))

    @functools.wraps(sample_original)
    def _sample(*args: Any, **kwargs: Any) -> Any:
        set_current_chain(kwargs.get("chain"))
        ours = bool(STEPS.get())
        if ours and INTERRUPTED.get() is not None:
            return None  # Ctrl-C stopped an earlier chain: return what was drawn so far
        try:
            with host_blas_threads() if ours else contextlib.nullcontext():
                result = sample_original(*args, **kwargs)
        except DivergenceError as error:
            if stopped(error) is None:
                raise
            record(kwargs.get("chain"), error)  # the trace was closed by _iter_sample
            return None
        except Exception as error:
            # Several hosts (pymc_sgmcmc.distributed): a collective failed because another
            # process stopped; name it instead of JAX's transport message.
            if ours and is_collective_failure(error):
                raise lost_process_error(error) from error
            raise
        trace, draws = kwargs.get("trace"), kwargs.get("draws")
        if ours and trace is not None and draws is not None and len(trace) < draws:
            # PyMC's _sample swallows the KeyboardInterrupt and returns early.
            INTERRUPTED.set((kwargs.get("chain"), len(trace)))
        return result

    @functools.wraps(mp_sample_original)
    def _mp_sample(*args: Any, **kwargs: Any) -> Any:
        if STEPS.get():
            # One of our steps: never PyMC's worker processes (adapter.chains_in_process). One
            # step over every variable runs its chains side by side, as pmsg.sample does;
            # else one after another in this process, where _sample (wrapped above) stops a
            # diverging chain as in a sequential run.
            if sample_side_by_side(kwargs):
                return None
            return sample_in_this_process(kwargs)
        try:
            return mp_sample_original(*args, **kwargs)
        except Exception as error:
            found = stopped(error)
            if found is None:
                raise
            record(getattr(error, "_chain", None), found)
            for trace in kwargs.get("traces", ()):
                trace.close()
            return None

    @functools.wraps(assign_original)
    def assign_step_methods(*args: Any, **kwargs: Any) -> Any:
        # pm.sample(step=pmsg.IASG(), model=m) with the step built outside `with m:`: bind
        # it to the model being sampled (pymc_sgmcmc.adapter.step.UnboundStep).
        args = list(args)
        model = args[0] if args else kwargs.get("model")
        if len(args) > 1:
            args[1] = bind_steps(args[1], model)
        elif "step" in kwargs:
            kwargs["step"] = bind_steps(kwargs["step"], model)
        result = assign_original(*args, **kwargs)
        provided = result[0] if isinstance(result, tuple) else []
        ours = _ours(list(provided))
        if ours:
            _refuse_pymc_steps_on_minibatches(model, list(provided), result)
        STEPS.set(ours or None)
        return result

    @functools.wraps(return_original)
    def _sample_return(*args: Any, **kwargs: Any) -> Any:
        steps = STEPS.get()
        STEPS.set(None)
        diverged = DIVERGED.get()
        DIVERGED.set(None)
        interrupted = INTERRUPTED.get()
        INTERRUPTED.set(None)
        if steps:
            _refuse_a_run_stopped_in_tuning(kwargs, interrupted)
        if interrupted is not None:
            chain, done = interrupted
            logging.getLogger("pymc").warning(
                f"pymc_sgmcmc: interrupted in chain {chain} after {done} draws (tuning "
                "included); the chains after it were not started. Returning the draws so far "
                "(PyMC keeps the chains and length that give the most draws)."
            )
        result = return_original(*args, **kwargs)
        if steps and is_result(result):
            entries = step_entries(steps, _tuned_from_stats(_pop_stat(result, "sgmcmc_tuned")))
            group = variational_group(entries, steps[0].problem.model)
            attrs = sgmcmc_attrs(steps, entries)
            set_attrs(result, ("posterior", "sample_stats"), attrs)
            check = _check_values(_pop_stat(result, "sgmcmc_check"))
            report = run_checks(check, entries, ess=ess_mean, draws=_checked_draws(result, steps))
            set_attrs(
                result,
                ("posterior", "sample_stats"),
                {"sgmcmc_diagnostics": json.dumps(report, default=float)},
            )
            if group is not None:
                set_group(result, "variational", group)
        if diverged:
            lines = [f"chain {chain}: {error}" for chain, error in diverged]
            raise DivergenceError(
                f"{len(diverged)} chain(s) diverged after tuning and were stopped; the draws "
                "sampled before are in this error's `idata` attribute (chains cut to a common "
                "length as after an interrupt).\n" + "\n".join(lines),
                idata=result,
                chains=[(chain, error.draw) for chain, error in diverged],
            )
        return result

    instantiate_original = mcmc.instantiate_steppers

    @functools.wraps(instantiate_original)
    def instantiate_steppers(*args: Any, **kwargs: Any) -> Any:
        ours = STEPS.get()
        step_kwargs = kwargs.get("step_kwargs") or {}
        selected = kwargs.get("selected_steps") or {}
        names = {getattr(cls, "name", None) for cls, v in selected.items() if v}
        unused = sorted(k for k in step_kwargs if k not in names)
        if ours and unused:
            given = ", ".join(
                f"{key}" if key != "nuts" else "target_accept / nuts={...}" for key in unused
            )
            samplers = ", ".join(sorted({type(s).__name__ for s in ours}))
            raise ValueError(
                f"{given} configure PyMC's own step methods ({', '.join(unused)}), and no "
                f"variable is sampled by one here: the step is {samplers}. A stochastic-"
                "gradient step has no acceptance target: its step size is tuned from the "
                "measured curvature and gradient noise (docs: tuning). The settings that play "
                "that part are the step's own — SGLD/SAGALD/SVRGLD(target_bias=...), a fixed "
                "step_size=..., or more tuning draws (tune=...). Remove the keyword from "
                "pm.sample."
            )
        return instantiate_original(*args, **kwargs)

    mcmc.instantiate_steppers = instantiate_steppers
    mcmc.assign_step_methods = assign_step_methods
    mcmc._sample_return = _sample_return
    mcmc._sample = _sample
    mcmc._mp_sample = _mp_sample
    parallel._run_process = _run_process_with_chain
    _INSTALLED = True
