"""Helpers the GPU benchmark scripts share: the link's reference bandwidth and markdown tables."""

from __future__ import annotations

import torch


def memcpy_gbs(nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """GB/s of one large pinned host -> device cudaMemcpyAsync (the link's reference peak)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    return 5 * nbytes / (a.elapsed_time(b) * 1e6)


def table(rows: list[dict]) -> str:
    """Markdown table of ``rows`` (floats with three decimals); columns from the first row."""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows])
