"""The figure of benchmarks/nuts_comparison.py (time to an accurate posterior, and per-pass
times), from a run's rows."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nuts_comparison_render import (  # noqa: E402
    fastest_nuts,
    floor_of,
    micro,
    row_label,
    row_time,
    sampler_label,
    sg_s_per_pass,
)


def make_figure(
    rows: list[dict], tps: list[dict], samplers: list[str], path: Path, target: float = 400
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if tps:
        fig, (ax1, ax2) = plt.subplots(
            1, 2, figsize=(15, 5.8), gridspec_kw={"width_ratios": [1.6, 1]}
        )
    else:  # --no-throughput: the time-to-accuracy panel only
        fig, ax1 = plt.subplots(figsize=(10.5, 5.8))
    unreached: list[tuple[float, Any, str]] = []  # (x, colour, label): no time to draw
    ns = sorted({r["n"] for r in rows})
    labels: list[str] = []
    for r in rows:
        lab = row_label(r).replace("`", "")
        if lab not in labels:
            labels.append(lab)
    width = 0.8 / max(len(labels), 1)
    sg_colors = {s: plt.get_cmap("tab10")(k) for k, s in enumerate(samplers)}
    nuts_colors = {"numpyro": "0.2", "nutpie-jax": "0.4", "nutpie": "0.6", "pymc": "0.8"}

    def color_of(r: dict) -> Any:
        if r["driver"] in nuts_colors:
            return nuts_colors[r["driver"]]
        return sg_colors.get(r["sampler"], "c")

    for j, lab in enumerate(labels):
        for i, n in enumerate(ns):
            match = [r for r in rows if r["n"] == n and row_label(r).replace("`", "") == lab]
            if not match:
                continue
            r = match[0]
            t, kind = row_time(r)
            x = i + (j - (len(labels) - 1) / 2) * width
            if not math.isfinite(t):
                unreached.append((x, color_of(r), lab))
                continue
            hatch = {"reached": None, "extrapolated": "//", "not reached": "xx", "killed": "++"}[
                kind
            ]
            if r["driver"] == "pm" and kind == "reached":
                hatch = ".."
            color = color_of(r)
            ax1.bar(
                x,
                t,
                width,
                color=color,
                hatch=hatch,
                edgecolor="k",
                linewidth=0.4,
                alpha=1.0 if kind == "reached" else 0.55,
                label=lab if i == 0 or lab not in ax1.get_legend_handles_labels()[1] else None,
            )
            ref_t, _ = fastest_nuts(rows, n)
            note = f"{t / ref_t:.2g}×" if math.isfinite(ref_t) else ""
            if kind != "reached":
                note += "*"
            ax1.text(x, t * 1.08, note, ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax1.set_yscale("log")
    bottom = ax1.get_ylim()[0]
    for x, color, lab in unreached:
        ax1.text(
            x,
            bottom * 1.15,
            "not reached:\nmeans or sds off",
            ha="center",
            va="bottom",
            fontsize=6.5,
            rotation=90,
            color=color,
        )
        ax1.bar(x, 0, width, color=color, alpha=0.55, label=lab)  # a legend entry only
    ax1.set_xticks(range(len(ns)), [f"N = {n:,}" for n in ns])
    ax1.set_ylabel(f"wall time to accuracy and ≥ {target:.0f} ESS (s, log)")
    ax1.set_title(
        f"Time to a posterior within 0.1 sd (means) and 10% (sds) with ≥ {target:.0f} ESS, "
        "4 SG chains / 2 NUTS chains on 2 cores\nannotation: ratio to the fastest NUTS; "
        "* = hatched: extrapolated (//), not reached, time extrapolated (xx), killed: "
        "lower bound (++); "
        "dotted: pm.sample",
        fontsize=9,
    )
    handles, labs = ax1.get_legend_handles_labels()
    uniq = dict(zip(labs, handles, strict=True))
    ax1.legend(uniq.values(), uniq.keys(), fontsize=7, ncol=2, loc="upper left")
    ax1.grid(axis="y", which="both", alpha=0.3)

    if tps:
        _throughput_panel(ax2, tps, samplers)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _throughput_panel(ax2: Any, tps: list[dict], samplers: list[str]) -> None:
    """Seconds per data pass against N: the full gradient, the floor, BlackJAX, the samplers."""
    import matplotlib.pyplot as plt
    import numpy as np

    tns = [tp["n"] for tp in tps]
    series = [
        ("full-data gradient", lambda tp: micro(tp, "full_grad_bridge"), "k", "-", "o"),
        ("floor (bare JAX loop)", floor_of, "0.4", "--", "s"),
        ("BlackJAX sgld", lambda tp: micro(tp, "blackjax_sgld"), "tab:red", ":", "^"),
    ]
    for k, s in enumerate(samplers):
        series.append(
            (
                sampler_label(s),
                lambda tp, s=s: sg_s_per_pass(tp, s),
                plt.get_cmap("tab10")(k),
                "-",
                ".",
            )
        )
    for name, fn, color, ls, marker in series:
        vals = np.array([fn(tp) for tp in tps])
        ax2.plot(tns, vals, ls=ls, marker=marker, color=color, label=name)
    x = np.array([tns[0], tns[-1]], dtype=float)
    y0 = micro(tps[-1], "full_grad_bridge")
    ax2.plot(x, y0 * x / tns[-1], color="k", alpha=0.2, lw=6, label="∝ N (slope 1)")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("N (rows)")
    ax2.set_ylabel("seconds per data pass (1 chain)")
    batch = tps[0]["runs"].get("IASG", {}).get("batch_size", 256)
    ax2.set_title(f"Seconds per pass vs N (B = {batch})", fontsize=9)
    ax2.grid(which="both", alpha=0.3)
    ax2.legend(fontsize=7)
