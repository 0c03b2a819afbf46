"""SGLD throughput on a large logistic regression (issue 2).

One run generates one data set (``N`` rows, ``D`` standard-normal features, float64, labels
from a logistic model) and one PyMC model::

    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=D)
        pm.Bernoulli("y", logit_p=X @ beta, observed=y)

and measures, on that same data, for every batch size ``B``:

full gradient (bridge)
    Seconds for one full-data gradient of the log-posterior, built from the package's own
    bridge: ``jax.jit(jax.grad(θ ↦ logprior(θ) + Σ_rows loglik_rows(θ, data)))`` with
    ``f = pymc_sgmcmc.build_problem(model).jax_functions()``. The goal of issue 2 is one data
    pass of SGLD in at most 2× this time.
full gradient (hand-written)
    The same gradient with the log-density written by hand in ``jax.numpy``
    (``Σ y·η − softplus(η)`` plus the N(0, 1) prior, ``softplus`` with derivative ``σ``).
    Separates the cost of the graph that PyTensor's JAX backend emits from the cost of the
    data pass itself.
bare JAX loop
    The floor: a hand-written, jitted ``lax.scan`` of ``ceil(N/B)`` SGLD iterations (one
    pass) on the hand-written log-density, minibatches read as contiguous blocks
    (``lax.dynamic_slice`` at a uniform offset into a once-shuffled copy of the data padded
    with its first ``B − 1`` rows), no statistics. Seconds per pass.
bare loop, bridge log-density
    The same loop with the gradient from the bridge's ``logdensity_and_grad`` instead of the
    hand-written one: the difference to the bare loop is the cost of the graph PyTensor
    generates, inside the loop.
bare loop + loss stats (hand-written / bridge density)
    The same two loops, but also computing the minibatch log-density value and the gradient
    norm at every iteration and averaging them, which is what the step method's draw does for
    its ``minibatch_loss`` and ``grad_norm`` statistics. The value needs the transcendentals
    (``exp``, ``log1p``) that the gradient alone does not; the difference to the compiled
    draw below is the rest of the step method's bookkeeping (key splits, finiteness checks).
bare loop, ``B/s`` blocks of ``s`` rows
    Since the package's ``"blocks"`` scheme reads a minibatch as ``B/s`` contiguous
    sub-blocks of ``s`` rows at independent offsets (``pymc_sgmcmc.minibatch.block_rows``;
    ``s`` is printed), the hand-written loop and the bridge-density-plus-stats loop are also
    timed with that layout. The latter does what the step method's compiled draw does, so the
    two should be close.
pmsg SGLD, ``step.step``
    ``pmsg.SGLD(batch_size=B, step_size=1e-6)`` (``thin = ceil(N/B)``, one pass per draw):
    seconds per call of ``step.step(point)`` after one warm-up call that compiles; this is
    what ``pm.sample`` pays per draw apart from its own bookkeeping.
pmsg SGLD, compiled draw
    The jitted draw alone, ``c["draw"](key, state, c["data"], (), step._params(0))`` with
    ``c = step._compile()`` and ``block_until_ready``: the compute part of ``step.step``,
    without the Python work around it (parameter lookup, stats to host, unravel).
``minibatch="random"``
    The same two timings with uniform indices drawn with replacement and gathered.
thin=1 rows (per-draw overhead)
    With ``pmsg.SGLD(batch_size=B, step_size=1e-6, thin=1)`` one draw is one iteration, so
    fixed per-draw costs dominate: the compiled one-iteration draw (mean of ``100 · calls``
    back-to-back calls, dispatch included), ``step.step``, and ``pm.sample(draws=S, tune=0, chains=1, cores=1, ...)`` divided by
    ``S``. "pm.sample overhead per draw" is ``(T_sample(S) − S · t_draw) / S``, which still
    contains ``pm.sample``'s fixed start-up and ``InferenceData`` conversion spread over the
    ``S`` draws; the "marginal" variant is ``(T_sample(5S) − T_sample(S)) / (4S) − t_draw``,
    which cancels the fixed part.

Every time is the best (minimum) over ``--repeats`` repeats of the mean over ``--calls``
calls, after a warm-up call that compiles, with ``jax.block_until_ready`` on results.

Run from the repository root::

    .venv/bin/python benchmarks/throughput.py --n 100000          # quick check
    .venv/bin/python benchmarks/throughput.py                     # N = 1e6, appends to RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import logging
import math
import os
import platform
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)  # float64 data, as PyMC's default floatX

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pymc as pm  # noqa: E402
from _report import append_section, git_state  # noqa: E402  (benchmarks/ is on sys.path)

import pymc_sgmcmc as pmsg  # noqa: E402

HEADING = "## SGLD throughput (issue 2)"
STEP_SIZE = 1e-6
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


def best_time(fn: Callable[[], Any], repeats: int, calls: int = 1) -> float:
    """Min over ``repeats`` of the mean seconds of ``calls`` calls of ``fn`` (blocked)."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def warm_up(fn: Callable[[], Any]) -> float:
    """Run ``fn`` once (compilation) and return its wall time."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------
# Data and model
# ---------------------------------------------------------------------------------------


def make_data(n: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``X ~ N(0, 1)^{n×d}`` and ``y ~ Bernoulli(σ(X β*))`` with ``β* ~ N(0, 0.5²)``."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    beta_true = 0.5 * rng.standard_normal(d)
    y = rng.binomial(1, 1.0 / (1.0 + np.exp(-(X @ beta_true))))
    return X, y


def make_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 1, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=X @ beta, observed=y)
    return model


def hand_logprior(theta: jax.Array) -> jax.Array:
    return jnp.sum(-0.5 * theta**2) - 0.5 * theta.shape[0] * jnp.log(2 * jnp.pi)


@jax.custom_jvp
def softplus(x: jax.Array) -> jax.Array:
    """``log(1 + eˣ)``, with derivative ``σ(x)`` so a gradient alone needs no ``log1p``.

    (``jnp.logaddexp``'s own derivative is written through its output, which keeps the
    primal ``exp``/``log1p`` alive in a gradient-only program.)
    """
    return jnp.logaddexp(0.0, x)


@softplus.defjvp
def _softplus_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[Any, Any]:
    (x,), (t,) = primals, tangents
    return softplus(x), jax.nn.sigmoid(x) * t


def hand_loglik_rows(theta: jax.Array, X: jax.Array, y: jax.Array) -> jax.Array:
    """Bernoulli-logit log-likelihood of each row, ``y η − log(1 + e^η)`` with ``η = X θ``."""
    eta = X @ theta
    return y * eta - softplus(eta)


def check_same_density(problem: pmsg.MinibatchProblem, X: jax.Array, y: jax.Array) -> None:
    """The hand-written log-density must equal the bridge's (else the comparison is moot)."""
    f = problem.jax_functions()
    theta = jnp.asarray(np.random.default_rng(1).normal(0, 0.3, problem.dim))
    rows = slice(0, min(1000, X.shape[0]))
    bridge = f["logprior"](theta, ()) + f["loglik_rows"](theta, (), (X[rows], y[rows])).sum()
    hand = hand_logprior(theta) + hand_loglik_rows(theta, X[rows], y[rows]).sum()
    if not np.allclose(float(bridge), float(hand), rtol=1e-10):
        raise AssertionError(f"bridge log-density {float(bridge)} != hand-written {float(hand)}")


