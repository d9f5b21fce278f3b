"""Startup checks: every rejection, each alone and all listed together, before any weight is
loaded; the shared state released with the model; moepage or SGLang's built-in selected by the
flag."""

from __future__ import annotations

import re

import pytest
import sglang.srt.layers.moe.paged_experts  # noqa: F401  (the [test] extra installs it)
import torch

from helpers import sglang as H  # noqa: E402
from helpers.sglang import (  # noqa: E402
    K,
    bare_layer,
    build_pair,
    fp8_config,
    graph_config,
    paged_args,
)
from moepage.errors import ConfigError  # noqa: E402
from moepage.integrations.sglang import contracts  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module", autouse=True)
def sglang_process():
    H.setup_sglang()


# -- startup checks -------------------------------------------------------------------------------
REJECTIONS = {
    "pp": (dict(pp_size=2), {}, "--pp-size=2: a pipeline stage builds only its own MoE layers"),
    "dp": (dict(dp_size=2), {}, "--dp-size=2: data-parallel replicas"),
    "dp_attention": (dict(tp_size=2, attn_dp_size=2), {}, "--attn-dp-size / --enable-dp-attention=2: DP attention"),
    "moe_dp": (dict(tp_size=2, moe_dp_size=2), {}, "--moe-dp-size=2"),
    "context_parallel": (dict(tp_size=2, attn_cp_size=2), {}, "--attn-cp-size=2"),
    "dwdp": (dict(tp_size=2, dwdp_size=2), {}, "DWDP rebinds"),
    "eplb": (dict(enable_eplb=True), {}, "--enable-eplb"),
    "redundant_experts": (dict(tp_size=2, ep_size=2, ep_num_redundant_experts=2), {},
                          "--ep-num-redundant-experts=2"),
    "expert_location": (dict(tp_size=2, ep_size=2, init_expert_location="placement.json"), {},
                        "--init-expert-location placement.json"),
    "elastic_ep": (dict(tp_size=2, ep_size=2, ep_join_mode="recover"), {}, "elastic EP"),
    "k_above_local_experts": (dict(tp_size=2, ep_size=2, paged_experts_num_resident=5), {},
                              "(K counts this rank's 4 of 8 experts under --ep-size 2)"),
    "a2a": (dict(moe_a2a_backend="deepep"), {}, "--moe-a2a-backend deepep"),
    "speculative": (dict(speculative_algorithm="EAGLE"), {}, "speculative decoding"),
    "shared_fusion": ({}, dict(shared=1), "--disable-shared-experts-fusion"),
    "fused_sum_all_reduce": (dict(enable_fused_moe_sum_all_reduce=True), {}, "--enable-fused-moe-sum-all-reduce"),
    "prefill_graph": ({}, dict(prefill="full"), "prefill CUDA graph backend 'full'"),
    "decode_graph": ({}, dict(decode="breakable"), "decode CUDA graph backend 'breakable'"),
    "k_below_top_k": (dict(paged_experts_num_resident=1), {}, "--paged-experts-num-resident=1 is below top_k=2"),
    "k_missing": (dict(paged_experts_num_resident=None), {}, "--paged-experts-num-resident is required"),
    "k_above_e": (dict(paged_experts_num_resident=H.E + 1), {},
                  "--paged-experts-num-resident=9 is outside top_k=2..num_experts=8 (K = E keeps every expert "
                  "resident)"),
    "format": ({}, dict(quant=True), "Fp8MoEMethod: no format of SGLang's paged experts; moepage serves"),
    "runner_backend": (dict(moe_runner_backend="flashinfer_cutlass"), {}, "--moe-runner-backend flashinfer_cutlass"),
    "host_budget": (dict(_moepage_paged_experts_host_budget="64GiB"), {},
                    "--paged-experts-host-budget 64GiB keeps experts on disk: pass --paged-experts-spill-dir DIR"),
}


def _reject(args: dict, layer: dict):
    fields = {**paged_args(), **args}
    with H.server_args(**fields):
        graph_config(layer.get("decode", "disabled"), layer.get("prefill", "disabled"))
        qc = fp8_config(block=None) if layer.get("quant") else None
        with pytest.raises(ConfigError) as info:
            bare_layer(shared=layer.get("shared", 0), quant_config=qc)
    return str(info.value)


@pytest.mark.parametrize("case", REJECTIONS)
def test_startup_rejection(case):
    args, layer, expected = REJECTIONS[case]
    message = _reject(args, layer)
    assert expected in message
    assert message.count("\n  - ") == 1, message  # exactly this problem


