"""Which SGLang fused-MoE quantization methods moepage pages, and which of a layer's tensors.

A *format* names a quant method (by class, checked lazily so an absent optional dependency costs
nothing) plus what the generic rule cannot see: per-expert tensors the runner never reads
(``unpaged``: loaded with the checkpoint, never paged). The generic rule: every parameter of the
layer whose name starts with ``w13_`` / ``w2_`` and whose leading dimension is the layer's local
expert count is per-expert; a parameter tagged ``_sglang_require_global_experts`` stays whole.

Whether the post-load step repacks the experts follows from the runner contract
(``runner.MarlinContract.repacks``), not from the format.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

EXPERT_PREFIXES = ("w13_", "w2_")
UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Format:
    label: str
    module: str  # where the method class lives
    cls: str
    unpaged: tuple[str, ...] = ()
    check: str | None = None  # name of an extra predicate in this module

    def method_class(self):
        try:
            return getattr(importlib.import_module(self.module), self.cls)
        except (ImportError, AttributeError):
            return None

    def matches(self, method) -> bool:
        klass = self.method_class()
        if klass is None or not isinstance(method, klass):
            return False
        return self.check is None or globals()[self.check](method)


def _is_block_fp8(method) -> bool:
    cfg = method.quant_config
    return (
        cfg.weight_block_size is not None
        and cfg.is_checkpoint_fp8_serialized
        and not getattr(method, "use_mxfp8", False)
        and not getattr(method, "is_fp4_expert", False)
    )


def _no_cpu_kernel(method) -> bool:
    # On AMX / arm64 hosts this method runs a CPU kernel of its own instead of its runner.
    mod = importlib.import_module(type(method).__module__)
    return not getattr(mod, "_is_cpu_amx_available", False) and not getattr(mod, "_is_cpu_arm64", False)


FORMATS: tuple[Format, ...] = (
    Format("unquantized bf16/fp16/fp32", "sglang.srt.layers.quantization.unquant", "UnquantizedFusedMoEMethod"),
    Format("block FP8 (Triton)", "sglang.srt.layers.quantization.fp8", "Fp8MoEMethod", check="_is_block_fp8"),
    Format("W8A8 FP8 (Triton)", "sglang.srt.layers.quantization.w8a8_fp8", "W8A8FP8MoEMethod"),
    Format("W8A8 INT8 (Triton)", "sglang.srt.layers.quantization.w8a8_int8", "W8A8Int8MoEMethod", check="_no_cpu_kernel"),
    Format("block INT8 (Triton)", "sglang.srt.layers.quantization.blockwise_int8", "BlockInt8MoEMethod"),
    # The Marlin kernel never reads GPTQ's zero points.
    Format("GPTQ int4/int8 (Marlin)", "sglang.srt.layers.quantization.gptq.gptq", "GPTQMarlinMoEMethod",
           unpaged=("w13_qzeros", "w2_qzeros")),
    Format("AWQ int4 (Marlin)", "sglang.srt.layers.quantization.awq.awq", "AWQMoEMethod"),
)


def supported_labels() -> str:
    return ", ".join(f.label for f in FORMATS)


def format_for(method) -> Format | None:
    for fmt in FORMATS:
        if fmt.matches(method):
            return fmt
    return None


def format_problem(method, params_dtype: torch.dtype | None) -> str | None:
    """Why ``method`` cannot be paged (None: it can)."""
    fmt = format_for(method)
    if fmt is None:
        near = [f.label for f in FORMATS if (c := f.method_class()) is not None and isinstance(method, c)]
        detail = f" (only as {near[0]})" if near else ""
        return (
            f"{type(method).__name__} experts are not supported{detail}; "
            f"supported formats: {supported_labels()}"
        )
    if fmt.cls == "UnquantizedFusedMoEMethod" and params_dtype is not None and params_dtype not in UNQUANTIZED_DTYPES:
        return f"unquantized experts of dtype {params_dtype} are not supported; supported formats: {supported_labels()}"
    return None


def expert_params(layer, num_rows: int) -> tuple[str, ...]:
    """The layer's per-expert parameters: ``w13_*`` / ``w2_*`` with ``num_rows`` leading rows."""
    return tuple(
        name
        for name, p in layer.named_parameters(recurse=False)
        if name.startswith(EXPERT_PREFIXES)
        and p.dim() >= 1
        and p.shape[0] == num_rows
        and p.numel() > 0  # e.g. GPTQ's g_idx without act-order: nothing to page
        and not getattr(p, "_sglang_require_global_experts", False)
    )
