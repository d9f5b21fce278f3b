"""The host tier over a disk (``host_budget=``): how many of the device tier's misses it serves, on the real routing
traces (``bench.data.traces``) and on uniform routing (the worst case), replayed through both tiers as
``backends.tiered`` runs them (``traces.replay(host_slots=H)``: the host tier starts empty). CPU only.

    python -m bench.analysis.tier_replay [--tokens 2000] [--md OUT.md]

Per trace, K/E in {0.25, 0.5} and H/E in {0.5, 0.75}, policies lru and the default: the device tier's misses per
step, the host tier's hit rate on them, and the rows read from disk per step (each a row of one layer's expert);
then the trace's second half under the default policy, the host tier empty or warmed from the first half's most
routed experts (``host_warm=``, held out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.analysis.trace_replay import make_trace, real_keys, uniform_keys
from bench.common import table
from bench.data import traces as real
from moepage.planning import traces
from moepage.residency import DEFAULT_POLICY

K_FRACTIONS = ("0.25", "0.5")
H_FRACTIONS = ("0.5", "0.75")


def rows(keys: list[tuple]) -> list[dict]:
    out = []
    for key in keys:
        t = make_trace(key)
        for kf in K_FRACTIONS:
            k = max(t.top_k, traces.resolve_k(kf, t.num_experts))
            for hf in H_FRACTIONS:
                h = max(k, traces.resolve_k(hf, t.num_experts))
                first, second = t.window(0, t.num_steps // 2), t.window(t.num_steps // 2, t.num_steps)
                runs = [(policy, t, None) for policy in ("lru", DEFAULT_POLICY)]
                # the second half, the host tier empty or warmed from the first half's most routed experts (held out)
                runs += [(f"{DEFAULT_POLICY}, 2nd half{label}", second, warm)
                         for label, warm in (("", None), (", warmed from the 1st", first))]
                for policy, trace, warm in runs:
                    r = traces.replay(trace, k, policy.split(",")[0], host_slots=h, host_warm=warm)
                    out.append({
                        "trace": t.name, "E": t.num_experts, "K": k, "H": h, "policy": policy,
                        "device misses / step": round(r.misses / trace.num_steps, 2),
                        "host tier hit rate": f"{1 - r.host_misses / r.misses:.1%}" if r.misses else "-",
                        "disk rows / step": round(r.host_misses / trace.num_steps, 2),
                    })
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="steps of the uniform traces")
    ap.add_argument("--md", type=Path, help="write the table here too")
    args = ap.parse_args(argv)
    keys = [key for key in real_keys() if real.SHARED.exists()] + uniform_keys(args.tokens)[:1]
    text = table(rows(keys))
    print(text)
    if args.md is not None:
        args.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