# ---------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------


def time_full_gradient(problem: pmsg.MinibatchProblem, repeats: int, calls: int) -> float:
    """One full-data gradient of the log-posterior through the bridge (seconds)."""
    f = problem.jax_functions()
    data = tuple(jnp.asarray(a) for a in problem.data)
    grad = jax.jit(
        jax.grad(lambda th: f["logprior"](th, ()) + f["loglik_rows"](th, (), data).sum())
    )
    theta = jnp.zeros(problem.dim)
    warm_up(lambda: grad(theta))
    return best_time(lambda: grad(theta), repeats, calls)


def time_full_gradient_by_hand(X: jax.Array, y: jax.Array, repeats: int, calls: int) -> float:
    """One full-data gradient of the hand-written log-posterior (seconds).

    The data are arguments of the jitted function (the bridge timing above closes over them
    as the issue specifies, which lets XLA constant-fold ``Xᵀy`` at compile time).
    """

    def logpost(th: jax.Array, X: jax.Array, y: jax.Array) -> jax.Array:
        return hand_logprior(th) + hand_loglik_rows(th, X, y).sum()

    grad = jax.jit(jax.grad(logpost))
    theta = jnp.zeros(X.shape[1])
    warm_up(lambda: grad(theta, X, y))
    return best_time(lambda: grad(theta, X, y), repeats, calls)


