"""Issue 6 item 5: LRU against the frequency-aware policies (and the Belady bound) on every real
trace in ../shared/data/traces and on the synthetic generator, at K/E in {0.25, 0.5, 0.75}.

    python bench/trace_replay.py [--tokens 2000] [--md out.md] [--png out.png]

Prints a markdown table (hit rate; misses per step summed over layers in parentheses) and says
whether a frequency-aware policy beats LRU everywhere (the rule for changing the default). CPU only.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moepage import synthetic, traces  # noqa: E402
from moepage.cli import plot  # noqa: E402

FRACTIONS = ("0.25", "0.5", "0.75")
POLICIES = ("lru", "lfu", "lfru:32", "belady")


def workloads(tokens: int) -> list[Callable[[], traces.Trace]]:
    """Makers of every workload, in table order (each made in the worker that replays it)."""
    root = traces.shared_traces_dir()
    out = [partial(traces.load_trace, root / spec) for spec in traces.REAL_TRACES]
    for rho in (0.0, 0.3, 0.6):
        out.append(partial(_qwen, rho, tokens, name=f"qwen3-30b synthetic rho={rho:g}"))
    out.append(partial(_qwen, 0.3, tokens // 4, batch=8, name="qwen3-30b synthetic rho=0.3 batch=8"))
    for seed in (0, 1, 2):  # LFU vs LRU on uniform routing is a coin toss: show several seeds
        out.append(partial(_uniform, seed, tokens))
    return out


def _qwen(rho: float, steps: int, batch: int = 1, name: str = "") -> traces.Trace:
    return synthetic.synthetic_trace(synthetic.qwen3_30b(rho, seed=0), steps, batch=batch, name=name)


def _uniform(seed: int, tokens: int) -> traces.Trace:
    gen = synthetic.uniform(48, 128, 8, 0.0, seed=seed)
    return synthetic.synthetic_trace(gen, tokens, name=f"uniform 48x128 top-8 seed={seed}")


def _replay(make: Callable[[], traces.Trace]) -> tuple[tuple, list[traces.ReplayResult]]:
    trace = make()
    meta = (trace.name, trace.num_experts, trace.top_k, len(trace.layers), trace.num_steps)
    return meta, traces.replay_grid(trace, FRACTIONS, POLICIES)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000, help="synthetic decode steps")
    ap.add_argument("--md", help="also write the markdown table here")
    ap.add_argument("--png", help="plot of hit rate against K/E")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    args = ap.parse_args()
    results: list[traces.ReplayResult] = []
    lines = [
        "| trace | E | top_k | layers | steps | K | K/E | " + " | ".join(POLICIES) + " | lfu - lru | lfru:32 - lru |",
        "|---|---|---|---|---|---|---|" + "---|" * len(POLICIES) + "---|---|",
    ]
    wins = {p: [] for p in POLICIES[1:-1]}
    t0 = time.time()
    # One process per workload: the replays are independent and pure Python.
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        replayed = list(pool.map(_replay, workloads(args.tokens)))
    for (name, num_experts, top_k, layers, steps), rows in replayed:
        results += rows
        for k in sorted({r.num_slots for r in rows}):
            by = {r.policy: r for r in rows if r.num_slots == k}
            for p in wins:
                wins[p].append((name, k, by[p].hits - by["lru"].hits))
            delta = " | ".join(f"{by[p].hit_rate - by['lru'].hit_rate:+.4f}" for p in wins)
            cells = " | ".join(f"{by[p].hit_rate:.3f} ({by[p].misses_per_step:.2f})" for p in POLICIES)
            lines.append(
                f"| {name} | {num_experts} | {top_k} | {layers} | {steps} "
                f"| {k} | {k / num_experts:.2f} | {cells} | {delta} |"
            )
    table = "\n".join(lines)
    print(table)
    for p, w in wins.items():
        losses = [(n, k, d) for n, k, d in w if d < 0]
        ties = [(n, k) for n, k, d in w if d == 0]
        print(f"\n{p}: more hits than LRU at {len(w) - len(losses) - len(ties)}/{len(w)} points; "
              f"ties {ties}; fewer hits (hit difference) {losses}")
    print(f"\n({time.time() - t0:.0f} s)")
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
