"""Helpers the GPU benchmark scripts share: the benchmark layer, the link's reference bandwidth,
CUDA-event timing and graph capture, and markdown tables."""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch


def hf_experts(hidden: int = 2048, inter: int = 768, num_experts: int = 128, top_k: int = 8,
               device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """HF ``Qwen3MoeExperts`` (``grouped_mm``) of these shapes (default Qwen3-30B-A3B's), made
    uninitialised on ``device`` in ``dtype``; on "meta" it holds no memory."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                      num_experts_per_tok=top_k)
    cfg._experts_implementation = "grouped_mm"
    with torch.device(device):
        return Qwen3MoeExperts(cfg).to(dtype)


def qwen3_experts(device: str = "cuda") -> torch.nn.Module:
    """``hf_experts`` with Qwen3-30B-A3B expert shapes (E=128, top-8, H=2048, I=768) on ``device``,
    bf16, weights drawn N(0, 0.02)."""
    layer = hf_experts(device=device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer.requires_grad_(False)  # inference only: moepage refuses grad mode on parameters requiring grad


def memcpy_gbs(nbytes: int = 1 << 30, device: str = "cuda", host: torch.Tensor | None = None) -> float:
    """GB/s of one large pinned host -> device cudaMemcpyAsync (the link's reference peak): of
    ``nbytes`` fresh pinned bytes, or of the whole pinned tensor ``host`` when given."""
    if host is None:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host = host.reshape(-1)
    nbytes = host.numel() * host.element_size()
    dev = torch.empty_like(host, device=device)
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


def versions() -> str:
    """The device and the versions a result depends on, for the first line of a report."""
    import importlib.metadata as md

    def v(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "absent"

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return f"{device}, torch {torch.__version__}, triton {v('triton')}, transformers {v('transformers')}"


def time_ms(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture(fn: Callable[[], Any], n: int = 1, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` called ``warmup`` times eagerly on a side stream, then ``n`` times captured in one
    CUDA graph, both inside ``moepage.capture_mode()`` (paged steps take the path the capture
    takes); returns the graph and the captured last call's result (its static output)."""
    import moepage

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), moepage.capture_mode():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    out = None
    with moepage.capture_mode(), torch.cuda.graph(g):
        for _ in range(n):
            out = fn()
    return g, out


def graph_of(fn: Callable[[], Any], n: int) -> torch.cuda.CUDAGraph:
    return capture(fn, n)[0]


def table(rows: list[dict]) -> str:
    """Markdown table of ``rows`` (floats with three decimals); columns: every key, in order of
    first appearance."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows])
