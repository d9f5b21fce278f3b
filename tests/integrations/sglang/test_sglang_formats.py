"""Quantized formats on CPU: where SGLang's loaders put block-FP8 and GPTQ rows, the post-load step
run K experts at a time (repack) or checked to leave the layout (keep)."""

from __future__ import annotations

import re

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from helpers import sglang as H  # noqa: E402
from helpers.sglang import (  # noqa: E402
    FMT_E,
    K,
    bare_layer,
    fp8_block_checkpoint,
    fp8_config,
    gptq_checkpoint,
    gptq_config,
    quant_pair,
)
from moepage.errors import ConfigError  # noqa: E402
from moepage.integrations.sglang import checks, compat, contracts  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


# -- quantized formats: loader placement and host rows ---------------------------------------------


def test_fp8_block_host_rows_and_post_load():
    ref, paged = quant_pair(fp8_config, fp8_block_checkpoint())
    method = paged.quant_method
    assert method.contract is compat.TRITON and not method.contract.repacks
    assert set(method.names) == {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}
    for n in method.names:
        assert method.store.host_rows(method.layer_key, n).shape[0] == FMT_E
        assert torch.equal(method.store.host_rows(method.layer_key, n).view(torch.uint8),
                           getattr(ref, n).data.view(torch.uint8)), n
    with H.server_args():
        ref.quant_method.process_weights_after_loading(ref)
        method.process_weights_after_loading(paged)  # the base step runs, and keeps the layout
    for n in method.names:
        assert torch.equal(getattr(paged, n).data.view(torch.uint8), getattr(ref, n).data[:K].view(torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_loaders_write_staged_host_rows(bits):
    """GPTQ (Marlin) repacks after loading: its checkpoint rows are staged on the host for the
    K-at-a-time repack (which needs the CUDA Marlin kernels: see the GPU test)."""
    ref, paged = quant_pair(lambda: gptq_config(bits), gptq_checkpoint(bits, seed=bits))
    method = paged.quant_method
    assert method.contract is contracts.MARLIN_ON_SLOTS and method.contract.repacks
    assert method.format.unpaged == ("w13_qzeros", "w2_qzeros")
    loaded = ["w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros", "w13_g_idx",
              "w2_g_idx"]
    for n in loaded:
        assert method.rows.staging[n].shape == (FMT_E, *getattr(ref, n).shape[1:])
        assert torch.equal(method.rows.staging[n], getattr(ref, n).data), n
    assert paged.w13_qweight.shape[0] == K


class _RepackingMethod:
    """A post-load step that repacks every expert on its own into a new layout (what Marlin does),
    or, with ``mix``, one that mixes experts (adds their sum to each, which differs from chunk to
    chunk; a max over them could tie in bf16 and let the mix pass unseen)."""

    def __init__(self, mix=False):
        self.mix = mix

    def process_weights_after_loading(self, layer):
        w = layer.w13_weight.data
        packed = w.transpose(1, 2).flip(-1).contiguous() * 2
        if self.mix:
            packed = packed + packed.float().sum(0).to(packed.dtype)
        layer.w13_weight = torch.nn.Parameter(packed, requires_grad=False)
        layer.repacked = True


@pytest.mark.parametrize("num_experts", [8, 7])
def test_repack_k_experts_at_a_time(num_experts):
    from moepage.backends.torch import TorchStore
    from moepage.integrations import postload
    from moepage.integrations.sglang.compat import expert_params

    with H.server_args():
        layer = bare_layer()  # an unpaged FusedMoE; its tensors serve as the K-row templates
    k = 3
    torch.manual_seed(num_experts)
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data[:k].clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(layer.w2_weight.data[:k].clone(), requires_grad=False)
    staged = {n: torch.randn(num_experts, *getattr(layer, n).shape[1:]).to(torch.bfloat16)
              for n in ("w13_weight", "w2_weight")}
    store = TorchStore(pin_memory=False)

    def allocate(specs):
        store.allocate("L", specs, num_experts, k, torch.device("cpu"))
        return lambda n: store.host_rows("L", n)

    names = postload.repack(layer, _RepackingMethod(), staged, k, (), allocate, expert_params)
    assert set(names) == {"w13_weight", "w2_weight"}
    assert torch.equal(store.host_rows("L", "w13_weight"), staged["w13_weight"].transpose(1, 2).flip(-1) * 2)
    assert torch.equal(store.host_rows("L", "w2_weight"), staged["w2_weight"])
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data.transpose(1, 2).flip(1).contiguous() / 2,
                                          requires_grad=False)
    template = {n: getattr(layer, n) for n in staged}

    def fresh_rows(specs):
        rows = {n: torch.empty(num_experts, *s.shape, dtype=s.dtype) for n, s in specs.items()}
        return rows.__getitem__

    for mix in (False, True):  # the per-expert step over the same layer passes; a mixing one is refused
        for n, p in template.items():
            setattr(layer, n, p)
        if not mix:
            postload.repack(layer, _RepackingMethod(), staged, k, (), fresh_rows, expert_params)
            continue
        with pytest.raises(ConfigError, match=r"does not treat each expert on its own \(w13_weight\)"):
            postload.repack(layer, _RepackingMethod(mix=True), staged, k, (), fresh_rows, expert_params)


def test_keep_layout_refuses_a_transforming_post_load_step():
    from moepage.integrations import postload
    from moepage.integrations.sglang.compat import expert_params

    class Doubles:
        def process_weights_after_loading(self, layer):
            layer.w13_weight.data.mul_(2)

    with H.server_args():
        layer = bare_layer()
    host = {n: getattr(layer, n).data.clone().normal_() for n in ("w13_weight", "w2_weight")}
    slots = {n: getattr(layer, n).data for n in host}
    with pytest.raises(ConfigError, match="transforms w13_weight"):
        postload.keep_layout(layer, Doubles(), list(host), host.__getitem__, slots.__getitem__, H.E, expert_params)


# -- every format SGLang describes: served exactly or refused with the reason -----------------------
def test_every_format_sglang_describes_has_a_case():
    """The formats under test are SGLang's own registry: a format SGLang adds fails here until it
    has a case (``helpers.sglang_formats``) and a verdict (``checks.SERVED`` or refused)."""
    from helpers.sglang_formats import CASES

    assert {c.fmt for c in CASES.values()} == {f.__name__ for f in compat.sglang_formats.FORMATS}
    assert set(checks.SERVED) <= {f.__name__ for f in compat.sglang_formats.FORMATS}


def test_a_refused_format_is_refused_at_startup_with_its_label(monkeypatch):
    """compressed-tensors FP8 builds on the CPU (the refused Marlin formats repack with CUDA kernels first): with it
    taken off the served list, startup refuses it, naming it and what is served."""
    from helpers.sglang_formats import CASES, pair

    case = CASES["ct-fp8"]
    monkeypatch.setattr(checks, "SERVED", tuple(f for f in checks.SERVED if f != case.fmt))
    with pytest.raises(ConfigError, match=r"compressed-tensors FP8 .* experts are not served by moepage \(not checked "
                                          r"exact yet\); moepage serves unquantized"):
        pair(case, k=3, device="cpu")


def test_block_int8_is_refused_with_the_reason():
    """Block INT8 is refused at startup, saying why it cannot be exact: the kernel's K tile, and so its rounding,
    follows the layer's expert count, which paging changes."""
    from helpers.sglang_formats import CASES, pair

    with pytest.raises(ConfigError, match=r"block-quantized INT8 experts are not served by moepage \(SGLang's Triton "
                                          r"MoE kernel rounds block-INT8 products once per K tile.*K slots in place"):
        pair(CASES["block-int8"], k=3, device="cpu")


def test_compressed_tensors_block_fp8_is_served_at_the_served_blocks_only():
    """The block rule of block FP8 holds for compressed-tensors' block strategy too (read from its scheme)."""
    from helpers.sglang_formats import Case, ct_fp8_block, pair

    with pytest.raises(ConfigError, match=re.escape("weight_block_size [16, 16]: moepage serves [128, 128]")):
        pair(Case("CompressedTensorsFp8Format", ct_fp8_block(16), block=(16, 16)), k=3, device="cpu")
    ref, paged = pair(Case("CompressedTensorsFp8Format", ct_fp8_block(128), block=(128, 128)), k=3, device="cpu")
    assert paged.quant_method.num_slots == 3


def _case_names():
    from helpers.sglang_formats import CASES

    return list(CASES)


@pytest.mark.parametrize("name", _case_names())
def test_every_format_s_random_experts_fit_any_layer_shape(name):
    """The GPU format tests' random checkpoint contents (``helpers.sglang_formats.fill``), on the CPU, at SMALL's widths
    and at wider ones: each per-expert tensor drawn, the (out, in) rows a format records being the layer's own, and
    scales (or unscaled weights) shrinking with the fan-in, so that a wide layer's outputs stay finite in fp16."""
    from helpers.sglang_formats import CASES, SMALL, Shape, fill, layer

    case, wide = CASES[name], Shape(experts=4, top_k=2, hidden=4 * SMALL.hidden, inter=4 * SMALL.inter)
    drawn = {}
    with H.server_args(**case.sgl_config):
        for shape in (SMALL, wide):
            try:
                module = layer(case, "cpu", shape)
            except ValueError as exc:  # Marlin's AWQ checks the GPU's capability when it makes its parameters
                pytest.skip(f"{name}'s parameters need a GPU: {exc}")
            drawn[shape] = fill(module, torch.Generator().manual_seed(0), shape)
            assert set(drawn[shape]) == {n for n, _ in module.named_parameters() if n.startswith(("w13_", "w2_"))}
            for tensor_name, rows in drawn[shape].items():
                if tensor_name.endswith("weight_shape"):
                    out_in = ((2 * shape.inter, shape.hidden) if tensor_name.startswith("w13")
                              else (shape.hidden, shape.inter))
                    assert rows.reshape(-1, 2).tolist() == [list(map(float, out_in))] * (rows.numel() // 2)
    fixed = ("bias", "global_scale", "scale_2", "weight_shape")  # drawn alike at any width
    shrinks = [n for n, t in drawn[SMALL].items() if t.is_floating_point() and ("scale" in n or t.dtype.itemsize > 1)
               and not any(f in n for f in fixed)]
    shrinks += [n for n, t in drawn[SMALL].items() if t.dtype == torch.uint8 and "scale" in n]  # e8m0 exponents
    assert shrinks, "no scale or float weight to check"
    for tensor_name in shrinks:
        small, wider = (drawn[s][tensor_name].float().abs().mean() for s in (SMALL, wide))
        assert wider < small, f"{tensor_name}: {wider} at 4x the fan-in, {small} at SMALL's"
