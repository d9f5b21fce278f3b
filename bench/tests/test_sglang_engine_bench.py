"""CPU side of ``bench/serving/sglang_engine.py`` (the SGLang engine benchmark, run on an H200): the
checkpoint writers (read back through SGLang's and transformers' own loaders, block FP8 round
trip), the run matrix and engine arguments (against sglang 0.5.23's ``ServerArgs`` fields), and
the report built from run results."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.serving import ckpt_quant as Q
from bench.serving import matrix as M
from bench.serving import sglang_ckpt as C
from bench.serving import sglang_engine as B
from bench.serving import sglang_report as R
from bench.serving import sglang_runs as S

TINY_QWEN = replace(C.QWEN3_30B_SHAPES, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                    inter=32, vocab=64, context=256)
TINY_GPT_OSS = replace(C.GPT_OSS_QWEN_SHAPES, layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8,
                       top_k=2, inter=128, vocab=64, context=256)  # widths SGLang's MXFP4 Marlin layout takes unpadded
TINY_MIXTRAL = replace(C.MIXTRAL_SMALL, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, inter=32,
                       vocab=64, context=256)
BLOCK = (16, 16)
FP8_16 = Q.Quantization("fp8-block", BLOCK)
GPTQ_32 = Q.Quantization("gptq-int4", group=32)  # the tiny model's widths (32, 64) take groups of 32
GPTQ8_32 = Q.Quantization("gptq-int8", group=32)
CT_W4A16_32 = Q.Quantization("ct-w4a16", group=32)
AWQ_32 = Q.Quantization("awq-int4", group=32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {"qwen": root / "qwen", "fp8": root / "qwen-fp8", "ctfp8": root / "qwen-ctfp8", "mixtral": root / "mixtral",
           "w8a8fp8": root / "qwen-w8a8fp8", "w8a8int8": root / "qwen-w8a8int8", "gptq": root / "qwen-gptq",
           "gptq8": root / "qwen-gptq8", "ctw4": root / "qwen-ctw4", "awq": root / "qwen-awq"}
    C.write_checkpoints(TINY_QWEN, out["qwen"], {out["fp8"]: FP8_16, out["ctfp8"]: Q.CT_FP8, out["w8a8fp8"]: Q.W8A8_FP8,
                                                 out["w8a8int8"]: Q.W8A8_INT8, out["gptq"]: GPTQ_32,
                                                 out["gptq8"]: GPTQ8_32, out["ctw4"]: CT_W4A16_32, out["awq"]: AWQ_32},
                        threads=2)
    C.write_checkpoints(TINY_MIXTRAL, out["mixtral"], threads=2)
    out.update(gptoss=root / "gptoss", mxfp4=root / "gptoss-mxfp4")
    C.write_checkpoints(TINY_GPT_OSS, out["gptoss"], {out["mxfp4"]: Q.MXFP4}, threads=2)
    return out


def read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


# -- checkpoints -----------------------------------------------------------------------------------
def test_checkpoint_files_hold_the_generated_weights(ckpts):
    tensors = read(ckpts["qwen"])
    dense, experts = C.layer_weights(TINY_QWEN, 1)  # regenerated: deterministic per spec and layer
    for name, t in dense.items():
        assert torch.equal(tensors[name], t), name
    assert torch.equal(tensors["model.layers.1.mlp.experts.5.up_proj.weight"], experts["up"][5])
    assert torch.equal(tensors["model.layers.1.mlp.experts.7.down_proj.weight"], experts["down"][7])
    index = json.loads((ckpts["qwen"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(tensors) and len(tensors) == 2 * (9 + 3 * 8) + 3  # 9 dense tensors a layer
    assert C.is_complete(ckpts["qwen"], TINY_QWEN) and not C.is_complete(ckpts["qwen"], TINY_MIXTRAL)
    from moepage.planning.sizing import checkpoint_size  # what --paged-experts-num-resident auto reads

    assert checkpoint_size(str(ckpts["qwen"])).expert_bytes == [TINY_QWEN.expert_bytes] * TINY_QWEN.layers
    assert C.write_checkpoints(TINY_QWEN, ckpts["qwen"], {ckpts["fp8"]: FP8_16}) == {}  # kept as written
    assert not C.is_complete(ckpts["fp8"], TINY_QWEN, Q.FP8_BLOCK)  # other blocks: another checkpoint
    # the router's logits have the std asked for, for unit-RMS inputs
    router = dense["model.layers.1.mlp.gate.weight"].float()
    logits = router @ torch.randn(TINY_QWEN.hidden, 2000, generator=torch.Generator().manual_seed(0))
    assert 0.8 * TINY_QWEN.router_scale < logits.std() < 1.2 * TINY_QWEN.router_scale


def test_block_fp8_round_trip():
    w = (torch.randn(3, 40, 72, generator=torch.Generator().manual_seed(1)) * torch.rand(3, 40, 1)).to(torch.bfloat16)
    q, s = Q.quantize_block_fp8(w, BLOCK)  # 40 x 72: partial blocks at both edges
    assert q.dtype == Q.FP8 and q.shape == w.shape and s.shape == (3, 3, 5) and s.dtype == torch.float32
    deq = Q.dequantize_block_fp8(q, s, BLOCK)
    blocks = w.float().reshape(3, 40, 72)
    for b in range(3):
        for i in range(3):
            for j in range(5):
                x = blocks[b, 16 * i : 16 * i + 16, 16 * j : 16 * j + 16]
                y = deq[b, 16 * i : 16 * i + 16, 16 * j : 16 * j + 16]
                amax = x.abs().max()
                assert torch.isclose(s[b, i, j], amax / Q.FP8_MAX)  # the block's max maps to 448
                assert (x - y).abs().max() <= amax * 16 / Q.FP8_MAX + 1e-6  # half an e4m3 step at the top
    assert (deq - w.float()).abs().mean() < 0.04 * w.float().abs().mean()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("kind", ["qwen", "fp8", "ctfp8", "w8a8fp8", "w8a8int8", "gptq", "gptq8", "ctw4", "awq",
                                  "gptoss", "mxfp4"])
def test_auto_k_counts_each_format_s_expert_bytes(ckpts, kind):
    """Auto K's per-expert bytes, read from the headers, are every tensor of a layer's experts (weights, scales,
    zeros, group indices, biases, MXFP4 blocks) over E, and nothing else: what paging one expert in costs."""
    from moepage.planning.sizing import checkpoint_size

    tensors, spec = read(ckpts[kind]), TINY_GPT_OSS if kind in ("gptoss", "mxfp4") else TINY_QWEN
    size = checkpoint_size(ckpts[kind])
    nbytes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    per_layer = [sum(b for k, b in nbytes.items() if f".layers.{i}.mlp.experts." in k) for i in range(spec.layers)]
    assert size.num_layers == spec.layers and size.expert_bytes == [b // spec.experts for b in per_layer]
    assert all(b % spec.experts == 0 for b in per_layer)
    assert size.dense_bytes == sum(nbytes.values()) - sum(per_layer)
    if kind not in ("qwen", "gptoss"):  # a quantized twin pages fewer bytes than its bf16 base
        base = checkpoint_size(ckpts["gptoss" if kind == "mxfp4" else "qwen"])
        assert size.expert_bytes[0] < base.expert_bytes[0]


def test_fp8_checkpoint_is_the_bf16_one_quantized(ckpts):
    bf16, fp8 = read(ckpts["qwen"]), read(ckpts["fp8"])
    cfg = json.loads((ckpts["fp8"] / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "weight_block_size": [16, 16],
                                          "activation_scheme": "dynamic", "fmt": "e4m3"}
    for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert fp8[name].dtype == Q.FP8 and fp8[name + "_scale_inv"].dtype == torch.float32
        q, s = Q.quantize_block_fp8(bf16[name], BLOCK)
        assert torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)) \
            and torch.equal(fp8[name + "_scale_inv"], s)
    for name in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(fp8[name], bf16[name])  # router, embeddings and lm_head stay bf16


@pytest.mark.parametrize("target,top,scale_dtype",
                         [(Q.FP8, Q.FP8_MAX, torch.bfloat16), (torch.int8, 127.0, torch.float32)])
def test_channel_round_trip(target, top, scale_dtype):
    w = (torch.randn(3, 40, 72, generator=torch.Generator().manual_seed(2)) * torch.rand(3, 40, 1)).to(torch.bfloat16)
    q, s = Q.quantize_channel(w, target, scale_dtype)
    assert q.dtype == target and q.shape == w.shape and s.shape == (3, 40, 1) and s.dtype == scale_dtype
    amax = w.float().abs().amax(-1, keepdim=True)
    assert torch.allclose(s.float(), amax / top, rtol=2**-8)  # the row's max maps to the top value
    deq = q.float() * s.float()
    step = 16 / Q.FP8_MAX if target == Q.FP8 else 0.5 / 127  # half a step at the top of the range
    assert ((deq - w.float()).abs() <= amax * step * 1.01 + 1e-6).all()
    assert (deq - w.float()).abs().mean() < 0.04 * w.float().abs().mean()


def test_ct_fp8_checkpoint_is_the_bf16_one_quantized(ckpts):
    bf16, ct = read(ckpts["qwen"]), read(ckpts["ctfp8"])
    cfg = json.loads((ckpts["ctfp8"] / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "float-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"] == {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    for name in ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight"):
        q, s = Q.quantize_channel(bf16[name])
        assert torch.equal(ct[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(ct[name + "_scale"], s)
    for name in ("model.layers.0.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(ct[name], bf16[name]) and name + "_scale" not in ct  # as "FP8-dynamic" checkpoints keep them
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        Q.Quantization("int3")
    from moepage.planning.sizing import checkpoint_size  # what --paged-experts-num-resident auto reads

    h, i = TINY_QWEN.hidden, TINY_QWEN.inter  # per expert: fp8 weights and one bf16 scale per output row
    assert checkpoint_size(str(ckpts["ctfp8"])).expert_bytes == [3 * h * i + 2 * (2 * i + h)] * TINY_QWEN.layers


def test_transformers_loads_the_checkpoints(ckpts):
    from transformers import AutoModelForCausalLM

    for kind in ("qwen", "mixtral"):
        model = AutoModelForCausalLM.from_pretrained(str(ckpts[kind]), dtype=torch.bfloat16)
        logits = model(torch.tensor([[1, 5, 9, 30]])).logits
        assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()
        experts = next(m for m in model.model.layers[1].modules() if type(m).__name__.endswith("Experts"))
        spec = TINY_QWEN if kind == "qwen" else TINY_MIXTRAL
        _, stacked = C.layer_weights(spec, 1)
        assert torch.equal(experts.down_proj.data[2], stacked["down"][2])


def _sglang_model(path: Path, quant_config=None):
    """SGLang's model class for the checkpoint at ``path``, built on CPU (unloaded)."""
    from transformers import AutoConfig

    from helpers import sglang as H

    config = AutoConfig.from_pretrained(str(path))
    with H.server_args():
        return H.construct(config.model_type, config, torch.bfloat16, quant_config)


