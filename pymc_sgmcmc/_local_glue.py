"""The step methods' glue to local variables (``local_vars``, :mod:`pymc_sgmcmc.variational`):
the iteration and initial state with q, the full-data log-likelihood in the locals, and the
full-data fits of a q that is frozen for the draws. A mixin of
:class:`~pymc_sgmcmc.adapter.step.SGMCMCStep` (it reads the step's ``hybrid``, ``problem``,
``tuner``, ``batch_size`` and compiled functions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pymc_sgmcmc.errors import ModelNotSupportedError
from pymc_sgmcmc.minibatch import default_batch_size, full_data_chunks
from pymc_sgmcmc.schedules import as_schedule
from pymc_sgmcmc.tuning.tuner import MEASURE_EVERY_FIRST, MEASURE_GROWTH
from pymc_sgmcmc.variational import (
    AVERAGE_HORIZON,
    LOCAL_FAMILIES,
    Hybrid,
    HybridState,
    LocalLayout,
)

__all__ = ["LocalVariablesGlue"]


class LocalVariablesGlue:
    """Methods of a step method with ``local_vars`` (see the module docstring)."""

    @property
    def freeze_locals(self) -> bool:
        """Whether q is frozen for the draws (fitted on the full data, then fixed). Unless
        ``freeze_locals=`` says: where q's updates are exact (every row in every iteration)
        it keeps adapting; with minibatches their noise would pass into the
        locals' draws, so ``"markov"`` (which follows the prior's parameters by construction)
        is frozen, and ``"meanfield"`` (which follows the globals only by adapting) adapts.
        The family is known once the step compiles (``"auto"`` resolves then)."""
        if self._freeze_arg is not None:
            return self._freeze_arg
        hybrid = self.hybrid
        return (
            hybrid is not None
            and self.batch_size < self.problem.data_size
            and hybrid.family_name == "markov"
        )

    def _hybrid_iteration(self, kernel_step: Callable) -> Callable:
        """The iteration with local variables: the kernel moves the globals along the
        gradient of the K-sample ELBO estimate; q takes a natural-gradient step where its
        rate is not zero (:meth:`pymc_sgmcmc.variational.Hybrid.step`)."""
        import jax

        hybrid = self.hybrid
        assert hybrid is not None

        def iteration(normal, state, batch, row_ids, next_row_ids, fixed, params):
            key = jax.random.fold_in(state.local["key"], state.iteration)
            _, grad, local = hybrid.step(
                state.position, state.local, fixed, batch, key, params["local_rate"]
            )
            kernel_state, info = kernel_step(normal, state.kernel, lambda _: grad, params)
            return HybridState(kernel_state, local), info, grad

        return iteration

    def _hybrid_init(self, fns: dict[str, Callable], kernel_init: Callable) -> Callable:
        """The chain's initial state with local variables: the kernel's, and q initialised
        at the conditional mode of the locals given the initial globals, with the curvature of
        the full-data log-density there (a Laplace approximation)."""

        hybrid = self.hybrid
        assert hybrid is not None
        full_loglik = self._full_loglik(fns)

        def init(position, data, fixed):
            def loglik(z):
                return full_loglik(position, fixed, data, z)

            # q starts at the Laplace approximation of p(z | θ0, x).
            mode = hybrid.conditional_mode(position, fixed, loglik)
            at_mode = hybrid.layout.insert(fixed, mode)
            curvature = hybrid.curvature(position, at_mode, loglik)
            local = hybrid.init_local(position, at_mode, curvature)
            return HybridState(kernel_init(position, data, fixed), local)

        return init

    def _make_freeze(self, fns: dict[str, Callable]) -> Callable:
        """``freeze(state, data, fixed, key, theta=None) -> state``: q refit on the full data
        at ``theta`` (default the chain's position;
        :meth:`pymc_sgmcmc.variational.Hybrid.refine`)."""
        import jax

        hybrid = self.hybrid
        assert hybrid is not None
        full_loglik = self._full_loglik(fns)

        def freeze(state, data, fixed, key, theta=None):
            theta = state.position if theta is None else theta.astype(state.position.dtype)
            local = hybrid.refine(
                theta,
                state.local,
                fixed,
                lambda th, z: full_loglik(th, fixed, data, z),
                jax.random.fold_in(key, 4),
            )
            return HybridState(state.kernel, local)

        return freeze

    def _full_loglik(self, fns: dict[str, Callable]) -> Callable:
        """``full_loglik(position, fixed, data, z)``: the full-data log-likelihood with the
        locals at ``z``, in chunks of ``B`` laid-out rows (each row once)."""
        import jax
        import jax.numpy as jnp

        hybrid = self.hybrid
        assert hybrid is not None
        b = self.batch_size
        starts, masks = full_data_chunks(self.problem.data_size, b)
        loglik_rows = fns["loglik_rows"]

        def full_loglik(position, fixed, data, z):
            with_z = hybrid.layout.insert(fixed, z)

            def chunk(total, xs):
                start, mask = xs
                rows = tuple(jax.lax.dynamic_slice_in_dim(a, start, b, axis=0) for a in data)
                return total + jnp.sum(mask * loglik_rows(position, with_z, rows)), None

            total, _ = jax.lax.scan(chunk, jnp.zeros((), position.dtype), (starts, masks))
            return total

        return full_loglik

    def _refit_locals(self, state: Any, fixed: tuple, key: Any) -> Any:
        """Before a tuning measurement, a q that is frozen for the draws is refit on the full
        data at the chain's position, so that the chain tunes (and moves) under the density
        it will sample. Refit only at the end of tuning, with minibatch updates in between,
        the tuning chain sat 5 posterior sds low in radon's log σ_α and its gradient noise
        was measured there, 2.8x what the draws saw: σ_α's and μ_α's sds 0.63x."""
        tuner = self.tuner
        if self.hybrid is None or not self.freeze_locals or tuner is None:
            return state
        # The mean position over about the last half of the tuning draws (weights as q's
        # average over iterations, AVERAGE_HORIZON), where q is refit for the draws: at the
        # last tuning position instead, q's sites held one draw's β, and β came out 0.12-0.14
        # sd off.
        position = np.asarray(state.position)
        if int(state.iteration) == 0 or self._theta_mean is None:
            self._theta_mean, self._theta_count, self._last_refit = position, 0, 0
        self._theta_count += 1
        weight = 1.0 / min(1.0 + self._theta_count / 2.0, AVERAGE_HORIZON)
        self._theta_mean = self._theta_mean + weight * (position - self._theta_mean)
        if not tuner.wants_measurement(bool(self.tune)):
            return state
        if tuner.follow:
            # Variational EM measures at every tuning draw; refit on a geometric schedule
            # (each refit costs ~2·K·4 data passes, not counted in data_passes).
            count = self._theta_count
            if count > MEASURE_EVERY_FIRST and count < MEASURE_GROWTH * self._last_refit:
                return state
            self._last_refit = count
        compiled = self._compile()
        state = compiled["freeze"](state, compiled["data"], fixed, key, state.position)
        self.chain_state = (self.chain_state[0], state)
        return state

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
