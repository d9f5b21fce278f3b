"""Every expert format SGLang's paged experts describes (``paged_experts.formats.FORMATS``), as a
test case: the quantization config that selects it, the runner backend it needs, and whether
moepage serves it. Real ``FusedMoE`` layers are built from a case and filled with random valid
expert tensors in the checkpoint layout their ``create_weights`` made (``fill``); the unpaged
layer and the paged one start from the same tensors, so every format is tested by the same code.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helpers import sglang as H

E, TOP_K, HIDDEN, INTER, GROUP = 8, 2, 256, 256, 128  # multiples of every format's block and group
# Formats on SGLang's Marlin runner (compared against its batch noise, not bit for bit)
MARLIN_FORMATS = ("GptqFormat", "AwqFormat", "CompressedTensorsWNA16Format", "Mxfp4Format", "ModelOptNvfp4Format",
                  "CompressedTensorsNvfp4Format")


@dataclass(frozen=True)
class Shape:
    """A layer's experts: how many, routed how many a token, and their widths."""

    experts: int = E
    top_k: int = TOP_K
    hidden: int = HIDDEN
    inter: int = INTER


SMALL = Shape()
ENGINE = Shape(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B's, as the engine benchmark's


@dataclass(frozen=True)
class Case:
    fmt: str  # the SGLang ExpertFormat's class name
    config: Callable[[], object] | None  # the QuantizationConfig (None: unquantized)
    runner: str = "auto"  # --moe-runner-backend
    dtype: torch.dtype = torch.bfloat16
    sgl_config: dict = field(default_factory=dict)
    block: tuple[int, int] | None = None  # block FP8's weight_block_size
    bits: int | None = None  # the weight width, for formats that take several

    @property
    def served(self) -> bool:
        """Whether moepage's startup checks serve this case (``checks.SERVED``, ``FP8_BLOCKS``, ``CHECKED_BITS``)."""
        from moepage.integrations.sglang import checks

        return (self.fmt in checks.SERVED and (self.block is None or list(self.block) in checks.FP8_BLOCKS)
                and (self.bits is None or self.bits in checks.CHECKED_BITS.get(self.fmt, (self.bits,))))


def _fp8_block(block: int = 128):
    def make():
        from sglang.srt.layers.quantization.fp8 import Fp8Config

        return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                         weight_block_size=[block, block])

    return make


def _w8a8_fp8():
    from sglang.srt.layers.quantization.w8a8_fp8 import W8A8Fp8Config

    return W8A8Fp8Config(is_checkpoint_fp8_serialized=True)


def _w8a8_int8():
    from sglang.srt.layers.quantization.w8a8_int8 import W8A8Int8Config

    return W8A8Int8Config({"quant_method": "w8a8_int8"})


def _block_int8():
    from sglang.srt.layers.quantization.blockwise_int8 import BlockInt8Config

    return BlockInt8Config(is_checkpoint_int8_serialized=True, activation_scheme="dynamic", ignored_layers=None,
                           weight_block_size=[128, 128])


def _gptq(bits: int):
    def make():
        from sglang.srt.layers.quantization.gptq.gptq import GPTQMarlinConfig

        return GPTQMarlinConfig.from_config({"bits": bits, "group_size": GROUP, "desc_act": False, "sym": True,
                                             "lm_head": False, "quant_method": "gptq"})

    return make


def _awq():
    from sglang.srt.layers.quantization.awq.awq import AWQMarlinConfig

    return AWQMarlinConfig.from_config({"bits": 4, "group_size": GROUP, "zero_point": True, "lm_head": False,
                                        "quant_method": "awq"})


def _mxfp4():
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    return Mxfp4Config.from_config({"quant_method": "mxfp4"})


