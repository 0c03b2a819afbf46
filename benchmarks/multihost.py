"""Several processes on JAX's CPU collectives: per-pass time and communication per iteration.

One machine with two cores cannot show scaling, only the overhead of going multi-process:
the same SGLD run (logistic regression, D = 10, batch B, fixed step size, one data pass per
draw) on

* 1 process: the ordinary single-device path, every row in memory (loaded from the files);
* 2 processes (``jax.distributed`` on localhost, one pinned per core): each memory-maps only
  its own shard file (rows ``0..N/2−1`` or ``N/2..N−1``, written beforehand: the out-of-core
  layout of a cluster) and passes it as ``pmsg.RowShard``; the minibatch gradient is
  all-reduced every iteration over TCP (gloo).

Per-pass time: the median gap between successive draws (``callback=`` timestamps; each draw
is one pass, ``thin = N/B`` iterations), after the compiling first draw. Communication: the
bytes on the loopback interface (``/proc/net/dev``) during the timed draws, per iteration
(both directions, both processes: everything gloo and the coordination service sent), next
to the all-reduce's payload, ``8·D`` bytes of float64 gradient per iteration.

    python benchmarks/multihost.py                  # N = 10⁶ and 10⁷, B = 1000 and 10 000
    python benchmarks/multihost.py --sizes 1e6 --out -   # print only

Writes the table and the scaling estimate into RESULTS.md (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pymc_sgmcmc.distributed import local_environment

ROOT = Path(__file__).resolve().parent.parent
D = 10

WORKER = r"""
import json, os, sys, time
import numpy as np
mode, data_dir, batch, draws = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import pymc as pm, pymc_sgmcmc as pmsg
if mode in ("dist", "allreduce"):
    pmsg.distributed.initialize()
me = pmsg.distributed.process_index()
os.sched_setaffinity(0, {me % os.cpu_count()})
if mode == "allreduce":
    # The all-reduce alone: a compiled loop of 1000 psums of D float64, nothing else.
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("data",))
    def body(c, _):
        out = jax.shard_map(lambda c: jax.lax.psum(c * 1.0001, "data"), mesh=mesh,
                            in_specs=P(), out_specs=P())(c)
        return out * 0.5, None
    f = jax.jit(lambda c: jax.lax.scan(body, c, None, length=1000)[0])
    c = jnp.ones(batch)
    f(c).block_until_ready()
    t = time.perf_counter(); f(c).block_until_ready()
    print("RESULT" + json.dumps({"allreduce_us": (time.perf_counter() - t) * 1e3}), flush=True)
    sys.exit(0)
if mode == "dist":
    X = np.load(f"{data_dir}/X_{me}.npy", mmap_mode="r")
    y = np.load(f"{data_dir}/y_{me}.npy", mmap_mode="r")
    start = int(np.load(f"{data_dir}/start_{me}.npy"))
else:
    X = np.concatenate([np.load(f"{data_dir}/X_{i}.npy") for i in (0, 1)])
    y = np.concatenate([np.load(f"{data_dir}/y_{i}.npy") for i in (0, 1)])

def lo_bytes():
    for line in open("/proc/net/dev"):
        if line.strip().startswith("lo:"):
            f = line.split(":")[1].split()
            return int(f[0]) + int(f[8])
    return 0

stamps = []
def cb(trace, draw):
    stamps.append((time.perf_counter(), lo_bytes()))

with pm.Model():
    Xd = pm.Data("X", np.asarray(X[:1000]))
    beta = pm.Normal("beta", 0, 1, shape=X.shape[1])
    pm.Bernoulli("y", logit_p=Xd @ beta, observed=pm.Data("y_obs", np.asarray(y[:1000])))
    data = (pmsg.RowShard({"X": X, "y_obs": y}, start=start) if mode == "dist"
            else {"X": X, "y_obs": y})
    step = pmsg.SGLD(step_size=1e-7, batch_size=batch, preconditioner=None, data=data)
    t0 = time.perf_counter()
    idata = pm.sample(step=step, draws=draws, tune=0, chains=1, random_seed=1,
                      progressbar=False, compute_convergence_checks=False, callback=cb)
