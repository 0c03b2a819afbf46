"""PyMC step methods: ``pm.sample(step=pmsg.SGLD(...))`` inside a model block.

One ``pm.sample`` draw is one jitted ``lax.scan`` over ``thin`` inner iterations; the kernel
state (position, momentum, preconditioner, iteration, PRNG key) persists across the draws of
a chain and is reset at the start of every chain (``set_rng``). Tuning draws are burn-in and
tune step sizes; ``stop_tuning`` freezes them.

JAX is touched only on the first draw, in whichever process samples the chain, so that
PyMC's forked workers never inherit JAX's thread pools (see :mod:`pymc_sgmcmc._multiprocessing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any, ClassVar

import numpy as np
import pymc as pm
from pymc.step_methods.compound import BlockedStep, Competence, StepMethodState
from pymc.step_methods.state import dataclass_state
from pymc.util import get_random_generator

from pymc_sgmcmc.bridge import MinibatchProblem, build_problem
from pymc_sgmcmc.errors import DivergenceError
from pymc_sgmcmc.minibatch import MinibatchScheme, draw_minibatch, layout_data
from pymc_sgmcmc.schedules import Schedule, as_schedule
from pymc_sgmcmc.tuning import (
    NoiseEstimate,
    gradient_noise,
    kl_optimal_scalar_step,
    sgld_step_size,
)

__all__ = ["SGMCMCStep", "ConstantSGD", "SGLD"]

DEFAULT_BATCH_SIZE = 256


@dataclass_state
class SGMCMCStepState(StepMethodState):
    chain_state: Any = field(default=None)
    tune: bool = True


class SGMCMCStep(BlockedStep):
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
    model
        Default: the model on the context stack.
    """

    name: ClassVar[str] = "sgmcmc"
    default_blocked = True
    stats_dtypes_shapes: ClassVar[dict[str, tuple[Any, Any]]] = {
        "tune": (bool, []),
        "step_size": (np.float64, []),
        "data_passes": (np.float64, []),
        "minibatch_loss": (np.float64, []),
        "grad_norm": (np.float64, []),
        "diverging": (bool, []),
    }
    _state_class = SGMCMCStepState

    def __init__(
        self,
        vars: Sequence[Any] | None = None,
        *,
        batch_size: int | None = None,
        temperature: float = 1.0,
        thin: int | None = None,
        minibatch: MinibatchScheme = "blocks",
        minibatch_data: Sequence[Any] | None = None,
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
            model, vars, minibatch_data=minibatch_data, batch_size=batch_size
        )
        n = self.problem.data_size
        self.batch_size = int(batch_size) if batch_size is not None else min(DEFAULT_BATCH_SIZE, n)
        if thin is None:
            thin = math.ceil(n / self.batch_size)
        if int(thin) != thin or thin < 1:
            raise ValueError(f"thin must be a positive integer, got {thin!r}.")
        self.thin = int(thin)
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}.")
        self.temperature = float(temperature)
        if minibatch not in ("blocks", "random"):
            raise ValueError(f"minibatch must be 'blocks' or 'random', got {minibatch!r}.")
        self.minibatch: MinibatchScheme = minibatch
        value_vars = {v.name: v for v in model.value_vars}
        self.vars = [value_vars[info.name] for info in self.problem.var_infos]
        self.rng = get_random_generator(rng)
        self.tune = True
        self.chain_state: Any = None
        self._compiled: dict[str, Any] | None = None

    @classmethod
    def _valid_kwargs(cls) -> set[str]:
        import inspect

        names: set[str] = set()
        for klass in cls.__mro__:
            if "__init__" in klass.__dict__:
                names |= {
                    p.name
                    for p in inspect.signature(klass.__init__).parameters.values()
                    if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
                }
        return names - {"self", "rng", "blocked", "initial_point", "compile_kwargs"}

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
        self._reset_tuning()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_compiled"] = None
        return state

    # -- subclass hooks -----------------------------------------------------------------------
    def _kernel(self) -> tuple[Callable, Callable]:
        """(init(position) -> state, step(key, state, grad_fn, params) -> (state, info))."""
        raise NotImplementedError

    def _params(self, iteration: int) -> dict[str, Any]:
        """Dynamic hyperparameters of the compiled draw (changing them does not recompile)."""
        raise NotImplementedError

    def _reset_tuning(self) -> None:
        """Forget tuned quantities at the start of a chain."""

    def _tune_draw(self, position: Any, fixed: tuple, key: Any) -> None:
        """Called after each tuning draw with the chain's position (JAX array)."""

    def settings(self) -> dict[str, Any]:
        """The sampler's settings, stored in ``InferenceData.attrs`` by :func:`pmsg.sample`."""
        return {
            "sampler": type(self).__name__,
            "batch_size": self.batch_size,
            "thin": self.thin,
            "temperature": self.temperature,
            "minibatch": self.minibatch,
            "data_size": self.problem.data_size,
            "minibatched_observed": list(self.problem.minibatched_observed),
            "dtype": self.problem.dtype,
        }

    # -- compilation ----------------------------------------------------------------------------
    def _compile(self) -> dict[str, Any]:
        if self._compiled is not None:
            return self._compiled
        import jax
        import jax.numpy as jnp

        problem = self.problem
        fns = problem.jax_functions()
        n, b, thin, scheme = problem.data_size, self.batch_size, self.thin, self.minibatch
        data = tuple(jnp.asarray(a) for a in layout_data(problem.data, b, scheme))
        kernel_init, kernel_step = self._kernel()
        logdensity_and_grad = fns["logdensity_and_grad"]

        def draw(key, state, data, fixed, params):
            def body(state, key):
                key_batch, key_step = jax.random.split(key)
                batch = draw_minibatch(key_batch, data, n, b, scheme)

                def grad_fn(position):
                    return logdensity_and_grad(position, fixed, batch)

                state, info = kernel_step(key_step, state, grad_fn, params)
                return state, info

            key, key_draw = jax.random.split(key)
            state, infos = jax.lax.scan(body, state, jax.random.split(key_draw, thin))
            finite = (
                jnp.all(jnp.isfinite(state.position))
                & jnp.all(jnp.isfinite(infos.loss))
                & jnp.all(jnp.isfinite(infos.grad_norm))
            )
            stats = {
                "step_size": infos.step_size[-1],
                "minibatch_loss": jnp.mean(infos.loss),
                "grad_norm": jnp.mean(infos.grad_norm),
                "diverging": ~finite,
            }
            return key, state, stats

        noise_rows = min(n, max(b, 1024))

        def noise_diag(key, position, fixed, data):
            # Uniform rows with replacement (the first N rows of either layout are the data);
            # per-example gradients by vmap; unbiased sample variance per coordinate.
            batch = draw_minibatch(key, data, n, noise_rows, "random")
            return gradient_noise(fns["per_example_grads"](position, fixed, batch))

        self._compiled = {
            "draw": jax.jit(draw),
            "init": jax.jit(kernel_init),
            "noise_diag": jax.jit(noise_diag),
            "data": data,
            "jax": jax,
        }
        return self._compiled

    # -- one draw --------------------------------------------------------------------------------
    def step(self, point: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:
        compiled = self._compile()
        jax = compiled["jax"]
        fixed = tuple(compiled_array for compiled_array in self.problem.fixed_values(point))
        if self.chain_state is None:
            position = self.problem.ravel(point)
            if not np.all(np.isfinite(position)):
                bad = [
                    k for k, v in self.problem.unravel(position).items() if not np.all(np.isfinite(v))
                ]
                raise ValueError(
                    f"The initial point has non-finite values for {bad}; pass finite "
                    "`initvals=` to pm.sample."
                )
            seed = int(self.rng.integers(2**31))
            self.chain_state = (jax.random.PRNGKey(seed), compiled["init"](position))
            # Automatic step sizes need one estimate before the first draw, tuning or not.
            self._tune_draw(self.chain_state[1].position, fixed, self.chain_state[0])
        key, state = self.chain_state
        params = self._params(int(state.iteration))
        key, state, stats = compiled["draw"](key, state, compiled["data"], fixed, params)
        stats = {k: np.asarray(v).item() for k, v in stats.items()}
        if stats["diverging"]:
            raise DivergenceError(
                f"{type(self).__name__} diverged: the position, minibatch loss or gradient "
                f"became non-finite within {self.thin} iterations at step_size="
                f"{stats['step_size']:.3g}. Reduce step_size (or leave it to automatic "
                "tuning), check the model for variables without a proper prior, or use a "
                "larger batch_size."
            )
        self.chain_state = (key, state)
        if self.tune:
            self._tune_draw(state.position, fixed, key)
        stats["tune"] = bool(self.tune)
        stats["data_passes"] = float(int(state.iteration) * self.batch_size / self.problem.data_size)
        new_point = dict(point)
        new_point.update(self.problem.unravel(np.asarray(self._emit(state))))
        return new_point, [stats]

    def _emit(self, state: Any) -> Any:
        """The saved draw for a kernel state (the position; IASG overrides with an average)."""
        return state.position

    def _noise_diag(self, position: Any, fixed: tuple, key: Any) -> np.ndarray:
        """Per-datum gradient variance at ``position`` from one block of rows (host array)."""
        compiled = self._compile()
        key = compiled["jax"].random.fold_in(key, 1)
        return np.asarray(compiled["noise_diag"](key, position, fixed, compiled["data"]))


class ConstantSGD(SGMCMCStep):
    r"""Constant-rate SGD as an approximate posterior sampler (Mandt, Hoffman & Blei 2017).

    .. math::

        v \leftarrow (1-\mu) v - P \hat g(\theta), \qquad \theta \leftarrow \theta + v

    (``momentum=None`` is plain SGD, :math:`\mu = 1`). Near the mode the iterates are an
    Ornstein–Uhlenbeck process with stationary covariance Σ solving
    :math:`P A_U \Sigma + \Sigma A_U P = P (N^2 C / B) P` (§4.1); momentum damping μ gives the
    stationary covariance of plain SGD at :math:`P/\mu` (§4.3), so the rate used is
    :math:`\mu P`.

    Parameters
    ----------
    step_size
        ``"auto"`` (default): during tuning, the per-datum gradient covariance ``C`` is
        estimated at the chain's position and the scalar KL-optimal rate of Theorem 1,
        :math:`P^* = 2 B D / (N^2 \operatorname{Tr} C)`, is used and then frozen; multiplied by
        ``temperature``. A float is used as given.
    momentum
        Damping μ in (0, 1], or None.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(vars, **kwargs)
        if momentum is not None and not (0.0 < float(momentum) <= 1.0):
            raise ValueError(f"momentum (damping μ) must be in (0, 1], got {momentum!r}.")
        self.momentum = None if momentum is None else float(momentum)
        if step_size == "auto":
            self.auto_step_size = True
            self.step_size_value = float("nan")
        else:
            self.auto_step_size = False
            self.step_size_value = float(as_schedule(step_size).value)  # type: ignore[attr-defined]
        self._noise = NoiseEstimate()

    def _kernel(self):
        from pymc_sgmcmc.kernels import sgd

        momentum = self.momentum

        def step(key, state, grad_fn, params):
            return sgd.step(key, state, grad_fn, params["step_size"], momentum=momentum)

        return sgd.init, step

    def _reset_tuning(self) -> None:
        self._noise.reset()
        if self.auto_step_size:
            self.step_size_value = float("nan")

    def _tune_draw(self, position, fixed, key) -> None:
        if not self.auto_step_size:
            return
        c = self._noise.update(self._noise_diag(position, fixed, key))
        p_star = kl_optimal_scalar_step(
            float(c.sum()), self.problem.dim, self.problem.data_size, self.batch_size
        )
        self.step_size_value = p_star * self.temperature * (self.momentum or 1.0)

    def _params(self, iteration: int) -> dict[str, Any]:
        return {"step_size": np.asarray(self.step_size_value, dtype=self.problem.dtype)}

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size": self.step_size_value,
            "step_size_rule": "kl_optimal_scalar" if self.auto_step_size else "fixed",
            "momentum": self.momentum,
        }


class SGLD(SGMCMCStep):
    r"""Stochastic-gradient Langevin dynamics (Welling & Teh 2011), optionally pSGLD.

    .. math::

        \theta \leftarrow \theta + \frac{\epsilon_t}{2} G\, \nabla\log\hat p(\theta)
        + \mathcal N(0, \epsilon_t T G)

    with :math:`G = I` or, for ``preconditioner="rmsprop"``, Li et al.'s diagonal RMSprop
    preconditioner. See :mod:`pymc_sgmcmc.kernels.sgld`.

    Parameters
    ----------
    step_size
        ``"auto"`` (default): during tuning, the per-datum gradient variance is estimated at
        the chain's position and the largest constant step whose stationary variance
        inflation is ``target_bias`` is used, then frozen
        (:func:`pymc_sgmcmc.tuning.sgld_step_size`). A float is a constant step; a schedule
        such as ``pmsg.schedules.polynomial_decay(a, b, gamma)`` (:math:`a (b+t)^{-\gamma}`)
        decreases with the iteration count.
    preconditioner
        ``None`` or ``"rmsprop"`` (pSGLD).
    target_bias
        Relative variance inflation allowed by the automatic step size (default 0.05, i.e.
        posterior sds about 2.5% too wide from the constant step).
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
        preconditioner: str | None = None,
        target_bias: float = 0.05,
        **kwargs: Any,
    ) -> None:
        super().__init__(vars, **kwargs)
        if preconditioner not in (None, "rmsprop"):
            raise ValueError(
                f"SGLD preconditioner must be None or 'rmsprop', got {preconditioner!r}."
            )
        self.preconditioner = preconditioner
        if not (0 < target_bias < 1):
            raise ValueError(f"target_bias must be in (0, 1), got {target_bias!r}.")
        self.target_bias = float(target_bias)
        self.auto_step_size = step_size == "auto"
        self.schedule: Schedule | None = None if self.auto_step_size else as_schedule(step_size)
        self.step_size_value = float("nan")
        self._noise = NoiseEstimate()

    def _kernel(self):
        from pymc_sgmcmc.kernels import sgld

        rmsprop = self.preconditioner == "rmsprop"
        temperature = self.temperature
        schedule = self.schedule

        def step(key, state, grad_fn, params):
            eps = params["step_size"] if schedule is None else schedule(state.iteration)
            return sgld.step(key, state, grad_fn, eps, temperature=temperature, rmsprop=rmsprop)

        return sgld.init, step

    def _reset_tuning(self) -> None:
        self._noise.reset()
        if self.auto_step_size:
            self.step_size_value = float("nan")

    def _tune_draw(self, position, fixed, key) -> None:
        if not self.auto_step_size:
            return
        c = self._noise.update(self._noise_diag(position, fixed, key))
        self.step_size_value = sgld_step_size(
            c,
            self.problem.data_size,
            self.batch_size,
            rmsprop=self.preconditioner == "rmsprop",
            target_bias=self.target_bias,
        )

    def _params(self, iteration: int) -> dict[str, Any]:
        return {"step_size": np.asarray(self.step_size_value, dtype=self.problem.dtype)}

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "step_size": self.step_size_value if self.schedule is None else repr(self.schedule),
            "step_size_rule": "auto_bias" if self.auto_step_size else "user",
            "target_bias": self.target_bias,
            "preconditioner": self.preconditioner,
        }
