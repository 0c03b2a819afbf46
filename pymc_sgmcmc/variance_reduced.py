r"""Variance-reduced Langevin dynamics through ``pm.sample``: SAGA-LD and SVRG-LD.

Dubey et al. (2016) replace SGLD's minibatch gradient by a control-variate estimate whose
variance vanishes near the stored positions (:mod:`pymc_sgmcmc.kernels.saga`,
:mod:`pymc_sgmcmc.kernels.svrg`). The Langevin step, temperature, automatic step size, stats
and InferenceData are SGLD's (:class:`pymc_sgmcmc.SGLD`); what differs is the estimator and
its state, which persists across the draws of a chain like the rest of the kernel state.

Cost accounting in the ``data_passes`` stat counts every row whose gradient is evaluated:
SAGA-LD's table fill (one pass at the chain's initial point) plus ``B`` rows per
iteration; SVRG-LD's ``2B`` rows per iteration (the minibatch at θ and at the anchor) plus one
full pass per anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pymc_sgmcmc.draws import full_data_gradient
from pymc_sgmcmc.errors import ModelNotSupportedError
from pymc_sgmcmc.kernels import saga, svrg
from pymc_sgmcmc.kernels.preconditioning import apply_to_rows, as_parameter
from pymc_sgmcmc.minibatch import full_data_chunks, noise_factor
from pymc_sgmcmc.sgld import SGLD
from pymc_sgmcmc.tuning.averaging import arrowhead_moments_along, chunked_gradient_noise
from pymc_sgmcmc.tuning.measurements import NOISE_CHUNK_WORK
from pymc_sgmcmc.tuning.structure import StructuredCurvature

__all__ = ["SAGALD", "SVRGLD"]


class _VarianceReducedLD(SGLD):
    """Shared parts: Langevin steps in the measured whitening and the automatic step size.

    Automatic step size: SGLD's rule (:class:`~pymc_sgmcmc.SGLD`) with the noise of the
    variance-reduced estimator measured at the chain's state — the covariance over rows of the
    per-row differences between the gradient and its stored value (the SAGA table's row, or the
    row's gradient at the SVRG anchor), times ``N²/B``. That noise vanishes as the stored
    positions approach the chain, so on a flat model the step is mostly set by the
    discretisation cap (``h ≤ 0.25`` in whitened units): about four iterations per relaxation
    time.

    Where a coordinate is informed by few rows (a group effect), the noise is large and grows
    with the step: between visits of the group's rows its gradient is the stored one, the chain
    drifts from the stored point by about ``2h`` per iteration, and each visit feeds
    ``(N/B)·H_i·(θ − θ_stored)`` back — a noise proportional to the state's distance, heavy
    in its tails. Two consequences, measured on 2 000 exact random intercepts (20 rows per
    group, B = 256 of 40 000 rows; a simulation of one group gives the same numbers):

    - the tuner finds the step whose own noise fits the rule (its fixed point:
      :class:`~pymc_sgmcmc.tuning.tuner.Tuner`'s ``noise_grows_with_step``), not the rule's
      answer to the noise measured at the previous step (which gave the groups steps from
      10⁻⁵ to 0.13 and kicked some tens of sds away);
    - the rule's share is ``target_bias`` (0.05), not SGLD's ``5·target_bias``: a noise
      proportional to the state's distance is not the white noise the budget assumes. In the
      simulation, at the fixed point of a quarter (h = 0.028) a group's draws have variance
      0.94 and kurtosis 3.8 (3 for the Gaussian posterior); at 0.05 (h = 0.010), 0.99 and
      3.1. On a flat model the noise is far below either share, and the step stays at the
      cap.
    """

    _streams = False  # SAGA's table and SVRG's anchor need the data in memory
    _supports_locals = False  # per-row gradients of θ that locals drawn afresh make random
    _noise_grows_with_step = True  # the chain's distance from the anchor / table does
    _share_per_bias = 1.0  # a share of target_bias: a multiplicative noise (class docstring)
    _stored_rows_dense = True  # SAGA's table rows (D entries each); SVRG's are recomputed

    def __init__(
        self,
        vars: Any = None,
        *,
        step_size: Any = "auto",
        preconditioner: Any = "auto",
        **kwargs: Any,
    ) -> None:
        if preconditioner not in ("auto", "full", "diagonal", None):
            raise ValueError(
                f"{type(self).__name__} preconditioner must be 'auto', 'full', 'diagonal' or None, "
                f"got {preconditioner!r}."
            )
        if step_size != "auto":
            preconditioner = None  # a user's step: Dubey et al.'s plain update
        super().__init__(vars, step_size=step_size, preconditioner=preconditioner, **kwargs)
        others = [self.problem.rv_name(n) for n in self.problem.fixed_in_rows]
        if others:
            # Measured in a compound step (a categorical k beside continuous variables,
            # tests/test_compound.py, against a 4 x 40 000-draw reference): SAGA-LD's g 0.26
            # sd off with sd 0.72x and P(k = 3) 0.94 against 0.82 — its stored gradients
            # hold the likelihood at k's earlier values and pull the chain back to them.
            names = ", ".join(repr(n) for n in others)
            raise ModelNotSupportedError(
                f"{type(self).__name__} cannot share the likelihood with another step method: "
                f"{names} {'is' if len(others) == 1 else 'are'} sampled by another step "
                f"method (a compound step) and enter the rows' log-likelihood, while "
                f"{type(self).__name__} keeps gradients of those rows from earlier draws, "
                f"computed at earlier values of {names}. Use IASG or ConstantSGD for "
                f"{', '.join(self.problem.rv_name(v.name) for v in self.problem.var_infos)} in a "
                f"compound step, or sample every variable with {type(self).__name__}."
            )

    def _measure(self, state: Any, fixed: tuple, key: Any):
        base = super()._measure(state, fixed, key)
        if self.exact:
            return base
        compiled = self._compile()
        fn = compiled.get("vr_noise")
        if fn is None:
            fn = compiled["vr_noise"] = self._build_vr_noise(compiled)
        n, b = self.problem.data_size, self.batch_size
        scale = n**2 / b * noise_factor(n, b, self.minibatch)
        if isinstance(base.curvature, StructuredCurvature):
            # the control variates' noise in the structure's blocks (as the plain noise is:
            # a diagonal would misplace the globals' noise along their marginal direction)
            structure = base.curvature.structure
            moments = fn(
                compiled["fold_in"](key, 5),
                state,
                fixed,
                compiled["data"],
                False,
                structure.probes(dtype=self.problem.dtype),
                structure.id_probes(dtype=self.problem.dtype),
                structure.local_idx,
                pairs=tuple(structure.pairs()),
            )
            c = StructuredCurvature(structure, *(np.asarray(m) for m in moments))
            return type(base)(
                base.curvature, c * scale, base.fisher, base.stability, base.row_stiffness
            )
        dense = self.whitening_kind == "dense"
        c = np.asarray(fn(compiled["fold_in"](key, 5), state, fixed, compiled["data"], dense))
        noise = scale * c
        if not dense and noise.ndim == 2:
            noise = np.diag(noise)
        return type(base)(base.curvature, noise, base.fisher, base.stability, base.row_stiffness)

    def _build_vr_noise(self, compiled: dict[str, Any]):
        import jax
        import jax.numpy as jnp

        n = self.problem.data_size
        # As many rows as the plain minibatch noise is measured on (the tuning block: every
        # row up to N = 16 384 or for a sparsely informed coordinate, else at least 16 rows
        # per dimension): the estimator's noise in a group's direction comes from that
        # group's few rows, which 1024 rows drawn at random mostly miss (radon: 386 counties,
        # many with 1-3 of 12 573 rows; 2 000 groups of 20 rows in 40 000: half a row per
        # group, and the groups none was drawn from got the largest step and were kicked
        # tens of sds away at their rows' next visit).
        every_row = getattr(self, "_search_rows", 0) == n
        rows = n if every_row else min(n, max(self.batch_size, 1024, self._search_rows))
        fns = self.problem.jax_functions()
        per_example, loglik_rows = fns["per_example_grads"], fns["loglik_rows"]
        stored_fn, stored_along = self._stored_rows, self._stored_along

        def vr_noise(
            key, state, fixed, data, dense, probes=None, id_probes=None, local_idx=None, pairs=()
        ):
            if every_row:
                idx = jnp.arange(n)
            else:
                idx = jax.random.randint(key, (rows,), 0, n)

            def rows_at(start, size):
                part = jax.lax.dynamic_slice_in_dim(idx, start, size)
                return part, tuple(jnp.take(a, part, axis=0) for a in data)

            dim = state.position.shape[0]
            if local_idx is not None:
                # With the model's nested structure: the per-row differences along the
                # structure's probes (forward mode at the chain's position, less the stored
                # rows' along the same probes), no per-row gradients of D entries.
                def along(start, size, tangents):
                    part, batch = rows_at(start, size)

                    def one(t):
                        fn = lambda th: loglik_rows(th, fixed, batch)  # noqa: E731
                        return jax.jvp(fn, (state.position,), (t,))[1]

                    return jax.vmap(one)(tangents) - stored_along(
                        state, fixed, batch, part, tangents
                    )

                return arrowhead_moments_along(
                    along,
                    rows,
                    probes,
                    id_probes,
                    local_idx,
                    pairs,
                    NOISE_CHUNK_WORK,
                    row_work=dim if self._stored_rows_dense else None,
                )

            def rows_of(start, size):
                # The per-row differences for rows idx[start : start + size] (in chunks on
                # every row: N x D at once would be a second SAGA table).
                part, batch = rows_at(start, size)
                return per_example(state.position, fixed, batch) - stored_fn(
                    state, fixed, batch, part
                )

            return chunked_gradient_noise(rows_of, rows, dim, dense, NOISE_CHUNK_WORK)

        return jax.jit(vr_noise, static_argnames=("dense", "pairs"))

    def _stored_rows(self, state: Any, fixed: tuple, batch: Any, idx: Any) -> Any:
        """The stored per-row gradients the estimator subtracts, for rows ``idx``."""
        raise NotImplementedError

    def _stored_along(self, state: Any, fixed: tuple, batch: Any, idx: Any, tangents: Any) -> Any:
        """``(T, m)``: the stored per-row gradients of rows ``idx`` along each of ``tangents``
        (``(T, D)``)."""
        return tangents @ self._stored_rows(state, fixed, batch, idx).T

    def _params(self, iteration: int) -> dict[str, Any]:
        params = super()._params(iteration)
        if self.tuner is not None and not self.exact and self.tuned is not None:
            dtype = self.problem.dtype
            params["precond_vr"] = as_parameter(self.tuned.preconditioner, dtype)
            params["inject"] = as_parameter(self.tuned.noise_factor, dtype)
        return params

    def _mix_normals(self, normals, params):
        inject = params.get("inject")
        if inject is None:
            return normals
        return apply_to_rows(inject, normals)

    def _step_size(self, params: dict[str, Any], iteration: Any) -> Any:
        if self.schedule is None:
            return params["step_size"]
        return params["shrink"] * self.schedule(iteration)

    def _prior_grad(self, fns: dict[str, Callable]) -> Callable:
        import jax

        return jax.grad(fns["logprior"])


class SAGALD(_VarianceReducedLD):
    r"""SAGA Langevin dynamics (Dubey et al. 2016, Algorithm 1).

    .. math::

        \hat g = \nabla\log p(\theta) + \tfrac{N}{B}\textstyle\sum_{i\in S}
        \big(\nabla\log p(x_i\mid\theta) - g_i\big) + \sum_n g_n,\qquad
        \theta \leftarrow \theta + \tfrac{h}{2}\hat g + \mathcal N(0, hTI),

    then :math:`g_i \leftarrow \nabla\log p(x_i\mid\theta)` for the minibatch rows.

    The table of per-datum gradients lives on the device, ``N × D`` values (8 N D bytes in
    float64: 160 MB for N = 10⁶, D = 20). **Initialisation**: a full pass at the chain's
    initial point fills it (counted as one data pass in ``data_passes``); the paper's online
    fill, which starts from zeros, is not used because until every row has been visited its
    estimator is biased.

    Parameters
    ----------
    step_size
        ``"auto"`` (default): SGLD's bias rule without the gradient-noise term, which the
        estimator removes, ``ε = 4·target_bias / max_k h_kk`` (``h`` the potential's
        diagonal Hessian); a float or a schedule.
    target_bias, search_draws, temperature, batch_size, thin, ...
        As for :class:`pymc_sgmcmc.SGLD`.

    References
    ----------
    .. [1] Dubey, K. A., Reddi, S. J., Williamson, S. A., Póczos, B., Smola, A. J., Xing, E. P.
       (2016). Variance reduction in stochastic gradient Langevin dynamics. NeurIPS.
    """

    name = "sagald"

    def _make_init(self, fns, kernel_init):
        import jax
        import jax.numpy as jnp

        n, b = self.problem.data_size, self.batch_size
        starts, _ = full_data_chunks(n, b)
        per_example = fns["per_example_grads"]

        def init(position, data, fixed):
            # Chunks of B rows; the clamped last chunk rewrites rows with identical values.
            def fill(table, start):
                rows = tuple(jax.lax.dynamic_slice_in_dim(a, start, b, axis=0) for a in data)
                grads = per_example(position, fixed, rows)
                return jax.lax.dynamic_update_slice_in_dim(table, grads, start, axis=0), None

            table = jnp.zeros((n, position.shape[0]), dtype=position.dtype)
            table, _ = jax.lax.scan(fill, table, starts)
            return saga.init(position, table, batch_size=b)

        return init

    def _make_iteration(self, fns, kernel_step, data):
        import jax.numpy as jnp

        n = self.problem.data_size
        prior_grad = self._prior_grad(fns)
        per_example = fns["per_example_grads"]
        temperature = self.temperature

        def iteration(normal, state, batch, row_ids, next_row_ids, fixed, params):
            state, info = saga.step(
                None,
                state,
                lambda th: prior_grad(th, fixed),
                lambda th: per_example(th, fixed, batch),
                row_ids,
                n,
                self._step_size(params, state.iteration),
                temperature=temperature,
                normal=normal,
                next_rows=next_row_ids,
                preconditioner=params.get("precond_vr"),
            )
            return state, info, jnp.zeros_like(state.position)

        return iteration

    def _start_draw(self, state, first_row_ids):
        return saga.prefetch(state, first_row_ids)

    def _stored_rows(self, state, fixed, batch, idx):
        return state.table[idx]

    def _data_passes(self, iteration: int) -> float:
        if self.exact:
            return super()._data_passes(iteration)
        return 1.0 + float(iteration * self.batch_size / self.problem.data_size)


class SVRGLD(_VarianceReducedLD):
    r"""SVRG Langevin dynamics (Dubey et al. 2016, Algorithm 2).

    Every ``anchor_every`` iterations the position becomes the anchor and the full-data
    gradient is taken there (one pass); each iteration uses
    :math:`\nabla\log p(\theta) + \tfrac{N}{B}\sum_{i\in S}(\nabla\log p(x_i\mid\theta) -
    \nabla\log p(x_i\mid\tilde\theta)) + \sum_n \nabla\log p(x_n\mid\tilde\theta)`.
    Extra memory :math:`O(D)`.

    Parameters
    ----------
    anchor_every
        Iterations between anchors (default ``N/B``: one anchor pass per ``N/B`` steps, so
        that the anchor passes cost a third of the total).
    step_size, target_bias, search_draws, temperature, batch_size, thin, ...
        As for :class:`~pymc_sgmcmc.SAGALD`.

    References
    ----------
    .. [1] Dubey et al. (2016), Algorithm 2.
    """

    name = "svrgld"
    _stored_rows_dense = False  # the anchor's rows, by forward mode: no table

    def __init__(self, vars: Any = None, *, anchor_every: int | None = None, **kwargs: Any) -> None:
        super().__init__(vars, **kwargs)
        if anchor_every is None:
            anchor_every = -(-self.problem.data_size // self.batch_size)
        if int(anchor_every) != anchor_every or anchor_every < 1:
            raise ValueError(f"anchor_every must be a positive integer, got {anchor_every!r}.")
        self.anchor_every = int(anchor_every)

    def _make_init(self, fns, kernel_init):
        return lambda position, data, fixed: svrg.init(position)

    def _make_iteration(self, fns, kernel_step, data):
        import jax
        import jax.numpy as jnp

        n, b = self.problem.data_size, self.batch_size
        prior_grad = self._prior_grad(fns)
        loglik_rows = fns["loglik_rows"]
        full_data = full_data_gradient(loglik_rows, n, b)
        temperature, anchor_every = self.temperature, self.anchor_every

        def iteration(normal, state, batch, row_ids, next_row_ids, fixed, params):
            def batch_grad(th):
                return jax.grad(lambda t: jnp.sum(loglik_rows(t, fixed, batch)))(th)

            def full_grad(th):
                return full_data(th, fixed, data)

            state, info = svrg.step(
                None,
                state,
                lambda th: prior_grad(th, fixed),
                batch_grad,
                full_grad,
                n,
                b,
                self._step_size(params, state.iteration),
                anchor_every,
                temperature=temperature,
                normal=normal,
                preconditioner=params.get("precond_vr"),
            )
            return state, info, jnp.zeros_like(state.position)

        return iteration

    def _stored_rows(self, state, fixed, batch, idx):
        per_example = self.problem.jax_functions()["per_example_grads"]
        return per_example(state.anchor, fixed, batch)

    def _stored_along(self, state, fixed, batch, idx, tangents):
        import jax

        loglik_rows = self.problem.jax_functions()["loglik_rows"]

        def one(t):
            return jax.jvp(lambda th: loglik_rows(th, fixed, batch), (state.anchor,), (t,))[1]

        return jax.vmap(one)(tangents)

    def _data_passes(self, iteration: int) -> float:
        if self.exact:
            return super()._data_passes(iteration)
        anchors = -(-iteration // self.anchor_every)
        return float(2 * iteration * self.batch_size / self.problem.data_size + anchors)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "anchor_every": self.anchor_every}
