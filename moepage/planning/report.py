"""Replay results for people: ``format_table`` (one block per trace, rows K, columns policy) and ``plot`` (hit rate
against K/E; needs matplotlib, which the ``moepage trace --png`` command checks for before replaying)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .traces import ReplayResult


def format_table(results: Sequence[ReplayResult]) -> str:
    """One block per trace: rows K, columns policy: ``hit rate (misses per step)``."""
    lines: list[str] = []
    for name in dict.fromkeys(r.trace for r in results):
        rows = [r for r in results if r.trace == name]
        pols = list(dict.fromkeys(r.policy for r in rows))
        r0 = rows[0]
        lines.append(f"{name}: E={r0.num_experts}, {len(r0.layer_hits)} layers, {r0.steps} steps  "
                     "[hit rate (misses/step over all layers)]")
        lines.append(f"  {'K':>4} {'K/E':>5}  " + "  ".join(f"{p:>16}" for p in pols))
        for k in sorted({r.num_slots for r in rows}):
            by = {r.policy: r for r in rows if r.num_slots == k}
            cells = [f"{by[p].hit_rate:6.3f} ({by[p].misses_per_step:7.2f})" for p in pols]
            lines.append(f"  {k:>4} {k / r0.num_experts:5.2f}  " + "  ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def plot(results: Sequence[ReplayResult], png: str) -> None:
    """Hit rate against K/E, one line per policy, one panel per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r.trace for r in results))
    cols = min(4, len(names))
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        rows = [r for r in results if r.trace == name]
        for pol in dict.fromkeys(r.policy for r in rows):
            pts = sorted((r.num_slots / r.num_experts, r.hit_rate) for r in rows if r.policy == pol)
            ax.plot(*zip(*pts), marker="o", label=pol, linestyle="--" if pol == "belady" else "-")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("K / E")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
