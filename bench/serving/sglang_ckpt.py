"""Random-weight MoE checkpoints for the SGLang engine benchmark: written straight to safetensors.

Owns the model shapes (``ModelSpec``: a Qwen3-MoE with Qwen3-30B-A3B's expert and attention shapes,
a small Mixtral), deterministic random weights per layer, their quantizations (``Quantization``:
block FP8 per 128 x 128 block with ``weight_scale_inv`` as DeepSeek / Qwen FP8 checkpoints store it,
w ~= fp8 x scale; compressed-tensors FP8 per output channel with a bf16 ``weight_scale`` [N, 1] and
dynamic per-token activations, the layout of "FP8-dynamic" checkpoints; SGLang's own W8A8 FP8 and INT8
per output channel; int4 experts as GPTQ, AWQ and compressed-tensors checkpoints pack them) and the files:
``config.json`` (from transformers' config class), one safetensors shard per decoder layer plus one
for embeddings / norm / lm_head, and the index. Attention projections (not under int4) and experts are
quantized; norms, the router, embeddings and lm_head stay bf16, as in those checkpoints.

Tensor names are the Hugging Face hub layout SGLang's loaders read: per-expert
``mlp.experts.{e}.{gate,up,down}_proj`` (Qwen3-MoE) or ``block_sparse_moe.experts.{e}.w{1,2,3}``
(Mixtral). The writer fills shards without copies (each expert's row of a stacked tensor is one
contiguous byte range), one layer per thread, so several GB take seconds.

Weights are scaled so that no term dominates the residual stream (std 1/sqrt(fan-in)) and the
router's logits have std ``router_scale``: routing then changes from token to token, and
greedy outputs do not collapse onto one token.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = (128, 128)
GPTQ_GROUP = 128
_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", FP8: "F8_E4M3", torch.int32: "I32",
           torch.int64: "I64",
           torch.int8: "I8"}
MARKER = "moepage_bench_spec.json"  # written last: a checkpoint without it is incomplete


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "qwen3_moe" | "mixtral"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    inter: int  # per-expert intermediate size
    vocab: int = 1024
    context: int = 4096
    router_scale: float = 4.0  # std of the router logits
    seed: int = 0

    @property
    def expert_bytes(self) -> int:
        """bf16 bytes of one expert (gate, up and down)."""
        return 3 * self.hidden * self.inter * 2

    @property
    def experts_bytes(self) -> int:
        """bf16 bytes of every routed expert of the model."""
        return self.layers * self.experts * self.expert_bytes


# Qwen3-30B-A3B's shapes (E = 128, top-8, H = 2048, I = 768, 32 x 128 heads, 4 KV heads): each
# layer's experts are 1.2 GB in bf16, so 4 layers hold 4.8 GB of experts.
QWEN3_30B_SHAPES = ModelSpec("qwen3_moe", layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                             experts=128, top_k=8, inter=768)
MIXTRAL_SMALL = ModelSpec("mixtral", layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64,
                          experts=8, top_k=2, inter=2048)


# -- config ----------------------------------------------------------------------------------
def hf_config(spec: ModelSpec, quant: Quantization | None = None) -> dict:
    """``config.json`` of ``spec`` (transformers' own config class), quantized as ``quant`` says."""
    import transformers as tf

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                  num_experts_per_tok=spec.top_k, max_position_embeddings=spec.context, tie_word_embeddings=False)
    if spec.kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(num_experts=spec.experts, moe_intermediate_size=spec.inter,
                                intermediate_size=4 * spec.hidden, decoder_sparse_step=1, mlp_only_layers=[],
                                norm_topk_prob=True, **common)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif spec.kind == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=spec.experts, intermediate_size=spec.inter, **common)
        cfg.architectures = ["MixtralForCausalLM"]
    else:
        raise ValueError(f"unknown model kind {spec.kind!r}")
    out = cfg.to_dict()
    dtype = "bfloat16" if quant is None else quant.dtype
    out.update(dtype=dtype, torch_dtype=dtype)
    if quant is not None:
        out["quantization_config"] = quant.config()
    return out


# -- weights ---------------------------------------------------------------------------------
def _randn(shape, std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std).to(torch.bfloat16)


def _generator(spec: ModelSpec, *key: int) -> torch.Generator:
    seed = spec.seed
    for k in key:
        seed = (seed * 1_000_003 + k + 1) % (2**63)
    return torch.Generator().manual_seed(seed)