times = np.array([s[0] for s in stamps]); nets = np.array([s[1] for s in stamps])
gaps = np.diff(times)
n = int(np.load(f"{data_dir}/n.npy"))
iters = -(-n // batch)
print("RESULT" + json.dumps({
    "process": me, "pass_s": float(np.median(gaps)), "gaps": gaps.tolist(),
    "lo_bytes_per_iter": float((nets[-1] - nets[0]) / (iters * (len(nets) - 1))),
    "first_draw_s": float(times[0] - t0),
    "mean": idata.posterior["beta"].mean(("chain", "draw")).values.tolist(),
}), flush=True)
"""


def write_data(n: int, directory: Path) -> None:
    rng = np.random.default_rng(0)
    half = n // 2
    beta = rng.normal(size=D) / np.sqrt(D)
    for i, (lo, hi) in enumerate([(0, half), (half, n)]):
        X = rng.normal(size=(hi - lo, D))
        y = (rng.random(hi - lo) < 1 / (1 + np.exp(-(X @ beta)))).astype(np.float64)
        np.save(directory / f"X_{i}.npy", X)
        np.save(directory / f"y_{i}.npy", y)
        np.save(directory / f"start_{i}.npy", np.int64(lo))
    np.save(directory / "n.npy", np.int64(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


def run(mode: str, directory: Path, batch: int, draws: int, worker: Path) -> list[dict]:
    """``one``: one process; ``dist`` / ``allreduce``: two jax.distributed processes."""
    cmd = [sys.executable, str(worker), mode, str(directory), str(batch), str(draws)]
    if mode == "one":
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return [result(out.stdout)]
    port = free_port()
    procs = []
    for pid in (0, 1):
        env = {**os.environ, **local_environment(pid, 2, port)}
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode:
            raise RuntimeError(stderr[-3000:])
        outs.append(result(stdout))
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1e6,1e7")
    parser.add_argument("--batches", default="1000,10000")
    parser.add_argument("--draws", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="re-render the table and estimate from benchmarks/results/multihost.json",
    )
    args = parser.parse_args()
    saved = ROOT / "benchmarks" / "results" / "multihost.json"
    if args.render_only:
        record = json.loads(saved.read_text())
        emit(render(record["rows"], record["wall_s"]), args.out)
        return
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        latency = max(r["allreduce_us"] for r in run("allreduce", Path(tmp), D, 0, worker))
        print(f"all-reduce of {D} float64 alone: {latency:.0f} µs", flush=True)
        for size in [int(float(s)) for s in args.sizes.split(",")]:
            directory = Path(tmp) / f"n{size}"
            directory.mkdir()
            write_data(size, directory)
            for batch in [int(b) for b in args.batches.split(",")]:
                one = run("one", directory, batch, args.draws, worker)[0]
                two = run("dist", directory, batch, args.draws, worker)
                iters = -(-size // batch)
                row = {
                    "N": size,
                    "B": batch,
                    "iters": iters,
                    "one_pass_s": one["pass_s"],
                    "two_pass_s": max(r["pass_s"] for r in two),
                    "lo_bytes_per_iter": two[0]["lo_bytes_per_iter"],
                    "payload": 8 * D,
                    "allreduce_us": latency,
                }
                row["one_iter_us"] = 1e6 * row["one_pass_s"] / iters
                row["two_iter_us"] = 1e6 * row["two_pass_s"] / iters
                rows.append(row)
                print(json.dumps(row), flush=True)
    wall = time.time() - started
    saved.write_text(json.dumps({"rows": rows, "wall_s": wall}, indent=1))
    emit(render(rows, wall), args.out)


def emit(text: str, out: str) -> None:
    if out == "-":
        print(text)
    else:
        with open(out, "a") as f:
            f.write("\n" + text)
        print(f"appended to {out}")


# The scaling estimate's networks: per-message latency of a small all-reduce step (µs) and
# bandwidth (bytes / µs). "as measured" is this machine's localhost all-reduce through JAX's
# CPU collectives, taken as the per-step latency (pessimistic: it is one whole all-reduce).
NETWORKS = [
    ("TCP, 25 GbE (α = 30 µs, 3.1 GB/s)", 30.0, 3125.0),
    ("RDMA / InfiniBand HDR (α = 3 µs, 25 GB/s)", 3.0, 25000.0),
]


def estimate(rows: list[dict]) -> list[str]:
    """Per-iteration time on H hosts, T(H) = c·D·B/H + A(H), against T(1) = c·D·B: compute
    split over the hosts plus a recursive-doubling all-reduce of 8·D bytes,
    A(H) = ⌈log2 H⌉·(2α + 2·8D/β). c (µs per row per feature) from the 1-process rows; the
    measured 2-process all-reduce time a = T2 − T1/2 from the 2-process rows."""
    import math

    big = max(rows, key=lambda r: (r["B"], r["N"]))
    c = big["one_iter_us"] / (big["B"] * D)
    overhead = float(np.median([r["two_iter_us"] - r["one_iter_us"] / 2 for r in rows]))
    measured = rows[0]["allreduce_us"]
    lines = [
        "",
        "Scaling estimate (on paper, from this run's rows): per-iteration time on H hosts "
        "T(H) = c·D·B/H + A(H), against one host's T(1) = c·D·B, with "
        f"c = {c * 1e3:.2f} ns per row per feature (1 process, B = {big['B']}, "
        f"N = {big['N']:.0e}) and a recursive-doubling all-reduce of the 8·D-byte gradient, "
        "A(H) = ⌈log₂H⌉·(2α + 2·8D/β). Assumptions: one process per host, compute that "
        "splits perfectly over hosts (it is row-parallel), no overlap of compute and "
        "communication (the next iteration needs the summed gradient), the rows already on "
        "the hosts. Measured here between two local processes: an all-reduce of D = 10 "
        f"float64 alone (a compiled loop of 1000) takes {measured:.0f} µs, and going from one "
        f"process to two adds {overhead:.0f} µs per iteration (median of T₂ − T₁/2 over the "
        "rows above) — far above a network's latency: JAX's CPU collectives (gloo over TCP) "
        "pay per call. The last column takes the measured all-reduce as α, a pessimistic "
        "bound.",
        "",
        "| D | B | H | "
        + " | ".join(f"speed-up, {n}" for n, _, _ in NETWORKS)
        + f" | speed-up, α = {measured:.0f} µs (measured here) |",
        "|---:|---:|---:|" + "---:|" * (len(NETWORKS) + 1),
    ]
    for d in (10, 1000):
        for b in (10_000, 100_000):
            for h in (8, 16, 64):
                one = c * d * b
                cells = []
                for _, alpha, beta in [*NETWORKS, ("", measured, 3125.0)]:
                    a = math.ceil(math.log2(h)) * (2 * alpha + 2 * 8 * d / beta)
                    cells.append(f"{one / (one / h + a):.1f}×")
                lines.append(f"| {d} | {b} | {h} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Reading: a narrow model with small minibatches (D = 10, B = 10⁴: ~0.3 ms of "
        "compute per iteration) is latency-bound — little gain on TCP, and more hosts are "
        "slower; wide models or large minibatches (D·B ≥ 10⁷) scale near-linearly to 16 hosts "
        "on TCP and to 64 on RDMA; at the per-call cost of the CPU collectives measured here "
        "only the widest cases gain. What several hosts buy first is room: data that do not "
        "fit on one host, read where they are.",
    ]
    return lines


def render(rows: list[dict], wall: float) -> str:
    import platform

    import jax

    load = os.getloadavg()[0]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    lines = [
        "## Several processes: per-pass time and communication (issue 26, benchmarks/multihost.py)",
        "",
        f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Command: `python benchmarks/multihost.py` (wall {wall / 60:.1f} min); git {commit}; "
        f"{platform.platform()}, {os.cpu_count()} CPUs, load average at the end {load:.2f}; "
        f"jax {jax.__version__}. Logistic regression, D = {D}, SGLD with a fixed step, one "
        "pass per draw; 1 process: in memory on one core; 2 processes: jax.distributed on "
        "localhost, one pinned per core, each with only its own half of the rows "
        "(memory-mapped shard file → RowShard).",
        "",
        "| N | B | iterations / pass | 1 process: s / pass | 2 processes: s / pass | "
        "1 process: µs / iteration | 2 processes: µs / iteration | loopback bytes / iteration "
        "| all-reduce payload (bytes) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['N']:.0e} | {r['B']} | {r['iters']} | {r['one_pass_s']:.3f} | "
            f"{r['two_pass_s']:.3f} | {r['one_iter_us']:.1f} | {r['two_iter_us']:.1f} | "
            f"{r['lo_bytes_per_iter']:.0f} | {r['payload']} |"
        )
    lines += estimate(rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
