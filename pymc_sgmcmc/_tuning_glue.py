"""The steps' automatic tuning on the host: measure (the compiled functions of
:mod:`pymc_sgmcmc.tuning.measurements`), hand the measurements to the tuner
(:mod:`pymc_sgmcmc.tuning.tuner`), apply what it returns; the search for the mode before it;
and the exact MALA kernel's parts used on a full batch.

Mixins of :class:`pymc_sgmcmc.adapter.step.SGMCMCStep` (they read the step's problem, compiled
functions and chain state), kept apart so that the step's module holds the draw loop.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from pymc_sgmcmc.diagnostics import NoStructureWarning
from pymc_sgmcmc.draws import full_data_logdensity
from pymc_sgmcmc.kernels import mala
from pymc_sgmcmc.kernels.preconditioning import apply_to_rows, as_parameter
from pymc_sgmcmc.minibatch import full_data_chunks, noise_factor
from pymc_sgmcmc.tuning.adaptation import StepSizeAdaptation, initial_mala_step
from pymc_sgmcmc.tuning.measurements import NOISE_CHUNK_WORK
from pymc_sgmcmc.tuning.rates import Rates
from pymc_sgmcmc.tuning.structure import (
    VERIFY_TOLERANCE,
    GroupStructure,
    StructuredCurvature,
    StructuredWhitening,
    find_groups,
    verify,
)
from pymc_sgmcmc.tuning.tuner import Measurement, Tuned, Tuner
from pymc_sgmcmc.tuning.whitening import DENSE_MAX_DIM, Whitening

# The chains of pmsg.sample's thread groups measure at the same time: a function built on
# first use is compiled under this lock, so the second chain finds it compiled (two first
# calls at once compiled it twice: 2 x 2.6 s for the row stiffness of a 4-D model).
FIRST_USE = threading.Lock()

__all__ = ["AutomaticTuning", "ExactMALA", "ModeSearch"]

SEARCH_TRUST = 1000.0  # the longest Newton step of the search, in posterior sds
SEARCH_LOG_STEP = 2.0  # ... and in the unconstrained value of a transformed variable
SEARCH_ITERATIONS = (
    100  # flat priors, x ~ 100 ± 15, N = 10⁶: 50 stopped at σ 0.57 (5.0); 100 reach it
)
ROW_POWER_ITERATIONS = 6  # per-row power iteration of the row stiffness (rank-1 rows: 1 is exact)


class AutomaticTuning:
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

    # -- automatic tuning: measure, then the tuner (pymc_sgmcmc.tuning.tuner) -----------------

    def _measure(self, state: Any, fixed: tuple, key: Any) -> Measurement:
        """Curvature and gradient noise at the chain's position, from one block of rows: the
        Hessian of the potential (dense, or its diagonal) and the covariance of the sampler's
        gradient estimate in θ units (``(N²/B)·f·C``, ``f`` the minibatch scheme's factor: 0
        with every row in every iteration; with devices or row shards the stratified
        ``Σ_d (N_d²/B_d)·f_d·C_d``, measured piece by piece)."""
        position = state.position
        dense = self.whitening_kind == "dense"
        structure = self._group_structure(state, fixed) if not dense else None
        if structure is not None:
            return self._measure_structured(state, fixed, key, structure)
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

    def _measure_structured(
        self, state: Any, fixed: tuple, key: Any, structure: GroupStructure
    ) -> Measurement:
        """:meth:`_measure` with the model's nested structure: the curvature's arrowhead on
        every row (``G + k`` Hessian-vector products) and the gradient noise's on the tuning
        block, so that the whitened noise each coordinate's step is tuned from holds the
        correlations between a global and the groups — along the globals' marginal direction
        the rows' noise largely cancels, which a diagonal of the noise misses by orders of
        magnitude (IASG's θ step on J = 2 000 random intercepts was then 25x too small)."""
        import jax.numpy as jnp

        position = state.position
        compiled = self._compile()
        h = self._structured_curvature(position, fixed, structure)
        noise_key = compiled["fold_in"](key, 1)
        moments = compiled["structured_noise"](
            noise_key,
            position,
            fixed,
            self._tuning_data(noise_key, self._search_rows),
            jnp.asarray(structure.probes(), dtype=self.problem.dtype),
            jnp.asarray(structure.id_probes(), dtype=self.problem.dtype),
            jnp.asarray(structure.local_idx),
            pairs=tuple(structure.pairs()),
        )
        c = StructuredCurvature(structure, *(np.asarray(m) for m in moments))
        n, b = self.problem.data_size, self.batch_size
        noise = c * (n**2 / b * noise_factor(n, b, self.minibatch))
        stability = self._relative_stiffness(
            position, fixed, key, StructuredWhitening.from_curvature(h).covariance()
        )
        if self._row_stiffness is None and not self.exact and self._every_row_in_memory:
            self._row_stiffness = self._measure_row_stiffness(state, fixed, h.diagonal())
        return Measurement(h, noise, c * n, stability, self._row_stiffness)

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

        compiled = self._compile()
        n, b = self.problem.data_size, self.batch_size
        factor = np.asarray(Whitening.from_curvature(curvature).factor(), dtype=self.problem.dtype)
        args = (state.position, fixed, tuple(a[:n] for a in compiled["data"]), factor)
        with FIRST_USE:  # built and compiled once; each chain's pass runs outside the lock
            fn = compiled.get("row_stiffness")
            if fn is None:
                fn = compiled["row_stiffness"] = jax.jit(self._row_stiffness_function(n))
            fn.lower(*args).compile()
        lam = float(fn(*args))
        return (n / b) * lam if np.isfinite(lam) else None

    def _row_stiffness_function(self, n: int) -> Callable:
        """``largest(position, fixed, data, factor)``: max over the rows of the power
        iteration's ``λmax(Lᵀ H_i L)``, ``L`` the whitening factor (dense or diagonal)."""
        import jax
        import jax.numpy as jnp

        dim = self.problem.dim
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

        return largest

    def _relative_stiffness(self, position: Any, fixed: tuple, key: Any, curvature: Any) -> float:
        """``λmax(A⁻¹ H)`` on a block of rows (power iteration on the device), ``A`` the
        whitening's curvature — ``curvature`` its diagonal ``(D,)``, or ``A⁻¹`` as a
        structured operator: how much stiffer the coupled curvature is than the whitening
        sees (it bounds the step)."""
        compiled = self._compile()
        key = compiled["fold_in"](key, 2)
        if isinstance(curvature, np.ndarray):
            precond = np.asarray(1.0 / np.maximum(curvature, 1e-300), dtype=self.problem.dtype)
        else:
            precond = curvature.astype(self.problem.dtype)
        radius = float(
            compiled["spectral_radius"](
                key, position, fixed, self._tuning_data(key), precond, self._tuning_local()
            )
        )
        return radius if np.isfinite(radius) and radius > 0 else 1.0

    # -- the model's structure (pymc_sgmcmc.tuning.structure) ----------------------------------

    def _structure_wanted(self) -> bool:
        """Whether to look for nested group structure: the default whitening above the dense
        one's dimension, without local variables, variational EM or rows off the host."""
        sharded = self.devices not in (None, 1, "chains")
        return (
            getattr(self, "_structured_auto", False)
            and self.hybrid is None
            and self._sampled_idx is None
            and not self.streaming
            and not sharded
            and not self.problem.row_local_names
        )

    def _group_structure(self, state: Any, fixed: tuple) -> GroupStructure | None:
        """The nested structure of the posterior's curvature, found once per step (under the
        first-use lock, shared by the chains) at the first measurement: the grouping of the
        rows (:func:`~pymc_sgmcmc.tuning.structure.find_groups`), then the arrowhead measured
        there checked against two Hessian-vector products of the model (a prior coupling
        groups would fail it). None where it is not wanted or not found (a
        :class:`NoStructureWarning` says why where group effects sit beside globals)."""
        if not self._structure_wanted():
            return None
        compiled = self._compile()
        with FIRST_USE:
            if "group_structure" not in compiled:
                found = self._find_structure(state.position, fixed)
                compiled["group_structure"] = found
                if isinstance(found, str):
                    if self._global_indices().size:
                        warnings.warn(
                            f"No nested group structure found ({found}): the "
                            f"{self.problem.dim} coordinates get a diagonal whitening, "
                            "which cannot follow the globals along their ridge with the "
                            "group effects; the self-check on the globals' marginal says "
                            "whether the draws are right.",
                            NoStructureWarning,
                            stacklevel=2,
                        )
        found = compiled["group_structure"]
        if isinstance(found, GroupStructure):
            self.whitening_kind = "structured"
            return found
        return None

    def _find_structure(self, position: Any, fixed: tuple) -> GroupStructure | str:
        """The nested structure at (near) ``position``, or why there is none."""
        import jax
        import jax.numpy as jnp

        compiled = self._compile()
        fns = self.problem.jax_functions()
        loglik_rows = fns["loglik_rows"]
        n, dtype = self.problem.data_size, self.problem.dtype
        rows = tuple(a[:n] for a in compiled["data"])
        rng = np.random.default_rng(0)
        # a generic point near the chain's (no row's derivative vanishes by symmetry)
        point = np.asarray(position, dtype=np.float64)
        point = point + 0.1 * rng.standard_normal(point.shape)

        @jax.jit
        def directional(position, tangent):
            return jax.jvp(lambda th: loglik_rows(th, fixed, rows), (position,), (tangent,))[1]

        variables, offset = [], 0
        for info in self.problem.var_infos:
            variables.append((info.name, tuple(info.shape), offset))
            offset += info.size
        found = find_groups(
            lambda t: directional(jnp.asarray(point, dtype), jnp.asarray(t, dtype)), variables
        )
        if isinstance(found, str):
            return found
        products = compiled.get("structured_products")
        if products is None:
            products = compiled["structured_products"] = self._structured_products_function()
        at = jnp.asarray(point, dtype)
        probes = jnp.asarray(found.probes(), dtype)
        curvature = found.curvature_from_products(np.asarray(products(at, fixed, probes)))
        error = verify(
            found,
            curvature,
            lambda v: np.asarray(products(at, fixed, jnp.asarray(v[None], dtype)))[0],
            rng,
        )
        if not error <= VERIFY_TOLERANCE * (1e3 if dtype == "float32" else 1.0):
            return (
                f"the groups of {found.description} couple beyond the rows' grouping "
                f"(a prior across groups): relative error {error:.1e}"
            )
        return found

    def _structured_products_function(self) -> Callable:
        """Jitted ``(position, fixed, probes (m, D)) -> (m, D)``: Hessian-vector products of
        the potential on every row (in chunks of the draw's minibatch)."""
        import jax

        compiled = self._compile()
        n, b = self.problem.data_size, self.batch_size
        logdensity = full_data_logdensity(self.problem.jax_functions(), n, b)
        data = compiled["data"]

        def products(position, fixed, probes):
            grad = jax.grad(lambda th: -logdensity(th, fixed, data))
            return jax.lax.map(lambda v: jax.jvp(grad, (position,), (v,))[1], probes)

        return jax.jit(products)

    def _structured_curvature(
        self, position: Any, fixed: tuple, structure: GroupStructure
    ) -> StructuredCurvature:
        """The arrowhead curvature of the potential at ``position``, on every row: ``G + k``
        Hessian-vector products."""
        import jax.numpy as jnp

        compiled = self._compile()
        dtype = self.problem.dtype
        probes = compiled.get("structure_probes")
        if probes is None:
            probes = compiled["structure_probes"] = jnp.asarray(structure.probes(), dtype)
        products = compiled["structured_products"](jnp.asarray(position, dtype), fixed, probes)
        return structure.curvature_from_products(np.asarray(products))

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
        found = (self._compiled or {}).get("group_structure")
        out: dict[str, Any] = {
            "whitening": self.whitening_kind,
            # the nested structure found (or why none was), where it was looked for
            **({"structure": getattr(found, "description", found)} if found is not None else {}),
            "whitened_step_size": tuned.step_size,
            "whitened_step_size_min": float(tuned.rates.steps.min()),
            "mala": bool(self.exact),
            **report,
        }
        return out

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
            noise_grows_with_step=self._noise_grows_with_step,
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


class ModeSearch:
    # -- the search for the mode -----------------------------------------------------------------

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


class ExactMALA:
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
        head = apply_to_rows(params["noise"], normals[:, :dim])
        return jnp.concatenate([head, normals[:, dim:]], axis=1)

    def _mala_params(self) -> dict[str, Any]:
        """The compiled MALA draw's parameters from the tuning in force."""
        dtype = self.problem.dtype
        tuned = self.tuned
        assert tuned is not None
        h = tuned.step_size
        whitening = tuned.whitening
        searching = tuned.searching
        inverse = whitening.precision() * (1.0 / h)
        noise = whitening.factor() * (0.0 if searching else np.sqrt(2.0 * h))
        return {
            "precond": as_parameter(tuned.preconditioner, dtype),
            "inverse_precond": as_parameter(inverse, dtype),
            "noise": as_parameter(noise, dtype),
            "adjust": np.asarray(0.0 if searching else 1.0, dtype=dtype),
            "step_size": np.asarray(h, dtype=dtype),
        }
