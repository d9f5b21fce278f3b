"""Random-weight MoE checkpoints for the SGLang engine benchmark: written straight to safetensors.

Owns the model shapes (``ModelSpec``: a Qwen3-MoE with Qwen3-30B-A3B's expert and attention shapes,
a small Mixtral, gpt-oss's architecture with the same expert shapes), deterministic random weights per
layer, and the files of them, in bf16 and quantized (``bench.serving.ckpt_quant``):
``config.json`` (from transformers' config class), one safetensors shard per decoder layer plus one
for embeddings / norm / lm_head, and the index. Attention projections (not under int4, MXFP4) and experts are
quantized; norms, the router, embeddings and lm_head stay bf16, as in those checkpoints.

Tensor names are the Hugging Face hub layout SGLang's loaders read: per-expert
``mlp.experts.{e}.{gate,up,down}_proj`` (Qwen3-MoE) or ``block_sparse_moe.experts.{e}.w{1,2,3}``
(Mixtral), and gpt-oss's stacked ``mlp.experts.{gate_up,down}_proj`` with their ``_bias`` (``_blocks`` and
``_scales`` in MXFP4). The writer fills shards without copies (each expert's row of a stacked tensor is one
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

from bench.serving.ckpt_quant import FP8, Quantization

_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", FP8: "F8_E4M3", torch.int32: "I32",
           torch.int64: "I64", torch.int8: "I8", torch.uint8: "U8"}
MARKER = "moepage_bench_spec.json"  # written last: a checkpoint without it is incomplete


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "qwen3_moe" | "mixtral" | "gpt_oss"
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

    def stored_expert_bytes(self, quant: Quantization | None = None) -> int:
        """Bytes of one expert as a checkpoint quantized as ``quant`` says holds it (weights and scales; bf16 where
        None), which are its bytes in an engine's slot too."""
        if quant is None:
            return self.expert_bytes
        shapes = ((self.inter, self.hidden), (self.inter, self.hidden), (self.hidden, self.inter))
        return sum(t.nbytes for n, k in shapes
                   for _, t in quant.quantize("w.weight", torch.zeros((1, n, k), dtype=torch.bfloat16)))


# Qwen3-30B-A3B's shapes (E = 128, top-8, H = 2048, I = 768, 32 x 128 heads, 4 KV heads): each
# layer's experts are 1.2 GB in bf16, so 4 layers hold 4.8 GB of experts.
QWEN3_30B_SHAPES = ModelSpec("qwen3_moe", layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                             experts=128, top_k=8, inter=768)
# The same with 8 MoE layers (9.7 GB of experts): per-layer overheads show as they will in a real model
QWEN3_30B_DEEP = ModelSpec("qwen3_moe", layers=8, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                           experts=128, top_k=8, inter=768)
# Every layer of Qwen3-30B-A3B (48; 58 GB of experts in bf16): served with the engines' dummy weights (a folder of its
# config only, ``write_config``) or from a block-FP8 checkpoint written without a bf16 copy (``write_checkpoints``
# with ``quant``): the bf16 checkpoint would not fit beside the parts on the GPU machine's disk
QWEN3_30B_FULL = ModelSpec("qwen3_moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                           experts=128, top_k=8, inter=768)
MIXTRAL_SMALL = ModelSpec("mixtral", layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64,
                          experts=8, top_k=2, inter=2048)
QWEN3_E64 = ModelSpec("qwen3_moe", layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64,
                      experts=64, top_k=8, inter=512)
# gpt-oss's architecture (attention sinks and biases, sliding and full layers, biased experts, a biased router) with
# the Qwen3-30B-A3B expert shapes of the other rows, so that its MXFP4 twin pages the same experts per step
GPT_OSS_QWEN_SHAPES = ModelSpec("gpt_oss", layers=4, hidden=2048, heads=32, kv_heads=4, head_dim=64,
                                experts=128, top_k=8, inter=768)


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
    elif spec.kind == "gpt_oss":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)]
        common.update(max_position_embeddings=32 * 4096)  # its YaRN rope: 32 x the original 4096, as gpt-oss's
        cfg = tf.GptOssConfig(num_local_experts=spec.experts, intermediate_size=spec.inter, layer_types=layer_types,
                              sliding_window=128, attention_bias=True, **common)
        cfg.architectures = ["GptOssForCausalLM"]
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
    """Decoder layer ``i``: (dense tensors by name, stacked experts {"gate": [E, I, H], "up", "down": [E, H, I]}, and
    gpt-oss's biases "gate_bias", "up_bias" [E, I], "down_bias" [E, H]), the same for the same spec and ``i`` on every
    machine."""
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
    if spec.kind == "gpt_oss":
        for proj, width in (("q", q), ("k", kv), ("v", kv), ("o", h)):
            dense[pre + f"self_attn.{proj}_proj.bias"] = _randn((width,), 0.02, g)
        dense[pre + "self_attn.sinks"] = _randn((spec.heads,), 1.0, g)
        dense[pre + "mlp.router.weight"] = router
        dense[pre + "mlp.router.bias"] = _randn((spec.experts,), 0.1, g)
    elif spec.kind == "qwen3_moe":
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
    if spec.kind == "gpt_oss":  # its experts have biases
        g = _generator(spec, i, 4)
        experts.update(gate_bias=_randn((e, n), 0.02, g), up_bias=_randn((e, n), 0.02, g),
                       down_bias=_randn((e, h), 0.02, g))
    return dense, experts


