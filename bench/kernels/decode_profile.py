"""Where a captured paged decode step spends its time, stage by stage (CUDA GPU; markdown table).

The layer of ``cuda_bench.py`` c (HF ``Qwen3MoeExperts``, Qwen3-30B-A3B expert shapes, bf16,
``grouped_mm``, K = 64 slots, ``cuda`` backend, 100 % hits). Each stage of
``step.device_step`` (planner writing entry slots, gather, the module's forward on slot
ids) is captured alone, 20 calls in one graph, beside the whole paged step and the unpaged one;
and one eager call of each is profiled for its kernel count. A step of more entries than fit one wave (⌈min(E,
entries) / K⌉ > 1, fixed by shapes: 32 tokens x top-8 at K = 64) runs every wave per entry: for those, the per-entry
wave (the module over every row, the other waves' entries on the sentinel slot), its reduction, the ranks and a
wave holding no entry are timed too, and the empty wave's kernels listed: where a multi-wave captured step's time goes;
and beside the paged step, the one whose replay skips its empty waves (``MOEPAGE_SKIP_EMPTY_WAVES=on``: graph
if-nodes, where torch has them, not torch 2.11).

    python -m bench.kernels.decode_profile [--tokens 1 4 8 32]
"""

from __future__ import annotations

import argparse
import copy

import torch

import moepage
from bench.common import graph_of, paging_config, qwen3_experts, table, time_ms
from moepage import step as moepage_step
from moepage.backends.cuda import CudaStore
from moepage.nn.layer import paged_layer
from moepage.step import StepWave

DEV = torch.device("cuda")


def kernels_of_call(fn) -> list[tuple[str, float]]:
    """(name, device µs) of each kernel one eager call of ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def top_kernels(kernels: list[tuple[str, float]], n: int = 8) -> str:
    """The ``n`` kernels taking the most device time, summed by name."""
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:n]
    return "\n".join(f"  {sum(v):8.1f} us  x{len(v):<3} {name[:100]}" for name, v in rows)


def device_forward(layer, x, idx, w):
    """The captured step of ``layer``, as a graph captures it."""
    return moepage_step.device_step(layer.pager, idx, layer.waves(layer.runner, x, idx, w))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    unpaged = qwen3_experts()
    paged = copy.deepcopy(unpaged)
    k_slots = 64
    moepage.wrap(paged, resident=k_slots, backend=CudaStore())
    layer = paged_layer(paged)
    pager, state = layer.pager, layer.pager.device_state
    rows = []
    breakdown: dict[int, str] = {}  # tokens -> the empty wave's kernels
    reps = 20
    for t in args.tokens:
        x = torch.randn(t, 2048, device=DEV, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(k_slots)[:8] for _ in range(t)]).to(DEV)
        w = torch.rand(t, 8, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(paged(x, idx, w), unpaged(x, idx, w))
        waves = moepage_step.device_wave_count(pager, idx.numel())
        stages = {
            "unpaged step": lambda: unpaged(x, idx, w),
            "paged step (device_forward)": lambda: device_forward(layer, x, idx, w),
            "gather at count 0": lambda: pager.store.gather(pager.name, state.step_plan.experts,
                                                            state.step_plan.slots, state.step_plan.count),
        }
        if waves == 1:
            slots = state.plan(idx, pad=k_slots)

            def plan_and_gather():
                state.plan(idx, pad=k_slots)
                pager.store.gather(pager.name, state.step_plan.experts, state.step_plan.slots, state.step_plan.count)

            stages.update({
                "plan (writes entry slots)": lambda: state.plan(idx, pad=k_slots),
                "plan + gather": plan_and_gather,
                "forward on slot ids": lambda: layer.original_forward(x, slots, w),
            })
        else:  # every wave runs per entry: the module over every row, the other waves' entries on the sentinel
            ranks = state.ranks(idx)
            slots = state.plan(idx, -1, ranks, 0)
            runner = layer.runner

            def entry_wave(reduce: bool):
                step = layer.waves(runner, x, idx, w)
                step.run(StepWave(slots, 0, waves))
                return step.finish() if reduce else None

            empty = torch.full_like(slots, -1)

            def empty_wave():  # a later wave at 100 % hits: no entry is its own, every row still runs
                step = layer.waves(runner, x, idx, w)
                step.run(StepWave(empty, 1, waves))

            def paged_skipping():  # its empty waves as graph if-nodes (MOEPAGE_SKIP_EMPTY_WAVES=on)
                with paging_config(paged, skip_empty_waves=True):
                    return device_forward(layer, x, idx, w)

            def paged_overlapped():  # waves of K // 2, each paged in beside the last (MOEPAGE_DECODE_OVERLAP=on)
                with paging_config(paged, decode_overlap=True):
                    return device_forward(layer, x, idx, w)

            stages.update({
                "ranks alone": lambda: state.ranks(idx),
                f"ranks + plan of one wave (of {waves})": lambda: state.plan(idx, -1, state.ranks(idx), 0),
                "one per-entry wave": lambda: entry_wave(False),
                "one per-entry wave + reduce": lambda: entry_wave(True),
                "one empty per-entry wave": empty_wave,
                "paged step, empty waves skipped (if-nodes)": paged_skipping,
                "paged step, overlapped waves of K // 2": paged_overlapped,
            })
            breakdown[t] = top_kernels(kernels_of_call(empty_wave))
        for name, fn in stages.items():
            us = time_ms(graph_of(fn, reps).replay) * 1e3 / reps
            kernels = kernels_of_call(fn)
            rows.append(dict(tokens=t, stage=name, captured_us=us, eager_kernels=len(kernels),
                             eager_kernel_us=sum(us for _, us in kernels)))
    conditionals = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, graph conditionals: {conditionals}")
    print(table(rows))
    for t, text in breakdown.items():
        print(f"\nThe empty wave's kernels at {t} tokens (eager, by device time):\n{text}")


if __name__ == "__main__":
    main()
