"""The experts of an engine's fused-MoE layer (SGLang's and vLLM's) on the CPU, for ``cpu_share``: unquantized
``w13_weight [E, 2I, H]`` (gate rows, then up rows: what both engines' Triton kernels and ``silu_and_mul`` read) and
``w2_weight [E, H, I]``, SiLU-gated, no biases, the router weight applied to the output. Under TP a rank's rows are its
shard of every expert, and the CPU's output its partial sum, as the device's is. Every other layout or format is
refused for the split (``fused_problem``), saying why: its CPU computation is not checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

W13, W2 = "w13_weight", "w2_weight"
UNQUANTIZED = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class FusedLayout:
    """What a fused-MoE layer computes, as its engine says: the weights' format and dtype, the per-expert tensors, the
    activation and the quirks a SwiGLU layer may have."""

    unquantized: bool
    dtype: torch.dtype
    params: tuple[str, ...]
    activation: str = "silu"
    gated: bool = True
    weight_on_input: bool = False  # the router weight multiplies the input, not the output
    swiglu_quirks: tuple[str, ...] = ()  # set alpha / beta / limit of a clamped SwiGLU (gpt-oss), by name


def fused_problem(layout: FusedLayout, flag: str) -> str | None:
    """Why ``flag`` (the engine's cpu_share option) cannot split this layer (None: it can)."""
    why = None
    if not layout.unquantized:
        why = "its experts are quantized; the CPU computes unquantized bf16 / fp16 / fp32 experts only (the CPU "
        why += "computation of a quantized format is not checked)"
    elif layout.dtype not in UNQUANTIZED:
        why = f"its experts are {layout.dtype}; the CPU computes bf16 / fp16 / fp32 ones"
    elif set(layout.params) != {W13, W2}:
        why = f"it pages {', '.join(layout.params)}; the CPU computes {W13} and {W2} alone (no biases)"
    elif layout.activation != "silu" or not layout.gated:
        why = f"its activation is {'' if layout.gated else 'ungated '}{layout.activation}; the CPU computes SiLU-gated"
    elif layout.weight_on_input:
        why = "it applies the router weight to the input; the CPU applies it to the output"
    elif layout.swiglu_quirks:
        why = f"its SwiGLU sets {', '.join(layout.swiglu_quirks)} (a clamped variant the CPU does not compute)"
    return None if why is None else f"{flag}: {why}; serve without it"


class FusedSwiglu:
    """One expert of a fused-MoE layer on the CPU (a ``moepage.CpuExpert``)."""

    params = (W13, W2)

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size
        self.kind = "fused SwiGLU (w13, w2)"

    def __call__(self, x: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        w13 = rows[W13]
        gate, up = F.linear(x.to(w13.dtype), w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, rows[W2]).float()
