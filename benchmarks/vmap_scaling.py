"""What batching chains with ``jax.vmap`` saves per iteration on XLA's CPU backend (issue 6).

The goal "4 vectorised chains cost less than 2x one chain" leaves a 2-core machine little room:
with a per-chain cost that batching does not share, 4 chains on 2 cores cost at least 2x one
chain on one core. This script measures that per-chain cost where nothing else
is in the way — one hand-written logistic-regression SGLD loop, no PyMC, no host work, in a
process pinned to one CPU:

- the library's own minibatch read (:func:`pymc_sgmcmc.minibatch.take_minibatch` on
  :func:`~pymc_sgmcmc.minibatch.layout_data`'s layout: ``B/s`` random sub-blocks of ``s``
  rows, ``s`` from :func:`~pymc_sgmcmc.minibatch.block_rows`), then
  ``g = (N/B) X_bᵀ (y_b − σ(X_b θ)) − θ`` and ``θ ← θ + ε g + √(2ε) z`` (float64,
  D = 20, B = 256, one draw = 400 iterations in a ``lax.scan`` unrolled 4× — about one pass
  at N = 10⁵, and the same count at every N so that the per-draw work weighs the same —,
  indices and noise drawn before the scan as the library does);
- the same with one contiguous block of ``B`` rows (at a random offset) instead of the random
  sub-blocks: the arithmetic with a sequential read (the offsets are still drawn as for the
  sub-blocks, and only the first of each iteration's is used);
- at N = 2 000 (the laid-out data, 0.4 MB, fit in one core's 1 MiB L2), 10⁵ (17 MB: the
  32 MiB L3) and 10⁶ (168 MB: memory).

Each configuration compiles one chain (``draw``) and 4 chains (``jax.vmap(draw)``) and calls
them alternately ``--pairs`` times; the table gives the medians per iteration (for 4 chains:
per batched iteration of all 4) and the median and range of the pairs' ratios (not the ratio
of the two medians). 4x means batching saved nothing; the 2-core bound for 4 chains is then
(that ratio)/2 × one chain, before the second core's own slowdown (1.2–1.3x measured side by
side in ``vectorised.py``).

Run from the repository root::

    .venv/bin/python benchmarks/vmap_scaling.py            # appends to RESULTS.md
    .venv/bin/python benchmarks/vmap_scaling.py --out -    # prints only
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import time
from pathlib import Path

PINNED = None
if __name__ == "__main__" and hasattr(os, "sched_setaffinity"):
    # Before JAX (or NumPy's BLAS) starts a thread pool, which then sizes itself for one CPU.
    PINNED = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {PINNED})

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import REPO, append_section, git_state  # noqa: E402
from throughput import cpu_model  # noqa: E402

D, B, ITERATIONS, DRAWS_PER_CALL = 20, 256, 400, 10


def make_calls(n: int, read: str):
    """``{chains: (jitted call, initial positions)}`` for 1 and 4 chains of the loop."""
    import jax
    import jax.numpy as jnp

    from pymc_sgmcmc.minibatch import layout_data, minibatch_indices, take_minibatch

    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, D))
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ (0.3 * rng.normal(size=D))))).astype(np.float64)
    data = tuple(jnp.asarray(a) for a in layout_data([X, y], B, "blocks"))
    iterations = ITERATIONS
    eps = 0.1 / n

    def minibatch(rows):
        if read == "one block":
            return tuple(jax.lax.dynamic_slice_in_dim(a, rows[0], B) for a in data)
        return take_minibatch(rows, data, n, B, "blocks")

    def draw(key, theta):
        key_rows, key_noise = jax.random.split(key)
        rows = minibatch_indices(key_rows, n, B, "blocks", (iterations,))
        noise = jax.random.normal(key_noise, (iterations, D), dtype=theta.dtype)

        def body(theta, xs):
            xb, yb = minibatch(xs[0])
            g = (n / B) * ((yb - jax.nn.sigmoid(xb @ theta)) @ xb) - theta
            return theta + eps * g + np.sqrt(2 * eps) * xs[1], None

        return jax.lax.scan(body, theta, (rows, noise), unroll=4)[0]

    def repeat(one_draw, keys_of):
        def call(key, theta):
            def step(i, theta):
                return one_draw(keys_of(jax.random.fold_in(key, i)), theta)

            return jax.lax.fori_loop(0, DRAWS_PER_CALL, step, theta)

        return jax.jit(call)

    return {
        1: (repeat(draw, lambda k: k), jnp.zeros(D)),
        4: (repeat(jax.vmap(draw), lambda k: jax.random.split(k, 4)), jnp.zeros((4, D))),
    }, iterations


def measure(n: int, read: str, pairs: int) -> dict:
    import jax

    calls, iterations = make_calls(n, read)
    for call, theta in calls.values():  # compile
        call(jax.random.PRNGKey(0), theta).block_until_ready()
    times: dict[int, list[float]] = {1: [], 4: []}
    for p in range(pairs):
        for chains, (call, theta) in calls.items():
            t = time.perf_counter()
            call(jax.random.PRNGKey(p + 1), theta).block_until_ready()
            times[chains].append(time.perf_counter() - t)
    per_it = {c: np.asarray(v) / (DRAWS_PER_CALL * iterations) * 1e6 for c, v in times.items()}
    ratios = per_it[4] / per_it[1]
    return {
        "n": n,
        "read": read,
        "one": float(np.median(per_it[1])),
        "four": float(np.median(per_it[4])),
        "ratio": float(np.median(ratios)),
        "lo": float(ratios.min()),
        "hi": float(ratios.max()),
    }


def render(rows: list[dict], pairs: int) -> str:
    import jax

    from pymc_sgmcmc.minibatch import block_rows

    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    where = "one CPU" if PINNED is not None else "NOT pinned (no sched_setaffinity)"
    lines = [
        f"### {stamp}: {where}, D = {D}, B = {B}, float64, paired medians of {pairs}",
        "",
        f"- git: {git_state()}; machine: {cpu_model()}, {platform.platform()}, jax "
        f"{jax.__version__}" + (f", pinned to CPU {PINNED}" if PINNED is not None else ""),
        "",
        "| N | data | read | s | 1 chain (µs/iteration) | 4 vmapped chains (µs/iteration) "
        "| ratio, median | ratio, range |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mb = (r["n"] + B - 1) * (D + 1) * 8 / 1e6  # X and y as laid out
        s = block_rows(r["n"], B) if r["read"] == "sub-blocks" else B
        lines.append(
            f"| {r['n']:,} | {mb:.1f} MB | {r['read']} | {s} | {r['one']:.2f} | {r['four']:.2f} "
            f"| {r['ratio']:.2f}x | {r['lo']:.2f}–{r['hi']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2000,100000,1000000")
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "RESULTS.md"), help="'-' prints")
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)
    rows = []
    for n in (int(v) for v in args.sizes.split(",")):
        for read in ("sub-blocks", "one block"):
            rows.append(measure(n, read, args.pairs))
            print(rows[-1], flush=True)
    section = render(rows, args.pairs)
    print(section)
    if args.out != "-":
        append_section(
            Path(args.out),
            section,
            "## Vectorised chains: what vmap saves per iteration (issue 6)",
            "`benchmarks/vmap_scaling.py`: a hand-written logistic SGLD loop with the library's "
            "minibatch reads, 1 chain against 4 vmapped chains, pinned to one CPU (see the "
            "script's docstring). The 4-chain column is µs per batched iteration (all 4 "
            "chains); the ratio is the median of the pairs' ratios, not the ratio of the two "
            "medians. A ratio of 4x means batching saved nothing.",
        )
    return rows


if __name__ == "__main__":
    main()