def test_startup_rejections_listed_together():
    args, layer = {}, {}
    for a, lay, _ in REJECTIONS.values():
        if "paged_experts_num_resident" not in a:
            args.update(a)
            layer.update(lay)
    args.update(paged_experts_num_resident=1, tp_size=8, dwdp_size=8)  # a layout all the widths above divide
    message = _reject(args, layer)
    for case, (_, _, expected) in REJECTIONS.items():
        if case not in ("k_missing", "k_above_e", "k_above_local_experts"):  # K is 1 here
            assert expected in message, case
    assert "moepage serves unquantized (bf16/fp16), block-quantized FP8" in message
    served = message.split("moepage serves")[-1]
    assert "GPTQ" in served and "NVFP4" not in served and "block-quantized INT8" not in served


def test_k_equal_to_e_keeps_every_expert_resident():
    """K = E is the way to keep everything resident (K = E + 1 is refused above, as by wrap)."""
    with H.server_args(**paged_args(k=H.E)):
        graph_config()
        layer = bare_layer()
    assert layer.quant_method.num_slots == H.E and layer.w13_weight.shape[0] == H.E


def test_shared_state_released_with_the_model():
    """Stores, layer names and the auto K live while a paged model does: when the model goes
    away its rows are released and the stores closed, and the next model starts clean."""
    import gc

    from moepage.backends.protocol import RowSpec
    from moepage.integrations import session
    from moepage.integrations.sglang.method import paged_methods

    gc.collect()
    assert session.state()["live"] == 0 and session.state()["names"] == []
    _, first = build_pair("mixtral", torch.bfloat16)
    keys = [m.layer_key for m in paged_methods(first)]
    store = paged_methods(first)[0].store
    _, second = build_pair("mixtral", torch.bfloat16)  # alive together: names are made unique
    assert [m.layer_key for m in paged_methods(second)] == [k + "#2" for k in keys]
    session.CHOSEN[("m", 8, 2)] = 4  # what auto would have chosen
    assert session.state()["live"] == 4 and len(keys) == 2
    del second
    gc.collect()
    assert session.state()["live"] == 2 and session.state()["names"] == sorted(keys)
    assert store.host_bytes() == 2 * H.E * paged_methods(first)[0].pager.row_bytes  # only first's rows
    del first
    gc.collect()
    assert session.state() == dict(live=0, stores={}, names=[], chosen={})
    with pytest.raises(ConfigError, match="closed"):
        store.allocate("x", {"w": RowSpec((1,), torch.float32)}, 1, 1, torch.device("cpu"))
    _, third = build_pair("mixtral", torch.bfloat16)
    assert [m.layer_key for m in paged_methods(third)] == keys  # names restart
    assert paged_methods(third)[0].store is not store


def test_unquantized_dtype_rejected():
    with H.server_args(**paged_args()):
        graph_config()
        with pytest.raises(ConfigError, match="unquantized experts of dtype torch.float64"):
            bare_layer(dtype=torch.float64)


def test_decode_graphs_need_a_gathering_store(monkeypatch):
    """A full decode graph captures device-planned steps: a store that cannot gather a device-made
    plan (here a pinned torch store, as on CUDA without cuda-python) is refused at startup."""
    from moepage.backends.torch import TorchStore
    from moepage.integrations import session

    with H.server_args(**paged_args()):
        graph_config(decode="full", bs=[1, 2, 4])
        monkeypatch.setattr(session, "store_for", lambda device, tier=None: TorchStore(pin_memory=True))
        with pytest.raises(ConfigError, match="decode CUDA graphs need a store that pages device-made plans"):
            bare_layer()


def test_decode_capture_sizes_are_not_capped():
    """Decode steps of more than K entries run as device-planned waves inside the graph, so every
    capture batch size stays (SGLang's built-in caps them at K // top_k)."""
    with H.server_args(**paged_args(k=6)):
        cfg = graph_config(decode="full", prefill="breakable", bs=[1, 2, 4, 8, 16, 32])
        layer = bare_layer()
        from sglang.srt.runtime_context import get_exec

        decode = get_exec().graph.cuda_graph_config.decode
        assert decode.bs == [1, 2, 4, 8, 16, 32]
        assert layer.quant_method.num_slots == 6
        del cfg


def test_impl_sglang_selects_the_builtin(monkeypatch):
    from sglang.srt.layers.moe.paged_experts import store as builtin_store
    from sglang.srt.layers.moe.paged_experts.method import PagedExpertsMoEMethod

    from moepage.integrations.sglang.settings import FLAGS

    IMPL_ATTR = FLAGS["paged_experts_impl"].attr

    # The built-in store pins host memory, which needs a CUDA driver: pageable memory here.
    monkeypatch.setattr(builtin_store.HostExpertStore, "_alloc",
                        lambda self, shape, dtype: torch.empty(shape, dtype=dtype))
    with H.server_args(**paged_args(), **{IMPL_ATTR: "sglang"}):
        graph_config()
        assert isinstance(bare_layer().quant_method, PagedExpertsMoEMethod)
    monkeypatch.setenv("MOEPAGE_SGLANG_IMPL", "sglang")
    with H.server_args(**paged_args()):
        graph_config()
        assert isinstance(bare_layer().quant_method, PagedExpertsMoEMethod)
    with H.server_args(**paged_args(), **{IMPL_ATTR: "moepage"}):
        graph_config()
        assert type(bare_layer().quant_method).__name__ == "PagedMoeMethod"



