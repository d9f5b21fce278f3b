"""Why an overlapped prefill step takes longer than its page-in (diagnostic, CUDA GPU).

The layer of ``prefill_bench.py`` at K/E = 0.25, 2048 tokens, ``prefill_overlap=True``. Prints:
- how long the host is held by one ``non_blocking`` row copy from the ``cuda`` store's host rows
  (an asynchronous copy returns in microseconds; a synchronous one takes the row's transfer time);
- the device timeline of one step from torch.profiler: every host-to-device copy and kernel,
  with its stream, start and duration, and the idle gaps of the copy engine.

    python -m bench.models.prefill_timeline
"""

from __future__ import annotations

import time

import torch

import moepage
from bench.common import qwen3_experts
from moepage.nn.layer import paged_layer

DEV = torch.device("cuda")


def main() -> None:
    layer = qwen3_experts()
    moepage.wrap(layer, resident=32, prefill_overlap=True)
    pager = paged_layer(layer)
    host = pager.store.host_rows(pager.name, "gate_up_proj")
    slots = pager.store.slots(pager.name, "gate_up_proj")
    torch.cuda.synchronize()
    for _ in range(3):
        t0 = time.perf_counter()
        slots[0].copy_(host[5], non_blocking=True)
        held = time.perf_counter() - t0
        torch.cuda.synchronize()
    print(f"host rows pinned: {host.is_pinned()}; one {host[5].nbytes / 1e6:.1f} MB non_blocking row copy holds "
          f"the host {held * 1e6:.0f} us")

    tokens = 2048
    x = torch.randn(tokens, 2048, device=DEV, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(128)[:8] for _ in range(tokens)]).to(DEV)
    w = torch.rand(tokens, 8, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        layer(x, idx, w)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        layer(x, idx, w)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    print(f"one step: host returns after {host_s * 1e3:.2f} ms, GPU done after {wall_s * 1e3:.2f} ms")
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    t_first = events[0].time_range.start
    copies = [e for e in events if "Memcpy" in e.name or "memcpy" in e.name]
    copy_ids = {id(e) for e in copies}
    busy, gaps, last_end = 0.0, [], None
    for e in copies:
        if last_end is not None and e.time_range.start > last_end:
            gaps.append((last_end - t_first, e.time_range.start - last_end))
        busy += e.time_range.end - e.time_range.start
        last_end = max(last_end or 0, e.time_range.end)
    span = events[-1].time_range.end - t_first
    print(f"device span {span / 1e3:.2f} ms; {len(copies)} copies busy {busy / 1e3:.2f} ms; "
          f"{len(events) - len(copies)} kernels")
    print("copy-engine gaps over 50 us (at ms, for us):",
          ", ".join(f"{a / 1e3:.2f}:{g:.0f}" for a, g in gaps if g > 50))
    print("| start ms | dur us | stream | what |\n|---|---|---|---|")
    prev = None
    for e in events:  # runs of the same kind on one stream are folded into one line
        key = (getattr(e, "device_resource_id", None), "copy" if id(e) in copy_ids else "kernel")
        if prev and prev[0] == key and e.time_range.start - prev[2] < 30:
            prev[2] = e.time_range.end
            prev[3] += 1
            continue
        if prev:
            print(f"| {(prev[1] - t_first) / 1e3:.3f} | {prev[2] - prev[1]:.0f} | {prev[0][0]} "
                  f"| {prev[3]} x {prev[0][1]} |")
        prev = [key, e.time_range.start, e.time_range.end, 1]
    print(f"| {(prev[1] - t_first) / 1e3:.3f} | {prev[2] - prev[1]:.0f} | {prev[0][0]} | {prev[3]} x {prev[0][1]} |")


if __name__ == "__main__":
    main()
