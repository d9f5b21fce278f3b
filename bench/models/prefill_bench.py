"""Multi-wave prefill overlap (issue 6 item 6), on a CUDA GPU; prints a markdown table.

One Qwen3-30B-A3B-shaped experts layer (HF ``Qwen3MoeExperts``, E=128, top-8, H=2048, I=768,
bf16, ``grouped_mm``), uniform random routing (the worst case), prompts of 512 and 2048 tokens, K/E
= 0.25 and 0.5, ``cuda`` backend. Side by side in one run:
- serialized waves (``prefill_overlap=False``) and overlapped ones (``prefill_overlap=True``);
- compute: the unpaged layer's step;
- page-in: the bytes the overlapped run pages per step at one large pinned cudaMemcpyAsync's
  bandwidth, measured in this run;
- the bound max(compute, page-in), and ``best_speedup`` = serialized / bound: the gain of an
  overlap that hid everything but the longer of the two.
Each output is checked ``torch.equal`` to the unpaged layer before timing.

    python -m bench.models.prefill_bench [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import moepage
from bench.common import memcpy_gbs, qwen3_experts, table, write_json

DEV = torch.device("cuda")


def seconds(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paged_seconds(layer, x, idx, w) -> tuple[float, float]:
    """Median seconds of a paged step and the bytes it pages per step."""
    before = moepage.stats(layer).total
    t = seconds(lambda: layer(x, idx, w))
    after = moepage.stats(layer).total
    return t, (after.bytes_paged - before.bytes_paged) / (after.steps - before.steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    unpaged = qwen3_experts()
    bw = memcpy_gbs()
    rows = []
    for frac in (0.25, 0.5):
        k = int(128 * frac)
        layers = {}
        for overlap in (False, True):
            layers[overlap] = copy.deepcopy(unpaged)
            moepage.wrap(layers[overlap], resident=k, prefill_overlap=overlap)
        for tokens in (512, 2048):
            x = torch.randn(tokens, 2048, device=DEV, dtype=torch.bfloat16)
            idx = torch.stack([torch.randperm(128)[:8] for _ in range(tokens)]).to(DEV)
            w = torch.rand(tokens, 8, device=DEV, dtype=torch.bfloat16)
            want = unpaged(x, idx, w)
            for layer in layers.values():
                assert torch.equal(layer(x, idx, w), want), "paged != unpaged"
            compute = seconds(lambda: unpaged(x, idx, w))
            serial, serial_bytes = paged_seconds(layers[False], x, idx, w)
            overlapped, per_step = paged_seconds(layers[True], x, idx, w)
            page_in = per_step / (bw * 1e9)
            bound = max(compute, page_in)
            rows.append(dict(k_over_e=frac, tokens=tokens, serial_ms=serial * 1e3, overlapped_ms=overlapped * 1e3,
                             serial_mb=serial_bytes / 1e6, overlapped_mb=per_step / 1e6, speedup=serial / overlapped,
                             best_speedup=serial / bound, compute_ms=compute * 1e3, page_in_ms=page_in * 1e3,
                             bound_ms=bound * 1e3, overlapped_over_bound=overlapped / bound,
                             prefill_tok_s=tokens / overlapped))
    print(f"device {torch.cuda.get_device_name()}, pinned H2D memcpy {bw:.1f} GB/s")
    print(table(rows))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
