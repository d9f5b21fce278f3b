"""Where a captured paged decode step spends its time, stage by stage (CUDA GPU; markdown table).

The layer of ``cuda_bench.py`` c (HF ``Qwen3MoeExperts``, Qwen3-30B-A3B expert shapes, bf16,
``grouped_mm``, K = 64 slots, ``cuda`` backend, 100 % hits). Each stage of
``PagedLayer.forward``'s device-planned path is captured alone, 20 calls in one graph, beside the
whole paged step and the unpaged one; and one eager paged step is profiled for its kernel count.

    python bench/decode_profile.py [--tokens 1 4 8]
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import graph_of, qwen3_experts, table, time_ms

import moepage
from moepage.backends.cuda import CudaStore
from moepage.executor import paged_layer
from moepage.runners import runner_for

DEV = torch.device("cuda")


def kernels_per_call(fn) -> tuple[int, float]:
    """(kernels launched, their summed device µs) for one eager call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), sum(e.device_time for e in events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    unpaged = qwen3_experts()
    paged = copy.deepcopy(unpaged)
    k_slots = 64
    moepage.wrap(paged, resident=k_slots, backend=CudaStore())
    layer = paged_layer(paged)
    runner = runner_for(paged, None)
    rows = []
    reps = 20
    for t in args.tokens:
        x = torch.randn(t, 2048, device=DEV, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(k_slots)[:8] for _ in range(t)]).to(DEV)
        w = torch.rand(t, 8, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(paged(x, idx, w), unpaged(x, idx, w))
        valid = (idx >= 0) & (idx < 128)
        rank = runner.tie_rank(idx)
        tokens = runner.entry_tokens(t, 8, DEV)
        slots = runner.entries(layer.device_slots(idx, pad=k_slots, valid=valid))
        merged = runner.run(layer.original_forward, x, None, tokens, slots, w.dtype, rank)
        stages = {
            "unpaged step": lambda: unpaged(x, idx, w),
            "paged step": lambda: paged(x, idx, w),
            "valid + tie_rank + entry_tokens": lambda: (
                (idx >= 0) & (idx < 128), runner.tie_rank(idx), runner.entry_tokens(t, 8, DEV)),
            "plan + gather (device_slots)": lambda: layer.device_slots(idx, pad=k_slots, valid=valid),
            "plan only": lambda: layer.shared.for_device().plan(idx),
            "run (arrange + forward)": lambda: runner.run(layer.original_forward, x, None, tokens, slots, w.dtype, rank),
            "forward on slots only": lambda: layer.original_forward(x[tokens], slots[:, None], torch.ones(slots.shape[0], 1, dtype=w.dtype, device=DEV)),
            "reduce": lambda: runner.reduce(merged, idx, w, valid, x.dtype),
        }
        for name, fn in stages.items():
            us = time_ms(graph_of(fn, reps).replay) * 1e3 / reps
            n, dev_us = kernels_per_call(fn)
            rows.append(dict(tokens=t, stage=name, captured_us=us, eager_kernels=n, eager_kernel_us=dev_us))
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(rows))


if __name__ == "__main__":
    main()