def _expert_names(spec: ModelSpec, i: int) -> tuple[str, tuple[str, str, str]]:
    """(prefix of expert e's tensors with {e}, (gate, up, down) suffixes)."""
    if spec.kind == "qwen3_moe":
        return f"model.layers.{i}.mlp.experts.{{e}}.", ("gate_proj", "up_proj", "down_proj")
    return f"model.layers.{i}.block_sparse_moe.experts.{{e}}.", ("w1", "w3", "w2")


def layer_weights(spec: ModelSpec, i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Decoder layer ``i``: (dense tensors by name, stacked experts {"gate": [E, I, H], "up", "down": [E, H, I]}),
    the same for the same spec and ``i`` on every machine."""
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    pre = f"model.layers.{i}."
    g = _generator(spec, i)
    dense = {
        pre + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        pre + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        pre + "self_attn.q_proj.weight": _randn((q, h), h**-0.5, g),
        pre + "self_attn.k_proj.weight": _randn((kv, h), h**-0.5, g),
        pre + "self_attn.v_proj.weight": _randn((kv, h), h**-0.5, g),
        pre + "self_attn.o_proj.weight": _randn((h, q), q**-0.5, g),
    }
    router = _randn((spec.experts, h), spec.router_scale * h**-0.5, g)
    if spec.kind == "qwen3_moe":
        dense[pre + "self_attn.q_norm.weight"] = torch.ones(spec.head_dim, dtype=torch.bfloat16)
        dense[pre + "self_attn.k_norm.weight"] = torch.ones(spec.head_dim, dtype=torch.bfloat16)
        dense[pre + "mlp.gate.weight"] = router
    else:
        dense[pre + "block_sparse_moe.gate.weight"] = router
    e, n = spec.experts, spec.inter
    experts = {
        "gate": _randn((e, n, h), h**-0.5, _generator(spec, i, 1)),
        "up": _randn((e, n, h), h**-0.5, _generator(spec, i, 2)),
        "down": _randn((e, h, n), n**-0.5, _generator(spec, i, 3)),
    }
    return dense, experts


def outer_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    g = _generator(spec, 10_000)
    return {
        "model.embed_tokens.weight": _randn((spec.vocab, spec.hidden), 1.0, g),
        "model.norm.weight": torch.ones(spec.hidden, dtype=torch.bfloat16),
        "lm_head.weight": _randn((spec.vocab, spec.hidden), spec.hidden**-0.5, g),
    }


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


# -- int4 in groups (GPTQ, AWQ, compressed-tensors W4A16) ---------------------------------------------
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: word j's nibble i holds output column 8j + AWQ_ORDER[i]


def group_codes(w: torch.Tensor, group: int, zero_point: bool, bits: int = 4):
    """``w`` [..., N, K] -> (codes [..., N, K] in 0 .. 2^bits - 1, fp16 scales [..., N, K / group], zero points
    [..., N, K / group]) with w ~= (code - zero) * scale per group along K. Symmetric (GPTQ, compressed-tensors):
    the zero is 2^(bits-1) and the group's largest magnitude sits at the code's edge; with ``zero_point`` (AWQ) the
    group's range spans the codes."""
    *lead, n, k = w.shape
    if k % group or k % 8 or n % 8:
        raise ValueError(f"int{bits} groups: K = {k} must be a multiple of the group ({group}), and K and N = {n} of 8")
    top = 2**bits - 1
    x = w.float().reshape(*lead, n, k // group, group)
    if zero_point:
        lo, hi = x.amin(dim=-1), x.amax(dim=-1)
        scale = ((hi - lo) / top).clamp_(min=1e-8).half()
        zero = (-lo / scale.float()).round_().clamp_(0, top)
    else:
        scale = (x.abs().amax(dim=-1) * 2 / top).clamp_(min=1e-8).half()
        zero = torch.full(scale.shape, 2 ** (bits - 1), dtype=torch.float32)
    codes = (x / scale.float().unsqueeze(-1)).round_().add_(zero.unsqueeze(-1)).clamp_(0, top)
    return codes.to(torch.int64).reshape(*lead, n, k), scale, zero.to(torch.int64)


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Codes 0 .. 15 [..., R, C] packed 8 to an int32 along ``dim`` (-2 or -1), low bits first (compressed-tensors'
    own packer, which GPTQ's layout shares)."""
    from compressed_tensors.compressors import pack_to_int32

    flat = (codes - 8).to(torch.int8).reshape(-1, *codes.shape[-2:])
    packed = pack_to_int32(flat, 4, packed_dim=0 if dim == -2 else 1)
    return packed.reshape(*codes.shape[:-2], *packed.shape[-2:]).contiguous()


def quantize_gptq(w: torch.Tensor, group: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """GPTQ int4's symmetric tensors of ``w`` [..., N, K], ``desc_act`` off: ``qweight`` [..., K / 8, N], fp16
    ``scales`` [..., K / group, N], ``qzeros`` [..., K / group, N / 8] (the zero point minus one, as GPTQ's v1
    format writes it) and ``g_idx`` [..., K]."""
    codes, scale, zero = group_codes(w, group, zero_point=False)
    k = w.shape[-1]
    return {"qweight": pack_int4(codes.transpose(-1, -2), -2), "scales": scale.transpose(-1, -2).contiguous(),
            "qzeros": pack_int4(zero.transpose(-1, -2) - 1, -1),
            "g_idx": (torch.arange(k, dtype=torch.int32) // group).expand(*w.shape[:-2], k).contiguous()}


def quantize_awq(w: torch.Tensor, group: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """AWQ int4's tensors of ``w`` [..., N, K] (GEMM layout, zero points): ``qweight`` [..., K, N / 8] and ``qzeros``
    [..., K / group, N / 8] packed along N in ``AWQ_ORDER``, fp16 ``scales`` [..., K / group, N]."""
    codes, scale, zero = group_codes(w, group, zero_point=True)
    n = w.shape[-2]
    order = (torch.arange(n).reshape(-1, 8)[:, list(AWQ_ORDER)]).flatten()  # column 8j + i <- 8j + AWQ_ORDER[i]
    return {"qweight": pack_int4(codes.transpose(-1, -2)[..., order], -1),
            "qzeros": pack_int4(zero.transpose(-1, -2)[..., order], -1), "scales": scale.transpose(-1, -2).contiguous()}


def quantize_ct_w4a16(w: torch.Tensor, group: int = GPTQ_GROUP) -> dict[str, torch.Tensor]:
    """compressed-tensors' "pack-quantized" W4A16 tensors of ``w`` [..., N, K] (symmetric, in groups):
    ``weight_packed`` [..., N, K / 8], ``weight_scale`` [..., N, K / group] in ``w``'s dtype and ``weight_shape``
    (N, K)."""
    codes, scale, _ = group_codes(w, group, zero_point=False)
    shape = torch.tensor(w.shape[-2:], dtype=torch.int64).expand(*w.shape[:-2], 2).contiguous()
    return {"weight_packed": pack_int4(codes, -1), "weight_scale": scale.to(w.dtype), "weight_shape": shape}


INT4 = {"gptq-int4": quantize_gptq, "awq-int4": quantize_awq, "ct-w4a16": quantize_ct_w4a16}
_KINDS = ("fp8-block", "ct-fp8", "w8a8-fp8", "w8a8-int8", *INT4)


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's attention projections and experts are quantized:
    - ``"fp8-block"``: FP8 per ``block`` with ``weight_scale_inv`` (SGLang's ``fp8`` method; DeepSeek, Qwen3-FP8);
    - ``"ct-fp8"``: compressed-tensors FP8 per output channel, bf16 ``weight_scale``, dynamic per-token
      activations ("FP8-dynamic" checkpoints);
    - ``"w8a8-fp8"`` / ``"w8a8-int8"``: SGLang's ``w8a8_fp8`` / ``w8a8_int8`` methods, per output channel with
      an fp32 ``weight_scale``, dynamic per-token activations;
    - ``"gptq-int4"`` / ``"awq-int4"`` / ``"ct-w4a16"``: int4 experts in ``group``s along the input (128 as in
      real checkpoints), as GPTQ (symmetric, ``desc_act`` off, fp16: SGLang's GPTQ MoE scales are fp16), AutoAWQ
      (GEMM layout with zero points, fp16) and compressed-tensors ("pack-quantized", symmetric, bf16) write them.
      Attention stays unquantized (each format's own skip list), so that SGLang's Marlin MoE kernel is the only
      one these build."""

    kind: str
    block: tuple[int, int] = BLOCK  # FP8 blocks
    group: int = GPTQ_GROUP  # GPTQ's input group

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown quantization {self.kind!r}: one of {', '.join(map(repr, _KINDS))}")

    @property
    def attention(self) -> bool:
        """Whether the attention projections are quantized too."""
        return self.kind not in INT4

    @property
    def dtype(self) -> str:
        """The checkpoint's activation dtype."""
        return "float16" if self.kind in ("gptq-int4", "awq-int4") else "bfloat16"

    def config(self) -> dict:
        """The checkpoint's ``quantization_config``."""
        if self.kind == "gptq-int4":
            return {"quant_method": "gptq", "bits": 4, "group_size": self.group, "desc_act": False, "sym": True,
                    "lm_head": False, "dynamic": {"-:.*self_attn.*": {}}}
        if self.kind == "awq-int4":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group, "zero_point": True, "version": "gemm",
                    "modules_to_not_convert": ["self_attn"]}
        if self.kind == "ct-w4a16":
            return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": self.group, "dynamic": False, "actorder": None}}}}
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
        if self.kind in INT4:
            base = name.removesuffix("weight")
            return [(base + n, t) for n, t in INT4[self.kind](w, self.group).items()]
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
AWQ_INT4 = Quantization("awq-int4")
CT_W4A16 = Quantization("ct-w4a16")


# -- files -----------------------------------------------------------------------------------
def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file of ``tensors`` (name, contiguous CPU tensor), written without copying:
    views of one stacked tensor are written from its memory as they lie."""
    header, offset = {}, 0
    for name, t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: safetensors rows must be contiguous CPU tensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes:
                f.write(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())))


def _layer_files(spec: ModelSpec, i: int, quants: list[Quantization]):
    """(bf16 tensors, {quantization: its tensors}) of layer ``i``, each a list of (name, tensor)."""
    dense, experts = layer_weights(spec, i)
    prefix, (gate, up, down) = _expert_names(spec, i)
    names = {"gate": gate, "up": up, "down": down}
    bf16 = list(dense.items())
    for which, stacked in experts.items():
        bf16 += [(prefix.format(e=e) + names[which] + ".weight", stacked[e]) for e in range(spec.experts)]
    quantized = {}
    for quant in quants:
        out = []
        for name, t in dense.items():  # attention projections; norms and the router stay bf16
            out += quant.quantize(name, t) if quant.attention and name.endswith("_proj.weight") else [(name, t)]
        for which, stacked in experts.items():
            per_expert = quant.quantize(names[which] + ".weight", stacked)  # all experts at once, then row e of each
            out += [(prefix.format(e=e) + n, t[e]) for e in range(spec.experts) for n, t in per_expert]
        quantized[quant] = out
    return bf16, quantized


def _marker(spec: ModelSpec, quant: Quantization | None) -> dict:
    return {"spec": asdict(spec), "quantization": quant.marker() if quant else None}


def is_complete(path: Path, spec: ModelSpec, quant: Quantization | None = None) -> bool:
    m = Path(path) / MARKER
    return m.exists() and json.loads(m.read_text()) == _marker(spec, quant)


def write_checkpoints(spec: ModelSpec, path: Path, quantized: dict[Path, Quantization] | None = None,
                      threads: int | None = None) -> dict[str, float]:
    """Write ``spec`` in bf16 to ``path`` and, for each (path, quantization) of ``quantized``, the
    same weights quantized so. A complete checkpoint of the same spec is kept as it is. Returns
    seconds taken per path written."""
    import time

    todo = [(Path(p), q) for p, q in [(path, None), *(quantized or {}).items()] if not is_complete(p, spec, q)]
    if not todo:
        return {}
    t0 = time.perf_counter()
    for p, _ in todo:
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    files = {p: {} for p, _ in todo}  # path -> {file name: [tensor names]}

    def one_layer(i: int) -> None:
        bf16, quantized_files = _layer_files(spec, i, [q for _, q in todo if q is not None])
        fname = f"model-layer-{i:03d}.safetensors"
        for p, q in todo:
            tensors = bf16 if q is None else quantized_files[q]
            write_safetensors(p / fname, tensors)
            files[p][fname] = [n for n, _ in tensors]

    workers = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one_layer, range(spec.layers)))
    outer = list(outer_weights(spec).items())
    for p, q in todo:
        write_safetensors(p / "model-outer.safetensors", outer)
        files[p]["model-outer.safetensors"] = [n for n, _ in outer]
        weight_map = {n: f for f, names in sorted(files[p].items()) for n in names}
        (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (p / "config.json").write_text(json.dumps(hf_config(spec, q), indent=1))
        (p / MARKER).write_text(json.dumps(_marker(spec, q)))
    return {str(p): time.perf_counter() - t0 for p, _ in todo}
