"""Helpers the GPU benchmark scripts share: the benchmark layer, the link's reference bandwidth
and markdown tables."""

from __future__ import annotations

import torch


def qwen3_experts(device: str = "cuda") -> torch.nn.Module:
    """HF ``Qwen3MoeExperts`` with Qwen3-30B-A3B expert shapes (E=128, top-8, H=2048, I=768), bf16,
    ``grouped_mm``, weights drawn N(0, 0.02)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    cfg._experts_implementation = "grouped_mm"
    layer = Qwen3MoeExperts(cfg).to(device, torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer.requires_grad_(False)  # inference only: moepage refuses grad mode on parameters requiring grad


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