@pytest.mark.parametrize("kind", ["qwen", "mixtral"])
def test_sglang_loads_every_tensor(ckpts, kind):
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)

    from helpers import sglang as H

    H.setup_sglang()
    model = _sglang_model(ckpts[kind])
    written = read(ckpts[kind])
    with H.server_args():
        model.load_weights(iter(written.items()))
    spec = TINY_QWEN if kind == "qwen" else TINY_MIXTRAL
    _, stacked = C.layer_weights(spec, 1)
    moe = H.moe_layers(model)[1]
    assert torch.equal(moe.w13_weight.data, torch.cat([stacked["gate"], stacked["up"]], dim=1))
    assert torch.equal(moe.w2_weight.data, stacked["down"])
    attn = model.model.layers[0].self_attn
    pre = "model.layers.0.self_attn."
    assert torch.equal(attn.qkv_proj.weight.data, torch.cat([written[pre + p + "_proj.weight"] for p in "qkv"]))
    assert torch.equal(model.lm_head.weight.data, written["lm_head.weight"])


def _sglang_loaded(path: Path, config_class):
    """SGLang's model of the quantized checkpoint at ``path`` (its config read by ``config_class``), with every
    tensor loaded through SGLang's own loaders; and the tensors as written."""
    from helpers import sglang as H

    H.setup_sglang()
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    model = _sglang_model(path, config_class.from_config(cfg))
    written = read(path)
    with H.server_args():
        model.load_weights(iter(written.items()))
    return model, written


def test_sglang_loads_block_fp8_names(ckpts):
    """SGLang 0.5.23's block-FP8 loaders take the checkpoint's ``weight_scale_inv`` tensors."""
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from helpers import sglang as H

    model, written = _sglang_loaded(ckpts["fp8"], Fp8Config)
    moe = H.moe_layers(model)[0]
    pre = "model.layers.0.mlp.experts.6."
    w13 = torch.cat([written[pre + "gate_proj.weight"], written[pre + "up_proj.weight"]]).view(torch.uint8)
    assert torch.equal(moe.w13_weight.data[6].view(torch.uint8), w13)
    s13 = torch.cat([written[pre + "gate_proj.weight_scale_inv"], written[pre + "up_proj.weight_scale_inv"]])
    assert torch.equal(moe.w13_weight_scale_inv.data[6], s13)
    assert torch.equal(moe.w2_weight_scale_inv.data[6], written[pre + "down_proj.weight_scale_inv"])
    qkv = model.model.layers[1].self_attn.qkv_proj
    pre = "model.layers.1.self_attn."
    assert torch.equal(qkv.weight_scale_inv.data,
                       torch.cat([written[pre + p + "_proj.weight_scale_inv"] for p in "qkv"]))