def _marlin_cases() -> list[str]:
    """The served formats that run on SGLang's Marlin runner (the GPU tests' cases say which)."""
    from helpers.sglang_formats import CASES, MARLIN_FORMATS

    return [n for n, c in CASES.items() if c.served and c.fmt in MARLIN_FORMATS]


def _build(case, graphs):
    from helpers.sglang_formats import layer

    with H.server_args(**paged_args(), **case.sgl_config):
        graph_config(*graphs)
        try:
            return layer(case, "cpu")
        except ValueError as exc:  # AWQ's Marlin check asks for a CUDA device before moepage's checks run
            if "Marlin does not support" in str(exc):
                pytest.skip(f"{case.fmt} builds on CUDA only: {exc}")
            raise


@pytest.mark.parametrize("name", _marlin_cases())
@pytest.mark.parametrize("graphs", [("full", "breakable"), ("disabled", "disabled")])
def test_marlin_formats_are_served_with_or_without_cuda_graphs(name, graphs):
    """Every Marlin wave runs the whole batch on the slot table (fixed shapes, no host read), so the Marlin formats
    start with decode graphs and breakable prefill graphs as the Triton formats do, and without them."""
    from helpers.sglang_formats import CASES

    method = _build(CASES[name], graphs).quant_method
    assert method.num_slots == K and method.contract is contracts.MARLIN_ON_SLOTS


@pytest.mark.parametrize("layout,local", [(dict(tp_size=2), H.E), (dict(tp_size=2, ep_size=2), H.E // 2)])
def test_tensor_and_expert_parallel_layouts_are_served(layout, local):
    """TP and EP over SGLang's standard dispatch build (their steps: test_sglang_parallel.py)."""
    with H.server_args(**paged_args(), **layout):
        graph_config()
        layer = bare_layer()
    method = layer.quant_method
    assert method.num_experts == local and method.global_experts == H.E and method.first_expert == 0
    assert layer.w2_weight.shape == (K, 64, 32 // (2 // layout.get("ep_size", 1)))  # I split over moe_tp_size


@pytest.mark.parametrize("name", ["nvfp4", "ct-nvfp4a16"])
def test_formats_found_beyond_their_kernel_noise_are_refused_with_the_measurement(name):
    """NVFP4 (ModelOpt and compressed-tensors) measured beyond Marlin's own batch noise on an H200: refused at
    startup, with what was measured."""
    from helpers.sglang_formats import CASES

    with pytest.raises(ConfigError, match=r"NVFP4.* experts are not served by moepage \(on SGLang's Marlin runner "
                                          r"its paged steps differed from unpaged beyond the runner's own batch"):
        _build(CASES[name], ("disabled", "disabled"))


def test_weight_widths_not_checked_are_refused_at_startup():
    """compressed-tensors WNA16 is served in the width measured on an H200 (4 bits); 8-bit is refused, saying so."""
    from helpers.sglang_formats import CASES

    with pytest.raises(ConfigError, match=r"W4A16/W8A16 experts with 8-bit weights: moepage serves 4-bit ones"):
        _build(CASES["ct-w8a16"], ("disabled", "disabled"))
    assert _build(CASES["ct-w4a16"], ("disabled", "disabled")).quant_method.num_slots == K


@pytest.mark.parametrize("runner", ["auto", "triton"])
def test_mxfp4_is_served_on_marlin_only(runner):
    """MXFP4's method picks its runner from --moe-runner-backend: served on Marlin (the runner checked exact), refused
    on any other, saying which flag to pass."""
    import dataclasses

    from helpers.sglang_formats import CASES

    with pytest.raises(ConfigError, match=r"MXFP4 experts are served on SGLang's Marlin MoE runner only.*pass "
                                          r"--moe-runner-backend marlin"):
        _build(dataclasses.replace(CASES["mxfp4"], runner=runner), ("disabled", "disabled"))
    assert CASES["mxfp4"].runner == "marlin"
    assert _build(CASES["mxfp4"], ("disabled", "disabled")).quant_method.num_slots == K


def test_fp8_blocks_not_checked_are_refused_at_startup():
    """Block FP8 with [16, 16] blocks does not compile in SGLang's kernel: refused, saying so."""
    with H.server_args(**paged_args()):
        graph_config("disabled", "disabled")
        with pytest.raises(ConfigError, match=re.escape("weight_block_size [16, 16]: moepage serves [128, 128]")):
            bare_layer(quant_config=H.fp8_config((16, 16)))
        with H.admitted(fp8_blocks=((16, 16),)):  # what was refused, admitted, builds
            assert bare_layer(quant_config=H.fp8_config((16, 16))).quant_method.num_slots == K
