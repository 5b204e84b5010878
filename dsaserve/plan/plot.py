"""Plots: `dsaserve plan --plot` (prefill FLOP curves of indexer and sparse MLA, and the crossover)
and `dsaserve simulate --plot` (interactivity against throughput per GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dsaserve.plan.costmodel import PrefillFlops

if TYPE_CHECKING:
    from dsaserve.plan.simulate import SimResult


def plot_prefill_flops(flops: PrefillFlops, path: str | Path, title: str, max_length: int) -> None:
    """Write a PNG of the cumulative per-GPU prefill FLOPs against prompt length (log-log).

    The x-axis runs from 256 tokens to at least twice the crossover, so the crossing is always
    visible whatever `max_length` (the planned context) is.
    """
    crossover = flops.crossover
    hi = max(max_length, 2 * crossover, 1024)
    lengths = np.unique(np.geomspace(256, hi, 200).astype(np.int64))  # [num_points]
    indexer = np.array([flops.indexer(int(n)) for n in lengths])  # [num_points] FLOPs
    mla = np.array([flops.mla(int(n)) for n in lengths])  # [num_points] FLOPs

    # A bare Figure on the Agg canvas: no pyplot, so no global backend state is touched.
    fig = Figure(figsize=(7.0, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(lengths, indexer, label="indexer (grows with L²)")
    ax.loglog(lengths, mla, label=f"sparse MLA (top-{flops.topk}: grows with L)")
    ax.axvline(crossover, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        f"crossover {crossover:,} tokens",
        xy=(crossover, flops.mla(crossover)),
        xytext=(8, -24),
        textcoords="offset points",
    )
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("cumulative prefill FLOPs per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(path), format="png")


def plot_interactivity(results: list[SimResult], path: str | Path) -> None:
    """Write a PNG of P90 E2E-normalised interactivity (tok/s/user) against throughput per GPU,
    one line per deployment, one point per concurrency (AgentX's headline picture)."""
    fig = Figure(figsize=(7.0, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for spec in dict.fromkeys(r.deployment.spec for r in results):
        rows = [(r.concurrency, r.summary()) for r in results if r.deployment.spec == spec]
        rows = [(c, s) for c, s in rows if s["requests"]]
        xs = [s["throughput_per_gpu"] for _, s in rows]
        ys = [s["p90_e2e_interactivity"] for _, s in rows]
        ax.plot(xs, ys, marker="o", label=spec)
        for (c, _), x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(f"c{c}", xy=(x, y), xytext=(4, 4), textcoords="offset points",
                        fontsize=8)
    ax.set_xlabel("throughput per GPU (tokens/s, prompt incl. cached + output)")
    ax.set_ylabel("P90 E2E-normalised interactivity (tok/s/user)")
    ax.set_title("dsaserve simulate", fontsize=10)
    ax.grid(True, linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path), format="png")