def _modelopt_nvfp4():
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    return ModelOptFp4Config.from_config({"quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                           "exclude_modules": []}})


def _compressed(weights: dict, activations: dict | None, fmt: str):
    def make():
        from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig.from_config({
            "format": fmt, "quant_method": "compressed-tensors", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
        })

    return make


def ct_wna16(bits: int):
    return _compressed({"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                        "dynamic": False, "actorder": None}, None, "pack-quantized")

CT_FP8 = _compressed({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                     {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
                     "float-quantized")
def ct_fp8_block(block: int):
    """compressed-tensors FP8 with [block, block] weight blocks and per-token-group dynamic activations."""
    return _compressed({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                        "block_structure": [block, block], "dynamic": False},
                       {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": block,
                        "dynamic": True}, "float-quantized")


CT_NVFP4A16 = _compressed({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                           "group_size": 16, "dynamic": False}, None, "nvfp4-pack-quantized")

CASES: dict[str, Case] = {
    "bf16": Case("UnquantizedFormat", None),
    "fp16": Case("UnquantizedFormat", None, dtype=torch.float16),
    "fp8-block": Case("Fp8BlockFormat", _fp8_block(), block=(128, 128)),  # DeepSeek's and Qwen3-FP8's
    "fp8-block16": Case("Fp8BlockFormat", _fp8_block(16), block=(16, 16)),  # the old GPU test's blocks
    "w8a8-fp8": Case("W8A8Fp8Format", _w8a8_fp8),
    "w8a8-int8": Case("W8A8Int8Format", _w8a8_int8),
    "block-int8": Case("BlockInt8Format", _block_int8),
    "ct-fp8": Case("CompressedTensorsFp8Format", CT_FP8),
    "ct-fp8-block": Case("CompressedTensorsFp8Format", ct_fp8_block(128), block=(128, 128)),
    # SGLang's GPTQ MoE method makes its scales fp16 whatever the model's dtype, and Marlin needs the
    # activations in the scales' dtype: GPTQ experts run in fp16.
    "gptq4": Case("GptqFormat", _gptq(4), dtype=torch.float16),
    "gptq8": Case("GptqFormat", _gptq(8), dtype=torch.float16),
    "awq4": Case("AwqFormat", _awq),
    "mxfp4": Case("Mxfp4Format", _mxfp4, runner="marlin"),
    "nvfp4": Case("ModelOptNvfp4Format", _modelopt_nvfp4, runner="marlin"),
    "ct-w4a16": Case("CompressedTensorsWNA16Format", ct_wna16(4), bits=4),
    "ct-w8a16": Case("CompressedTensorsWNA16Format", ct_wna16(8), bits=8),
    "ct-nvfp4a16": Case("CompressedTensorsNvfp4Format", CT_NVFP4A16),
}


@contextlib.contextmanager
def runner_backend(name: str):
    """SGLang's ``--moe-runner-backend`` for the block (its methods read it when built)."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend, get_flags

    moe = get_flags().moe
    before = moe.runner_backend
    moe.runner_backend = MoeRunnerBackend(name)
    try:
        yield
    finally:
        moe.runner_backend = before


def layer(case: Case, device: str, shape: Shape = SMALL):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(case.dtype), torch.device(device), runner_backend(case.runner):
        return FusedMoE(num_experts=shape.experts, hidden_size=shape.hidden, intermediate_size=shape.inter, layer_id=0,
                        top_k=shape.top_k, prefix="model.layers.0.mlp.experts",
                        quant_config=case.config() if case.config else None)


def _draw(name: str, p: torch.Tensor, gen: torch.Generator, shape: Shape) -> torch.Tensor:
    """Random valid contents of one expert tensor: small scales and weights, so no output overflows. Scales and
    weights shrink with the square root of the tensor's fan-in beyond SMALL's, so that outputs are as large at
    the engine's widths as at SMALL's (at 2048 x 768, int8 codes at SMALL's scales overflow fp16)."""
    size, dt = p.shape, p.dtype
    fan_in = (lambda s: s.hidden) if name.startswith("w13") else (lambda s: s.inter)
    shrink = (fan_in(SMALL) / fan_in(shape)) ** 0.5
    if name.endswith("g_idx_sort_indices"):
        return torch.arange(size[-1], dtype=dt).expand(size).clone()
    if name.endswith("g_idx"):
        return (torch.arange(size[-1]) // GROUP).to(dt).expand(size).clone()
    if name.endswith("weight_shape"):  # the (out, in) of each expert's tensor
        out_in = (2 * shape.inter, shape.hidden) if name.startswith("w13") else (shape.hidden, shape.inter)
        return torch.tensor(out_in, dtype=dt).expand(size).clone()
    if "global_scale" in name or "scale_2" in name:  # one per expert, shared by its gate and up projections
        return torch.ones(size, dtype=dt)
    if dt in (torch.int32, torch.int64):
        return torch.randint(-2**31, 2**31 - 1, size, dtype=torch.int64, generator=gen).to(dt)
    if dt == torch.int8:
        return torch.randint(-100, 100, size, dtype=torch.int8, generator=gen)
    if dt == torch.uint8:  # MXFP4's e8m0 scales: 2^-7 .. 2^-1 at SMALL's widths; packed 4-bit values: any byte
        below = round(-math.log2(shrink))
        lo, hi = (120 - below, 127 - below) if "scale" in name else (0, 256)
        return torch.randint(lo, hi, size, dtype=torch.int64, generator=gen).to(dt)
    if "scale" in name:
        return ((torch.rand(size, generator=gen) * 0.01 + 0.005) * shrink).to(dt)
    if "bias" in name:
        return (torch.randn(size, generator=gen) * 0.05).to(dt)
    # 8-bit float weights keep their range (their scales shrink); wider ones shrink themselves
    return (torch.randn(size, generator=gen) * (0.5 if dt.itemsize == 1 else 0.1 * shrink)).to(dt)


def fill(module, gen: torch.Generator, shape: Shape) -> dict[str, torch.Tensor]:
    """Random checkpoint-layout contents for every per-expert tensor of an unpaged layer (written into it)."""
    out = {}
    for name, p in module.named_parameters(recurse=False):
        if name.startswith(("w13_", "w2_")):
            out[name] = _draw(name, p, gen, shape)
            p.data.copy_(out[name].to(p.device))
    return out


def pair(case: Case, k: int, device: str = "cuda", graphs=("disabled", "disabled"), seed: int = 0,
         shape: Shape = SMALL):
    """The unpaged layer and the paged one (K slots) of ``case``, loaded with the same random experts."""
    from moepage.integrations.sglang import compat

    gen = torch.Generator().manual_seed(seed)
    with H.server_args(**case.sgl_config):
        ref = layer(case, device, shape)
        data = fill(ref, gen, shape)
        with runner_backend(case.runner):
            ref.quant_method.process_weights_after_loading(ref)
    with H.server_args(**H.paged_args(k), **case.sgl_config), runner_backend(case.runner):
        H.graph_config(*graphs)
        paged = layer(case, device, shape)
        method = paged.quant_method
        freed = compat.format_for(paged, method.base_method).freed  # made for other runners; paging frees them
        for name, rows in data.items():
            if name in method.names:
                method.rows.host(name).copy_(rows)
            elif name not in freed:
                getattr(paged, name).data.copy_(rows.to(device))
        method.process_weights_after_loading(paged)
    assert compat.format_for(paged, method.base_method).__class__.__name__ == case.fmt
    return ref, paged


def forward(module, x, topk):
    return H.forward(module, x, topk)