def test_sglang_loads_ct_fp8_names(ckpts, monkeypatch):
    """SGLang 0.5.23's compressed-tensors loaders take the checkpoint's per-channel ``weight_scale``
    tensors into its FP8 MoE and attention layers, and load the bf16 router as it is (SGLang's Qwen3-MoE builds
    its gate unquantized; the config's ``ignore`` also lists it, as FP8-dynamic checkpoints do)."""
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # as on the H200 the engine runs on
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from helpers import sglang as H

    model, written = _sglang_loaded(ckpts["ctfp8"], CompressedTensorsConfig)
    moe = H.moe_layers(model)[1]
    assert type(moe.scheme).__name__ == "CompressedTensorsW8A8Fp8MoE"
    pre = "model.layers.1.mlp.experts.5."
    w13 = torch.cat([written[pre + "gate_proj.weight"], written[pre + "up_proj.weight"]]).view(torch.uint8)
    assert torch.equal(moe.w13_weight.data[5].view(torch.uint8), w13)
    s13 = torch.cat([written[pre + "gate_proj.weight_scale"], written[pre + "up_proj.weight_scale"]])
    assert torch.equal(moe.w13_weight_scale.data[5], s13.float())
    assert torch.equal(moe.w2_weight_scale.data[5], written[pre + "down_proj.weight_scale"].float())
    qkv = model.model.layers[0].self_attn.qkv_proj
    pre = "model.layers.0.self_attn."
    assert torch.equal(qkv.weight_scale.data.float().flatten(),
                       torch.cat([written[pre + p + "_proj.weight_scale"] for p in "qkv"]).float().flatten())
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.dtype == torch.bfloat16 and torch.equal(gate.data, written["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("which,method", [("w8a8fp8", "W8A8FP8MoEMethod"), ("w8a8int8", "W8A8Int8MoEMethod")])
def test_sglang_loads_w8a8_names(ckpts, which, method, monkeypatch):
    """SGLang 0.5.23's W8A8 FP8 / INT8 loaders take the checkpoint's per-channel weights and fp32 ``weight_scale``
    tensors into its MoE and attention layers as they were written (the bf16 twin, quantized per channel)."""
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # as on the H200 the engine runs on
    from sglang.srt.layers.quantization.w8a8_fp8 import W8A8Fp8Config
    from sglang.srt.layers.quantization.w8a8_int8 import W8A8Int8Config

    from helpers import sglang as H

    quant = Q.W8A8_FP8 if which == "w8a8fp8" else Q.W8A8_INT8
    assert json.loads((ckpts[which] / "config.json").read_text())["quantization_config"] == quant.config()
    model, written = _sglang_loaded(ckpts[which], W8A8Fp8Config if which == "w8a8fp8" else W8A8Int8Config)
    moe = H.moe_layers(model)[0]
    assert type(moe.quant_method).__name__ == method
    bf16 = read(ckpts["qwen"])
    pre = "model.layers.0.mlp.experts.2."
    for proj in ("gate_proj", "down_proj"):
        q, s = Q.quantize_channel(bf16[pre + proj + ".weight"], Q.FP8 if which == "w8a8fp8" else torch.int8,
                                  torch.float32)
        assert torch.equal(written[pre + proj + ".weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(written[pre + proj + ".weight_scale"], s)
    w13 = torch.cat([written[pre + "gate_proj.weight"], written[pre + "up_proj.weight"]]).view(torch.uint8)
    assert torch.equal(moe.w13_weight.data[2].view(torch.uint8), w13)
    s13 = torch.cat([written[pre + "gate_proj.weight_scale"], written[pre + "up_proj.weight_scale"]])
    assert torch.equal(moe.w13_weight_scale.data[2], s13) and torch.equal(
        moe.w2_weight_scale.data[2], written[pre + "down_proj.weight_scale"])
    qkv = model.model.layers[1].self_attn.qkv_proj
    pre = "model.layers.1.self_attn."
    assert torch.equal(qkv.weight_scale.data.flatten(),
                       torch.cat([written[pre + p + "_proj.weight_scale"] for p in "qkv"]).flatten())


@pytest.mark.parametrize("zero_point,bits", [(False, 4), (True, 4), (False, 8)])
def test_group_codes_round_trip(zero_point, bits):
    """Each weight within half a step of its group's scale: symmetric codes put the group's largest magnitude at the
    code's edge (zero 2^(bits - 1)), AWQ's zero points span the group's range."""
    gen = torch.Generator().manual_seed(4)  # every draw seeded: an unseeded scale near 0 made fp16 subnormal scales
    w = (torch.randn(3, 48, 64, generator=gen) * (0.5 + torch.rand(3, 48, 1, generator=gen))).bfloat16()
    codes, scale, zero = Q.group_codes(w, 32, zero_point, bits)
    top = (1 << bits) - 1
    assert codes.shape == w.shape and scale.shape == zero.shape == (3, 48, 2) and scale.dtype == torch.float16
    assert codes.min() >= 0 and codes.max() <= top and (codes == top).any()
    x = w.float().reshape(3, 48, 2, 32)
    span = x.amax(-1) - x.amin(-1) if zero_point else x.abs().amax(-1) * 2
    assert torch.allclose(scale.float(), span / top, rtol=2**-10)
    assert zero_point or (zero == 1 << (bits - 1)).all()
    up = lambda t: t.float().repeat_interleave(32, dim=-1)  # noqa: E731
    half = 0.51 + top * 2**-11  # half a step, and the fp16 scale's rounding at the code's edge
    assert (((codes - up(zero)) * up(scale) - w.float()).abs() <= up(scale) * half).all()
    with pytest.raises(ValueError, match="must be a multiple of the group"):
        Q.group_codes(w[..., :48], 32, zero_point, bits)


def test_int4_packing_is_each_format_s():
    """GPTQ packs input rows and compressed-tensors input columns low bits first (SGLang's own packers); AWQ packs
    output columns in AutoAWQ's order (read back as SGLang's loader reads it); zero points as each format keeps them."""
    import sglang.srt.layers.quantization.utils  # noqa: F401  (the [test] extra installs it)
    from sglang.srt.layers.quantization.utils import pack_cols, pack_rows

    w = torch.randn(2, 48, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    sym, _, _ = Q.group_codes(w, 32, zero_point=False)
    asym, _, zero = Q.group_codes(w, 32, zero_point=True)
    gptq, awq, ct = Q.quantize_gptq(w, 32), Q.quantize_awq(w, 32), Q.quantize_ct_w4a16(w, 32)
    assert torch.equal(gptq["g_idx"][1], torch.arange(64, dtype=torch.int32) // 32)
    assert torch.equal(ct["weight_shape"][1], torch.tensor([48, 64])) and ct["weight_scale"].dtype == torch.bfloat16
    for e in range(2):
        assert torch.equal(gptq["qweight"][e], pack_rows(sym[e].T.contiguous().int(), 4, 64, 48))
        assert torch.equal(gptq["qzeros"][e], pack_cols(torch.full((2, 48), 7, dtype=torch.int32), 4, 2, 48))
        assert torch.equal(ct["weight_packed"][e], pack_cols(sym[e].int(), 4, 48, 64))
    sym8, _, _ = Q.group_codes(w, 32, zero_point=False, bits=8)  # GPTQ int8: four codes a word, zero 128 - 1
    gptq8 = Q.quantize_gptq(w, 32, bits=8)
    for e in range(2):
        assert torch.equal(gptq8["qweight"][e], pack_rows(sym8[e].T.contiguous().int(), 8, 64, 48))
        assert torch.equal(gptq8["qzeros"][e], pack_cols(torch.full((2, 48), 127, dtype=torch.int32), 8, 2, 48))

    def awq_read(packed):  # SGLang's moe_wna16 reading of AWQ words: nibbles, then AutoAWQ's order undone
        nibbles = (packed.view(torch.uint8).unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0xF
        return nibbles.reshape(*packed.shape[:-1], -1, 8)[..., [0, 4, 1, 5, 2, 6, 3, 7]].flatten(-2).long()

    assert awq["qweight"].shape == (2, 64, 6) and torch.equal(awq_read(awq["qweight"]), asym.transpose(-1, -2))
    assert torch.equal(awq_read(awq["qzeros"]), zero.transpose(-1, -2))


@pytest.mark.parametrize("bits", [4, 8])
def test_sglang_loads_gptq_names(ckpts, monkeypatch, bits):
    """SGLang 0.5.23's GPTQ (Marlin) loaders take the checkpoint's ``qweight``, ``scales``, ``qzeros`` and ``g_idx``
    into its MoE layers as written (the bf16 twin's experts, quantized); attention stays unquantized, in fp16."""
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # as on the H200 the engine runs on
    from sglang.srt.layers.quantization.gptq.gptq import GPTQMarlinConfig
    from transformers import AutoConfig

    from helpers import sglang as H

    which, quant = ("gptq", GPTQ_32) if bits == 4 else ("gptq8", GPTQ8_32)
    cfg = json.loads((ckpts[which] / "config.json").read_text())
    assert cfg["quantization_config"] == quant.config() and cfg["quantization_config"]["bits"] == bits
    assert cfg["dtype"] == "float16"
    H.setup_sglang()
    config = AutoConfig.from_pretrained(str(ckpts[which]))
    quant_config = GPTQMarlinConfig.from_config(cfg["quantization_config"])
    with H.server_args():
        model = H.construct(config.model_type, config, torch.float16, quant_config)
    written = read(ckpts[which])
    with H.server_args():
        model.load_weights(iter(written.items()))
    moe = H.moe_layers(model)[1]
    assert type(moe.quant_method).__name__ == "GPTQMarlinMoEMethod"
    bf16 = read(ckpts["qwen"])
    pre = "model.layers.1.mlp.experts.5."
    gate, up, down = (Q.quantize_gptq(bf16[pre + p + ".weight"], 32, bits) for p in ("gate_proj", "up_proj",
                                                                                       "down_proj"))
    for n in ("qweight", "scales", "qzeros", "g_idx"):
        assert torch.equal(written[pre + "down_proj." + n], down[n]), n
    assert torch.equal(moe.w13_qweight.data[5], torch.cat([gate["qweight"], up["qweight"]], dim=-1))
    assert torch.equal(moe.w2_scales.data[5], down["scales"])
    attn = model.model.layers[1].self_attn.qkv_proj
    assert attn.weight.dtype == torch.float16 and "model.layers.1.self_attn.q_proj.qweight" not in written
    assert torch.equal(attn.weight.data[: TINY_QWEN.heads * TINY_QWEN.head_dim],
                       written["model.layers.1.self_attn.q_proj.weight"].half())


def test_mxfp4_round_trip():
    """Every weight becomes its block's nearest MXFP4 value, read back by SGLang's own MXFP4 dequantizer: e2m1 codes
    with one e8m0 scale per 32, the block's largest magnitude at most 6 x the scale, and above 3 x it."""
    import sglang.srt.layers.quantization.fp8_utils  # noqa: F401  (the [test] extra installs it)
    from sglang.srt.layers.quantization.fp8_utils import dequant_mxfp4

    w = (torch.randn(3, 16, 128, generator=torch.Generator().manual_seed(6)) * torch.rand(3, 16, 1) * 4).bfloat16()
    w[0, 0, :32] = 0  # an all-zero block
    blocks, scales = Q.quantize_mxfp4(w)
    assert blocks.shape == (3, 16, 4, 16) and scales.shape == (3, 16, 4) and blocks.dtype == scales.dtype == torch.uint8
    got = dequant_mxfp4(blocks, scales, torch.float32)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    grid = torch.cat([grid, -grid])
    nearest = (w.float().unsqueeze(-1) - grid * scale.unsqueeze(-1)).abs().argmin(dim=-1)
    assert torch.equal(got, grid[nearest] * scale)
    amax = w.float().reshape(3, 16, 4, 32).abs().amax(-1)
    s = torch.exp2(scales.float() - 127)
    assert ((amax <= 6 * s) & ((amax > 3 * s) | (amax == 0))).all()
    assert (got[0, 0, :32] == 0).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_mxfp4(w[..., :48])


def test_gpt_oss_checkpoints(ckpts, monkeypatch):
    """The gpt-oss twins: bf16 as transformers reads it (gate and up interleaved), MXFP4 as SGLang's gpt-oss loader
    reads gpt-oss's ``*_blocks`` / ``*_scales`` into its MXFP4 (Marlin) layers, from the same weights; attention,
    sinks and the router stay bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpts["gptoss"]), dtype=torch.bfloat16)
    assert torch.isfinite(model(torch.tensor([[1, 5, 9, 30]])).logits).all()
    _, stacked = C.layer_weights(TINY_GPT_OSS, 1)
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj.data[3][:, 0::2], stacked["gate"][3].T)
    assert torch.equal(experts.gate_up_proj.data[3][:, 1::2], stacked["up"][3].T)
    assert torch.equal(experts.down_proj.data[3], stacked["down"][3].T)
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # as on the H200 the engine runs on
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config
    from transformers import AutoConfig

    from helpers import sglang as H
    from helpers.sglang_formats import runner_backend

    H.setup_sglang()
    config = AutoConfig.from_pretrained(str(ckpts["mxfp4"]))
    quant = json.loads((ckpts["mxfp4"] / "config.json").read_text())["quantization_config"]
    assert quant == Q.MXFP4.config()
    written = read(ckpts["mxfp4"])
    with H.server_args(), runner_backend(Q.MXFP4.runner):
        sgl = H.construct(config.model_type, config, torch.bfloat16, Mxfp4Config.from_config(quant))
        sgl.load_weights(iter(written.items()))
    moe = H.moe_layers(sgl)[1]
    assert type(moe.quant_method).__name__ == "Mxfp4MoEMethod" and moe.quant_method.use_marlin
    pre = "model.layers.1.mlp.experts."
    gate_up = torch.stack([stacked["gate"], stacked["up"]], dim=2).reshape(8, 256, 256)  # interleaved rows
    blocks, scales = Q.quantize_mxfp4(gate_up)
    assert torch.equal(written[pre + "gate_up_proj_blocks"], blocks) and torch.equal(
        written[pre + "gate_up_proj_scales"], scales)
    assert torch.equal(moe.w13_weight.data, blocks.flatten(-2)) and torch.equal(moe.w13_weight_scale.data, scales)
    assert torch.equal(moe.w2_weight.data, written[pre + "down_proj_blocks"].flatten(-2))
    assert torch.equal(moe.w13_weight_bias.data, written[pre + "gate_up_proj_bias"])
    attn = sgl.model.layers[1].self_attn
    assert torch.equal(attn.sinks.data, written["model.layers.1.self_attn.sinks"])
    assert attn.qkv_proj.weight.dtype == torch.bfloat16
    # Paged (K = 3): gpt-oss's loader hands every expert at once; moepage stages all E rows on the host
    with H.server_args(**H.paged_args(3)), runner_backend(Q.MXFP4.runner):
        H.graph_config("disabled", "disabled")
        paged = H.construct(config.model_type, config, torch.bfloat16, Mxfp4Config.from_config(quant))
        paged.load_weights(iter(written.items()))
    method = H.moe_layers(paged)[1].quant_method
    assert type(method).__name__ == "PagedMoeMethod" and method.num_slots == 3
    for name in ("w13_weight", "w13_weight_scale", "w13_weight_bias", "w2_weight", "w2_weight_scale"):
        assert torch.equal(method.rows.host(name), getattr(moe, name).data), name


def test_sglang_loads_ct_w4a16_names(ckpts, monkeypatch):
    """SGLang 0.5.23's compressed-tensors WNA16 loaders take the checkpoint's ``weight_packed``, ``weight_scale``
    and ``weight_shape`` into its MoE layers as written; attention and the router stay bf16."""
    import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # as on the H200 the engine runs on
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from helpers import sglang as H

    assert json.loads((ckpts["ctw4"] / "config.json").read_text())["quantization_config"] == CT_W4A16_32.config()
    model, written = _sglang_loaded(ckpts["ctw4"], CompressedTensorsConfig)
    moe = H.moe_layers(model)[0]
    assert type(moe.scheme).__name__ == "CompressedTensorsWNA16MoE"
    bf16 = read(ckpts["qwen"])
    pre = "model.layers.0.mlp.experts.6."
    gate, up, down = (Q.quantize_ct_w4a16(bf16[pre + p + ".weight"], 32) for p in ("gate_proj", "up_proj", "down_proj"))
    for n in ("weight_packed", "weight_scale", "weight_shape"):
        assert torch.equal(written[pre + "down_proj." + n], down[n]), n
    # SGLang keeps these transposed ([K / 8, 2I], its loaders' "is_transposed")
    assert torch.equal(moe.w13_weight_packed.data[6], torch.cat([gate["weight_packed"], up["weight_packed"]]).T)
    assert torch.equal(moe.w2_weight_scale.data[6], down["weight_scale"].T)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.bfloat16 and torch.equal(
        qkv.weight.data[: TINY_QWEN.heads * TINY_QWEN.head_dim], written["model.layers.0.self_attn.q_proj.weight"])


# -- the run matrix and the engine's arguments -------------------------------------------------------
def test_coded_runs_set_the_compress_variable_and_the_others_clear_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPAGE_COMPRESS", "1")  # a parent's setting reaches no run that did not ask
    assert B.child_env(B.RUNS["qwen-moepage-k32-coded"], tmp_path)["MOEPAGE_COMPRESS"] == "1"
    assert "MOEPAGE_COMPRESS" not in B.child_env(B.RUNS["qwen-moepage-k32"], tmp_path)


def test_each_run_gets_its_checkpoint_beside_its_bf16_base(tmp_path, monkeypatch):
    """The engine writes what the chosen runs load: a quantized twin beside the bf16 checkpoint of its architecture
    (gpt-oss's MXFP4 beside gpt-oss, GPTQ beside Qwen), in the layout its quantization says, and nothing else."""
    tiny = {"qwen": TINY_QWEN, "mixtral": TINY_MIXTRAL, "gptoss": TINY_GPT_OSS}
    monkeypatch.setattr(B, "MODELS", {**tiny, **{m: tiny[B.BASE.get(m, "qwen")] for m in B.QUANTIZED}})
    monkeypatch.setitem(B.QUANTIZED, "qwen_gptq4", GPTQ_32)
    B.write_checkpoints([B.RUNS["gptoss_mxfp4-moepage-k32"], B.RUNS["qwen_gptq4-unpaged-nograph"]], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptoss", "gptoss_mxfp4", "qwen", "qwen_gptq4"]
    assert C.is_complete(tmp_path / "gptoss_mxfp4", TINY_GPT_OSS, Q.MXFP4)
    assert C.is_complete(tmp_path / "qwen_gptq4", TINY_QWEN, GPTQ_32)
    cfg = json.loads((tmp_path / "gptoss_mxfp4" / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["quantization_config"]["quant_method"] == "mxfp4"
    for run, graphs in (("gptoss_mxfp4-moepage-k32", True), ("qwen_gptq4-builtin-k32", True),
                        ("qwen_gptq4-builtin-k32-nograph", False)):
        kw = B.engine_kwargs(B.RUNS[run], str(tmp_path / B.RUNS[run].model))
        assert kw["moe_runner_backend"] == B.QUANTIZED[B.RUNS[run].model].runner
        assert ("cuda_graph_bs_decode" in kw) == ("cuda_graph_bs_prefill" in kw) == graphs, run


def test_run_matrix():
    assert len(B.RUNS) == len(S._matrix())  # names are unique
    for run in B.RUNS.values():
        assert run.reference in B.RUNS, run.name  # every run has its unpaged reference
        if run.impl == "moepage" and run.k != "auto" and run.group != "arrivals":
            base = run.name.removesuffix("-restart").removesuffix("-coded").removesuffix(f"-{run.policy}")
            base = base.removesuffix("-warm" if run.warm else "").removesuffix(f"-disk{run.host_budget}")
            base = base.removesuffix("-eagerdecode")  # the built-in's peer run captures its decode
            if run.model not in S.DUMMY:  # (SGLang's built-in refuses dummy weights: no peer)
                assert B.RUNS[base.replace("moepage", "builtin")].k == run.k  # and its built-in peer
            if run.compress:  # and its raw-rows twin
                assert B.RUNS[base].k == run.k and not B.RUNS[base].compress
    q = B.MODELS["qwen"]
    assert {r.k for r in B.RUNS.values() if r.model == "qwen" and isinstance(r.k, int)} \
        == {q.experts // 4, q.experts // 2}
    assert {r.mem for r in B.RUNS.values() if r.k == "auto"} == {0.5, 0.8}
    assert {r.prefill for r in B.RUNS.values() if r.model == "qwen"} == {"breakable", "disabled"}
    assert [r.name for r in B.select("auto,qwen-unpaged")] \
        == ["qwen-unpaged", "qwen-moepage-auto-m50", "qwen-moepage-auto-m80"]
    assert B.select(None) == list(B.RUNS.values())
    with pytest.raises(SystemExit, match="unknown run or group 'nope'"):
        B.select("core,nope")
    assert q.experts_bytes > 4e9  # several GB of experts


def test_the_deep_group_sets_every_alternative_side_by_side(tmp_path, monkeypatch):
    """Group ``deep``: 8 layers; unpaged, moepage raw and coded, the built-in and SGLang's offload at equal GPU
    memory; the routed model loads the same checkpoint, replays its trace (the table written once, the engine's
    processes started with it) and compares with its own unpaged run."""
    from bench.serving import route_replay

    runs = [B.RUNS[n] for g in ("deep", "deep_coded", "deep_heat") for n in B.GROUPS[g]]
    spec, k = B.MODELS["deep"], B.MODELS["deep"].experts // 4
    assert spec.layers >= 8 and {r.model for r in runs} == {"deep", "deep_heat"}
    assert {(r.impl, r.compress, r.offload_gb > 0) for r in runs if r.model == "deep"} == {
        ("unpaged", False, False), ("moepage", False, False), ("moepage", True, False), ("builtin", False, False),
        ("unpaged", False, True)}
    offload = next(r for r in runs if r.offload_gb)
    held = spec.layers * k * spec.expert_bytes  # what the paged runs keep of the experts on the GPU
    assert abs(spec.experts_bytes - offload.offload_gb * 2**30 - held) < 2**30 / 2  # equal within rounding
    assert B.engine_kwargs(offload, "/m")["cpu_offload_gb"] == offload.offload_gb
    assert "cpu_offload_gb" not in B.engine_kwargs(B.RUNS["deep-unpaged"], "/m")
    heat = B.RUNS[f"deep_heat-moepage-k{k}-lru"]
    assert heat.reference == "deep_heat-unpaged" and S.checkpoint_of(heat.model) == "deep"
    env = B.child_env(heat, tmp_path)
    assert env["MOEPAGE_POLICY"] == "lru" and env[route_replay.ROUTE_ENV] == str(S.route_table(heat, tmp_path))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(route_replay.SITE)
    monkeypatch.setenv(route_replay.ROUTE_ENV, "/elsewhere")  # a parent's table reaches no run that did not ask
    assert route_replay.ROUTE_ENV not in B.child_env(B.RUNS["deep-unpaged"], tmp_path)
    assert "MOEPAGE_POLICY" not in B.child_env(B.RUNS[f"deep_heat-moepage-k{k}"], tmp_path)
    S.write_routes(runs, tmp_path)
    assert torch.load(S.route_table(heat, tmp_path)).shape[::2] == (spec.layers, spec.top_k)


def test_disk_runs_keep_half_the_experts_in_host_memory_and_measure_the_disk(tmp_path, monkeypatch):
    """Group ``disk``: the disk tier at H = E/2 rows a layer, decode eager (SGLang's breakable decode graph cannot serve
    a model) beside its unpaged reference and host-only twin decoding so too, its spill folder per run (where the
    disk's read speed is measured), the tier's variables set for it only; the report adds the host tier's hit rate,
    the disk bytes per token and the disk's reads to the bound."""
    spec = B.MODELS["deep"]
    group = [B.RUNS[n] for n in B.GROUPS["disk"]]
    assert all(r.decode == "disabled" and r.prefill == "breakable" for r in group)
    runs = [r for r in group if r.host_budget is not None]
    assert runs and all(r.host_budget == str(spec.experts // 2) for r in runs)
    twins = {(r.model, r.impl): r.name for r in group if r.host_budget is None}
    assert twins[("deep", "unpaged")] == "deep-unpaged-eagerdecode" == B.RUNS["deep-moepage-k32-disk64"].reference
    assert twins[("deep", "moepage")] == "deep-moepage-k32-eagerdecode" and len(twins) == 4
    env = B.child_env(runs[0], tmp_path)
    assert env["MOEPAGE_HOST_BUDGET"] == runs[0].host_budget
    assert env["MOEPAGE_SPILL_DIR"] == str(S.spill_dir(runs[0], tmp_path)) != str(S.spill_dir(runs[1], tmp_path))
    monkeypatch.setenv("MOEPAGE_HOST_BUDGET", "3")  # a parent's setting reaches no run that did not ask
    assert "MOEPAGE_HOST_BUDGET" not in B.child_env(B.RUNS["deep-moepage-k32"], tmp_path)
    stats = dict(steps=1, waves=1, hits=10, misses=30, bytes_paged=0, paging_seconds=0.0, host_hits=20,
                 host_misses=10, disk_bytes=0, disk_seconds=0.0)
    # its steps wait on the disk: 16 new tokens a request (of the reference's 64)
    assert all(r.new_tokens == 16 < S.NEW_TOKENS for r in runs) and B.RUNS["deep-unpaged"].new_tokens == S.NEW_TOKENS
    tp = {"8": dict(batch=8, prompt_tokens=8 * 128, new_tokens=8 * 16, prefill_s=0.1, total_s=1.1,
                    stats_prefill={**stats}, stats_total={**stats, "hits": 110, "misses": 130, "bytes_paged": 8e9,
                                                          "host_hits": 70, "host_misses": 60, "disk_bytes": 5e9})}
    ref = {"8": dict(batch=8, prompt_tokens=8 * 128, new_tokens=8 * 64, prefill_s=0.1, total_s=0.6)}
    host = {"8": dict(batch=8, prompt_tokens=8 * 128, new_tokens=8 * 64, prefill_s=0.1, total_s=1.1)}
    disk = _result("qwen-moepage-k32-disk64", "moepage", 32, [[1, 2, 3, 4]], tp, host_budget="64", new_tokens=2)
    disk["phases"]["sequential"]["outputs"] = [[1, 2], [5, 7]]  # greedy's first 2 tokens of each request
    results = {"qwen-unpaged": _result("qwen-unpaged", "unpaged", None, [[1, 2, 3, 4], [5, 6, 7, 8]], ref),
               "qwen-moepage-k32": _result("qwen-moepage-k32", "moepage", 32, [[1]], host),
               "qwen-moepage-k32-disk64": {**disk, "disk_gbs": 2.5}}
    results["qwen-unpaged"]["phases"]["batch"]["outputs"] = [[1, 2, 3, 4]]
    row = {r["run"]: r for r in R.throughput_rows(results)}["qwen-moepage-k32-disk64"]
    assert row["host_hit_rate"] == pytest.approx(50 / 100) and row["disk_bytes_per_token"] == pytest.approx(5e9 / 120)
    # bound: the unpaged decode of 120 tokens (0.5 s for 504) + 8 GB over the link (50 GB/s: 0.16 s) + 5 GB from the
    # disk (2.5 GB/s: 2 s); beside the same model with every row in host memory (504 tokens in 1 s)
    assert row["bound_tok_s"] == pytest.approx(120 / (0.5 * 120 / 504 + 2.16))
    assert row["vs_host_only"] == pytest.approx(120 / 504)
    assert "vs_host_only" not in {r["run"]: r for r in R.throughput_rows(results)}["qwen-moepage-k32"]
    corr = {r["run"]: r for r in R.correctness_rows(results)}["qwen-moepage-k32-disk64"]
    assert corr["batch"] == "1/1"  # the batch phase asks for the reference's tokens; sequential for its first 2
    assert corr["sequential"] == "1/2 (first diff: prompt 1, token 1: 6 vs 7)"
    # with a host-only twin decoding as the disk run does (eager), that one is its peer, not the captured one
    for name, decode in (("qwen-moepage-k32-disk64", "disabled"), ("qwen-moepage-k32", "full")):
        results[name]["spec"]["decode"] = decode
    eager = {"8": {**host["8"], "total_s": 2.1}}
    results["qwen-moepage-k32-eagerdecode"] = _result("qwen-moepage-k32-eagerdecode", "moepage", 32, [[1]], eager,
                                                      decode="disabled")
    row = {r["run"]: r for r in R.throughput_rows(results)}["qwen-moepage-k32-disk64"]
    assert row["vs_host_only"] == pytest.approx(120 / 504 * 2)


def test_coded_disk_runs_compare_with_the_raw_disk_run_and_restarts_reuse_its_folder(tmp_path):
    """``...-disk64-coded``: coded rows over the same disk tier, reported beside the raw disk run (not the host-only
    one); each ``-restart`` starts the engine again over the spill folder its first run kept (its start-up is a
    restart's), and no ratio takes a restart for a peer."""
    coded, raw = B.RUNS["deep-moepage-k32-disk64-coded"], B.RUNS["deep-moepage-k32-disk64"]
    assert coded.compress and coded.group == "disk" and B.child_env(coded, tmp_path)["MOEPAGE_COMPRESS"] == "1"
    names = B.GROUPS["disk"]
    for first in (raw, coded):
        again = B.RUNS[f"{first.name}-restart"]
        assert again.restart_of == first.name and names.index(again.name) > names.index(first.name)
        assert B.child_env(again, tmp_path)["MOEPAGE_SPILL_DIR"] == str(S.spill_dir(first, tmp_path))
        assert again.compress == first.compress and again.phases == ("batch",)
    stats = dict(steps=1, waves=1, hits=1, misses=1, bytes_paged=1e9, paging_seconds=0.0, host_hits=1, host_misses=1,
                 disk_bytes=1e9, disk_seconds=0.0)

    def tput(total_s):
        return {"8": dict(batch=8, prompt_tokens=8 * 128, new_tokens=8 * 16, prefill_s=0.1, total_s=total_s,
                          stats_prefill={**stats}, stats_total={**stats})}

    results = {"qwen-unpaged": _result("qwen-unpaged", "unpaged", None, [[1]], tput(0.2)),
               "qwen-moepage-k32": _result("qwen-moepage-k32", "moepage", 32, [[1]], tput(0.6)),
               "qwen-moepage-k32-disk64-restart": _result("r", "moepage", 32, [[1]], tput(0.1), host_budget="64",
                                                          restart_of="qwen-moepage-k32-disk64"),  # (never a peer)
               "qwen-moepage-k32-disk64": _result("d", "moepage", 32, [[1]], tput(2.1), host_budget="64"),
               "qwen-moepage-k32-disk64-coded": _result("c", "moepage", 32, [[1]], tput(1.6), host_budget="64",
                                                        compress=True)}
    rows = {r["run"]: r for r in R.throughput_rows(results)}
    assert rows["qwen-moepage-k32-disk64-coded"]["coded_over_raw"] == pytest.approx(2.0 / 1.5)  # the raw disk run's
    assert rows["qwen-moepage-k32-disk64-coded"]["vs_host_only"] == pytest.approx(0.5 / 1.5)


def test_a_warmed_disk_run_starts_its_host_tier_from_the_replayed_trace(tmp_path):
    """``deep_heat-...-warm``: ``MOEPAGE_HOST_WARM`` names a trace of the replayed table (written beside it), whose
    most routed experts per layer are the table's; no other run gets the variable."""
    from moepage.planning.tiers import warm_experts

    run = B.RUNS["deep_heat-moepage-k32-disk64-warm"]
    assert run.warm and run.group == "disk" and run.model in S.ROUTED
    S.write_routes([run], tmp_path)
    env = B.child_env(run, tmp_path)
    spec, table = B.MODELS["deep"], torch.load(S.route_table(run, tmp_path))
    for layer in (0, spec.layers - 1):
        counts = torch.bincount(table[layer].flatten(), minlength=spec.experts)
        want = sorted(range(spec.experts), key=lambda e: (-int(counts[e]), e))[:16]
        assert warm_experts(env["MOEPAGE_HOST_WARM"], layer, "x", spec.experts, 16) == want
    assert "MOEPAGE_HOST_WARM" not in B.child_env(B.RUNS["deep_heat-moepage-k32-disk64"], tmp_path)
    with pytest.raises(ValueError, match="warm is for a disk tier"):
        B.child_env(replace(B.RUNS["deep_heat-moepage-k32"], warm=True), tmp_path)


def test_arrivals_compare_paged_with_unpaged_under_the_same_determinism():
    """The staggered-arrivals runs: each paged run's reference is the unpaged run of the same model and the same
    --enable-deterministic-inference setting, and only the deterministic runs ask for it."""
    arrivals = [r for r in B.RUNS.values() if r.group == "arrivals"]
    assert {r.model for r in arrivals} == {"mixtral", "qwen64"} and all(r.phases == ("concurrent",) for r in arrivals)
    for run in arrivals:
        assert run.reference in B.RUNS and B.RUNS[run.reference].deterministic == run.deterministic
        assert B.engine_kwargs(run, "/m").get("enable_deterministic_inference", False) == run.deterministic
    assert {r.name for r in arrivals if r.impl == "moepage"} == {
        "mixtral-moepage-k4", "mixtral-moepage-k4-det", "qwen64-moepage-k8", "qwen64-moepage-k8-det"}


def test_engine_arguments_are_sglang_server_args(tmp_path):
    import sglang.srt.server_args  # noqa: F401  (the [test] extra installs it)
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in record_fields(ServerArgs)}
    for run in B.RUNS.values():
        kw = B.engine_kwargs(run, "/m")
        assert set(kw) <= fields, set(kw) - fields
        ServerArgs(**kw)  # constructs (resolution happens in the engine)
        assert kw["cuda_graph_backend_prefill"] == run.prefill and kw["cuda_graph_backend_decode"] == run.decode
        assert ("cuda_graph_bs_prefill" in kw) == (run.prefill == "breakable")
        assert ("cuda_graph_bs_decode" in kw) == (run.decode in ("full", "breakable"))
        marlin = run.model in S.MARLIN  # its runs: Marlin's runner, with graphs but for the nograph group's
        assert kw["moe_runner_backend"] == ("marlin" if run.model == "gptoss_mxfp4" else "auto" if marlin else "triton")
        if marlin:
            nograph = run.group == "nograph"
            assert (run.prefill, run.decode) == (("disabled", "disabled") if nograph else ("breakable", "full"))
        assert kw.get("paged_experts_num_resident") == (None if run.impl == "unpaged" else run.k)
        assert kw.get("enable_paged_experts", False) == (run.impl != "unpaged")
        env = B.child_env(run, tmp_path)
        assert env["MOEPAGE_STATS_PATH"] == str(tmp_path / "stats" / f"{run.name}.json")
        assert env.get("MOEPAGE_SGLANG_IMPL") == ("sglang" if run.impl == "builtin" else None)
    for name in ("qwen_fp8-unpaged", "qwen_ctfp8-moepage-k32"):
        assert B.engine_kwargs(B.RUNS[name], "/m")["fp8_gemm_runner_backend"] == "triton"


def test_prompts_are_fixed_and_in_vocab():
    a, b = B.prompts(1024, B.CORRECTNESS_LENGTHS, 1), B.prompts(1024, B.CORRECTNESS_LENGTHS, 1)
    assert a == b and [len(p) for p in a] == list(B.CORRECTNESS_LENGTHS)
    assert all(3 <= t < 1023 for p in a for t in p) and len(B.BATCH_NEW_TOKENS) == len(a)
    assert min(B.BATCH_NEW_TOKENS) <= 8 < 16 <= len(a)  # the decode batch shrinks through the capture cap


# -- failures: the child's whole log, its tracebacks, its session ---------------------------------
SCHEDULER_LOG = """[2026-12-01 10:00:00] INFO starting
[2026-12-01 10:00:05] Scheduler hit an exception: Traceback (most recent call last):
  File "/x/scheduler.py", line 10, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args)
  File "/x/runner.py", line 20, in capture
    raise RuntimeError("Capture cuda graph failed: out of memory")
RuntimeError: Capture cuda graph failed: out of memory
Possible solutions:
1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)
2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)

[2026-12-01 10:00:06] Received sigquit from a child process. It usually means the child failed.
Traceback (most recent call last):
  File "bench/sglang_engine.py", line 1, in <module>
RuntimeError: Initialization failed. Please see the error messages above.
"""


def test_tracebacks_keep_multi_line_messages():
    found = M.tracebacks(SCHEDULER_LOG)
    assert len(found) == 2
    assert found[0].startswith("[2026-12-01 10:00:05] Scheduler hit an exception")
    assert found[0].endswith("2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)")  # the whole message
    assert found[1].endswith("RuntimeError: Initialization failed. Please see the error messages above.")
    assert M.tracebacks("[rank0]: Traceback (most recent call last):\n[rank0]:   File 'a', line 1\n"
                        "[rank0]: ValueError: x\n") \
        == ["Traceback (most recent call last):\n  File 'a', line 1\nValueError: x"]


CHILD = """
import json, os, subprocess, sys, time
out = sys.argv[1]
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # like SGLang's scheduler
open(os.path.join(out, "pids"), "w").write(f"{os.getpid()} {grandchild.pid}")
json.dump({"run": "qwen-unpaged", "status": "started", "phases": {"batch": {"outputs": [[1]]}}, "spec": {}},
          open(os.path.join(out, "qwen-unpaged.json"), "w"))
sys.stderr.write(sys.argv[2])
sys.exit(1) if sys.argv[3] == "fail" else time.sleep(60)
"""


@pytest.mark.parametrize("how", ["fail", "hang"])
def test_launch_reports_a_failed_child_and_ends_its_session(tmp_path, capsys, how):
    run = B.RUNS["qwen-unpaged"]
    cmd = [sys.executable, "-c", CHILD, str(tmp_path), SCHEDULER_LOG, how]
    result = B.launch(run, tmp_path, tmp_path, timeout=3 if how == "hang" else 60, cmd=cmd)
    assert result["status"] == ("failed" if how == "fail" else "timeout")
    assert result["returncode"] == (1 if how == "fail" else None)
    assert result["phases"] == {"batch": {"outputs": [[1]]}}  # what the child saved is kept
    assert json.loads((tmp_path / "qwen-unpaged.json").read_text())["status"] == result["status"]
    printed = capsys.readouterr().out
    assert SCHEDULER_LOG.strip() in printed  # the whole log
    assert printed.rindex("Possible solutions") > printed.rindex("its whole log follows")  # tracebacks again, last
    assert "Capture cuda graph failed" in result["tracebacks"][0]
    for pid in map(int, (tmp_path / "pids").read_text().split()):  # the child, and its child with the session
        assert not _running(pid), pid


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended


def test_main_lists_and_skips_without_a_gpu(tmp_path, capsys):
    assert B.main(["--list"]) == 0
    assert "core: qwen-unpaged," in capsys.readouterr().out
    if B.unavailable() is None:
        pytest.skip("this machine can run the benchmark")
    assert B.main(["--out", str(tmp_path / "o"), "--ckpt-dir", str(tmp_path / "c"), "--only", "mixtral"]) == 0
    assert "SKIPPED: bench.serving.sglang_engine needs a CUDA GPU with sglang" in capsys.readouterr().out
    assert not (tmp_path / "c").exists()  # nothing written


# -- the report ------------------------------------------------------------------------------------
def _result(name, impl, k, outputs, tput=None, status="ok", gbs=50.0, stats=None, compress=False, **more):
    spec = dict(name=name, model="qwen", impl=impl, k=k, prefill="breakable", mem=0.35, compress=compress, **more)
    phases = {"batch": {"outputs": outputs, "stats": stats}, "sequential": {"outputs": outputs},
              "concurrent": {"outputs": outputs, "outputs_b": outputs}}
    if tput:
        phases["tput"] = {"batches": tput, "seconds": 1.0, "stats": None}
    slots = {"layers": {f"l{i}": {"num_experts": 128, "num_slots": k} for i in range(4)}} if impl == "moepage" else {}
    return dict(run=name, spec=spec, status=status, phases=phases, memcpy_gbs=gbs, load_s=30.0, wall_s=60.0,
                gpu={"peak_allocated": 12e9, "device_used": 50e9}, **slots)


def _tp(b, prefill_s, total_s, decode_bytes=None):
    st = None
    if decode_bytes is not None:
        st = (dict(steps=4, waves=8, hits=10, misses=30, bytes_paged=1000, paging_seconds=0.0),
              dict(steps=256, waves=300, hits=410, misses=130, bytes_paged=1000 + decode_bytes, paging_seconds=0.0))
    return {str(b): dict(batch=b, prompt_tokens=128 * b, new_tokens=64 * b, prefill_s=prefill_s, total_s=total_s,
                         stats_prefill=st[0] if st else None, stats_total=st[1] if st else None)}


def test_report_tables_and_plot(tmp_path):
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    bad = [[1, 2, 3], [4, 9, 6], [7, 8, 0]]
    stats = dict(steps=40, waves=60, hits=120, misses=200, bytes_paged=0, paging_seconds=0.0)
    results = {
        "qwen-unpaged": _result("qwen-unpaged", "unpaged", None, ref, _tp(8, 0.1, 0.6)),
        "qwen-moepage-k32": _result("qwen-moepage-k32", "moepage", 32, ref, _tp(8, 0.2, 1.2, decode_bytes=10e9),
                                    stats=stats),
        "qwen-builtin-k32": _result("qwen-builtin-k32", "builtin", 32, bad, _tp(8, 0.2, 1.7)),
        "qwen-moepage-k32-coded": _result("qwen-moepage-k32-coded", "moepage", 32, ref, _tp(8, 0.2, 1.0),
                                          compress=True),
        "qwen-moepage-k32-lru": _result("qwen-moepage-k32-lru", "moepage", 32, ref, _tp(8, 0.2, 1.1), policy="lru"),
        "qwen-offload7g": _result("qwen-offload7g", "unpaged", None, ref, _tp(8, 0.2, 4.2), offload_gb=7),
    }
    for name, r in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    corr = {r["run"]: r for r in R.correctness_rows(R.load(tmp_path))}
    assert corr["qwen-unpaged"]["batch"] == "reference"
    assert corr["qwen-moepage-k32"]["batch"] == "3/3" and corr["qwen-moepage-k32"]["sequential"] == "3/3"
    assert corr["qwen-builtin-k32"]["batch"] == "1/3 (first diff: prompt 1, token 1: 5 vs 9)"
    assert corr["qwen-builtin-k32"]["concurrent, same engine twice"] == "3/3"
    tput = {r["run"]: r for r in R.throughput_rows(results)}
    mp = tput["qwen-moepage-k32"]
    assert mp["decode_tok_s"] == pytest.approx(8 * 63 / 1.0) and mp["prefill_tok_s"] == pytest.approx(8 * 128 / 0.2)
    assert mp["hit_rate"] == pytest.approx(400 / 500) and mp["bytes_per_decode_token"] == pytest.approx(10e9 / 504)
    # bound: the unpaged decode (0.5 s) plus 10 GB at 50 GB/s (0.2 s)
    assert mp["bound_tok_s"] == pytest.approx(504 / 0.7) and mp["of_bound"] == pytest.approx(0.7)
    assert mp["vs_builtin"] == pytest.approx(1.5) and "vs_builtin" not in tput["qwen-unpaged"]
    # the coded run beside its raw-rows twin (decode 0.8 s against 1.0 s) and the same built-in peer
    assert tput["qwen-moepage-k32-coded"]["coded_over_raw"] == pytest.approx(1.25) and "coded_over_raw" not in mp
    assert tput["qwen-moepage-k32-coded"]["vs_builtin"] == pytest.approx(1.5 * 1.25)
    # another policy: the same built-in peer, not the default policy's raw twin; every paged run against the offload
    assert tput["qwen-moepage-k32-lru"]["vs_builtin"] == pytest.approx(1.5 / 0.9)
    assert mp["vs_offload"] == pytest.approx(4) and tput["qwen-builtin-k32"]["vs_offload"] == pytest.approx(4 / 1.5)
    assert "vs_offload" not in tput["qwen-unpaged"] and "vs_offload" not in tput["qwen-offload7g"]
    assert [g for g in R.goal_rows(list(tput.values())) if g["run"] == "qwen-moepage-k32"] == [
        dict(run="qwen-moepage-k32", batch=8, moepage_over_builtin=pytest.approx(1.5), goal="met")]
    div = {r["run"]: r for r in R.diversity_rows(results)}
    assert div["qwen-moepage-k32"]["experts_per_layer_step"] == "8.0" and div["qwen-moepage-k32"]["hit_rate"] == "37.5%"
    assert div["qwen-unpaged"]["distinct_tokens_per_output"] == "3.0 (min 3) of 3"
    short = R.write_report(tmp_path)
    report = (tmp_path / "REPORT.md").read_text()
    assert "| qwen-moepage-k32 | 8 | 504 |" in report and "NOT met" not in report
    assert "qwen-builtin-k32 | failed" not in short and "| qwen-builtin-k32 | ok | 32 | 1/3 | 1/3 | 1/3 |" in short
    import matplotlib  # noqa: F401  (the [test] extra installs it)
    assert (tmp_path / "sglang_engine.png").stat().st_size > 1000 and "![decode tokens/s](sglang_engine.png)" in report


def test_report_compares_every_run_with_the_unpaged_run_of_its_graph_settings(tmp_path):
    """Runs without CUDA graphs (Marlin's) are compared with ``-unpaged-nograph``, as their own reference says."""
    ref, got = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 0]]
    for name, impl, k, outputs in (("qwen_gptq4-unpaged-nograph", "unpaged", None, ref),
                                   ("qwen_gptq4-moepage-k32-nograph", "moepage", 32, got)):
        r = _result(name, impl, k, outputs)
        r["spec"].update(model="qwen_gptq4", prefill="disabled", decode="disabled")
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    corr = {r["run"]: r for r in R.correctness_rows(R.load(tmp_path))}
    assert corr["qwen_gptq4-unpaged-nograph"]["batch"] == "reference"
    moepage = corr["qwen_gptq4-moepage-k32-nograph"]
    assert moepage["reference"] == "qwen_gptq4-unpaged-nograph" == B.RUNS["qwen_gptq4-moepage-k32-nograph"].reference
    assert moepage["batch"] == "1/2 (first diff: prompt 1, token 2: 6 vs 0)"


def test_lease_script_declares_the_plugin_without_installing(tmp_path):
    """bench/gpu_sglang_lease.sh makes SGLang's entry point lookup find moepage from a dist-info
    made from pyproject.toml on PYTHONPATH (no pip, no setuptools on the GPU machine)."""
    import os
    import shutil
    import subprocess

    # A copy without package metadata: an editable install's egg-info must not answer for it.
    source, repo = Path(__file__).resolve().parents[2], tmp_path / "repo"
    shutil.copytree(source / "moepage", repo / "moepage", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "bench").mkdir()
    shutil.copy(source / "bench" / "gpu_sglang_lease.sh", repo / "bench")
    shutil.copy(source / "pyproject.toml", repo)
    (tmp_path / "env.sh").write_text("")  # stands in for /tmp/sgl/env.sh
    env = {**os.environ, "SGL_ENV": str(tmp_path / "env.sh"), "MOEPAGE_EP_DIR": str(tmp_path / "ep"),
           "OUT": str(tmp_path / "out"), "PYTHONPATH": ""}
    out = subprocess.run(["bash", "bench/gpu_sglang_lease.sh", "entry-point"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (info,) = (tmp_path / "ep").glob("moepage-*.dist-info")
    assert f"moepage.integrations.sglang:register (from {info})" in out.stdout
    usage = subprocess.run(["bash", "bench/gpu_sglang_lease.sh"], cwd=repo, capture_output=True, text=True)
    assert usage.returncode == 2 and "engine-check" in usage.stdout and "set -euo" not in usage.stdout


# -- a whole child run against a stand-in Engine ----------------------------------------------------
class FakeEngine:
    """Stands in for ``sglang.Engine`` in ``run_child``: deterministic outputs, and a stats dump
    shaped as moepage's (``dump.snapshot``) on every ``flush_cache``."""

    made: list = []

    def __init__(self, **kw):
        import asyncio

        self.kw, self.loop, self.seq, self.requests, self.closed = kw, asyncio.new_event_loop(), 0, 0, False
        FakeEngine.made.append(self)

    def _one(self, ids, sp):
        self.requests += 1
        return {"output_ids": [(sum(ids) * 7 + i) % 1000 for i in range(sp["max_new_tokens"])]}

    def generate(self, input_ids, sampling_params):
        if input_ids and isinstance(input_ids[0], list):
            sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
            return [self._one(p, s) for p, s in zip(input_ids, sps)]
        return self._one(input_ids, sampling_params)

    async def async_generate(self, input_ids, sampling_params):
        return self._one(input_ids, sampling_params)

    def flush_cache(self):
        import os

        from moepage.telemetry import LayerStats

        self.seq += 1
        paged = self.kw.get("enable_paged_experts") and os.environ.get("MOEPAGE_SGLANG_IMPL") != "sglang"
        n = self.requests
        total = LayerStats(steps=4 * n, waves=6 * n, hits=20 * n, misses=12 * n, bytes_paged=12 * n * 1000)
        k = self.kw.get("paged_experts_num_resident")
        layers = {f"model.layers.{i}.mlp.experts": {**total.as_dict(), "num_experts": 128, "num_slots": k}
                  for i in range(4)}
        data = dict(seq=self.seq, pid=0, layers=layers if paged else {}, total=total.as_dict(), auto_k={},
                    gpu=dict(peak_allocated=1e9 * self.seq, allocated=0, reserved=0, device_used=2e9,
                             device_total=1.4e11))
        Path(os.environ["MOEPAGE_STATS_PATH"]).write_text(json.dumps(data))

    def shutdown(self):
        self.closed = True


def test_child_runs_every_phase_and_the_report_reads_it(tmp_path, monkeypatch):
    import types

    from moepage.integrations.sglang import dump

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(B, "_require_plugin", lambda: None)
    monkeypatch.setenv("MOEPAGE_STATS_PATH", "unset")  # restored after the test; run_child sets its own
    monkeypatch.setenv("MOEPAGE_SGLANG_IMPL", "unset")
    FakeEngine.made = []
    for name in ("qwen-unpaged", "qwen-moepage-k32", "qwen-builtin-k32"):
        B.run_child(B.RUNS[name], tmp_path, tmp_path / "ckpt")
        assert FakeEngine.made[-1].closed
    moe = FakeEngine.made[1]
    assert moe.kw == B.engine_kwargs(B.RUNS["qwen-moepage-k32"], str(tmp_path / "ckpt" / "qwen"))
    assert set(json.loads((tmp_path / "stats" / "qwen-moepage-k32.json").read_text())) == {"seq", *dump.snapshot()}
    result = json.loads((tmp_path / "qwen-moepage-k32.json").read_text())
    assert result["status"] == "ok" and set(result["phases"]) == set(S.ALL_PHASES)
    assert {v["num_slots"] for v in result["layers"].values()} == {32} and "memcpy_error" in result  # no CUDA here
    assert [len(o) for o in result["phases"]["batch"]["outputs"]] == list(B.BATCH_NEW_TOKENS)
    assert len(result["phases"]["sequential"]["outputs"]) == 16 \
        and len(result["phases"]["concurrent"]["outputs_b"]) == 16
    tp = result["phases"]["tput"]["batches"]["32"]
    assert tp["new_tokens"] == 32 * 64 and tp["stats_total"]["misses"] == 12 * 32  # the fake counts 12 a request
    assert result["phases"]["batch"]["stats"]["steps"] == 4 * 16
    report = R.write_report(tmp_path)
    assert "| qwen-moepage-k32 | ok | 32 | 16/16 | 16/16 | 16/16 |" in report
    assert "qwen-builtin-k32 | ok | 32 | 16/16" in report
    text = (tmp_path / "REPORT.md").read_text()
    assert "| qwen-moepage-k32 | 32 |" in text  # a throughput row at batch 32
    # a moepage run whose scheduler pages nothing (the plugin not active there) fails, saying so

    class NoPlugin(FakeEngine):
        def __init__(self, **kw):
            super().__init__(**{k: v for k, v in kw.items() if k != "enable_paged_experts"})

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=NoPlugin))
    with pytest.raises(RuntimeError, match="moepage run, but 0 layers are paged by moepage"):
        B.run_child(B.RUNS["qwen-moepage-k64"], tmp_path, tmp_path / "ckpt")
    failed = json.loads((tmp_path / "qwen-moepage-k64.json").read_text())
    assert failed["status"] == "failed" and "0 layers are paged" in failed["error"] and FakeEngine.made[-1].closed


def test_report_measures_each_engine_s_own_batch_shape_noise():
    """Batch outputs against the same engine's sequential ones, each cut to the batch output's length: the unpaged
    engine's own batch-to-batch noise, beside which a Marlin run's differences are read."""
    r = _result("qwen_gptq4-unpaged", "unpaged", None, [[1, 2], [3, 4, 5]])
    r["phases"]["sequential"]["outputs"] = [[1, 2, 9, 9], [3, 7, 5, 9]]  # longer: 64 new tokens one at a time
    assert R.batch_vs_sequential(r) == dict(equal=1, total=2, first=(1, 1, 4, 7))
    assert R.correctness_rows({"qwen_gptq4-unpaged": r})[0]["batch vs sequential, same engine"] == \
        "1/2 (first diff: prompt 1, token 1: 4 vs 7)"
    del r["phases"]["sequential"]
    assert R.batch_vs_sequential(r) is None
