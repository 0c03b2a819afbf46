"""Rendering of benchmarks/nuts_comparison.py's results: the tables and text of its RESULTS.md
section, from the JSON a run writes (``nuts_comparison.py --render <json>`` re-renders one).
The criteria a row is judged by (``passes_criteria``) and the labels live here, so that a
re-render judges rows as the run did."""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import git_state  # noqa: E402

# Non-default settings, run beside the defaults (the module docstring says why).
# IASG-lr10: the default before 4dd4176 (10 relaxation times per window; see
# docs/samplers/iasg.md). IASG-lr3 was the variant before it became the default (with the full
# preconditioner); kept so that earlier runs' JSON renders as it did.
VARIANTS = {
    "IASG-lr10": ("IASG", "learning_rate = 10B/N", lambda n, b: {"learning_rate": 10 * b / n}),
    "IASG-lr3": ("IASG", "learning_rate = 3B/N", lambda n, b: {"learning_rate": 3 * b / n}),
}
# In this order: each NUTS after the first is stopped once slower than the fastest so far.
NUTS_SAMPLERS = ("numpyro", "nutpie-jax", "nutpie", "pymc")
NUTS_LABEL = {
    "numpyro": "NUTS (numpyro)",
    "nutpie-jax": "NUTS (nutpie, JAX backend)",
    "nutpie": "NUTS (nutpie, numba backend)",
    "pymc": "NUTS (PyMC)",
}


def passes_criteria(r: dict, args: argparse.Namespace) -> bool:
    return (
        "error" not in r
        and r["max_abs_mean_diff"] <= args.mean_tol
        and r["sd_ratio_min"] >= 1 - args.sd_tol
        and r["sd_ratio_max"] <= 1 + args.sd_tol
        and r["ess_min"] >= args.target_ess
    )


# -----------------------------------------------------------------------------------------
# Report
# -----------------------------------------------------------------------------------------