GradFn = Callable[[jax.Array, jax.Array, jax.Array], Any]


def block_layout(X: np.ndarray, y: np.ndarray, b: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """Shuffle the rows once and pad with the first ``b − 1`` shuffled rows."""
    perm = np.random.default_rng(seed).permutation(X.shape[0])
    Xs, ys = X[perm], y[perm]
    return (
        jnp.asarray(np.concatenate([Xs, Xs[: b - 1]])),
        jnp.asarray(np.concatenate([ys, ys[: b - 1]])),
    )


def read_block(a: jax.Array, starts: jax.Array, rows: int) -> jax.Array:
    """Rows ``starts[i] : starts[i] + rows`` of ``a`` for every ``i``, concatenated."""
    if starts.shape[0] == 1:
        return jax.lax.dynamic_slice_in_dim(a, starts[0], rows)
    blocks = jax.vmap(lambda st: jax.lax.dynamic_slice_in_dim(a, st, rows))(starts)
    return blocks.reshape((-1, *a.shape[1:]))


def make_bare_pass(
    n: int, b: int, grad_fn: GradFn, with_stats: bool = False, sub_block: int | None = None
) -> Callable[..., Any]:
    """Jitted ``(key, θ, X_padded, y_padded) -> θ`` after ``ceil(n/b)`` SGLD iterations.

    ``grad_fn(θ, X_batch, y_batch)`` returns the gradient, or with ``with_stats`` the pair
    ``(log-density, gradient)``; the loss and gradient norm are then stacked per iteration
    and averaged, as the step method does for its ``minibatch_loss`` / ``grad_norm`` stats.
    A minibatch is one contiguous block of ``b`` rows, or ``b / sub_block`` blocks of
    ``sub_block`` rows at independent offsets.
    """
    iterations = math.ceil(n / b)
    rows = b if sub_block is None else sub_block
    if b % rows:
        raise ValueError(f"sub_block={rows} must divide the batch size {b}")

    @jax.jit
    def one_pass(key: jax.Array, theta: jax.Array, Xp: jax.Array, yp: jax.Array) -> Any:
        def body(theta: jax.Array, key: jax.Array) -> tuple[jax.Array, Any]:
            key_batch, key_noise = jax.random.split(key)
            starts = jax.random.randint(key_batch, (b // rows,), 0, n)
            xb, yb = read_block(Xp, starts, rows), read_block(yp, starts, rows)
            if with_stats:
                value, g = grad_fn(theta, xb, yb)
                stats = (-value, jnp.linalg.norm(g))
            else:
                g, stats = grad_fn(theta, xb, yb), None
            noise = jax.random.normal(key_noise, theta.shape, theta.dtype)
            return theta + 0.5 * STEP_SIZE * g + math.sqrt(STEP_SIZE) * noise, stats

        theta, stats = jax.lax.scan(body, theta, jax.random.split(key, iterations))
        return theta if stats is None else (theta, jnp.mean(stats[0]), jnp.mean(stats[1]))

    return one_pass


def time_bare_loop(
    Xp: jax.Array,
    yp: jax.Array,
    n: int,
    b: int,
    grad_fn: GradFn,
    repeats: int,
    calls: int,
    with_stats: bool = False,
    sub_block: int | None = None,
) -> float:
    """Seconds per data pass of the hand-written SGLD scan."""
    one_pass = make_bare_pass(n, b, grad_fn, with_stats, sub_block)
    key, theta = jax.random.PRNGKey(0), jnp.zeros(Xp.shape[1])
    warm_up(lambda: one_pass(key, theta, Xp, yp))
    return best_time(lambda: one_pass(key, theta, Xp, yp), repeats, calls)


def package_sub_block(n: int, b: int) -> int | None:
    """Rows per contiguous read of pmsg's ``"blocks"`` minibatches (None: one block of B)."""
    from pymc_sgmcmc import minibatch

    block_rows = getattr(minibatch, "block_rows", None)
    return None if block_rows is None else int(block_rows(n, b))


def hand_logdensity(n: int, b: int) -> GradFn:
    """The hand-written minibatch estimate ``logprior + (n/b) Σ loglik`` of the log-posterior."""

    def logdensity(theta: jax.Array, xb: jax.Array, yb: jax.Array) -> jax.Array:
        return hand_logprior(theta) + (n / b) * jnp.sum(hand_loglik_rows(theta, xb, yb))

    return logdensity


def bridge_grad(problem: pmsg.MinibatchProblem, with_value: bool = False) -> GradFn:
    """Gradient (or, ``with_value``, value and gradient) of the same estimate from the bridge."""
    f = problem.jax_functions()

    def grad(theta: jax.Array, xb: jax.Array, yb: jax.Array) -> Any:
        value, g = f["logdensity_and_grad"](theta, (), (xb, yb))
        return (value, g) if with_value else g

    return grad


@dataclass
class StepTiming:
    """Seconds per draw of a step method: ``step.step`` and the compiled draw alone."""

    step: float
    kernel: float
    compile_s: float
    thin: int


def new_sgld(model: pm.Model, b: int, **kwargs: Any) -> pmsg.SGLD:
    with model:
        step = pmsg.SGLD(batch_size=b, step_size=STEP_SIZE, **kwargs)
    step.set_rng(np.random.default_rng(0))
    return step


def time_step_method(
    step: pmsg.SGLD, point: dict[str, np.ndarray], repeats: int, calls: int
) -> StepTiming:
    """Per-draw seconds of ``step.step(point)`` and of the compiled ``draw`` it calls."""
    compile_s = warm_up(lambda: step.step(point)[0])
    t_step = best_time(lambda: step.step(point)[0], repeats, calls)

    c = step._compile()
    params = step._params(0)

    def kernel_call() -> Any:
        key, state = step.chain_state
        out = c["draw"](key, state, c["data"], (), params)  # (key, state, [...,] stats)
        step.chain_state = (out[0], out[1])
        return out

    kernel_call()
    t_kernel = best_time(kernel_call, repeats, calls)
    return StepTiming(step=t_step, kernel=t_kernel, compile_s=compile_s, thin=step.thin)


@dataclass
class SampleOverhead:
    """Per-draw costs of a ``thin=1`` SGLD, in seconds."""

    kernel: float
    step: float
    sample_per_draw: float
    sample_marginal: float
    draws: int
    sample_total: float = field(default=math.nan)

    @property
    def overhead(self) -> float:
        return self.sample_per_draw - self.kernel

    @property
    def marginal_overhead(self) -> float:
        return self.sample_marginal - self.kernel


def time_sample_overhead(
    model: pm.Model, b: int, draws: int, repeats: int, calls: int
) -> SampleOverhead:
    """``pm.sample`` with one iteration per draw against the compiled one-iteration draw."""
    step = new_sgld(model, b, thin=1)
    point = model.initial_point()
    timing = time_step_method(step, point, repeats, calls * 100)

    def sample(n_draws: int) -> float:
        start = time.perf_counter()
        with model:
            pm.sample(
                draws=n_draws,
                tune=0,
                chains=1,
                cores=1,
                step=step,
                progressbar=False,
                compute_convergence_checks=False,
                random_seed=0,
            )
        return time.perf_counter() - start

    sample(5)  # warm-up (the draw is already compiled; PyMC's own functions are not)
    t_short = min(sample(draws) for _ in range(repeats))
    t_long = min(sample(5 * draws) for _ in range(repeats))
    return SampleOverhead(
        kernel=timing.kernel,
        step=timing.step,
        sample_per_draw=t_short / draws,
        sample_marginal=(t_long - t_short) / (4 * draws),
        draws=draws,
        sample_total=t_short,
    )


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


@dataclass
class Results:
    n: int
    d: int
    batch_sizes: list[int]
    full_grad: float = math.nan
    full_grad_hand: float = math.nan
    bare: dict[int, float] = field(default_factory=dict)
    bare_bridge: dict[int, float] = field(default_factory=dict)
    bare_stats: dict[int, float] = field(default_factory=dict)
    bare_bridge_stats: dict[int, float] = field(default_factory=dict)
    sub_block: dict[int, int | None] = field(default_factory=dict)
    bare_sub: dict[int, float] = field(default_factory=dict)
    bare_bridge_stats_sub: dict[int, float] = field(default_factory=dict)
    blocks: dict[int, StepTiming] = field(default_factory=dict)
    random: dict[int, StepTiming] = field(default_factory=dict)
    overhead: dict[int, SampleOverhead] = field(default_factory=dict)


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def system_busy_seconds() -> float:
    """CPU-seconds spent busy by the whole machine since boot (``/proc/stat``; NaN elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class ContentionMeter:
    """CPU used by *other* processes while this one runs: machine busy time minus our own.

    Timings on a shared machine are only comparable when this is near zero.
    """

    def __init__(self) -> None:
        self.busy0, self.own0, self.wall0 = (
            system_busy_seconds(),
            time.process_time(),
            time.perf_counter(),
        )

    def other_cores(self) -> float:
        """Mean number of cores other processes kept busy since construction."""
        busy = system_busy_seconds() - self.busy0
        own = time.process_time() - self.own0
        return max(busy - own, 0.0) / (time.perf_counter() - self.wall0)


def machine_info() -> dict[str, str]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu count": f"{os.cpu_count()} (usable: {affinity})",
        "python": platform.python_version(),
        "jax / jaxlib": f"{jax.__version__} / {_package_version('jaxlib')}",
        "jax devices": ", ".join(str(d) for d in jax.devices()),
        "pymc / pytensor": f"{pm.__version__} / {_package_version('pytensor')}",
        "numpy": np.__version__,
        "pymc_sgmcmc": f"{pmsg.__version__} (git {git_state()})",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "(unset)"),
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _s(x: float) -> str:
    return f"{x:.4f}" if x < 10 else f"{x:.2f}"


def _ms(x: float) -> str:
    return f"{1e3 * x:.3f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×"


def render_table(r: Results) -> str:
    bs = r.batch_sizes
    header = "| quantity | " + " | ".join(f"B = {b}" for b in bs) + " |"
    rule = "|---|" + "---:|" * len(bs)
    rows: list[tuple[str, list[str]]] = [
        ("iterations per pass, ceil(N/B)", [str(math.ceil(r.n / b)) for b in bs]),
        ("full-data gradient, bridge (s)", [_s(r.full_grad)] * len(bs)),
        ("full-data gradient, hand-written jnp (s)", [_s(r.full_grad_hand)] * len(bs)),
        ("bare JAX SGLD loop, hand-written density (s / pass)", [_s(r.bare[b]) for b in bs]),
        ("bare JAX SGLD loop, bridge density (s / pass)", [_s(r.bare_bridge[b]) for b in bs]),
        (
            "bare loop + loss/grad-norm stats, hand-written density (s / pass)",
            [_s(r.bare_stats[b]) for b in bs],
        ),
        (
            "bare loop + loss/grad-norm stats, bridge density (s / pass)",
            [_s(r.bare_bridge_stats[b]) for b in bs],
        ),
        (
            'pmsg `"blocks"` rows per contiguous read, s',
            [str(r.sub_block[b] or b) for b in bs],
        ),
        (
            "bare loop, hand-written density, B/s blocks of s rows (s / pass)",
            [_s(r.bare_sub[b]) for b in bs],
        ),
        (
            "bare loop + stats, bridge density, B/s blocks of s rows (s / pass)",
            [_s(r.bare_bridge_stats_sub[b]) for b in bs],
        ),
        ("pmsg SGLD blocks, `step.step` (s / pass)", [_s(r.blocks[b].step) for b in bs]),
        ("pmsg SGLD blocks, compiled draw only (s / pass)", [_s(r.blocks[b].kernel) for b in bs]),
        ("pmsg SGLD random, `step.step` (s / pass)", [_s(r.random[b].step) for b in bs]),
        ("pmsg SGLD random, compiled draw only (s / pass)", [_s(r.random[b].kernel) for b in bs]),
        (
            "**pmsg blocks per pass / full gradient** (goal ≤ 2×)",
            [_ratio(r.blocks[b].step, r.full_grad) for b in bs],
        ),
        ("pmsg blocks per pass / bare loop", [_ratio(r.blocks[b].step, r.bare[b]) for b in bs]),
        (
            "pmsg blocks compiled draw / bare loop + stats, bridge density, s-row blocks",
            [_ratio(r.blocks[b].kernel, r.bare_bridge_stats_sub[b]) for b in bs],
        ),
        ("bare loop / full gradient", [_ratio(r.bare[b], r.full_grad) for b in bs]),
        ("pmsg random / pmsg blocks", [_ratio(r.random[b].step, r.blocks[b].step) for b in bs]),
        (
            "µs per iteration: bare loop",
            [f"{1e6 * r.bare[b] / math.ceil(r.n / b):.1f}" for b in bs],
        ),
        (
            "µs per iteration: pmsg blocks compiled draw",
            [f"{1e6 * r.blocks[b].kernel / math.ceil(r.n / b):.1f}" for b in bs],
        ),
        ("first `step.step` incl. compile (s)", [_s(r.blocks[b].compile_s) for b in bs]),
        ("thin=1: compiled one-iteration draw (ms)", [_ms(r.overhead[b].kernel) for b in bs]),
        ("thin=1: `step.step` (ms / draw)", [_ms(r.overhead[b].step) for b in bs]),
        (
            f"thin=1: `pm.sample` {r.overhead[bs[0]].draws} draws, total (ms / draw)",
            [_ms(r.overhead[b].sample_per_draw) for b in bs],
        ),
        (
            "thin=1: **`pm.sample` overhead per draw** (total − compiled draw) (ms)",
            [_ms(r.overhead[b].overhead) for b in bs],
        ),
        (
            "thin=1: `pm.sample` marginal overhead per draw (ms)",
            [_ms(r.overhead[b].marginal_overhead) for b in bs],
        ),
    ]
    lines = [header, rule] + [f"| {name} | " + " | ".join(vals) + " |" for name, vals in rows]
    return "\n".join(lines)


def render_section(r: Results, command: str, info: dict[str, str], elapsed: float) -> str:
    date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    return (
        f"### N = {r.n:,}, D = {r.d}, float64 — {date}\n\n"
        f"Command: `{command}` (wall time {elapsed / 60:.1f} min)\n\n"
        f"{machine}\n\n"
        f"{render_table(r)}\n"
    )


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="rows N (default 1e6)")
    p.add_argument("--d", type=int, default=20, help="features D (default 20)")
    p.add_argument("--batch-sizes", default="100,1000", help="comma-separated B (default 100,1000)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many repeats (default 3)")
    p.add_argument("--calls", type=int, default=3, help="calls averaged per repeat (default 3)")
    p.add_argument(
        "--sample-draws", type=int, default=200, help="pm.sample draws, thin=1 (default 200)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "RESULTS.md"),
        help="markdown file whose '## SGLD throughput (issue 2)' section gets this run "
        "appended (default benchmarks/RESULTS.md); '-' only prints",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Results:
    args = parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    logging.getLogger("pymc").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    contention = ContentionMeter()
    info = machine_info()
    for k, v in info.items():
        log(f"{k}: {v}")

    n, d = args.n, args.d
    X_np, y_np = make_data(n, d, args.seed)
    model = make_model(X_np, y_np)
    problem = pmsg.build_problem(model)
    assert problem.data_size == n and problem.dim == d
    X, y = (jnp.asarray(a) for a in problem.data)  # the bridge's data order: (X, y)
    check_same_density(problem, X, y)
    r = Results(n=n, d=d, batch_sizes=batch_sizes)

    log("full-data gradient (bridge, hand-written)")
    r.full_grad = time_full_gradient(problem, args.repeats, args.calls)
    r.full_grad_hand = time_full_gradient_by_hand(X, y, args.repeats, args.calls)
    log(f"  bridge {r.full_grad:.4f} s, hand-written {r.full_grad_hand:.4f} s")
    del X, y

    point = model.initial_point()
    for b in batch_sizes:
        Xp, yp = block_layout(*problem.data, b, args.seed)
        log(f"B={b}: bare loop")
        timing = (args.repeats, args.calls)
        r.bare[b] = time_bare_loop(Xp, yp, n, b, jax.grad(hand_logdensity(n, b)), *timing)
        r.bare_bridge[b] = time_bare_loop(Xp, yp, n, b, bridge_grad(problem), *timing)
        r.bare_stats[b] = time_bare_loop(
            Xp, yp, n, b, jax.value_and_grad(hand_logdensity(n, b)), *timing, with_stats=True
        )
        r.bare_bridge_stats[b] = time_bare_loop(
            Xp, yp, n, b, bridge_grad(problem, with_value=True), *timing, with_stats=True
        )
        log(
            f"  s/pass: hand-written {r.bare[b]:.4f}, bridge density {r.bare_bridge[b]:.4f}; "
            f"with loss stats {r.bare_stats[b]:.4f} / {r.bare_bridge_stats[b]:.4f}"
        )
        r.sub_block[b] = sub = package_sub_block(n, b)
        if sub is None or sub == b:
            r.bare_sub[b], r.bare_bridge_stats_sub[b] = r.bare[b], r.bare_bridge_stats[b]
        else:
            r.bare_sub[b] = time_bare_loop(
                Xp, yp, n, b, jax.grad(hand_logdensity(n, b)), *timing, sub_block=sub
            )
            r.bare_bridge_stats_sub[b] = time_bare_loop(
                Xp,
                yp,
                n,
                b,
                bridge_grad(problem, with_value=True),
                *timing,
                with_stats=True,
                sub_block=sub,
            )
            log(
                f"  {b // sub} blocks of {sub} rows: hand-written {r.bare_sub[b]:.4f}, "
                f"bridge density + stats {r.bare_bridge_stats_sub[b]:.4f}"
            )
        del Xp, yp

        for scheme, store in (("blocks", r.blocks), ("random", r.random)):
            log(f"B={b}: pmsg SGLD minibatch={scheme!r}")
            step = new_sgld(model, b, minibatch=scheme)
            store[b] = time_step_method(step, point, args.repeats, args.calls)
            log(
                f"  step.step {store[b].step:.4f} s/pass, compiled draw {store[b].kernel:.4f} s/pass"
            )
            del step
            gc.collect()

        log(f"B={b}: thin=1, pm.sample({args.sample_draws} and {5 * args.sample_draws} draws)")
        r.overhead[b] = time_sample_overhead(model, b, args.sample_draws, args.repeats, args.calls)
        o = r.overhead[b]
        log(
            f"  draw {1e3 * o.kernel:.3f} ms, step {1e3 * o.step:.3f} ms, sample {1e3 * o.sample_per_draw:.3f} ms/draw"
        )
        gc.collect()

    elapsed = time.perf_counter() - t0
    info["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    others = contention.other_cores()
    info["CPU used by other processes during the run"] = f"{others:.2f} cores on average" + (
        " — TIMINGS CONTAMINATED, rerun on an idle machine" if others > 0.1 else ""
    )
    if others > 0.1:
        log(f"WARNING: other processes used {others:.2f} cores on average during the run")
    argv_used = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "benchmarks/throughput.py", *argv_used])
    section = render_section(r, command, info, elapsed)
    print(section)
    if args.out != "-":
        append_section(
            Path(args.out),
            section,
            HEADING,
            "See `benchmarks/throughput.py` for what each row measures.",
        )
        log(f"appended to {args.out}")
    return r


if __name__ == "__main__":
    main()