def outer_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    g = _generator(spec, 10_000)
    return {
        "model.embed_tokens.weight": _randn((spec.vocab, spec.hidden), 1.0, g),
        "model.norm.weight": torch.ones(spec.hidden, dtype=torch.bfloat16),
        "lm_head.weight": _randn((spec.vocab, spec.hidden), spec.hidden**-0.5, g),
    }


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


def _gpt_oss_experts(pre: str, experts: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """gpt-oss's stacked expert tensors, as [E, out, in] weights with their biases: gate and up interleaved row by
    row (gate j at row 2j, up j at 2j + 1), as gpt-oss stores ``gate_up_proj``."""
    e, n, h = experts["gate"].shape
    gate_up = torch.stack([experts["gate"], experts["up"]], dim=2).reshape(e, 2 * n, h)
    gate_up_bias = torch.stack([experts["gate_bias"], experts["up_bias"]], dim=2).reshape(e, 2 * n)
    return {pre + "mlp.experts.gate_up_proj": (gate_up, gate_up_bias),
            pre + "mlp.experts.down_proj": (experts["down"], experts["down_bias"])}


def _layer_files(spec: ModelSpec, i: int, quants: list[Quantization]):
    """(bf16 tensors, {quantization: its tensors}) of layer ``i``, each a list of (name, tensor)."""
    dense, experts = layer_weights(spec, i)
    if spec.kind == "gpt_oss":  # stacked experts; bf16 as transformers keeps them ([E, in, out])
        stacked = _gpt_oss_experts(f"model.layers.{i}.", experts)
        bf16 = list(dense.items()) + [t for name, (w, b) in stacked.items()
                                      for t in ((name, w.transpose(1, 2).contiguous()), (name + "_bias", b))]
        quantized = {}
        for quant in quants:
            if quant.kind != "mxfp4":
                raise ValueError(f"gpt-oss checkpoints are written in bf16 or MXFP4, not {quant.kind!r}")
            quantized[quant] = list(dense.items()) + [t for name, (w, b) in stacked.items()
                                                      for t in (*quant.quantize(name, w), (name + "_bias", b))]
        return bf16, quantized
    if any(q.kind == "mxfp4" for q in quants):
        raise ValueError(f"MXFP4 is written for gpt-oss models only, not {spec.kind!r}")
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


def _marker(spec: ModelSpec, quant: Quantization | None, dummy: bool = False) -> dict:
    out = {"spec": asdict(spec), "quantization": quant.marker() if quant else None}
    return {**out, "weights": "dummy"} if dummy else out  # a config-only folder is no checkpoint of the spec


def is_complete(path: Path, spec: ModelSpec, quant: Quantization | None = None, dummy: bool = False) -> bool:
    m = Path(path) / MARKER
    return m.exists() and json.loads(m.read_text()) == _marker(spec, quant, dummy)


def write_config(spec: ModelSpec, path: Path) -> bool:
    """A folder of ``spec``'s ``config.json`` only, for the engines' ``load_format="dummy"`` (random weights: both
    engines read the config and no weight file). Whether it was written (a complete one is kept)."""
    path = Path(path)
    if is_complete(path, spec, dummy=True):
        return False
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(spec), indent=1))
    (path / MARKER).write_text(json.dumps(_marker(spec, None, dummy=True)))
    return True


def write_checkpoints(spec: ModelSpec, path: Path, quantized: dict[Path, Quantization] | None = None,
                      threads: int | None = None, quant: Quantization | None = None) -> dict[str, float]:
    """Write ``spec`` to ``path`` in bf16 (or quantized as ``quant`` says, with no bf16 copy on disk) and, for each
    (path, quantization) of ``quantized``, the same weights quantized so. A complete checkpoint of the same spec is
    kept as it is. Returns seconds taken per path written."""
    import time

    todo = [(Path(p), q) for p, q in [(path, quant), *(quantized or {}).items()] if not is_complete(p, spec, q)]
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