def _fmt_s(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _load(r: dict) -> str:
    ls = r.get("load_start")
    return "?" if not ls else f"{ls[0]:.1f}"


def row_time(row: dict) -> tuple[float, str]:
    """(seconds, kind): kind is 'reached', 'killed' (seconds: a lower bound), 'extrapolated'
    or 'not reached' (seconds: extrapolated, or nan)."""
    if row.get("reached"):
        return row["final"]["wall"], "reached"
    if row.get("killed"):
        return row["lower_bound"], "killed"
    if row.get("extrapolated"):
        return row["extrapolated_wall"], "extrapolated"
    return row.get("extrapolated_wall", float("nan")), "not reached"


def fastest_nuts(rows: list[dict], n: int) -> tuple[float, str]:
    """The fastest NUTS at ``n``: the smallest time among those that reached the accuracy and
    the lower bounds of killed ones (a bound smaller than every reached time makes the
    fastest time itself a lower bound, said in the label); else extrapolated times."""
    best = (math.inf, "")
    for kinds in (("reached", "killed"), ("extrapolated",), ("not reached",)):
        for row in rows:
            if row["n"] == n and row["driver"] in NUTS_SAMPLERS:
                t, k = row_time(row)
                if k in kinds and t < best[0]:
                    note = {"reached": "", "killed": ", killed: a lower bound"}.get(k, f", {k}")
                    best = (t, NUTS_LABEL[row["driver"]] + note)
        if math.isfinite(best[0]):
            return best
    return best


def row_label(row: dict) -> str:
    if row["driver"] in NUTS_SAMPLERS:
        return NUTS_LABEL[row["driver"]]
    drv = "pmsg.sample" if row["driver"] == "pmsg" else "pm.sample, cores=2"
    return f"{sampler_label(row['sampler'])} (`{drv}`)"


def sampler_label(sampler: str) -> str:
    if sampler in VARIANTS:
        cls, text, _ = VARIANTS[sampler]
        return f"{cls}, {text}"
    return sampler


def render_tta(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "| N | sampler | chains × (tune + draws) | attempts | time to accuracy (s) | × fastest NUTS "
        "| min ESS | max \\|Δmean\\| (sd) | sd ratio range | ESS / pass | all attempts (s) "
        "| peak RSS − base (MB) | load (1 min) / others (cores) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        n = row["n"]
        f = row["final"]
        t, kind = row_time(row)
        ref_t, _ = fastest_nuts(rows, n)
        if kind == "killed":
            tcell = (
                f"> {_fmt_s(t)} (killed after {_fmt_s(row['killed'])} s: 1000 of "
                f"{1000 + f['draws_per_chain']} draws' share)"
            )
            lines.append(
                f"| {n:,} | {row_label(row)} | {row['chains']} × "
                f"(1000 + {f['draws_per_chain']}) | {row['n_attempts']} | {tcell} "
                f"| > {t / ref_t:.3g}× | | | | | {row['total_elapsed']:.0f} | "
                f"| {_load(f)} / {f['others']:.2f} |"
            )
            continue
        if "error" in f:
            lines.append(
                f"| {n:,} | {row_label(row)} | | {row['n_attempts']} | error: "
                f"{f['error'].strip().splitlines()[-1][:80] if f['error'].strip() else '?'} "
                f"| | | | | | {row['total_elapsed']:.0f} | | |"
            )
            continue
        if kind == "extrapolated":
            e = row["extrapolation"]
            lines.append(
                f"| {n:,} | {row_label(row)} | {row['chains']} × (1000 + "
                f"{e['draws_needed']:.0f}) predicted | 0 | {_fmt_s(t)} (extrapolated) "
                f"| {t / ref_t:.3g}× (extrap.) | | (not run) | (not run) | | "
                f"{row['total_elapsed']:.0f} | | {_load(f)} / {f.get('others', 0):.2f} |"
            )
            continue
        if kind == "reached":
            tcell, ratio = f"**{_fmt_s(t)}**", f"{t / ref_t:.3g}×"
        elif kind == "extrapolated":
            tcell, ratio = f"{_fmt_s(t)} (extrapolated)", f"{t / ref_t:.3g}× (extrap.)"
        else:
            est = f", ≈ {_fmt_s(t)} extrapolated" if math.isfinite(t) else ""
            tcell = f"not reached{est}"
            ratio = f"≈ {t / ref_t:.3g}×" if math.isfinite(t) else "—"
        shape = f"{f['chains']} × ({row['tune']} + {f['draws']})"
        if kind == "extrapolated":
            e = row["extrapolation"]
            shape = f"{row['chains']} × (1000 + {e['draws_needed']:.0f}) predicted"
        mem = f"{f['peak_rss'] - f['base_rss']:.0f}"
        if f.get("child_peak_rss", 0) > 0 and row["driver"] in ("pymc", "pm"):
            mem += f" (+ workers ≤ {f['child_peak_rss']:.0f})"
        acc = (
            f"{f['max_abs_mean_diff']:.3f} | {f['sd_ratio_min']:.3f}–{f['sd_ratio_max']:.3f}"
            if kind != "extrapolated"
            else "(short run) | (short run)"
        )
        lines.append(
            f"| {n:,} | {row_label(row)} | {shape} | {row['n_attempts']} | {tcell} | {ratio} "
            f"| {f['ess_min']:.0f} | {acc} | {f['ess_per_pass']:.3g} "
            f"| {row['total_elapsed']:.0f} | {mem} | {_load(f)} / {f['others']:.2f} |"
        )
    return "\n".join(lines)


def sg_s_per_pass(tp: dict, name: str) -> float:
    r = tp["runs"].get(name, {})
    return r.get("s_per_pass", float("nan"))


def micro(tp: dict, key: str) -> float:
    for r in tp["runs"].values():
        if key in r:
            return r[key]
    return float("nan")


def floor_of(tp: dict) -> float:
    return min(micro(tp, "bare_loop"), micro(tp, "floor_pass_prng"))


def render_throughput(tps: list[dict], samplers: list[str]) -> str:
    ns = [tp["n"] for tp in tps]
    head = "| seconds per data pass (ms) | " + " | ".join(f"N = {n:,}" for n in ns) + " |"
    lines = [head, "|---|" + "---:|" * len(ns)]

    def row(name: str, vals: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(vals) + " |")

    def ms(x: float) -> str:
        return "—" if not math.isfinite(x) else f"{1e3 * x:.3g}"

    row("full-data gradient, bridge", [ms(micro(tp, "full_grad_bridge")) for tp in tps])
    row("full-data gradient, hand-written jnp", [ms(micro(tp, "full_grad_hand")) for tp in tps])
    row(
        "bare loop, per-iteration PRNG (`throughput.make_bare_pass`)",
        [ms(micro(tp, "bare_loop")) for tp in tps],
    )
    row(
        "bare loop, PRNG once per pass (`floor_pass`)",
        [ms(micro(tp, "floor_pass_prng")) for tp in tps],
    )
    row("BlackJAX `sgld`, random-index batches", [ms(micro(tp, "blackjax_sgld")) for tp in tps])
    for s in samplers:
        row(
            f"{sampler_label(s)} (`pmsg.sample`, 1 chain)", [ms(sg_s_per_pass(tp, s)) for tp in tps]
        )
    lines.append("| **ratios** | " + " | " * (len(ns) - 1) + " |")
    for s in samplers:
        vals = []
        for tp in tps:
            t, fg = sg_s_per_pass(tp, s), micro(tp, "full_grad_bridge")
            mark = "✓" if t <= 2 * fg else "✗"
            vals.append(
                f"{t / fg:.2f}× gradient {mark}; {t / floor_of(tp):.2f}× floor; "
                f"{t / micro(tp, 'blackjax_sgld'):.2f}× BlackJAX"
            )
        row(f"{sampler_label(s)} per pass", vals)
    row(
        "BlackJAX per pass",
        [
            f"{micro(tp, 'blackjax_sgld') / micro(tp, 'full_grad_bridge'):.2f}× gradient; "
            f"{micro(tp, 'blackjax_sgld') / floor_of(tp):.2f}× floor"
            for tp in tps
        ],
    )
    row(
        "floor per pass",
        [f"{floor_of(tp) / micro(tp, 'full_grad_bridge'):.2f}× gradient" for tp in tps],
    )
    row(
        "load (1 min) at start",
        [f"{tp['runs']['fullgrad'].get('load_start', [math.nan])[0]:.1f}" for tp in tps],
    )
    others = [max(r.get("others", 0) for r in tp["runs"].values()) for tp in tps]
    row("other processes (max over the runs, cores)", [f"{o:.2f}" for o in others])
    return "\n".join(lines)


def render_linearity(tps: list[dict], samplers: list[str]) -> str:
    ns = [tp["n"] for tp in tps]
    names = [
        ("full-data gradient (bridge)", lambda tp: micro(tp, "full_grad_bridge")),
        ("floor", floor_of),
        ("BlackJAX sgld", lambda tp: micro(tp, "blackjax_sgld")),
    ] + [(sampler_label(s), lambda tp, s=s: sg_s_per_pass(tp, s)) for s in samplers]
    head = (
        "| µs per pass per 1000 rows | "
        + " | ".join(f"N = {n:,}" for n in ns)
        + (f" | log-log slope {ns[-2]:,}→{ns[-1]:,} |" if len(ns) > 1 else " |")
    )
    lines = [head, "|---|" + "---:|" * (len(ns) + (1 if len(ns) > 1 else 0))]
    for name, fn in names:
        vals = [fn(tp) for tp in tps]
        cells = [
            f"{1e9 * v / n:.3g}" if math.isfinite(v) else "—" for v, n in zip(vals, ns, strict=True)
        ]
        if len(ns) > 1:
            a, b = vals[-2], vals[-1]
            slope = math.log(b / a) / math.log(ns[-1] / ns[-2]) if a > 0 and b > 0 else math.nan
            cells.append(f"{slope:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_memory(tps: list[dict], samplers: list[str], rows: list[dict]) -> str:
    ns = [tp["n"] for tp in tps]
    head = "| peak RSS − RSS after imports (MB) | " + " | ".join(f"N = {n:,}" for n in ns) + " |"
    lines = [head, "|---|" + "---:|" * len(ns)]

    def cell(r: dict | None) -> str:
        if not r or "error" in r or "peak_rss" not in r:
            return "—"
        return f"{r['peak_rss'] - r['base_rss']:.0f}"

    lines.append(
        "| data X, y (float64, int64) | "
        + " | ".join(f"{n * (8 * 20 + 8) / 2**20:.0f}" for n in ns)
        + " |"
    )
    for what, label in (
        ("fullgrad", "full-gradient timing (bridge + hand-written)"),
        ("floor", "bare loops (shuffled, padded copy of the data)"),
        ("blackjax", "BlackJAX sgld"),
    ):
        lines.append(f"| {label} | " + " | ".join(cell(tp["runs"].get(what)) for tp in tps) + " |")
    for s in samplers:
        lines.append(
            f"| {sampler_label(s)}, 1 chain (`pmsg.sample`) | "
            + " | ".join(cell(tp["runs"].get(s)) for tp in tps)
            + " |"
        )
    labels = []
    for row in rows:
        if row_label(row) not in labels:
            labels.append(row_label(row))
    for label in labels:
        cells = []
        for n in ns:
            match = [r for r in rows if r["n"] == n and row_label(r) == label]
            if not match:
                cells.append("—")
                continue
            f = match[0]["final"]
            c = cell(f)
            if c != "—" and f.get("child_peak_rss", 0) > 0 and match[0]["driver"] in ("pymc", "pm"):
                c += f" (+ workers ≤ {f['child_peak_rss']:.0f})"
            if match[0].get("extrapolated"):
                c += " (short run)"
            cells.append(c)
        chains = match[0]["chains"] if match else "?"
        lines.append(f"| {label}, {chains} chains (last attempt) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_goals(
    rows: list[dict], tps: list[dict], samplers: list[str], args: argparse.Namespace
) -> str:
    out = []
    n_big = max(tp["n"] for tp in tps) if tps else max(r["n"] for r in rows)
    ref_t, ref_name = fastest_nuts(rows, n_big)
    sg_rows = [r for r in rows if r["n"] == n_big and r["driver"] in ("pmsg", "pm")]
    lines = []
    for r in sg_rows:
        t, kind = row_time(r)
        if not math.isfinite(t):
            lines.append(f"{row_label(r)}: not reached (means or sds off) ✗")
            continue
        if not any(q["n"] == n_big and q["driver"] in NUTS_SAMPLERS for q in rows):
            lines.append(f"{row_label(r)}: {_fmt_s(t)} s, {kind} (no NUTS run to compare)")
            continue
        speed = ref_t / t
        ok = kind == "reached" and speed >= args.speed_goal
        bound = "≥ " if "lower bound" in ref_name else ""
        lines.append(
            f"{row_label(r)}: {_fmt_s(t)} s{'' if kind == 'reached' else ' (' + kind + ')'}, "
            f"{bound}{speed:.2g}× faster {'✓' if ok else '✗'}"
        )

    def fast(r: dict) -> bool:
        return bool(r.get("reached")) and ref_t / r["final"]["wall"] >= args.speed_goal

    met = [row_label(r) for r in sg_rows if fast(r) and r["sampler"] not in VARIANTS]
    met_variant = [row_label(r) for r in sg_rows if fast(r) and r["sampler"] in VARIANTS]
    if not any(r["n"] == n_big and r["driver"] in NUTS_SAMPLERS for r in rows):
        ref_name, met, met_variant = "no NUTS run", [], []
    elif not math.isfinite(ref_t):
        ref_name = "no NUTS reached the accuracy"
    verdict = (
        "NOT JUDGED (no NUTS run)"
        if ref_name == "no NUTS run"
        else f"MET with default settings ({', '.join(met)})"
        if met
        else (
            f"MET only with non-default settings ({', '.join(met_variant)})"
            if met_variant
            else "NOT MET"
        )
    )
    out.append(
        f"- **Time to {args.target_ess:.0f} ESS at the accuracy, N = {n_big:,}, "
        f"≥ {args.speed_goal:g}× shorter "
        f"than the fastest NUTS ({ref_name}, {_fmt_s(ref_t)} s): {verdict}**. "
        + "; ".join(lines)
        + "."
    )
    iasg = [r for r in rows if r["sampler"] == "IASG" and r["driver"] == "pmsg"]
    vals = [
        f"N = {r['n']:,}: {r['final']['ess_per_pass']:.2f}"
        + ("" if r.get("reached") else " (run that did not pass)")
        for r in iasg
        if "error" not in r["final"]
    ]
    big = [r for r in iasg if r["n"] == n_big and "error" not in r["final"]]
    met = bool(big) and big[0]["final"]["ess_per_pass"] >= 0.5
    out.append(
        f"- **IASG ESS per data pass ≥ 0.5 (N = {n_big:,}): {'MET' if met else 'NOT MET'}** "
        f"({'; '.join(vals)}; min bulk ESS over the {args.d} coefficients / passes of the "
        "kept draws)."
    )
    tp = [t for t in tps if t["n"] == n_big]
    if tp:
        tp = tp[0]
        fg = micro(tp, "full_grad_bridge")
        parts = []
        for s in samplers:
            t = sg_s_per_pass(tp, s)
            parts.append(f"{sampler_label(s)} {t / fg:.2f}× {'✓' if t <= 2 * fg else '✗'}")
        met_all = all(sg_s_per_pass(tp, s) <= 2 * fg for s in samplers if s not in VARIANTS)
        met_iasg = sg_s_per_pass(tp, "IASG") <= 2 * fg if "IASG" in samplers else False
        out.append(
            f"- **Seconds per data pass ≤ 2× one full-data gradient (N = {n_big:,}, gradient "
            f"{1e3 * fg:.1f} ms): {'MET for every sampler' if met_all else ('MET for IASG, not for every sampler' if met_iasg else 'NOT MET')}** "
            f"({'; '.join(parts)})."
        )
    return "\n".join(out)


def machine_lines(args: argparse.Namespace) -> list[str]:
    from importlib.metadata import version

    from throughput import cpu_model

    def v(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "?"

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return [
        f"- machine: {cpu_model()}, {os.cpu_count()} cores (usable {affinity}), "
        f"{mem_gb:.1f} GB RAM, no GPU; {platform.platform()}",
        f"- versions: python {platform.python_version()}, jax {v('jax')}, pymc {v('pymc')}, "
        f"pytensor {v('pytensor')}, numpyro {v('numpyro')}, nutpie {v('nutpie')}, "
        f"blackjax {v('blackjax')}, arviz {v('arviz')}, numpy {v('numpy')}; "
        f"pymc_sgmcmc git {git_state()}",
    ]


def drop_biased_extrapolations(rows: list[dict], args: argparse.Namespace) -> None:
    """A row that did not reach the accuracy keeps its extrapolated time only if its last
    attempt fell short on ESS alone: more draws shrink Monte Carlo error, not a bias."""
    for row in rows:
        final = row.get("final", {})
        if row.get("reached") or "extrapolated_wall" not in row or "error" in final:
            continue
        if not passes_criteria({**final, "ess_min": args.target_ess}, args):
            row.pop("extrapolated_wall")


def render(results: dict, args: argparse.Namespace) -> str:
    rows, tps, samplers = results["rows"], results["throughput"], results["samplers"]
    drop_biased_extrapolations(rows, args)
    others_max = max((r.get("final", {}).get("others", 0.0) for r in rows), default=0.0)
    lines = [
        f"### {results['date']}, N ∈ {{{', '.join(f'{n:,}' for n in results['sizes'])}}}, D = {args.d}"
        + (
            ", natural units (the stress case natural_logistic)" if args.design == "natural" else ""
        ),
        "",
        f"Command: `{results['command']}` (wall time {results['elapsed'] / 60:.0f} min)",
        "",
        *machine_lines(args),
        f"- load average (1/5/15 min) at start {results['load_start']}, at end {results['load_end']}"
        f"; max 1-min load at the start of a measurement {results['load_max']:.1f}"
        + (
            " — **the machine was shared during this run (load > 3): timings are inflated by "
            "other people's jobs; compare rows measured at similar load**"
            if results["load_max"] > 3 and others_max > 0.25
            else (
                f" (the load counts this run's own threads: other processes used at most "
                f"{others_max:.2f} cores during any row's last attempt)"
                if results["load_max"] > 3
                else ""
            )
        ),
        (
            "- data: natural_logistic (tests/posteriors/stress.py): age, income $, hour, "
            "distance mi, air time min (corr 0.99 with distance) + intercept, Normal(0, 10) "
            f"priors, seed {args.seed}; B = "
            if args.design == "natural"
            else f"- data: X standardised N(0,1), β* ~ N(0, 0.5²), seed {args.seed}; B = "
        )
        + f"{args.batch_size} for every SG sampler (the default), one pass per draw (IASG: "
        "its window, about half a pass since 4dd4176); SG chains "
        f"{args.chains} (`pmsg.sample`, 2 groups on 2 cores), NUTS chains {args.nuts_chains}",
        f"- criteria: every |Δmean| ≤ {args.mean_tol} reference sd, every sd ratio within "
        f"{args.sd_tol:.0%}, min bulk ESS ≥ {args.target_ess}; at most {args.max_attempts} "
        f"attempts, next attempt only if predicted < {args.max_attempt_seconds:.0f} s; "
        f"numpyro / nutpie attempts killed after {args.nuts_max_seconds:.0f} s or once "
        "slower than the fastest NUTS that reached the accuracy (see the notes under the "
        f"table); PyMC's NUTS run if predicted < {args.pymc_max_seconds:.0f} s, else "
        "extrapolated",
        (
            "- references (the Laplace approximation, 20 000 i.i.d. draws): "
            if args.ref_kind == "laplace"
            else "- references (numpyro NUTS): "
        )
        + "; ".join(
            f"N = {int(n):,}: {ref['path']} "
            + (
                f"(cached, made {ref['created']}, reused)"
                if ref["reused"]
                else f"(made in this run, {ref['wall']:.0f} s)"
            )
            + f", min ESS {ref['ess_min']:.0f}, max r-hat {ref['rhat_max']:.3f}"
            for n, ref in results["references"].items()
        ),
        f"- figure: [`figures/{Path(args.figure).name}`](figures/{Path(args.figure).name}); raw "
        f"numbers: [`figures/{Path(args.json).name}`](figures/{Path(args.json).name})",
        "",
        "#### Goals",
        "",
        render_goals(rows, tps, samplers, args),
        "",
        "#### Time to accuracy",
        "",
        render_tta(rows, args),
        "",
    ]
    extrap = [r for r in rows if r.get("extrapolated")]
    for r in extrap:
        e = r["extrapolation"]
        lines.append(
            f"- NUTS (PyMC) at N = {r['n']:,} extrapolated: fixed {e['fixed_seconds']:.0f} s + "
            f"(1000 × {e['steps_per_warmup_draw']:.1f} + {e['draws_needed']:.0f} × "
            f"{e['steps_per_draw']:.1f}) gradient evaluations × {1e3 * e['s_per_grad_eval']:.1f} "
            f"ms per chain (the chains side by side); {e['source']}."
        )
    for r in rows:
        if r.get("killed"):
            lines.append(
                f"- {row_label(r)} at N = {r['n']:,} killed after {r['killed']:.0f} s: "
                f"{'slower than the fastest NUTS already' if r['killed'] < args.nuts_max_seconds - 1 else 'the time limit'}"
                f"; lower bound = {r['killed']:.0f} s × 1000 / (1000 + {r['final']['draws_per_chain']}) "
                "(its warm-up draws' share; a passing run makes at least those)."
            )
    if tps:
        lines += [
            "",
            "#### Seconds per data pass (one chain; B = "
            f"{args.batch_size}; best of {args.repeats} for the micro-benchmarks)",
            "",
            render_throughput(tps, samplers),
            "",
            "#### Linearity in N",
            "",
            render_linearity(tps, samplers),
            "",
            "#### Peak memory",
            "",
            render_memory(tps, samplers, rows),
        ]
    return "\n".join(lines) + "\n"
