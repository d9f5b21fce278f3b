"""How the engine benchmark's checkpoints are quantized (``Quantization``, one frozen record per layout), each
layout as its real checkpoints store it:
- block FP8 per 128 x 128 block with ``weight_scale_inv`` (DeepSeek, Qwen3-FP8), w ~= fp8 x scale;
- compressed-tensors FP8 per output channel with a bf16 ``weight_scale`` [N, 1] and dynamic per-token activations
  ("FP8-dynamic" checkpoints); SGLang's own W8A8 FP8 and INT8 per output channel;
- integer experts in groups of 128 along the input, as GPTQ (int4 and int8), AutoAWQ and compressed-tensors
  ("pack-quantized") pack them (``group_codes``, ``pack_codes``);
- gpt-oss's MXFP4 experts: e2m1 codes in blocks of 32 with an e8m0 scale each (``quantize_mxfp4``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = (128, 128)
GPTQ_GROUP = 128


# -- block FP8 -------------------------------------------------------------------------------
def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] -> (fp8 e4m3 [..., N, K], fp32 ``weight_scale_inv`` [..., ceil(N/bn), ceil(K/bk)])
    with w ~= fp8 * scale per block: each block's largest magnitude maps to 448."""
    bn, bk = block
    *lead, n, k = w.shape
    pn, pk = -n % bn, -k % bk
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    x = x.reshape(*lead, (n + pn) // bn, bn, (k + pk) // bk, bk)
    amax = x.abs().amax(dim=(-3, -1), keepdim=True).clamp_(min=1e-12)
    scale = amax / FP8_MAX
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(*lead, n + pn, k + pk)[..., :n, :k].contiguous()
    return q, scale.squeeze(-1).squeeze(-2).contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    bn, bk = block
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return q.float() * s


def quantize_channel(w: torch.Tensor, target: torch.dtype = FP8,
                     scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] -> (``target`` [..., N, K], ``weight_scale`` [..., N, 1] in ``scale_dtype``) with
    w ~= q * scale per output channel: each row's largest magnitude maps to the target's largest value (448
    for e4m3, 127 for int8, rounded to nearest). The scale is rounded to its stored dtype first, so that
    dequantizing with the stored scale is what was quantized."""
    top = FP8_MAX if target == FP8 else 127.0
    amax = w.float().abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
    scale = (amax / top).to(scale_dtype)
    x = (w.float() / scale.float()).clamp_(-top, top)
    q = x.to(FP8) if target == FP8 else x.round_().to(torch.int8)
    return q.contiguous(), scale.contiguous()


# -- integers in groups (GPTQ int4 and int8, AWQ, compressed-tensors W4A16) --------------------------------
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: word j's nibble i holds output column 8j + AWQ_ORDER[i]


def group_codes(w: torch.Tensor, group: int, zero_point: bool, bits: int = 4):
    """``w`` [..., N, K] -> (``bits``-wide codes [..., N, K] in 0 .. 2^bits - 1, fp16 scales [..., N, K / group],
    zero points [..., N, K / group]) with w ~= (code - zero) * scale per group along K. Symmetric (GPTQ,
    compressed-tensors): the zero is 2^(bits - 1) and the group's largest magnitude sits at the code's edge; with
    ``zero_point`` (AWQ) the group's range spans the codes."""
    *lead, n, k = w.shape
    if k % group or k % 8 or n % 8:
        raise ValueError(f"int{bits} groups: K = {k} must be a multiple of the group ({group}), and K and N = {n} of 8")
    top = (1 << bits) - 1
    x = w.float().reshape(*lead, n, k // group, group)
    if zero_point:
        lo, hi = x.amin(dim=-1), x.amax(dim=-1)
        scale = ((hi - lo) / top).clamp_(min=1e-8).half()
        zero = (-lo / scale.float()).round_().clamp_(0, top)
    else:
        scale = (x.abs().amax(dim=-1) * 2 / top).clamp_(min=1e-8).half()
        zero = torch.full(scale.shape, float(1 << (bits - 1)))
    codes = (x / scale.float().unsqueeze(-1)).round_().add_(zero.unsqueeze(-1)).clamp_(0, top)
    return codes.to(torch.int64).reshape(*lead, n, k), scale, zero.to(torch.int64)


def pack_codes(codes: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """Codes 0 .. 2^bits - 1 [..., R, C] packed 32 / ``bits`` to an int32 along ``dim`` (-2 or -1), low bits first
    (compressed-tensors' own packer, which GPTQ's layout shares)."""
    from compressed_tensors.compressors import pack_to_int32

    flat = (codes - (1 << (bits - 1))).to(torch.int8).reshape(-1, *codes.shape[-2:])
    packed = pack_to_int32(flat, bits, packed_dim=0 if dim == -2 else 1)
    return packed.reshape(*codes.shape[:-2], *packed.shape[-2:]).contiguous()


def quantize_gptq(w: torch.Tensor, group: int = GPTQ_GROUP, bits: int = 4) -> dict[str, torch.Tensor]:
    """GPTQ's symmetric ``bits``-wide (4 or 8) tensors of ``w`` [..., N, K], ``desc_act`` off: ``qweight``
    [..., K * bits / 32, N], fp16 ``scales`` [..., K / group, N], ``qzeros`` [..., K / group, N * bits / 32] (the zero
    point minus one, as GPTQ's v1 format writes it) and ``g_idx`` [..., K]."""
    codes, scale, zero = group_codes(w, group, zero_point=False, bits=bits)
    k = w.shape[-1]
    return {"qweight": pack_codes(codes.transpose(-1, -2), -2, bits), "scales": scale.transpose(-1, -2).contiguous(),
            "qzeros": pack_codes(zero.transpose(-1, -2) - 1, -1, bits),
            "g_idx": (torch.arange(k, dtype=torch.int32) // group).expand(*w.shape[:-2], k).contiguous()}


def quantize_awq(w: torch.Tensor, group: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """AWQ int4's tensors of ``w`` [..., N, K] (GEMM layout, zero points): ``qweight`` [..., K, N / 8] and ``qzeros``
    [..., K / group, N / 8] packed along N in ``AWQ_ORDER``, fp16 ``scales`` [..., K / group, N]."""
    codes, scale, zero = group_codes(w, group, zero_point=True)
    n = w.shape[-2]
    order = (torch.arange(n).reshape(-1, 8)[:, list(AWQ_ORDER)]).flatten()  # column 8j + i <- 8j + AWQ_ORDER[i]
    return {"qweight": pack_codes(codes.transpose(-1, -2)[..., order], -1),
            "qzeros": pack_codes(zero.transpose(-1, -2)[..., order], -1),
            "scales": scale.transpose(-1, -2).contiguous()}


def quantize_ct_w4a16(w: torch.Tensor, group: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """compressed-tensors' "pack-quantized" W4A16 tensors of ``w`` [..., N, K] (symmetric, in groups):
    ``weight_packed`` [..., N, K / 8], ``weight_scale`` [..., N, K / group] in ``w``'s dtype and ``weight_shape``
    (N, K)."""
    codes, scale, _ = group_codes(w, group, zero_point=False)
    shape = torch.tensor(w.shape[-2:], dtype=torch.int64).expand(*w.shape[:-2], 2).contiguous()
    return {"weight_packed": pack_codes(codes, -1), "weight_scale": scale.to(w.dtype), "weight_shape": shape}


# -- MXFP4 (gpt-oss) ----------------------------------------------------------------------------------
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of e2m1's magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] -> MXFP4 as gpt-oss checkpoints store it: ``blocks`` uint8 [..., N, K / 32, 16] (two e2m1
    codes a byte, the even element in the low nibble, sign in each code's high bit) and ``scales`` uint8
    [..., N, K / 32] (e8m0: the power of two 2^(s - 127) that brings the block's largest magnitude to at most 6),
    each weight rounded to the nearest e2m1 magnitude (NVIDIA ModelOpt's rule, which SGLang ships)."""
    *lead, n, k = w.shape
    if k % 32:
        raise ValueError(f"MXFP4: K = {k} must be a multiple of 32 (its block)")
    x = w.float().reshape(*lead, n, k // 32, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(dim=-1, keepdim=True) / 6.0)).clamp_(min=-127, max=127)
    y = x / torch.exp2(exp)
    # the count of midpoints below |y| (bucketize: no 7x temporary over a stack of experts)
    codes = (torch.bucketize(y.abs(), torch.tensor(E2M1_BOUNDS)) + 8 * torch.signbit(y)).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8).contiguous()


GROUPED = {"gptq-int4": quantize_gptq, "gptq-int8": functools.partial(quantize_gptq, bits=8),
           "awq-int4": quantize_awq, "ct-w4a16": quantize_ct_w4a16}  # integer experts in groups, on Marlin
_KINDS = ("fp8-block", "ct-fp8", "w8a8-fp8", "w8a8-int8", *GROUPED, "mxfp4")


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's attention projections and experts are quantized:
    - ``"fp8-block"``: FP8 per ``block`` with ``weight_scale_inv`` (SGLang's ``fp8`` method; DeepSeek, Qwen3-FP8);
    - ``"ct-fp8"``: compressed-tensors FP8 per output channel, bf16 ``weight_scale``, dynamic per-token
      activations ("FP8-dynamic" checkpoints);
    - ``"w8a8-fp8"`` / ``"w8a8-int8"``: SGLang's ``w8a8_fp8`` / ``w8a8_int8`` methods, per output channel with
      an fp32 ``weight_scale``, dynamic per-token activations;
    - ``"gptq-int4"`` / ``"gptq-int8"`` / ``"awq-int4"`` / ``"ct-w4a16"``: integer experts in ``group``s along the
      input (128 as in real checkpoints), as GPTQ (symmetric, ``desc_act`` off, fp16: SGLang's GPTQ MoE scales are
      fp16), AutoAWQ (GEMM layout with zero points, fp16) and compressed-tensors ("pack-quantized", symmetric, bf16)
      write them.
      Attention stays unquantized (each format's own skip list), so that SGLang's Marlin MoE kernel is the only
      one these build;
    - ``"mxfp4"``: gpt-oss's MXFP4 experts (``quantize_mxfp4``; gpt-oss models only), the rest bf16, as gpt-oss's
      checkpoints keep attention, the router, embeddings and lm_head."""

    kind: str
    block: tuple[int, int] = BLOCK  # FP8 blocks
    group: int = GPTQ_GROUP  # GPTQ's input group

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown quantization {self.kind!r}: one of {', '.join(map(repr, _KINDS))}")

    @property
    def attention(self) -> bool:
        """Whether the attention projections are quantized too."""
        return self.kind not in (*GROUPED, "mxfp4")

    @property
    def runner(self) -> str:
        """SGLang's ``--moe-runner-backend`` its experts are served with (the grouped integers and MXFP4 on Marlin:
        the grouped ones' methods pick it themselves)."""
        return "marlin" if self.kind == "mxfp4" else "auto" if self.kind in GROUPED else "triton"

    @property
    def dtype(self) -> str:
        """The checkpoint's activation dtype."""
        return "float16" if self.kind in ("gptq-int4", "gptq-int8", "awq-int4") else "bfloat16"

    def config(self) -> dict:
        """The checkpoint's ``quantization_config``."""
        if self.kind.startswith("gptq"):
            return {"quant_method": "gptq", "bits": int(self.kind[-1]), "group_size": self.group, "desc_act": False,
                    "sym": True, "lm_head": False, "dynamic": {"-:.*self_attn.*": {}}}
        if self.kind == "awq-int4":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group, "zero_point": True, "version": "gemm",
                    "modules_to_not_convert": ["self_attn"]}
        if self.kind == "ct-w4a16":
            return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": self.group, "dynamic": False, "actorder": None}}}}
        if self.kind == "mxfp4":
            return {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        if self.kind == "fp8-block":
            return {"quant_method": "fp8", "weight_block_size": list(self.block), "activation_scheme": "dynamic",
                    "fmt": "e4m3"}
        if self.kind.startswith("w8a8"):
            return {"quant_method": self.kind.replace("-", "_")}
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head", "re:.*mlp.gate$"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": {**fp8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**fp8, "strategy": "token", "dynamic": True}}}}

    def quantize(self, name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors of weight ``name`` (one matrix, or experts stacked on the first dim)."""
        if self.kind == "mxfp4":  # ``name``: a stacked gpt-oss expert tensor, ``w`` [E, N, K]
            blocks, scales = quantize_mxfp4(w)
            return [(name + "_blocks", blocks), (name + "_scales", scales)]
        if self.kind in GROUPED:
            base = name.removesuffix("weight")
            return [(base + n, t) for n, t in GROUPED[self.kind](w, self.group).items()]
        if self.kind == "fp8-block":
            q, scale = quantize_block_fp8(w, self.block)
            return [(name, q), (name + "_scale_inv", scale)]
        if self.kind == "ct-fp8":
            q, scale = quantize_channel(w)
        else:
            q, scale = quantize_channel(w, FP8 if self.kind == "w8a8-fp8" else torch.int8, torch.float32)
        return [(name, q), (name + "_scale", scale)]

    def marker(self) -> dict:
        return {"kind": self.kind, "block": list(self.block), "group": self.group}


FP8_BLOCK = Quantization("fp8-block")
CT_FP8 = Quantization("ct-fp8")
W8A8_FP8 = Quantization("w8a8-fp8")
W8A8_INT8 = Quantization("w8a8-int8")
GPTQ_INT4 = Quantization("gptq-int4")
GPTQ_INT8 = Quantization("gptq-int8")
AWQ_INT4 = Quantization("awq-int4")
CT_W4A16 = Quantization("ct-w4a16")
MXFP4 = Quantization("mxfp4")
