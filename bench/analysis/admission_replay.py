"""Prefill admission (``plan_waves(..., admit=N)``) on mixed prefill/decode traces built from the
real Granite trace (issue 14 item 3). CPU only.

    python -m bench.analysis.admission_replay [--md OUT.md] [--repeats 2] [--gap 16]

Two workloads from ``granite_1b_a400m_onnxgenai/moe_expert_trace.json`` (3 prompts, each a prefill
[position][layer][8] and 64 decode steps [step][layer][8]; 24 layers, E = 32, top-8):

- **serving mix**: the prompts, repeated ``--repeats`` times, arrive every ``--gap`` decode steps.
  An arrival is one step of its own (the whole prefill: a multi-wave step); every other step
  decodes one token of each running sequence together (the union of their routing). With 64
  decode steps per prompt and a gap of 16, up to 4 sequences decode together.
- **sequential**: the trace as recorded, prompt after prompt (each prefill, then its own decode).
- **Qwen3 synthetic serving mix**: the same schedule with E = 128 (48 layers): 6 requests of
  Qwen3-30B-A3B-calibrated routing (rho = 0.3), a 128-token prefill and 128 decode steps each,
  one every 32 steps. Granite's prefills route nearly all of its 32 experts; this shows a larger
  expert set, where a prefill's experts are not all the decode working set.

Admission applies to prefill steps only. Reported per policy, K and cap: decode misses per decode
step, prefill misses per prefill step, total misses per step, and prefill waves per prefill step
(a capped prefill rotates through fewer slots, so it runs in more, smaller waves).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench.common import table
from bench.data.traces import GRANITE, SHARED
from moepage.planning import synthetic, traces
from moepage.residency import DEFAULT_POLICY

FRACTIONS = ("0.25", "0.5", "0.75")


def serving_mix(name: str, requests: list[dict], gap: int, num_experts: int, top_k: int) -> traces.Trace:
    """``requests`` (each ``{"prefill": [position][layer][k], "decode": [step][layer][k]}``)
    arriving every ``gap`` decode steps; see the module docstring."""
    arrivals = {i * gap: r for i, r in enumerate(requests)}
    steps: list[np.ndarray] = []
    prefill: list[int] = []
    running: list[list] = []  # [request, next decode position]
    t = 0
    while arrivals or running:
        if t in arrivals:
            r = arrivals.pop(t)
            prefill.append(len(steps))
            steps.append(traces.prefill_step(r["prefill"]))
            running.append([r, 0])
        if running:
            steps.append(np.concatenate([np.asarray(r["decode"][i]) for r, i in running], axis=1))
            for entry in running:
                entry[1] += 1
            running = [e for e in running if e[1] < len(e[0]["decode"])]
        t += 1
    return traces.from_steps(f"{name} ({len(requests)} requests, one every {gap} steps)", steps, num_experts, top_k,
                             prefill)


def granite_mix(path: Path, repeats: int, gap: int) -> traces.Trace:
    d = json.loads(path.read_text())
    return serving_mix("granite serving mix", list(d["prompts"].values()) * repeats, gap, d["num_experts"], d["top_k"])


def qwen_mix(requests: int, prompt: int, decode: int, gap: int, rho: float = 0.3) -> traces.Trace:
    """The same schedule on Qwen3-30B-A3B-calibrated synthetic sequences (one seed per request):
    a request's first ``prompt`` tokens are its prefill, the next ``decode`` its decode steps."""
    seqs = [synthetic.calibrated(rho, seed=i).generate(prompt + decode) for i in range(requests)]
    reqs = [{"prefill": s[:prompt], "decode": s[prompt:]} for s in seqs]
    return serving_mix(f"qwen3-30b synthetic rho={rho:g} serving mix, prompts of {prompt}", reqs, gap, 128, 8)


def caps(k: int, top_k: int) -> list[int | None]:
    return [None] + sorted({max(1, k * 3 // 4), max(1, k // 2), max(1, k // 4), 1} - {k}, reverse=True)


def report(trace: traces.Trace) -> str:
    """The trace's line and its table: every policy, K and cap."""
    n_pre = len(trace.prefill_steps)
    n_dec = trace.num_steps - n_pre
    rows = []
    for policy in dict.fromkeys(("lru", DEFAULT_POLICY)):
        for frac in FRACTIONS:
            k = traces.resolve_k(frac, trace.num_experts)
            base = None
            for cap in caps(k, trace.top_k):
                r = traces.replay(trace, k, policy, admit=cap)
                dec, pre = r.misses - r.prefill_misses, r.prefill_misses
                waves_pre = r.prefill_waves / (n_pre * len(trace.layers))
                base = base or (dec, r.misses)
                rows.append({
                    "policy": policy, "K/E": f"{k / trace.num_experts:.2f}", "K": k, "admit": cap or "none",
                    "decode misses / decode step": f"{dec / n_dec:.2f}",
                    "prefill misses / prefill step": f"{pre / n_pre:.2f}",
                    "misses / step (all)": f"{r.misses / trace.num_steps:.2f}",
                    "prefill waves / prefill step / layer": f"{waves_pre:.1f}",
                    "decode vs no cap": f"{100 * (dec - base[0]) / base[0]:+.1f} %",
                    "all vs no cap": f"{100 * (r.misses - base[1]) / base[1]:+.1f} %"})
    return (f"**{trace.name}**: {trace.num_steps} steps ({n_pre} prefill, {n_dec} decode), "
            f"{len(trace.layers)} layers, E = {trace.num_experts}\n\n" + table(rows))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--md", help="also write the markdown tables here")
    ap.add_argument("--repeats", type=int, default=2, help="times each of the 3 prompts arrives")
    ap.add_argument("--gap", type=int, default=16, help="decode steps between arrivals")
    args = ap.parse_args()
    path = SHARED / GRANITE
    mixes = (granite_mix(path, args.repeats, args.gap), traces.load_trace(path), qwen_mix(6, 128, 128, 32))
    text = "\n\n".join(map(report, mixes)) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
