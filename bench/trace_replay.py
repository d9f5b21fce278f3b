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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moepage import synthetic, traces  # noqa: E402
from moepage.cli import plot  # noqa: E402

FRACTIONS = ("0.25", "0.5", "0.75")
POLICIES = ("lru", "lfu", "lfru:32", "belady")


def workloads(tokens: int) -> list[traces.Trace]:
    root = traces.shared_traces_dir()
    out = [traces.load_trace(root / spec) for spec in traces.REAL_TRACES]
    for rho in (0.0, 0.3, 0.6):
        out.append(synthetic.synthetic_trace(synthetic.qwen3_30b(rho, seed=0), tokens, name=f"qwen3-30b synthetic rho={rho:g}"))
    out.append(synthetic.synthetic_trace(synthetic.qwen3_30b(0.3, seed=0), tokens // 4, batch=8, name="qwen3-30b synthetic rho=0.3 batch=8"))
    for seed in (0, 1, 2):  # LFU vs LRU on uniform routing is a coin toss: show several seeds
        gen = synthetic.uniform(48, 128, 8, 0.0, seed=seed)
        out.append(synthetic.synthetic_trace(gen, tokens, name=f"uniform 48x128 top-8 seed={seed}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000, help="synthetic decode steps")
    ap.add_argument("--md", help="also write the markdown table here")
    ap.add_argument("--png", help="plot of hit rate against K/E")
    args = ap.parse_args()
    results: list[traces.ReplayResult] = []
    lines = [
        "| trace | E | top_k | layers | steps | K | K/E | " + " | ".join(POLICIES) + " | lfu - lru | lfru:32 - lru |",
        "|---|---|---|---|---|---|---|" + "---|" * len(POLICIES) + "---|---|",
    ]
    wins = {p: [] for p in POLICIES[1:-1]}
    t0 = time.time()
    for trace in workloads(args.tokens):
        rows = traces.replay_grid(trace, FRACTIONS, POLICIES)
        results += rows
        for k in sorted({r.num_slots for r in rows}):
            by = {r.policy: r for r in rows if r.num_slots == k}
            for p in wins:
                wins[p].append((trace.name, k, by[p].hits - by["lru"].hits))
            delta = " | ".join(f"{by[p].hit_rate - by['lru'].hit_rate:+.4f}" for p in wins)
            cells = " | ".join(f"{by[p].hit_rate:.3f} ({by[p].misses_per_step:.2f})" for p in POLICIES)
            lines.append(
                f"| {trace.name} | {trace.num_experts} | {trace.top_k} | {len(trace.layers)} | {trace.num_steps} "
                f"| {k} | {k / trace.num_experts:.2f} | {cells} | {delta} |"
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
